"""Property: what a node decides from the monitor's board is what it would decide from the whole state.

Most nodes never read the whole rendezvous state: the monitor publishes a
board (:func:`rules.board`) and they act on it (:func:`rules.board_change`,
:func:`rules.follower_action`), while the monitor and the node that closes a
round decide on the whole state (:func:`rules.membership_change`,
:func:`rules.late_place`). Both paths must agree on every state: who died,
rejoined, left or may be admitted, whether the round moved on, and where a
newcomer joins the running round.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ft.rendezvous import rules
from elastic_ft.rendezvous.model import Join, LateMember, Member, RendezvousState, RoundRecord, RoundResult

NODES = tuple("abcdefg")


def _lease(node: str) -> int:
    return 100 + NODES.index(node)


@st.composite
def states(draw: st.DrawFn) -> tuple[RendezvousState, rules.Limits]:
    """A running round ``r`` (members, some dead or left, late members in places), nodes waiting in ``r + 1``."""
    max_nodes = draw(st.integers(1, 4))
    limits = rules.Limits(
        min_nodes=draw(st.integers(1, max_nodes)),
        max_nodes=max_nodes,
        last_call_timeout=5.0,
        spare_nodes=draw(st.integers(0, 2)),
    )
    number = draw(st.integers(0, 3))
    members = draw(st.lists(st.sampled_from(NODES), min_size=1, max_size=limits.capacity, unique=True))
    others = [n for n in NODES if n not in members]
    alive = set(draw(st.lists(st.sampled_from(NODES), unique=True)))
    left = frozenset(draw(st.lists(st.sampled_from(members), unique=True)))
    # Late members: each in a place above the members' ranks; a live one holds its place (its slot).
    late_nodes = draw(st.lists(st.sampled_from(others), unique=True, max_size=2)) if others else []
    late, slots = {}, {}
    for offset, node in enumerate(late_nodes):
        place = len(members) + offset
        late[node] = LateMember(node, _lease(node), place)
        if node in alive:
            slots[place] = node
    running = RoundRecord(
        number,
        {n: Join(n, _lease(n), 10 + i, f"{n}.host", 1) for i, n in enumerate(members)},
        RoundResult(number, tuple(Member(n, _lease(n)) for n in members), f"{members[0]}.host", 1),
        left,
        late,
        slots,
    )
    waiting = draw(st.lists(st.sampled_from(NODES), unique=True, max_size=4))
    next_round = RoundRecord(
        number + 1,
        {n: Join(n, _lease(n) + 50, 100 + i, f"{n}.host", 1, draw(st.booleans())) for i, n in enumerate(waiting)},
    )
    rounds = {number: running, number + 1: next_round}
    if number > 0 and draw(st.booleans()):  # an older round, closed, that some node still belongs to
        rounds[number - 1] = RoundRecord(number - 1, {}, RoundResult(number - 1, (Member("a", 1),), "a.host", 1))
    state = RendezvousState(False, {n: _lease(n) for n in alive}, rounds)
    return state, limits


@settings(max_examples=400, deadline=None)
@given(states(), st.sampled_from(NODES))
def test_a_member_reads_the_same_change_on_the_board_as_in_the_whole_state(
    drawn: tuple[RendezvousState, rules.Limits], monitor: str
) -> None:
    state, limits = drawn
    last = state.last_closed
    assert last is not None
    board = rules.board(state, limits, monitor)
    assert rules.board_change(board, last.round) == rules.membership_change(state, last, limits)
    older = state.round(last.round - 1).result
    if older is not None:
        # A member of an older round reads that the job moved on, either way.
        assert rules.board_change(board, older.round).moved_on
        assert rules.membership_change(state, older, limits).moved_on


@settings(max_examples=400, deadline=None)
@given(states(), st.sampled_from(NODES), st.sampled_from(NODES))
def test_a_vanished_board_counts_its_monitor_dead_only_if_it_was_a_member_that_did_not_leave(
    drawn: tuple[RendezvousState, rules.Limits], monitor: str, reader: str
) -> None:
    state, limits = drawn
    last = state.last_closed
    assert last is not None
    board = rules.board(state, limits, monitor)
    change = rules.board_change(board, last.round, vanished=True)
    record = state.round(last.round)
    member = last.rank_of(monitor) is not None or monitor in record.late
    expected = set(rules.membership_change(state, last, limits).dead)
    if member and monitor not in record.left:
        expected.add(monitor)
    assert set(change.dead) == expected


@settings(max_examples=400, deadline=None)
@given(states(), st.sampled_from(NODES))
def test_a_newcomer_takes_the_place_the_whole_state_gives_it(
    drawn: tuple[RendezvousState, rules.Limits], node: str
) -> None:
    state, limits = drawn
    last = state.last_closed
    assert last is not None
    record = state.round(last.round)
    late_limits = dataclasses.replace(limits, late_joins=True)
    board = rules.board(state, limits, "a")
    action = rules.follower_action(board, node, None, None, late_limits)
    newcomer = last.rank_of(node) is None and node not in record.late and node not in state.round(last.round + 1).joins
    if rules.job_finished(state):
        assert action == rules.Closed()
    elif newcomer:
        place = rules.late_place(state, node, late_limits)
        if place is None:
            assert action == rules.JoinRound(last.round + 1)
        else:
            assert action == rules.JoinLate(*place)
    # Without late joins (plain torchrun's agent) nobody joins a running round.
    assert not isinstance(rules.follower_action(board, node, None, None, limits), rules.JoinLate)
