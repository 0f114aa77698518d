"""Every rendezvous decision, as a pure function of the state.

Nothing here does I/O. :func:`next_action` decides what a node in
``next_rendezvous()`` does next; :func:`close_verdict` whether a round may
close, with the reason; :func:`assign_ranks` orders a closing round;
:func:`waiting_count` and :func:`membership_change` answer torch's and
ftrun's agents. The handler (``handler.py``) only carries these decisions
out against etcd; the state they read is :mod:`elastic_ft.rendezvous.model`.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from elastic_ft.rendezvous.model import (
    BOARD_NAMES,
    Board,
    ClosedRound,
    Join,
    Member,
    RendezvousState,
    RoundResult,
)

#: A closing transaction checks every member's join key is still there; etcd
#: caps a transaction at 128 operations (``--max-txn-ops``), so beyond this
#: many members the check is skipped and a member lost during the close is
#: handled as a death after completion instead.
MAX_CHECKED_MEMBERS = 120


# ---- closing a round --------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """How many nodes a round needs and admits.

    ``spare_nodes`` hot spares are admitted beyond ``max_nodes``: they are
    members like the others (their workers start and wait as reserve ranks of
    the in-process world), so a round is full at ``capacity`` members.
    ``min_nodes`` counts every member, spares included.
    """

    min_nodes: int
    max_nodes: int
    last_call_timeout: float
    spare_nodes: int = 0
    #: A node may join a running round as a hot spare (:func:`late_place`); only ``ftrun``'s
    #: agent, which starts such a node's workers as joiners of the running world, allows it.
    late_joins: bool = False
    #: Nodes train in whole segments of this many nodes of one label (:func:`segment_layout`); None: no segments.
    segment: int | None = None

    @property
    def capacity(self) -> int:
        return self.max_nodes + self.spare_nodes


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


def assign_ranks(previous: RoundResult | None, joins: Iterable[Join], capacity: int) -> list[Join]:
    """Choose the members of a closing round, in rank order.

    Admission: members of the previous round first, then the others in the
    order they joined (create revision); at most ``capacity`` (``max_nodes``
    plus hot spares).  Ranks: an
    admitted node keeps its previous rank if that rank still exists; the
    remaining ranks go, lowest first, to the rest in their launcher's order
    (``Join.order``: Slurm's, which follows the network topology) where they
    have one, then in admission order.
    """
    previous_rank = {m.node: r for r, m in enumerate(previous.members)} if previous else {}
    by_join_order = sorted(joins, key=lambda j: (j.create_revision, j.node))
    returning = [j for j in by_join_order if j.node in previous_rank]
    returning.sort(key=lambda j: previous_rank[j.node])
    newcomers = [j for j in by_join_order if j.node not in previous_rank]
    admitted = (returning + newcomers)[:capacity]
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
    unplaced.sort(key=lambda j: (j.order is None, j.order or 0))  # stable: admission order among equals
    for join in unplaced:
        ranks[next(free)] = join
    return [j for j in ranks if j is not None]


def whole_segment_nodes(joins: Iterable[Join], segment: int) -> int:
    """How many of ``joins`` form whole segments: per label, the largest multiple of ``segment`` (a node without
    a label is in none)."""
    counts: dict[str, int] = {}
    for join in joins:
        if join.segment is not None:
            counts[join.segment] = counts.get(join.segment, 0) + 1
    return sum(count // segment * segment for count in counts.values())


def segment_layout(members: Sequence[Join], segment: int, max_nodes: int) -> tuple[list[Join], int]:
    """Reorder a closing round's ``members`` (in rank order) so that whole segments train: ``(members, active)``.

    As ``ft_launcher --ft-segment`` does: per label (an NVLink domain, a
    rack), in the order of each label's first member, as many whole
    segments of ``segment`` nodes as the label has, while ``max_nodes``
    leaves room for whole segments. Those nodes come first, each label's
    together, and train; the others (a label's incomplete remainder, the
    nodes beyond) follow as hot spares, in their order. A segment's nodes
    hold consecutive ranks, so a job's groups that follow rank order (a
    tensor-parallel group per segment) stay inside one domain.
    """
    by_label: dict[str, list[Join]] = {}
    for join in members:
        if join.segment is not None:
            by_label.setdefault(join.segment, []).append(join)
    active: list[Join] = []
    for nodes in by_label.values():
        whole = len(nodes) // segment * segment
        room = (max_nodes - len(active)) // segment * segment
        active += nodes[: min(whole, room)]
    chosen = {join.node for join in active}
    return active + [join for join in members if join.node not in chosen], len(active)


class CloseVerdict(Enum):
    CLOSE = "close"
    WAIT_FOR_PREVIOUS = "wait for the previous round's members"
    WAIT_FOR_MIN = "wait for min_nodes"
    WAIT_FOR_LAST_CALL = "wait for last call"


@dataclass(frozen=True)
class CloseDecision:
    """Whether a round may close; ``until``: when a last-call wait ends; ``reason``: why, for the log."""

    verdict: CloseVerdict
    until: float | None
    reason: str


def close_verdict(
    state: RendezvousState, number: int, limits: Limits, now: float, last_call_since: float | None
) -> CloseDecision:
    """Whether round ``number`` may close now; if it must wait for last call,
    also when that wait ends (``last_call_since + last_call_timeout``)."""
    pending = pending_members(state, number)
    if pending:
        names = ", ".join(m.node for m in pending[:8]) + (", ..." if len(pending) > 8 else "")
        return CloseDecision(
            CloseVerdict.WAIT_FOR_PREVIOUS,
            None,
            f"{len(pending)} member(s) of round {number - 1} still run and have not re-joined: {names}",
        )
    joins = state.round(number).joins
    joined = len(joins)
    if limits.segment is not None:
        whole = whole_segment_nodes(joins.values(), limits.segment)
        if whole < limits.min_nodes:
            return CloseDecision(
                CloseVerdict.WAIT_FOR_MIN,
                None,
                f"{whole} of min_nodes={limits.min_nodes} node(s) joined in whole segments of {limits.segment} "
                f"({joined} joined)",
            )
    if joined >= limits.capacity:
        spares = f" + spare_nodes={limits.spare_nodes}" if limits.spare_nodes else ""
        return CloseDecision(CloseVerdict.CLOSE, None, f"{joined} node(s) joined, max_nodes={limits.max_nodes}{spares}")
    if joined < limits.min_nodes:
        return CloseDecision(
            CloseVerdict.WAIT_FOR_MIN, None, f"{joined} of min_nodes={limits.min_nodes} node(s) joined"
        )
    if previous_fully_accounted(state, number):
        return CloseDecision(
            CloseVerdict.CLOSE,
            None,
            f"every member of round {number - 1} re-joined or is gone ({joined} node(s) joined)",
        )
    if last_call_since is None:
        ends = now + limits.last_call_timeout
    else:
        ends = last_call_since + limits.last_call_timeout
        if now >= ends:
            return CloseDecision(CloseVerdict.CLOSE, None, f"last call ended with {joined} node(s) joined")
    return CloseDecision(
        CloseVerdict.WAIT_FOR_LAST_CALL,
        ends,
        f"{joined} node(s) joined (min_nodes={limits.min_nodes}, max_nodes={limits.max_nodes}); "
        f"last call for {ends - now:.1f} s more",
    )


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
class JoinLate:
    """Join round ``number``, which is running, as a hot spare holding group rank ``place``."""

    number: int
    place: int


@dataclass(frozen=True)
class JoinRound:
    number: int


@dataclass(frozen=True)
class CloseRound:
    number: int
    members: tuple[Join, ...]
    reason: str = ""
    #: With segments: how many of the members train (the first ones); None: the first ``max_nodes``.
    active: int | None = None


@dataclass(frozen=True)
class Ranked:
    """Round ``number``, which this node joined, has closed: read its chunk of the ranks for its place."""

    number: int


@dataclass(frozen=True)
class Lead:
    """This node closes round ``number`` (its earliest joiner): follow the whole state until it completes."""

    number: int


@dataclass(frozen=True)
class Wait:
    number: int
    verdict: CloseVerdict
    until: float | None  # None: until the state changes
    standby: bool  # behind a full, healthy round: a spare, not short of nodes
    reason: str = ""


Action = Done | Closed | JoinLate | JoinRound | CloseRound | Wait | Ranked | Lead


def job_finished(state: RendezvousState) -> bool:
    """The job is over: closed (``set_closed``), or every node of its last round left it cleanly.

    torch's agent never calls ``set_closed``: when its workers are done it
    calls ``shutdown()``, which writes each member's ``left`` key. Once
    every member of the last closed round, and every hot spare alive in it,
    has left so, no one runs the job any more, and a node still waiting to
    join must not wait for it forever (a spare waits without a deadline).
    torch's own handlers close the rendezvous on ``shutdown()``; this is the
    same end, reached only when the last node is done.
    """
    if state.closed:
        return True
    last = state.last_closed
    if last is None:
        return False
    record = state.round(last.round)
    if not record.left or any(m.node not in record.left for m in last.members):
        return False
    return all(node in record.left for node in record.late if node in state.alive)


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
    if job_finished(state):
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
    late = late_place(state, node, limits)
    if late is not None:
        return JoinLate(*late)
    if mine is None or mine.lease != lease:
        return JoinRound(number)
    decision = close_verdict(state, number, limits, now, last_call_since)
    if decision.verdict is CloseVerdict.CLOSE:
        if closer_of(record.joins) == node:
            members = assign_ranks(state.round(number - 1).result, record.joins.values(), limits.capacity)
            if limits.segment is None:
                return CloseRound(number, tuple(members), decision.reason)
            members, active = segment_layout(members, limits.segment, limits.max_nodes)
            return CloseRound(number, tuple(members), decision.reason, active)
        return Wait(number, decision.verdict, None, standby=False, reason=decision.reason)
    standby = decision.verdict is CloseVerdict.WAIT_FOR_PREVIOUS and is_spare(state, number, node, limits)
    return Wait(number, decision.verdict, decision.until, standby, decision.reason)


def late_place(state: RendezvousState, node: str, limits: Limits) -> tuple[int, int] | None:
    """Where ``node`` may join the running round: ``(round, place)``, or None.

    Only where late joins are allowed (``ftrun``'s agent starts such a
    node's workers as joiners of the running world, which grows in-process
    up to ``max_nodes`` nodes' ranks; the ranks beyond wait as reserve
    ranks: hot spares): the running round has room below its capacity,
    counting its live members and late members, and no member is leaving
    or re-joining (no shutdown or restart under way). The place is the
    lowest group rank above the members' that no live late member holds.
    Otherwise the node joins the next round, as before.
    """
    last = state.last_closed
    if not limits.late_joins or state.closed or last is None:
        return None
    record = state.round(last.round)
    if record.left or last.rank_of(node) is not None or node in record.late:
        return None
    if any(m.node in state.round(last.round + 1).joins for m in last.members):
        return None
    alive = sum(1 for m in last.members if state.is_alive(m))
    late_alive = len(record.slots)  # a late member holds its place on its lease: a dead one's is gone
    if alive + late_alive >= limits.capacity:
        return None
    place = len(last.members)
    while place in record.slots:
        place += 1
    return last.round, place


def late_members_dead(state: RendezvousState, number: int) -> tuple[str, ...]:
    """Late members of round ``number`` whose lease is gone without a clean ``shutdown()``."""
    record = state.round(number)
    held = set(record.slots.values())
    return tuple(sorted(n for n in record.late if n not in held and n not in record.left and n not in state.alive))


def is_spare(state: RendezvousState, number: int, node: str, limits: Limits) -> bool:
    """``node`` waits behind a running round that is full and whose members
    are all alive: it is held in reserve, not short of nodes."""
    previous = state.round(number - 1).result
    if previous is None or node in {m.node for m in previous.members}:
        return False
    return len(previous.members) >= limits.capacity and all(state.is_alive(m) for m in previous.members)


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
    its workers), late members holding their place too (a late member's
    join is deleted when it takes its place, so a new one means its node
    restarts; one whose place is gone with its lease joins as any node);
    ``dead``: members whose lease is gone without a clean ``shutdown()``;
    ``left``: members that left it through ``shutdown()`` (finished, or
    failed and gave up); ``admissible``: nodes waiting in the next round
    for which the round has room (fewer members than its capacity,
    ``max_nodes`` plus hot spares, or a dead one); ``moved_on``: a later
    round closed without this node.
    """

    rejoined: tuple[str, ...] = ()
    dead: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    admissible: tuple[str, ...] = ()
    moved_on: bool = False


def membership_change(state: RendezvousState, member_of: RoundResult | None, limits: Limits) -> MembershipChange:
    """What changed since ``member_of`` closed (nothing when not a member of any round).

    Late members (nodes that joined the running round) that died count as
    dead members. A waiting node is admissible while fewer than
    ``max_nodes`` nodes run the round (members alive or finished, and live
    late members: a dead member frees its place), unless it takes a place
    in the running round itself (:func:`late_place`: it said it would, and
    one is open), and nobody restarts.
    """
    if member_of is None:
        return MembershipChange()
    next_joins = state.round(member_of.round + 1).joins
    members = {m.node for m in member_of.members}
    record = state.round(member_of.round)
    left = record.left
    dead = tuple(m.node for m in member_of.members if not state.is_alive(m) and m.node not in left)
    present = sum(1 for m in member_of.members if state.is_alive(m) or m.node in left) + len(record.slots)
    holding = set(record.slots.values())  # late members in their place: alive, not left
    rejoined = tuple(sorted(n for n in next_joins if n in members or n in holding))
    waiting = [n for n in next_joins if n not in members and n not in holding]
    if waiting and late_place(state, "", dataclasses.replace(limits, late_joins=True)) is not None:
        waiting = [n for n in waiting if not next_joins[n].late_joins]
    dead += late_members_dead(state, member_of.round)
    last = state.last_closed
    return MembershipChange(
        rejoined=rejoined,
        dead=dead,
        left=tuple(sorted(m.node for m in member_of.members if m.node in left)),
        admissible=tuple(sorted(waiting)) if present < limits.max_nodes else (),
        moved_on=last is not None and last.round > member_of.round,
    )


def waiting_count(change: MembershipChange) -> int:
    """torch's ``num_nodes_waiting()``: how many nodes the round this node belongs to is holding back.

    torch's agent restarts its workers (and re-rendezvouses) whenever this is
    positive, so it counts: nodes that joined the next round while the round
    has room for them (spares behind a full round do not count), members of
    the round that already re-joined (their workers failed), members that
    died (lease gone without a clean ``shutdown()``), since the round can no
    longer make progress without them, and 1 when the job moved on to a
    later round without this node.
    """
    waiting = len(change.rejoined) + len(change.dead) + len(change.admissible)
    return max(waiting, 1) if change.moved_on else waiting


# ---- the board: what the monitor publishes, and what the other nodes decide from it ----
#
# One node, the monitor, follows every rendezvous key; every other node
# watches one key, the board, which the monitor rewrites only when what they
# act on changes (:func:`board_moved`). A round's cost per node is then a
# few watch events, whatever the number of nodes (docs/rendezvous.md).

#: Members per chunk of a round's ranks, and the most chunks a round has
#: (the closing transaction writes them all, under etcd's 128 operations).
CHUNK_MEMBERS = 64
MAX_CHUNKS = 100


def chunk_count(size: int) -> int:
    """How many chunks the ranks of a round of ``size`` members are split into."""
    return max(1, min(MAX_CHUNKS, math.ceil(size / CHUNK_MEMBERS)))


def chunk_of(node: str, chunks: int) -> int:
    """The chunk that lists ``node`` (a stable hash: every node finds its own without reading the others)."""
    return zlib.crc32(node.encode()) % chunks


def board(state: RendezvousState, limits: Limits, monitor: str, *, quiet: bool = False) -> Board:
    """The board the monitor publishes for ``state``.

    ``late`` and ``full`` are computed for a node that is not a member of the
    running round (the only nodes that act on them). ``quiet``: report no
    member dead (the monitor's own lease has just been renewed after an etcd
    outage, which ended every lease at once; the others get the same time to
    announce themselves again).
    """
    number = state.open_round
    last = state.last_closed
    closed = None
    if last is not None:
        size = len(last.members)
        closed = ClosedRound(last.round, size, last.master_addr, last.master_port, chunk_count(size))
    change = membership_change(state, last, limits)
    decision = close_verdict(state, number, limits, 0.0, None)
    full = decision.verdict is CloseVerdict.WAIT_FOR_PREVIOUS and is_spare(state, number, "", limits)
    return Board(
        monitor=monitor,
        open_round=number,
        closer=closer_of(state.round(number).joins),
        last=closed,
        finished=job_finished(state),
        rejoined=change.rejoined[:BOARD_NAMES],
        dead=() if quiet else change.dead,
        left=change.left[:BOARD_NAMES],
        admissible=change.admissible[:BOARD_NAMES],
        late=late_place(state, "", dataclasses.replace(limits, late_joins=True)),
        full=full,
        monitor_member=last is not None
        and (last.rank_of(monitor) is not None or monitor in state.round(last.round).late),
        verdict=decision.verdict.value,
        reason=decision.reason,
    )


def _acted_on(board: Board) -> tuple:
    return (
        board.monitor,
        board.monitor in board.left,  # its board must say so before it goes with the monitor's lease
        board.open_round,
        board.closer,
        board.last,
        board.finished,
        board.dead,
        bool(board.rejoined),
        bool(board.left),
        bool(board.admissible),
        board.late,
        board.full,
    )


def board_moved(published: Board | None, current: Board) -> bool:
    """Whether the monitor must publish ``current``: something a node acts on changed.

    Who rejoined, left or waits is acted on only as "anyone?": a restart of
    every node is one board change, not one per node. Deaths are acted on one
    by one (the launcher absorbs each), and the closed round, the closer and
    the end of the job change once per round. The monitor's own leaving is
    acted on too: a board that vanishes without it names the monitor dead
    (:func:`board_change`), and its shutdown waits to see it published.
    """
    return published is None or _acted_on(published) != _acted_on(current)


def board_change(board: Board, member_round: int | None, *, vanished: bool = False) -> MembershipChange:
    """:func:`membership_change` for a member of round ``member_round``, from the board.

    ``vanished``: this is the last board seen, and it is gone: its monitor's
    lease ended. Unless the monitor left cleanly first, a member died.
    """
    last = board.last
    if last is None or member_round is None or last.round < member_round:
        return MembershipChange()
    if last.round > member_round:
        return MembershipChange(moved_on=True)
    dead = board.dead
    if vanished and board.monitor_member and board.monitor not in board.left and board.monitor not in dead:
        dead = (*dead, board.monitor)
    return MembershipChange(board.rejoined, dead, board.left, board.admissible)


def follower_action(
    board: Board, node: str, joined_round: int | None, member_round: int | None, limits: Limits
) -> Action:
    """The next step of ``node`` in next_rendezvous(), from the board alone.

    ``joined_round``: the round this call has joined, if any;
    ``member_round``: the round the node last belonged to. The node that
    closes the open round (its earliest joiner) leads: it follows the whole
    state and decides with :func:`next_action`.
    """
    if board.finished:
        return Closed()
    last = board.last
    if joined_round is not None and last is not None and last.round == joined_round:
        return Ranked(joined_round)
    number = board.open_round
    if limits.late_joins and board.late is not None and member_round != board.late[0]:
        return JoinLate(*board.late)
    if joined_round != number:
        return JoinRound(number)
    if board.closer == node:
        return Lead(number)
    try:
        verdict = CloseVerdict(board.verdict)
    except ValueError:
        verdict = CloseVerdict.WAIT_FOR_MIN
    standby = board.full and member_round != number - 1
    return Wait(number, verdict, None, standby, board.reason)
