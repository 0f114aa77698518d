"""The monitor's board: what it says of a state, when it is republished, and what a node decides from it alone."""

from __future__ import annotations

import json

import pytest

from elastic_ft.rendezvous import model, rules
from elastic_ft.rendezvous.model import Board, ClosedRound, RoundRecord
from elastic_ft.rendezvous.rules import Closed, JoinLate, JoinRound, Lead, Limits, Ranked, Wait
from elastic_ft.untrusted import MalformedRecord

from .test_rules import join, joins, make_state, result

LIMITS = Limits(min_nodes=2, max_nodes=3, last_call_timeout=5.0)


def running(*, alive: str = "abc", next_joins: str = "", left: str = "") -> model.RendezvousState:
    first = RoundRecord(0, joins(*(join(n, i) for i, n in enumerate("abc"))), result(0, "abc"), frozenset(left))
    second = RoundRecord(1, joins(*(join(n, 10 + i) for i, n in enumerate(next_joins))))
    return make_state(alive=alive, rounds=[first, second])


def test_the_board_summarizes_the_running_round() -> None:
    board = rules.board(running(alive="ab"), LIMITS, "a")
    assert board.last == ClosedRound(0, 3, "a.host", 1, 1) and board.open_round == 1
    assert board.dead == ("c",) and board.closer is None and board.monitor_member and not board.finished
    rejoined = rules.board(running(next_joins="ba"), LIMITS, "a")
    assert rejoined.rejoined == ("a", "b") and rejoined.closer == "b"  # the earliest joiner closes
    assert rules.board(running(alive="ab"), LIMITS, "a", quiet=True).dead == ()  # after an etcd outage
    assert rules.board(running(left="abc"), LIMITS, "a").finished


def test_the_board_is_republished_only_when_what_nodes_act_on_changes() -> None:
    one = rules.board(running(next_joins="a"), LIMITS, "m")
    two = rules.board(running(next_joins="ab"), LIMITS, "m")
    assert one.rejoined != two.rejoined
    assert not rules.board_moved(one, two)  # "anyone rejoined?" did not change: a restart is one board
    assert rules.board_moved(None, one)
    assert rules.board_moved(two, rules.board(running(alive="ab", next_joins="ab"), LIMITS, "m"))  # a death
    assert rules.board_moved(rules.board(running(), LIMITS, "m"), one)  # the first rejoin


def test_the_monitor_leaving_after_another_node_is_published() -> None:
    """Once another member left, "anyone left?" holds already; the monitor's own leaving must still move the
    board, or its shutdown waits a request timeout for it and the board vanishes naming the monitor dead."""
    other_left = rules.board(running(left="b"), LIMITS, "a")
    both_left = rules.board(running(left="ab"), LIMITS, "a")
    assert other_left.left == ("b",) and both_left.left == ("a", "b")
    assert rules.board_moved(other_left, both_left)
    assert rules.board_change(other_left, 0, vanished=True).dead == ("a",)  # what the others would conclude
    assert rules.board_change(both_left, 0, vanished=True).dead == ()


def test_the_board_names_a_bounded_number_of_nodes() -> None:
    many = [f"n{i}" for i in range(200)]
    first = RoundRecord(0, joins(*(join(n, i) for i, n in enumerate(many))), result(0, many))
    second = RoundRecord(1, joins(*(join(n, 500 + i) for i, n in enumerate(many))))
    state = make_state(alive=many, rounds=[first, second])
    board = rules.board(state, Limits(2, 200, 5.0), "n0")
    assert len(board.rejoined) == model.BOARD_NAMES and rules.waiting_count(rules.board_change(board, 0)) > 0


def test_a_node_decides_from_the_board() -> None:
    board = Board(monitor="m", open_round=1, closer="x", last=ClosedRound(0, 3, "h", 1, 1), full=True)
    assert rules.follower_action(board, "y", None, None, LIMITS) == JoinRound(1)
    assert rules.follower_action(board, "x", 1, None, LIMITS) == Lead(1)
    wait = rules.follower_action(board, "y", 1, None, LIMITS)
    assert isinstance(wait, Wait) and wait.standby  # a spare behind a full round: no deadline
    assert not rules.follower_action(board, "y", 1, 0, LIMITS).standby  # a member re-joining is not a spare
    assert rules.follower_action(board, "y", 0, None, LIMITS) == Ranked(0)  # its round closed: read its rank
    late = Limits(2, 3, 5.0, spare_nodes=1, late_joins=True)
    offer = Board(monitor="m", open_round=1, last=ClosedRound(0, 3, "h", 1, 1), late=(0, 3))
    assert rules.follower_action(offer, "y", None, None, late) == JoinLate(0, 3)
    assert rules.follower_action(offer, "y", None, 0, late) == JoinRound(1)  # a member takes no late place
    assert rules.follower_action(Board(monitor="m", finished=True), "y", 1, None, LIMITS) == Closed()


def test_membership_from_the_board_and_a_vanished_monitor() -> None:
    board = rules.board(running(next_joins="b"), LIMITS, "a")
    assert rules.board_change(board, 0).rejoined == ("b",)
    assert rules.board_change(board, None) == rules.MembershipChange()
    moved = Board(monitor="a", open_round=3, last=ClosedRound(2, 2, "h", 1, 1))
    assert rules.board_change(moved, 0).moved_on and rules.waiting_count(rules.board_change(moved, 0)) == 1
    assert rules.board_change(board, 0, vanished=True).dead == ("a",)  # the monitor's lease ended
    left = rules.board(running(left="a"), LIMITS, "a")
    assert rules.board_change(left, 0, vanished=True).dead == ()  # it left cleanly first


def test_chunks_of_the_ranks() -> None:
    assert rules.chunk_count(1) == 1 and rules.chunk_count(64) == 1 and rules.chunk_count(65) == 2
    assert rules.chunk_count(10**6) == rules.MAX_CHUNKS
    assert all(0 <= rules.chunk_of(f"n{i}", 7) < 7 for i in range(100))
    raw = model.chunk_json(4, {"a": model.Placement(2, 9)})
    assert model.placement_from_chunk(raw, 4, "a") == model.Placement(2, 9)
    assert model.placement_from_chunk(raw, 4, "b") is None
    with pytest.raises(MalformedRecord, match="stored under round 5"):
        model.placement_from_chunk(raw, 5, "a")
    with pytest.raises(MalformedRecord, match="chunk has rank=.x.; expected a whole number"):
        model.placement_from_chunk(b'{"round": 4, "ranks": {"a": ["x", 1]}}', 4, "a")


HOSTILE_BOARDS = [
    b"not json",
    b"[]",
    b'{"open_round": 1}',  # no monitor
    b'{"monitor": "m", "open_round": -1}',
    b'{"monitor": "m", "dead": "abc"}',
    b'{"monitor": "m", "dead": [1]}',
    b'{"monitor": "m", "last": {"round": 0, "size": 0, "master_addr": "h", "master_port": 1, "chunks": 1}}',
    b'{"monitor": "m", "late": [1]}',
    b'{"monitor": "m", "finished": "yes"}',
]


@pytest.mark.parametrize("value", HOSTILE_BOARDS, ids=range(len(HOSTILE_BOARDS)))
def test_a_malformed_board_is_refused_with_the_reason(value: bytes) -> None:
    with pytest.raises(MalformedRecord):
        Board.from_json(value)


def test_the_board_round_trips() -> None:
    board = rules.board(running(alive="ab", next_joins="a"), LIMITS, "a")
    assert Board.from_json(board.to_json()) == board
    assert json.loads(board.to_json())["monitor"] == "a"
