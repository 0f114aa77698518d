"""The rendezvous state as plain data, and its JSON codec.

Nothing here does I/O. :func:`parse_key` reads one key the node sees under
``<run>/rdzv/`` (its shape from :mod:`elastic_ft.keys`, its JSON value),
:func:`build_state` assembles the facts into a :class:`RendezvousState`, the
immutable input of every decision in :mod:`elastic_ft.rendezvous.rules`.

Every value read from etcd is untrusted: the decoders are total. A value
that is not the JSON object expected, or holds a number out of range, makes
a ``malformed`` fact naming the key and the reason; the state leaves the key
out and lists it in :attr:`RendezvousState.malformed`, so one corrupt or
forged key cannot stop a node (callers warn once and ``status`` shows it).

Round ``n + 1`` is the only open round once round ``n`` has a result.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from elastic_ft.keys import parse_rdzv_key
from elastic_ft.untrusted import (
    MAX_TEXT,
    MalformedRecord,
    count_field,
    flag_field,
    integer,
    json_document,
    text_field,
    text_list_field,
)


@dataclass(frozen=True)
class Join:
    node: str
    lease: int
    create_revision: int
    addr: str
    port: int
    #: The node would take a place in the running round (``ftrun``'s agent), if one opened.
    late_joins: bool = False
    #: The node's place in its launcher's order (Slurm's ``SLURM_PROCID``): new ranks go in this order.
    order: int | None = None
    #: The node's segment label (an NVLink domain, a rack): with a segment size set, nodes train in whole
    #: segments of one label (:func:`elastic_ft.rendezvous.rules.segment_layout`).
    segment: str | None = None


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
    #: With segments: how many of the members (the first ones) train; the others are hot spares. None: the
    #: first ``max_nodes``.
    active: int | None = None

    def rank_of(self, node: str) -> int | None:
        for rank, member in enumerate(self.members):
            if member.node == node:
                return rank
        return None

    def to_json(self) -> bytes:
        document: dict[str, object] = {
            "round": self.round,
            "members": [{"node": m.node, "lease": m.lease} for m in self.members],
            "master_addr": self.master_addr,
            "master_port": self.master_port,
        }
        if self.active is not None:
            document["active"] = self.active
        return json.dumps(document, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RoundResult:
        """Decode a result; raises :class:`MalformedRecord` for anything :meth:`to_json` does not write."""
        what = "round result"
        data = json_document(raw, what)
        members = data.get("members")
        if not isinstance(members, list) or not members:
            raise MalformedRecord("members must be a non-empty list")
        decoded = []
        for member in members:
            if not isinstance(member, dict):
                raise MalformedRecord("each member must be a JSON object")
            decoded.append(Member(text_field(member, "node", "member"), count_field(member, "lease", "member")))
        if len({m.node for m in decoded}) != len(decoded):
            raise MalformedRecord("a node is listed twice in members")
        return cls(
            round=count_field(data, "round", what),
            members=tuple(decoded),
            master_addr=text_field(data, "master_addr", what),
            master_port=count_field(data, "master_port", what, 1, 65535),
            active=count_field(data, "active", what, 0, len(decoded)) if "active" in data else None,
        )


@dataclass(frozen=True)
class LateMember:
    """A hot spare that joined a round while it ran: ``place`` is its group rank, above the members'."""

    node: str
    lease: int
    place: int

    def to_json(self) -> bytes:
        return json.dumps({"lease": self.lease, "place": self.place}, sort_keys=True).encode()


@dataclass(frozen=True)
class RoundRecord:
    number: int
    joins: Mapping[str, Join] = field(default_factory=dict)
    result: RoundResult | None = None
    left: frozenset[str] = frozenset()
    late: Mapping[str, LateMember] = field(default_factory=dict)  # by node, dead ones included
    slots: Mapping[int, str] = field(default_factory=dict)  # late places held (on live leases), by place


@dataclass(frozen=True)
class RendezvousState:
    closed: bool
    alive: Mapping[str, int]  # node -> lease of its live alive/ key
    rounds: Mapping[int, RoundRecord]
    malformed: Mapping[str, str] = field(default_factory=dict)  # key (relative to rdzv/) -> why it was left out

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
        """The member's agent holds an alive key, on any lease.

        Node ids are unique per agent process, so an alive key under the
        member's id is that agent, even on a lease newer than the round's:
        after an etcd outage every lease runs out at once, and each agent
        re-announces itself on a new one (see ``EtcdftRendezvousHandler``).
        """
        return member.node in self.alive


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


def join_value(
    addr: str, port: int, late_joins: bool = False, order: int | None = None, segment: str | None = None
) -> bytes:
    document: dict[str, object] = {"addr": addr, "port": port}
    if late_joins:
        document["late_joins"] = True
    if order is not None:
        document["order"] = order
    if segment is not None:
        document["segment"] = segment
    return json.dumps(document, sort_keys=True).encode()


@dataclass(frozen=True)
class Fact:
    """What one key says; ``kind`` is closed, alive, join, result, left, late, slot or malformed."""

    kind: str
    round: int = -1
    node: str = ""
    lease: int = 0
    join: Join | None = None
    result: RoundResult | None = None
    late: LateMember | None = None
    place: int = -1
    key: str = ""  # of a malformed fact
    reason: str = ""  # why a malformed fact's value was left out


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
    try:
        if shape.kind == "result":
            result = RoundResult.from_json(raw.value)
            if result.round != shape.round:
                raise MalformedRecord(f"round {result.round} stored under round {shape.round}")
            return Fact("result", round=shape.round, result=result)
        if shape.kind == "join":
            what = "join"
            data = json_document(raw.value, what)
            join = Join(
                shape.node,
                raw.lease,
                raw.create_revision,
                text_field(data, "addr", what),
                count_field(data, "port", what, 1, 65535),
                flag_field(data, "late_joins", what),
                count_field(data, "order", what) if "order" in data else None,
                text_field(data, "segment", what) if "segment" in data else None,
            )
            return Fact("join", round=shape.round, node=shape.node, join=join)
        if shape.kind == "late":
            data = json_document(raw.value, "late member")
            late = LateMember(
                shape.node, count_field(data, "lease", "late member"), count_field(data, "place", "late member")
            )
            return Fact("late", round=shape.round, node=shape.node, late=late)
        if shape.kind == "slot":
            node = text_field(json_document(raw.value, "slot"), "node", "slot")
            return Fact("slot", round=shape.round, node=node, place=shape.place)
    except MalformedRecord as exc:
        return Fact("malformed", round=shape.round, key=key, reason=str(exc))
    return Fact("left", round=shape.round, node=shape.node)


def build_state(facts: Iterable[Fact]) -> RendezvousState:
    closed = False
    alive: dict[str, int] = {}
    joins: dict[int, dict[str, Join]] = {}
    results: dict[int, RoundResult] = {}
    left: dict[int, set[str]] = {}
    late: dict[int, dict[str, LateMember]] = {}
    slots: dict[int, dict[int, str]] = {}
    malformed: dict[str, str] = {}
    for fact in facts:
        if fact.kind == "malformed":
            malformed[fact.key] = fact.reason
        elif fact.kind == "closed":
            closed = True
        elif fact.kind == "alive":
            alive[fact.node] = fact.lease
        elif fact.kind == "join" and fact.join is not None:
            joins.setdefault(fact.round, {})[fact.node] = fact.join
        elif fact.kind == "result" and fact.result is not None:
            results[fact.round] = fact.result
        elif fact.kind == "left":
            left.setdefault(fact.round, set()).add(fact.node)
        elif fact.kind == "late" and fact.late is not None:
            late.setdefault(fact.round, {})[fact.node] = fact.late
        elif fact.kind == "slot":
            slots.setdefault(fact.round, {})[fact.place] = fact.node
    numbers = set(joins) | set(results) | set(left) | set(late) | set(slots)
    rounds = {
        n: RoundRecord(
            n, joins.get(n, {}), results.get(n), frozenset(left.get(n, ())), late.get(n, {}), slots.get(n, {})
        )
        for n in numbers
    }
    return RendezvousState(closed, alive, rounds, malformed)


def parse_state(keys: Mapping[str, KeyRecord]) -> RendezvousState:
    """Build the state from keys relative to ``<run>/rdzv/``; unknown keys are ignored."""
    return build_state(f for f in (parse_key(k, raw) for k, raw in keys.items()) if f is not None)


# ---- what every node reads: the monitor's board and its chunk of the ranks -------

#: The board names at most this many nodes per list, so it stays small whatever the job's size; a
#: count of waiting nodes read from it is then a lower bound, still positive when any node waits.
BOARD_NAMES = 64


@dataclass(frozen=True)
class ClosedRound:
    """What a node needs of the last closed round without reading its members: size, master, chunks."""

    round: int
    size: int
    master_addr: str
    master_port: int
    chunks: int


@dataclass(frozen=True)
class Board:
    """The monitor's digest of the rendezvous (``rdzv/board``), the one key every node watches.

    The monitor (the node holding the key, on its lease) keeps the whole
    state and writes the board when what the other nodes act on changes
    (:func:`elastic_ft.rendezvous.rules.board_moved`): which round is open
    and who closes it, the last closed round, whether the job is over, and
    how the last round's membership changed (:class:`MembershipChange` as
    lists of at most :data:`BOARD_NAMES` nodes). ``late`` is where a hot
    spare may join the running round; ``full``: that round is complete and
    healthy, so a newcomer waits as a spare. ``verdict``/``reason`` say why
    the open round waits, for logs only.
    """

    monitor: str
    open_round: int = 0
    closer: str | None = None
    last: ClosedRound | None = None
    finished: bool = False
    rejoined: tuple[str, ...] = ()
    dead: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    admissible: tuple[str, ...] = ()
    late: tuple[int, int] | None = None
    full: bool = False
    #: The monitor is a member of the last closed round (so a board that vanishes without its
    #: monitor having left says that member died).
    monitor_member: bool = False
    verdict: str = ""
    reason: str = ""

    def to_json(self) -> bytes:
        data: dict = {
            "monitor": self.monitor,
            "open_round": self.open_round,
            "closer": self.closer,
            "last": None if self.last is None else dataclasses.asdict(self.last),
            "finished": self.finished,
            "rejoined": list(self.rejoined),
            "dead": list(self.dead),
            "left": list(self.left),
            "admissible": list(self.admissible),
            "late": None if self.late is None else list(self.late),
            "full": self.full,
            "monitor_member": self.monitor_member,
            "verdict": self.verdict,
            "reason": self.reason[:MAX_TEXT],
        }
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Board:
        """Decode a board; raises :class:`MalformedRecord` for anything :meth:`to_json` does not write."""
        what = "board"
        data = json_document(raw, what)
        closer = data.get("closer")
        if closer is not None:
            closer = text_field(data, "closer", what)
        last = data.get("last")
        closed = None
        if last is not None:
            if not isinstance(last, dict):
                raise MalformedRecord("last must be a JSON object or null")
            closed = ClosedRound(
                count_field(last, "round", "closed round"),
                count_field(last, "size", "closed round", 1),
                text_field(last, "master_addr", "closed round"),
                count_field(last, "master_port", "closed round", 1, 65535),
                count_field(last, "chunks", "closed round", 1, 1 << 16),
            )
        late = data.get("late")
        if late is not None:
            if not isinstance(late, list) or len(late) != 2:
                raise MalformedRecord("late must be [round, place] or null")
            late = (integer(late[0], "late round", what), integer(late[1], "late place", what))
        texts = {name: data.get(name, "") for name in ("verdict", "reason")}
        if not all(isinstance(v, str) for v in texts.values()):
            raise MalformedRecord("verdict and reason must be strings")
        return cls(
            monitor=text_field(data, "monitor", what),
            open_round=count_field(data, "open_round", what),
            closer=closer,
            last=closed,
            rejoined=_names(data, "rejoined"),
            dead=_names(data, "dead"),
            left=_names(data, "left"),
            admissible=_names(data, "admissible"),
            late=late,
            finished=flag_field(data, "finished", what),
            full=flag_field(data, "full", what),
            monitor_member=flag_field(data, "monitor_member", what),
            **texts,
        )


@dataclass(frozen=True)
class Placement:
    """A member's place in a closed round, as its chunk of the ranks records it."""

    rank: int
    lease: int


def _names(data: dict, name: str) -> tuple[str, ...]:
    return text_list_field(data, name, "board", max(BOARD_NAMES, 1 << 16))


def chunk_json(number: int, placements: Mapping[str, Placement]) -> bytes:
    ranks = {node: [p.rank, p.lease] for node, p in placements.items()}
    return json.dumps({"round": number, "ranks": ranks}, sort_keys=True).encode()


def placement_from_chunk(raw: bytes, number: int, node: str) -> Placement | None:
    """``node``'s place in round ``number`` from a chunk of its ranks; None when the chunk does not list it."""
    data = json_document(raw, "chunk")
    if count_field(data, "round", "chunk") != number:
        raise MalformedRecord(f"a chunk of round {data.get('round')!r} stored under round {number}")
    ranks = data.get("ranks")
    if not isinstance(ranks, dict):
        raise MalformedRecord("ranks must be a JSON object")
    entry = ranks.get(node)
    if entry is None:
        return None
    if not isinstance(entry, list) or len(entry) != 2:
        raise MalformedRecord(f"the entry of {node} must be [rank, lease]")
    return Placement(integer(entry[0], "rank", "chunk"), integer(entry[1], "lease", "chunk"))
