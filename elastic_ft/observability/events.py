"""The job's events: one model for the node side and the worker side.

An event says what happened, when (wall time), and where: the run, the
rendezvous round, the in-process restart iteration, the node and the
worker's initial rank (each ``None`` where it does not apply). Its ``data``
holds the rest (a fault's kind and message, a round's members and reason).
Names are a closed set (:data:`EVENTS`), so readers can rely on them;
:meth:`JobEvent.from_json` reads a stored event back as untrusted input.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_ft.untrusted import MalformedRecord, epoch_seconds, json_document, optional_count_field

#: Every event name, with what it means; ``source`` is who records it.
EVENTS: dict[str, str] = {
    # node side: the rendezvous
    "round_opened": "the first node joined a round",
    "node_joined": "a node asked to be in a round (data: role, waiting)",
    "round_closed": "a round's members were decided (data: members, reason)",
    "node_left": "a node left its round cleanly",
    "node_revoked": "a node confirmed another one lost (a probe refused or unanswered) and ended its lease "
    "(data: lost, reason)",
    # node side: the agent
    "workers_started": "an agent started its workers (data: ranks, pids)",
    "node_died": "a member node's lease expired; its ranks were reported terminated (data: ranks)",
    "respawned": "a dead worker was replaced by a new process joining the running world (data: local_rank, pid, "
    "standby: whether the node's warm standby took the place)",
    "escalated": "in-process restart could not absorb a fault: a process-level restart (data: reason)",
    "job_finished": "the job ended (data: state)",
    # worker side: elastic_ft.Wrapper
    "iteration_started": "a rank started an in-process iteration (data: world_size, active, active_world_size)",
    "fault_detected": "a rank's function raised, hung or stopped (source worker: the rank, or its monitor process "
    "for kinds hang, stopped, hard_timeout, restart_blocked), or its process died (source agent) (data: kind, "
    "message)",
    "restart_decided": "an iteration is restarted (data: faults, grouped by message)",
    "spare_activated": "a reserve rank or joiner became active",
    "rejoined": "a rank counted out while it lived (its node cut off) joins the running world again in the same "
    "process, under a new initial rank (data: previous_rank)",
    "healed": "a rank's state was loaded from a peer (data: step, sender)",
    "gave_up": "a rank left the job for good (data: kind, message)",
    "fenced": "a rank waits before a step or an atomic section: its node cannot prove its lease alive (data: what)",
    "progress": "a rank's optimizer steps so far (data: step), sampled",
    "first_step": "a process's first optimizer step, outside a restart (data: step)",
    "completed": "a rank's function returned: its training ended (data: step)",
    "recovery_phases": "a rank's first step after a restart or its admission (data: step): the wall time of each moment of its "
    "recovery and the seconds of each phase (data: moments, phases, total)",
    # any process: its etcd connection
    "etcd_unavailable": "a process stopped reaching etcd and waits for it with backoff, training on (data: "
    "endpoints, reason)",
    "etcd_available": "a process reaches etcd again (data: endpoints, seconds it was away, since)",
}
SOURCES = ("rendezvous", "agent", "worker")
#: Longest text kept in an event (a fault's message): the event log is bounded in bytes too.
MAX_TEXT = 500
_MAX_LIST = 4096


def _scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (str, int, bool))


def _clean_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` as JSON-safe values: scalars, and lists of scalars or of flat mappings; texts cut to MAX_TEXT."""
    cleaned: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise MalformedRecord(f"event data key {key!r} is not a string")
        cleaned[key] = _clean_value(key, value)
    return cleaned


def _clean_value(key: str, value: Any) -> Any:
    if isinstance(value, str):
        return value[:MAX_TEXT]
    if _scalar(value):
        return value
    if isinstance(value, (list, tuple)) and len(value) <= _MAX_LIST:
        items: list[Any] = []
        for item in value:
            if isinstance(item, Mapping):
                items.append(
                    {str(k): _clean_value(key, v) for k, v in item.items() if _scalar(v) or isinstance(v, list)}
                )
            elif _scalar(item):
                items.append(item[:MAX_TEXT] if isinstance(item, str) else item)
            else:
                raise MalformedRecord(f"event data {key}={value!r:.100}: expected scalars or flat mappings in the list")
        return items
    raise MalformedRecord(f"event data {key}={value!r:.100}: expected a string, number, boolean, null or a list")


@dataclass(frozen=True)
class JobEvent:
    """One event of a run. ``seq`` is its place in the run's event log (set when read back)."""

    name: str
    time: float
    run_id: str
    source: str
    node: str | None = None
    round: int | None = None
    iteration: int | None = None
    rank: int | None = None
    data: Mapping[str, Any] = field(default_factory=dict)
    seq: int | None = None

    def __post_init__(self) -> None:
        if self.name not in EVENTS:
            raise MalformedRecord(f"unknown event {self.name!r}; expected one of {', '.join(EVENTS)}")
        if self.source not in SOURCES:
            raise MalformedRecord(f"event source {self.source!r}; expected one of {', '.join(SOURCES)}")
        epoch_seconds(self.time, "time", "event")
        for name in ("round", "iteration", "rank", "seq"):
            optional_count_field({name: getattr(self, name)}, name, "event")
        if not isinstance(self.run_id, str) or (self.node is not None and not isinstance(self.node, str)):
            raise MalformedRecord("event run_id and node must be strings")
        object.__setattr__(self, "data", _clean_data(self.data))

    def to_document(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "time": self.time,
            "run_id": self.run_id,
            "source": self.source,
            "node": self.node,
            "round": self.round,
            "iteration": self.iteration,
            "rank": self.rank,
            "data": dict(self.data),
            **({} if self.seq is None else {"seq": self.seq}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_document(), sort_keys=True)

    @classmethod
    def from_document(cls, document: Any) -> JobEvent:
        if not isinstance(document, dict):
            raise MalformedRecord(f"an event is not a JSON object: {document!r:.100}")
        data = document.get("data", {})
        if not isinstance(data, dict):
            raise MalformedRecord(f"event data {data!r:.100}: expected a JSON object")
        name, source, run_id, node = (document.get(k) for k in ("name", "source", "run_id", "node"))
        if not isinstance(name, str) or not isinstance(source, str) or not isinstance(run_id, str):
            raise MalformedRecord(f"event {document!r:.200}: name, source and run_id must be strings")
        if node is not None and not isinstance(node, str):
            raise MalformedRecord(f"event node {node!r:.60}: expected a string or null")
        return cls(
            name=name,
            time=document.get("time"),  # type: ignore[arg-type]  # any JSON value: __post_init__ checks it
            run_id=run_id[:MAX_TEXT],
            source=source,
            node=None if node is None else node[:MAX_TEXT],
            round=optional_count_field(document, "round", "event"),
            iteration=optional_count_field(document, "iteration", "event"),
            rank=optional_count_field(document, "rank", "event"),
            data=data,
            seq=optional_count_field(document, "seq", "event"),
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> JobEvent:
        return cls.from_document(json_document(raw, "an event"))

    def to_torch(self) -> Any:
        """As a ``torch.distributed.elastic.events.Event``: what ``--event-log-handler`` handlers receive."""
        from torch.distributed.elastic.events import Event, EventSource

        metadata: dict[str, Any] = {
            "run_id": self.run_id,
            "node": self.node,
            "round": self.round,
            "iteration": self.iteration,
            "rank": self.rank,
        }
        for key, value in self.data.items():
            metadata[key] = json.dumps(value) if isinstance(value, list) else value
        return Event(
            name=f"elastic_ft.{self.name}",
            source=EventSource.WORKER if self.source == "worker" else EventSource.AGENT,
            timestamp=int(self.time * 1000),
            metadata=metadata,
        )

    def describe(self) -> str:
        """One line for people: ``node n0 rank 3 iteration 1: fault_detected kind=terminated``."""
        where = [
            f"{label} {value}"
            for label, value in (
                ("round", self.round),
                ("node", self.node),
                ("rank", self.rank),
                ("iteration", self.iteration),
            )
            if value is not None
        ]
        details = " ".join(f"{key}={_shown(value)}" for key, value in self.data.items())
        return f"{' '.join(where)}: {self.name}" + (f" {details}" if details else "")


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return repr(one_line(value, 120)) if " " in value else one_line(value, 120)
    if isinstance(value, list):
        return one_line(json.dumps(value), 160)
    return str(value)


def one_line(text: str, width: int) -> str:
    """``text`` on one line of at most ``width`` characters, cut after a word and marked with an ellipsis, so a
    reader sees that the text goes on (the job's events keep up to :data:`MAX_TEXT` characters of each)."""
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    cut = flat[: width - 1]
    space = cut.rfind(" ")
    return cut[:space] + " …" if space > width // 2 else cut + "…"
