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
from dataclasses import asdict, dataclass

from elastic_ft.untrusted import (
    MalformedRecord,
    count_field,
    epoch_seconds,
    int_list_field,
    json_document,
    typed_field,
)


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
        document = json_document(raw, what)
        record = cls(
            world_size=count_field(document, "world_size", what),
            active_world_size=None
            if document.get("active_world_size") is None
            else count_field(document, "active_world_size", what),
            max_nodes=count_field(document, "max_nodes", what),
        )
        for name, value in (("world_size", record.world_size), ("max_nodes", record.max_nodes)):
            if value < 1:
                raise MalformedRecord(f"{what} has {name}={value}; expected at least 1")
        return record


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
        document = json_document(raw, what)
        record = cls(
            host=typed_field(document, "host", str, what),
            group_rank=typed_field(document, "group_rank", int, what),
            round=typed_field(document, "round", int, what),
            global_ranks=int_list_field(document, "global_ranks", what),
            pids=int_list_field(document, "pids", what),
            world_size=typed_field(document, "world_size", int, what),
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
        document = json_document(raw, what)
        return cls(
            node=typed_field(document, "node", str, what),
            pid=typed_field(document, "pid", int, what),
            exitcode=typed_field(document, "exitcode", int, what),
            kind=typed_field(document, "kind", str, what),
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
        document = json_document(raw, what)
        return cls(
            node=typed_field(document, "node", str, what),
            reason=typed_field(document, "reason", str, what),
            time=epoch_seconds(document.get("time"), "time", what),
        )
