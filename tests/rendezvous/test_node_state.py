"""The node's own rendezvous history and the decisions the handler takes from it (``node_state.py``, pure)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ft.rendezvous import node_state, rules
from elastic_ft.rendezvous.model import Board, ClosedRound, Member, RendezvousState, RoundResult
from tests.rendezvous.test_board_properties import NODES, states

ME = "me"


def _board(monitor: str = "m", *, round_: int = 3, dead: tuple[str, ...] = (), left: tuple[str, ...] = ()) -> Board:
    return Board(
        monitor, round_ + 1, None, ClosedRound(round_, 4, "h", 1, 1), dead=dead, left=left, monitor_member=True
    )


def _member(number: int = 3) -> node_state.NodeState:
    return node_state.ranked(node_state.NodeState(ME), number)


def test_a_present_board_is_the_one_acted_on_and_clears_the_vanished_mark() -> None:
    board = _board()
    state = dataclasses.replace(_member(), board_gone_seen=True)
    state, look = node_state.look_at_board(state, board, _board("old"), may_take_over=True)
    assert look == node_state.BoardLook(board, reason="the monitor's board")
    assert not state.board_gone_seen


def test_no_board_yet_is_no_change_and_no_takeover() -> None:
    state, look = node_state.look_at_board(_member(), None, None, may_take_over=True)
    assert look.board is None and not look.vanished and not look.take_over
    assert node_state.membership(state, look, 0.0) == (rules.MembershipChange(), "no board yet")


def test_a_vanished_board_is_reported_on_the_first_look_and_taken_over_only_on_a_later_one() -> None:
    last = _board("m")
    state, first = node_state.look_at_board(_member(), None, last, may_take_over=True)
    assert first.board is last and first.vanished and not first.take_over
    assert "its monitor's lease ended" in first.reason
    # The first look counts the monitor dead: the members absorb its death before anyone replaces it.
    change, _ = node_state.membership(state, first, 0.0)
    assert change.dead == ("m",)
    state, second = node_state.look_at_board(state, None, last, may_take_over=True)
    assert second.vanished and second.take_over and "taking over" in second.reason
    # A node without a live session (or a look that may not campaign) never takes over.
    _, third = node_state.look_at_board(state, None, last, may_take_over=False)
    assert third.vanished and not third.take_over


def test_a_board_seen_again_makes_its_next_disappearance_a_first_look() -> None:
    state, _ = node_state.look_at_board(_member(), None, _board(), may_take_over=True)
    state = node_state.board_seen(state)
    _, look = node_state.look_at_board(state, None, _board(), may_take_over=True)
    assert look.vanished and not look.take_over


def test_a_monitor_that_left_is_not_counted_dead_when_its_board_vanishes() -> None:
    state, look = node_state.look_at_board(_member(), None, _board("m", left=("m",)), may_take_over=True)
    assert node_state.membership(state, look, 0.0)[0].dead == ()


def test_the_node_never_reports_itself_dead() -> None:
    board = _board(dead=(ME, "b"))
    state, look = node_state.look_at_board(_member(), board, None, may_take_over=False)
    change, reason = node_state.membership(state, look, 0.0)
    assert change.dead == ("b",) and "itself left out" in reason


def test_nobody_counts_dead_during_the_quiet_window_after_a_reannouncement() -> None:
    state = node_state.announced(_member(), lease=7, now=100.0, lease_ttl=10.0)
    assert state.announced_with == 7 and state.quiet_until == 110.0
    look = node_state.BoardLook(_board(dead=("b", "c")))
    change, reason = node_state.membership(state, look, 105.0)
    assert change.dead == () and "5.0 s more" in reason
    assert node_state.membership(state, look, 110.0)[0].dead == ("b", "c")


def test_a_member_announces_again_when_its_lease_or_its_key_is_gone() -> None:
    board = _board(dead=(ME,))
    assert node_state.lost_announcement(node_state.NodeState(ME), False, board) is None  # not a member yet
    assert node_state.lost_announcement(_member(), False, None) == "its lease is gone"
    assert node_state.lost_announcement(_member(), True, board) == "the board lists it dead in round 3"
    assert node_state.lost_announcement(_member(2), True, board) is None  # dead in a round it is not in
    assert node_state.lost_announcement(_member(), True, _board(dead=("b",))) is None


def test_an_announcement_on_the_current_lease_proves_that_lease_gone_with_its_key() -> None:
    state = node_state.joined(_member(), 4, lease=9, at=1.0)
    assert node_state.announcement_lost_its_lease(state, 9)
    assert not node_state.announcement_lost_its_lease(state, 10)
    assert not node_state.announcement_lost_its_lease(state, None)


def test_joins_places_and_withdrawals() -> None:
    state = node_state.NodeState(ME)
    state = node_state.joined(state, 0, lease=5, at=12.5)
    assert (state.joined_round, state.joined_at, state.announced_with) == (0, 12.5, 5)
    result = RoundResult(0, (Member(ME, 5),), "h", 1)
    state = node_state.ranked(state, 0, result)
    assert (state.member_round, state.member_of, state.late_place) == (0, result, None)
    assert node_state.withdrawn(node_state.joined(state, 1, 5, 13.0)).joined_round is None
    assert node_state.new_session(node_state.joined(state, 1, 5, 13.0)).joined_round is None
    late = node_state.joined_late(node_state.joined(state, 1, 5, 13.0), 0, place=3, lease=6)
    assert (late.member_round, late.member_of, late.late_place, late.joined_round, late.announced_with) == (
        0,
        None,
        3,
        None,
        6,
    )
    # A later round's close makes it a member by rank again, not a late one.
    assert node_state.ranked(late, 1).late_place is None


def test_members_read_for_another_round_are_not_kept() -> None:
    state = node_state.ranked(node_state.NodeState(ME), 2)
    assert node_state.members_read(state, RoundResult(1, (), "h", 1)).member_of is None
    result = RoundResult(2, (Member(ME, 1),), "h", 1)
    assert node_state.members_read(state, result).member_of == result


@settings(max_examples=300, deadline=None)
@given(states(), st.sampled_from(NODES), st.sampled_from(NODES), st.floats(0, 20), st.floats(0, 20))
def test_what_a_member_acts_on_is_the_whole_state_change_without_itself_and_quiet_while_told(
    drawn: tuple[RendezvousState, rules.Limits], monitor: str, node: str, quiet_until: float, now: float
) -> None:
    state, limits = drawn
    last = state.last_closed
    assert last is not None
    board = rules.board(state, limits, monitor)
    mine = dataclasses.replace(node_state.ranked(node_state.NodeState(node), last.round), quiet_until=quiet_until)
    mine, look = node_state.look_at_board(mine, board, None, may_take_over=True)
    change, _ = node_state.membership(mine, look, now)
    expected = rules.membership_change(state, last, limits)
    dead = () if now < quiet_until else tuple(n for n in expected.dead if n != node)
    assert change == dataclasses.replace(expected, dead=dead)
    assert node not in change.dead
