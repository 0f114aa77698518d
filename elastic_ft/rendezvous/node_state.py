"""What one node knows of its own place in the rendezvous, as data, and each step that changes it (pure).

``rules.py`` decides from the shared state (the whole ``rdzv/`` prefix, or
the monitor's board); this module holds the rest: the node's own history,
which no other node can see. The handler keeps one :class:`NodeState`,
replaces it through the transitions below, and carries out what the
decisions say (torch's ``_RendezvousState`` and its executor, one level
down). Nothing here does I/O or reads a clock: times come in as arguments.

The decisions behind ``membership_change()``, in the order the handler
applies them:

1. :func:`look_at_board`: which board the node acts on. While one exists,
   that one. Once it is gone (its monitor's lease ended), the last board
   seen, reported *vanished* on the first look (its monitor died, unless it
   left), and on later looks a member may take over as monitor.
2. :func:`lost_announcement`: whether the node's own ``alive`` key is gone
   (its lease lost, or the board lists it dead in its own round): it then
   announces itself again on a new lease (:func:`announced`), and
3. :func:`membership`: the board's change for its round, with the node
   itself never among the dead, and nobody dead during the quiet window
   that follows a re-announcement (an etcd outage ends every lease at once;
   the others get the same ``lease_ttl`` to announce themselves again).

Each decision returns its reason; the handler logs it when it changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastic_ft.rendezvous import rules
from elastic_ft.rendezvous.model import Board, RoundResult


@dataclass(frozen=True)
class NodeState:
    """One node's own rendezvous history (see the module docstring)."""

    node: str
    #: The round this node belongs to (its workers run in it), None before its first rendezvous.
    member_round: int | None = None
    #: Its members, once read (a node learns only its own place when a round closes).
    member_of: RoundResult | None = None
    #: The group rank it took as a hot spare in a running round; None when a member by a round's close.
    late_place: int | None = None
    #: The round whose join key this node holds (withdrawn on a timeout, replaced on the next join).
    joined_round: int | None = None
    #: Wall-clock time of its last join (the ``round_opened`` event's time).
    joined_at: float = 0.0
    #: The lease its ``alive`` key was last put on.
    announced_with: int | None = None
    #: The board is gone and a look has already reported it vanished.
    board_gone_seen: bool = False
    #: No member counts as dead before this (monotonic) time: the quiet window after a re-announcement.
    quiet_until: float = 0.0


# ---- transitions ----


def new_session(state: NodeState) -> NodeState:
    """A new lease: whatever join key the node held went with the old one."""
    return dataclasses.replace(state, joined_round=None)


def joined(state: NodeState, number: int, lease: int, at: float) -> NodeState:
    """It joined open round ``number``, its join and alive keys on ``lease``."""
    return dataclasses.replace(state, joined_round=number, joined_at=at, announced_with=lease)


def joined_late(state: NodeState, number: int, place: int, lease: int) -> NodeState:
    """It took place ``place`` of running round ``number`` as a hot spare (its join key, if any, withdrawn)."""
    return dataclasses.replace(
        state, member_round=number, member_of=None, late_place=place, joined_round=None, announced_with=lease
    )


def ranked(state: NodeState, number: int, result: RoundResult | None = None) -> NodeState:
    """Round ``number`` closed with this node as a member (``result``: its members, when already known)."""
    return dataclasses.replace(state, member_round=number, member_of=result, late_place=None)


def members_read(state: NodeState, result: RoundResult) -> NodeState:
    """The members of its round, read from the round's result."""
    if result.round != state.member_round:
        return state
    return dataclasses.replace(state, member_of=result)


def board_seen(state: NodeState) -> NodeState:
    """A board is there again (its next disappearance is reported before anyone takes over)."""
    return dataclasses.replace(state, board_gone_seen=False)


def withdrawn(state: NodeState) -> NodeState:
    """Its join key is taken back (a timed-out node is not counted)."""
    return dataclasses.replace(state, joined_round=None)


def announced(state: NodeState, lease: int, now: float, lease_ttl: float) -> NodeState:
    """Its alive key is on ``lease`` again after it was lost: nobody counts dead for the next ``lease_ttl``."""
    return dataclasses.replace(state, announced_with=lease, quiet_until=now + lease_ttl)


def announcement_lost_its_lease(state: NodeState, session_id: int | None) -> bool:
    """Whether the node's alive key was on lease ``session_id``: a key gone with its lease means the lease is
    gone too, even if no refresh has failed yet (a member revoked it)."""
    return session_id is not None and state.announced_with == session_id


# ---- decisions ----


@dataclass(frozen=True)
class BoardLook:
    """The board a node acts on, and what its absence means."""

    board: Board | None
    #: ``board`` is the last one seen, and it is gone: its monitor's lease ended.
    vanished: bool = False
    #: Ask to become the monitor now (the board has been gone since an earlier look).
    take_over: bool = False
    reason: str = ""


def look_at_board(
    state: NodeState, current: Board | None, last_seen: Board | None, *, may_take_over: bool
) -> tuple[NodeState, BoardLook]:
    """The board to act on: ``current`` if there is one, else the last one seen, reported vanished.

    The first look after a board vanished reports it (so the members
    absorb its monitor's death) without sending anything; later looks may
    take over (``may_take_over``: a member with a live session), and whoever
    wins the election publishes a new board.
    """
    if current is not None:
        return dataclasses.replace(state, board_gone_seen=False), BoardLook(current, reason="the monitor's board")
    if last_seen is None:
        return state, BoardLook(None, reason="no board yet")
    take_over = state.board_gone_seen and may_take_over
    reason = f"the board of monitor {last_seen.monitor} is gone" + (
        "; taking over as monitor" if take_over else "" if state.board_gone_seen else ": its monitor's lease ended"
    )
    return dataclasses.replace(state, board_gone_seen=True), BoardLook(last_seen, True, take_over, reason)


def lost_announcement(state: NodeState, session_live: bool, board: Board | None) -> str | None:
    """Why this member must announce itself again (its alive key is gone), or None."""
    if state.member_round is None:
        return None
    if not session_live:
        return "its lease is gone"
    last = board.last if board is not None else None
    if board is not None and last is not None and last.round == state.member_round and state.node in board.dead:
        return f"the board lists it dead in round {last.round}"
    return None


def membership(
    state: NodeState, look: BoardLook, now: float, promised_until: float = 0.0
) -> tuple[rules.MembershipChange, str]:
    """What changed around this node's round, from the board it looks at, and why it reads so.

    Nobody counts as dead before ``promised_until`` (the node promised so to
    a member that could not reach etcd: ``rendezvous/fencing.py``) nor during
    the quiet window after the node announced itself again.
    """
    if look.board is None:
        return rules.MembershipChange(), look.reason
    change = rules.board_change(look.board, state.member_round, vanished=look.vanished)
    dead = tuple(n for n in change.dead if n != state.node)
    if dead and now < promised_until:
        return dataclasses.replace(change, dead=()), (
            f"{len(dead)} member(s) without a lease count as alive for {promised_until - now:.1f} s more (this node "
            "promised a member that could not reach etcd to count nobody out)"
        )
    if dead and now < state.quiet_until:
        return dataclasses.replace(change, dead=()), (
            f"{len(dead)} member(s) without a lease count as alive for {state.quiet_until - now:.1f} s more "
            "(every lease ended at once; they may announce themselves again)"
        )
    reason = look.reason
    if len(dead) != len(change.dead):
        reason += "; itself left out of the dead (it is alive)"
    return dataclasses.replace(change, dead=dead), reason
