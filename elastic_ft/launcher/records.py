"""ftrun's records: what each agent publishes about its workers, and the escalations.

In the round's store (names from :mod:`elastic_ft.keys`):

``ftrun/world``               :class:`WorldRecord`: the round's world as its members' workers started it
``ftrun/nodes/<node>``        :class:`NodeRecord`: the node's global ranks and worker pids
``ftrun/exits/<rank>``        :class:`ExitRecord`: how a worker ended, as the agent classified it
``ftrun/exit_barrier/<node>`` the node's workers finished

In etcd, job-wide: ``ftrun/escalations/<round>`` (:class:`EscalationRecord`),
one per escalated round, whose count is the job's process-level restarts.

Values are JSON. Decoding checks every field and raises :class:`MalformedRecord`
naming what is wrong: records are read back from etcd, so they are untrusted.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from elastic_ft.untrusted import MalformedRecord, is_count


def _document(raw: bytes | str, what: str) -> dict[str, Any]:
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as error:  # RecursionError: nesting deeper than the parser's stack
        raise MalformedRecord(f"{what} is not JSON: {type(error).__name__}") from None
    if not isinstance(document, dict):
        raise MalformedRecord(f"{what} is not a JSON object: {document!r:.200}")
    return document


def _field(document: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = document.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise MalformedRecord(f"{what} has {name}={value!r:.100}; expected {getattr(kind, '__name__', kind)}")
    return value


def _int_list(document: dict[str, Any], name: str, what: str) -> tuple[int, ...]:
    value = _field(document, name, list, what)
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        raise MalformedRecord(f"{what} has {name}={value!r:.100}; expected a list of integers")
    return tuple(value)


@dataclass(frozen=True)
class WorldRecord:
    """The round's world, written by each member's agent as it starts its workers (all write the same).

    A hot spare that joins the running round later reads ``world_size`` to
    number its workers above it; ``max_nodes`` tells which nodes are spares.
    """

    world_size: int
    active_world_size: int | None
    max_nodes: int

    def spares_with(self, members: int) -> int:
        """The round's hot spares once it has ``members`` nodes (late members too): those beyond ``max_nodes``.

        A node that joins the running round below ``max_nodes`` grows the
        active world instead of waiting in reserve.
        """
        return max(0, members - self.max_nodes)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorldRecord:
        what = "world record"
        document = _document(raw, what)
        record = cls(
            world_size=_count(document, "world_size", what),
            active_world_size=None
            if document.get("active_world_size") is None
            else _count(document, "active_world_size", what),
            max_nodes=_count(document, "max_nodes", what),
        )
        for name, value in (("world_size", record.world_size), ("max_nodes", record.max_nodes)):
            if value < 1:
                raise MalformedRecord(f"{what} has {name}={value}; expected at least 1")
        return record


def _count(document: dict[str, Any], name: str, what: str) -> int:
    value = document.get(name)
    if not is_count(value):
        raise MalformedRecord(f"{what} has {name}={value!r:.100}; expected a whole number")
    return value


@dataclass(frozen=True)
class NodeRecord:
    host: str
    group_rank: int
    round: int
    global_ranks: tuple[int, ...]
    pids: tuple[int, ...]
    world_size: int

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "global_ranks": list(self.global_ranks), "pids": list(self.pids)})

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeRecord:
        what = "node record"
        document = _document(raw, what)
        record = cls(
            host=_field(document, "host", str, what),
            group_rank=_field(document, "group_rank", int, what),
            round=_field(document, "round", int, what),
            global_ranks=_int_list(document, "global_ranks", what),
            pids=_int_list(document, "pids", what),
            world_size=_field(document, "world_size", int, what),
        )
        if len(record.global_ranks) != len(record.pids):
            raise MalformedRecord(f"{what} lists {len(record.global_ranks)} ranks but {len(record.pids)} pids")
        return record


@dataclass(frozen=True)
class ExitRecord:
    node: str
    pid: int
    exitcode: int
    kind: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> ExitRecord:
        what = "exit record"
        document = _document(raw, what)
        return cls(
            node=_field(document, "node", str, what),
            pid=_field(document, "pid", int, what),
            exitcode=_field(document, "exitcode", int, what),
            kind=_field(document, "kind", str, what),
        )


@dataclass(frozen=True)
class EscalationRecord:
    node: str
    reason: str
    time: float

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> EscalationRecord:
        what = "escalation record"
        document = _document(raw, what)
        return cls(
            node=_field(document, "node", str, what),
            reason=_field(document, "reason", str, what),
            time=_time(document, what),
        )


def _time(document: dict[str, Any], what: str) -> float:
    """A finite UNIX time (an integer beyond a float, or inf from 1e400, is not one)."""
    value = _field(document, "time", (int, float), what)
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise MalformedRecord(f"{what} has time={value!r:.40}; expected a finite number of seconds since the epoch")
    return seconds
