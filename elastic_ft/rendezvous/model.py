"""The rendezvous state as plain data, and its JSON codec.

Nothing here does I/O. :func:`parse_key` reads one key the node sees under
``<run>/rdzv/`` (its shape from :mod:`elastic_ft.keys`, its JSON value),
:func:`build_state` assembles the facts into a :class:`RendezvousState`, the
immutable input of every decision in :mod:`elastic_ft.rendezvous.rules`.

Round ``n + 1`` is the only open round once round ``n`` has a result.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from elastic_ft.keys import parse_rdzv_key


@dataclass(frozen=True)
class Join:
    node: str
    lease: int
    create_revision: int
    addr: str
    port: int


@dataclass(frozen=True)
class Member:
    node: str
    lease: int


@dataclass(frozen=True)
class RoundResult:
    round: int
    members: tuple[Member, ...]  # in rank order
    master_addr: str
    master_port: int

    def rank_of(self, node: str) -> int | None:
        for rank, member in enumerate(self.members):
            if member.node == node:
                return rank
        return None

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "round": self.round,
                "members": [{"node": m.node, "lease": m.lease} for m in self.members],
                "master_addr": self.master_addr,
                "master_port": self.master_port,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RoundResult:
        data = json.loads(raw)
        return cls(
            round=int(data["round"]),
            members=tuple(Member(m["node"], int(m["lease"])) for m in data["members"]),
            master_addr=str(data["master_addr"]),
            master_port=int(data["master_port"]),
        )


@dataclass(frozen=True)
class RoundRecord:
    number: int
    joins: Mapping[str, Join] = field(default_factory=dict)
    result: RoundResult | None = None
    left: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RendezvousState:
    closed: bool
    alive: Mapping[str, int]  # node -> lease of its live alive/ key
    rounds: Mapping[int, RoundRecord]

    def round(self, number: int) -> RoundRecord:
        return self.rounds.get(number) or RoundRecord(number)

    @cached_property
    def last_closed(self) -> RoundResult | None:
        closed = [r.result for r in self.rounds.values() if r.result is not None]
        return max(closed, key=lambda r: r.round) if closed else None

    @property
    def open_round(self) -> int:
        last = self.last_closed
        return 0 if last is None else last.round + 1

    def is_alive(self, member: Member) -> bool:
        return self.alive.get(member.node) == member.lease


class KeyRecord(Protocol):
    """What the parser needs of one etcd key: its value, lease and create revision."""

    @property
    def value(self) -> bytes: ...

    @property
    def lease(self) -> int: ...

    @property
    def create_revision(self) -> int: ...


@dataclass(frozen=True)
class RawKey:
    """One etcd key as the state parser needs it (no I/O types)."""

    value: bytes
    lease: int
    create_revision: int


def join_value(addr: str, port: int) -> bytes:
    return json.dumps({"addr": addr, "port": port}, sort_keys=True).encode()


@dataclass(frozen=True)
class Fact:
    """What one key says; ``kind`` is closed, alive, join, result or left."""

    kind: str
    round: int = -1
    node: str = ""
    lease: int = 0
    join: Join | None = None
    result: RoundResult | None = None


def parse_key(key: str, raw: KeyRecord) -> Fact | None:
    """Decode one key relative to ``<run>/rdzv/``; None for keys of no concern.

    Kept apart from :func:`build_state` so a watcher decodes each key once,
    when it changes, rather than on every look at the state.
    """
    shape = parse_rdzv_key(key)
    if shape is None:
        return None
    if shape.kind == "closed":
        return Fact("closed")
    if shape.kind == "alive":
        return Fact("alive", node=shape.node, lease=raw.lease)
    if shape.kind == "result":
        return Fact("result", round=shape.round, result=RoundResult.from_json(raw.value))
    if shape.kind == "join":
        data = json.loads(raw.value)
        join = Join(shape.node, raw.lease, raw.create_revision, str(data["addr"]), int(data["port"]))
        return Fact("join", round=shape.round, node=shape.node, join=join)
    return Fact("left", round=shape.round, node=shape.node)


def build_state(facts: Iterable[Fact]) -> RendezvousState:
    closed = False
    alive: dict[str, int] = {}
    joins: dict[int, dict[str, Join]] = {}
    results: dict[int, RoundResult] = {}
    left: dict[int, set[str]] = {}
    for fact in facts:
        if fact.kind == "closed":
            closed = True
        elif fact.kind == "alive":
            alive[fact.node] = fact.lease
        elif fact.kind == "join" and fact.join is not None:
            joins.setdefault(fact.round, {})[fact.node] = fact.join
        elif fact.kind == "result" and fact.result is not None:
            results[fact.round] = fact.result
        elif fact.kind == "left":
            left.setdefault(fact.round, set()).add(fact.node)
    numbers = set(joins) | set(results) | set(left)
    rounds = {n: RoundRecord(n, joins.get(n, {}), results.get(n), frozenset(left.get(n, ()))) for n in numbers}
    return RendezvousState(closed, alive, rounds)


def parse_state(keys: Mapping[str, KeyRecord]) -> RendezvousState:
    """Build the state from keys relative to ``<run>/rdzv/``; unknown keys are ignored."""
    return build_state(f for f in (parse_key(k, raw) for k, raw in keys.items()) if f is not None)
