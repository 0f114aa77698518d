"""The rendezvous state as plain data, and every decision as a pure function of it.

Nothing here does I/O.  :func:`parse_state` turns the keys the node sees under
``<run>/rdzv/`` into a :class:`RendezvousState`; :func:`next_action` decides
what a node in ``next_rendezvous()`` does next; :func:`assign_ranks` orders a
closing round; :func:`num_nodes_waiting` answers torch's agent.  The handler
(``handler.py``) only carries these decisions out against etcd.

Keys (relative to ``<etcd_prefix>/<run_id>/rdzv/``), values are JSON:

``closed``                   the job is over (``set_closed()``)
``alive/<node>``             on the node's lease: the node's agent is alive
``round/<n>/join/<node>``    on the node's lease: the node asks to be in round n
``round/<n>/result``         written once, by a transaction, when round n closes
``round/<n>/left/<node>``    a member of round n left it cleanly (``shutdown()``)

Round ``n + 1`` is the only open round once round ``n`` has a result.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

#: A closing transaction checks every member's join key is still there; etcd
#: caps a transaction at 128 operations (``--max-txn-ops``), so beyond this
#: many members the check is skipped and a member lost during the close is
#: handled as a death after completion instead.
MAX_CHECKED_MEMBERS = 120


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


def parse_key(key: str, raw: RawKey) -> Fact | None:
    """Decode one key relative to ``<run>/rdzv/``; None for keys of no concern.

    Kept apart from :func:`build_state` so a watcher decodes each key once,
    when it changes, rather than on every look at the state.
    """
    parts = key.split("/")
    if parts == ["closed"]:
        return Fact("closed")
    if len(parts) == 2 and parts[0] == "alive":
        return Fact("alive", node=parts[1], lease=raw.lease)
    if len(parts) < 3 or parts[0] != "round" or not parts[1].isdigit():
        return None
    number = int(parts[1])
    if parts[2] == "result" and len(parts) == 3:
        return Fact("result", round=number, result=RoundResult.from_json(raw.value))
    if parts[2] == "join" and len(parts) == 4:
        data = json.loads(raw.value)
        join = Join(parts[3], raw.lease, raw.create_revision, str(data["addr"]), int(data["port"]))
        return Fact("join", round=number, node=parts[3], join=join)
    if parts[2] == "left" and len(parts) == 4:
        return Fact("left", round=number, node=parts[3])
    return None


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


def parse_state(keys: Mapping[str, RawKey]) -> RendezvousState:
    """Build the state from keys relative to ``<run>/rdzv/``; unknown keys are ignored."""
    return build_state(f for f in (parse_key(k, raw) for k, raw in keys.items()) if f is not None)


# ---- closing a round --------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    min_nodes: int
    max_nodes: int
    last_call_timeout: float


def pending_members(state: RendezvousState, number: int) -> list[Member]:
    """Members of round ``number - 1`` that are alive but have not joined round ``number``.

    While any exist, the previous group may still be training, so round
    ``number`` must not close (exclusivity).
    """
    previous = state.round(number - 1).result
    if previous is None:
        return []
    joined = state.round(number).joins
    gone = state.round(number - 1).left
    return [m for m in previous.members if state.is_alive(m) and m.node not in gone and m.node not in joined]


def previous_fully_accounted(state: RendezvousState, number: int) -> bool:
    """True when every member of round ``number - 1`` has rejoined or is gone.

    This is the fast re-rendezvous rule (TorchFT's fast quorum): when the
    previous group is complete again, or its missing members are known to be
    dead or departed, no one else is expected, so waiting for last call would
    only delay recovery.  At least one previous member must be back: nodes of
    a new job started under an old run id gather with last call as usual.
    The first round has no previous group.
    """
    previous = state.round(number - 1).result
    if previous is None:
        return False
    joined = state.round(number).joins
    if not any(m.node in joined for m in previous.members):
        return False
    return all(m.node in joined or not state.is_alive(m) for m in previous.members)


def assign_ranks(previous: RoundResult | None, joins: Iterable[Join], max_nodes: int) -> list[Join]:
    """Choose the members of a closing round, in rank order.

    Admission: members of the previous round first, then the others in the
    order they joined (create revision); at most ``max_nodes``.  Ranks: an
    admitted node keeps its previous rank if that rank still exists; the
    remaining ranks go, lowest first, to the rest in admission order.
    """
    previous_rank = {m.node: r for r, m in enumerate(previous.members)} if previous else {}
    by_join_order = sorted(joins, key=lambda j: (j.create_revision, j.node))
    returning = [j for j in by_join_order if j.node in previous_rank]
    returning.sort(key=lambda j: previous_rank[j.node])
    newcomers = [j for j in by_join_order if j.node not in previous_rank]
    admitted = (returning + newcomers)[:max_nodes]
    size = len(admitted)
    ranks: list[Join | None] = [None] * size
    unplaced = []
    for join in admitted:
        rank = previous_rank.get(join.node)
        if rank is not None and rank < size and ranks[rank] is None:
            ranks[rank] = join
        else:
            unplaced.append(join)
    free = iter(r for r in range(size) if ranks[r] is None)
    for join in unplaced:
        ranks[next(free)] = join
    return [j for j in ranks if j is not None]


class CloseVerdict(Enum):
    CLOSE = "close"
    WAIT_FOR_PREVIOUS = "wait for the previous round's members"
    WAIT_FOR_MIN = "wait for min_nodes"
    WAIT_FOR_LAST_CALL = "wait for last call"


def close_verdict(
    state: RendezvousState, number: int, limits: Limits, now: float, last_call_since: float | None
) -> tuple[CloseVerdict, float | None]:
    """Whether round ``number`` may close now; if it must wait for last call,
    also when that wait ends (``last_call_since + last_call_timeout``)."""
    if pending_members(state, number):
        return CloseVerdict.WAIT_FOR_PREVIOUS, None
    joined = len(state.round(number).joins)
    if joined >= limits.max_nodes:
        return CloseVerdict.CLOSE, None
    if joined < limits.min_nodes:
        return CloseVerdict.WAIT_FOR_MIN, None
    if previous_fully_accounted(state, number):
        return CloseVerdict.CLOSE, None
    if last_call_since is None:
        return CloseVerdict.WAIT_FOR_LAST_CALL, now + limits.last_call_timeout
    ends = last_call_since + limits.last_call_timeout
    if now >= ends:
        return CloseVerdict.CLOSE, None
    return CloseVerdict.WAIT_FOR_LAST_CALL, ends


def closer_of(joins: Mapping[str, Join]) -> str | None:
    """The node that writes the round's result: the earliest joiner (lowest
    create revision), as in etcd's elections.  If it dies its join key goes
    with its lease and the next earliest takes over."""
    if not joins:
        return None
    return min(joins.values(), key=lambda j: (j.create_revision, j.node)).node


# ---- what a node in next_rendezvous() does next ------------------------------


@dataclass(frozen=True)
class Done:
    result: RoundResult
    rank: int


@dataclass(frozen=True)
class Closed:
    pass


@dataclass(frozen=True)
class JoinRound:
    number: int


@dataclass(frozen=True)
class CloseRound:
    number: int
    members: tuple[Join, ...]


@dataclass(frozen=True)
class Wait:
    number: int
    verdict: CloseVerdict
    until: float | None  # None: until the state changes
    standby: bool  # behind a full, healthy round: a spare, not short of nodes


Action = Done | Closed | JoinRound | CloseRound | Wait


def next_action(
    state: RendezvousState,
    node: str,
    lease: int,
    joined_round: int | None,
    limits: Limits,
    now: float,
    last_call_since: float | None,
) -> Action:
    """Decide the next step of ``node`` (holding ``lease``) in next_rendezvous().

    ``joined_round`` is the round this call has asked to join, if any.
    """
    if state.closed:
        return Closed()
    if joined_round is not None:
        result = state.round(joined_round).result
        if result is not None:
            rank = result.rank_of(node)
            if rank is not None and result.members[rank].lease == lease:
                return Done(result, rank)
    number = state.open_round
    record = state.round(number)
    mine = record.joins.get(node)
    if mine is None or mine.lease != lease:
        return JoinRound(number)
    verdict, until = close_verdict(state, number, limits, now, last_call_since)
    if verdict is CloseVerdict.CLOSE:
        if closer_of(record.joins) == node:
            members = assign_ranks(state.round(number - 1).result, record.joins.values(), limits.max_nodes)
            return CloseRound(number, tuple(members))
        return Wait(number, verdict, None, standby=False)
    standby = verdict is CloseVerdict.WAIT_FOR_PREVIOUS and is_spare(state, number, node, limits)
    return Wait(number, verdict, until, standby)


def is_spare(state: RendezvousState, number: int, node: str, limits: Limits) -> bool:
    """``node`` waits behind a running round that is full and whose members
    are all alive: it is held in reserve, not short of nodes."""
    previous = state.round(number - 1).result
    if previous is None or node in {m.node for m in previous.members}:
        return False
    return len(previous.members) >= limits.max_nodes and all(state.is_alive(m) for m in previous.members)


def last_call_started(
    state: RendezvousState, number: int, limits: Limits, now: float, since: float | None
) -> float | None:
    """Track, locally, since when round ``number`` has had ``min_nodes`` eligible joins."""
    enough = not pending_members(state, number) and len(state.round(number).joins) >= limits.min_nodes
    if not enough:
        return None
    return since if since is not None else now


# ---- what torch's agent polls ------------------------------------------------


@dataclass(frozen=True)
class MembershipChange:
    """How the rendezvous moved on around the round a node belongs to.

    ``rejoined``: members that joined the next round (their node restarts
    its workers); ``dead``: members whose lease is gone without a clean
    ``shutdown()``; ``admissible``: nodes waiting in the next round for which
    the round has room (fewer members than ``max_nodes``, or a dead one);
    ``moved_on``: a later round closed without this node.
    """

    rejoined: tuple[str, ...] = ()
    dead: tuple[str, ...] = ()
    admissible: tuple[str, ...] = ()
    moved_on: bool = False


def membership_change(state: RendezvousState, member_of: RoundResult | None, max_nodes: int) -> MembershipChange:
    """What changed since ``member_of`` closed (nothing when not a member of any round)."""
    if member_of is None:
        return MembershipChange()
    next_joins = state.round(member_of.round + 1).joins
    members = {m.node for m in member_of.members}
    left = state.round(member_of.round).left
    dead = tuple(m.node for m in member_of.members if not state.is_alive(m) and m.node not in left)
    # A dead member frees its place; one that left cleanly has finished the job.
    has_room = len(member_of.members) < max_nodes or bool(dead)
    last = state.last_closed
    return MembershipChange(
        rejoined=tuple(sorted(n for n in next_joins if n in members)),
        dead=dead,
        admissible=tuple(sorted(n for n in next_joins if n not in members)) if has_room else (),
        moved_on=last is not None and last.round > member_of.round,
    )


def num_nodes_waiting(state: RendezvousState, member_of: RoundResult | None, max_nodes: int) -> int:
    """How many nodes the round this node belongs to is holding back.

    torch's agent restarts its workers (and re-rendezvouses) whenever this is
    positive, so it counts: nodes that joined the next round while the round
    has room for them (spares behind a full round do not count), members of
    the round that already re-joined (their workers failed), members that
    died (lease gone without a clean ``shutdown()``), since the round can no
    longer make progress without them, and 1 when the job moved on to a
    later round without this node.
    """
    change = membership_change(state, member_of, max_nodes)
    waiting = len(change.rejoined) + len(change.dead) + len(change.admissible)
    return max(waiting, 1) if change.moved_on else waiting
