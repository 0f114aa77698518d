"""SegmentSpares: a failed rank's place goes to a reserve rank of its own segment first (ftrun --segment-size)."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from elastic_ft.handoff import WORKER_ENV, WorkerHandoff
from elastic_ft.inprocess.rank_assignment import SegmentSpares
from elastic_ft.inprocess.rank_assignment.segments import Seat, next_slots
from elastic_ft.inprocess.wrapper import default_rank_assignment
from tests.inprocess.rank_world import World, active_ranks, assert_consistent, states_of


def seats(labels: str, slots: list[int | None]) -> list[Seat]:
    return [Seat(label, slot) for label, slot in zip(labels, slots, strict=True)]


def test_the_first_assignment_activates_the_ranks_of_the_rounds_whole_segments() -> None:
    assert next_slots(seats("aabbba", [None] * 6), 4, 2) == [0, 1, 2, 3, None, None]
    assert next_slots(seats("ab", [None, None]), None, 1) == [0, 1]


def test_a_vacated_slot_goes_to_a_reserve_rank_of_its_segment_first() -> None:
    # Slots 0-1 are segment 0 (label a), 2-3 segment 1 (label b); the rank holding slot 1 failed.
    # Reserve: a b-rank first in rank order, then an a-rank: the a-rank takes slot 1.
    survivors = seats("abbba", [0, 2, 3, None, None])
    assert next_slots(survivors, 4, 2) == [0, 2, 3, None, 1]
    # Segment 1 lost a rank: the b reserve rank takes it.
    assert next_slots(seats("aabba", [0, 1, 2, None, None]), 4, 2) == [0, 1, 2, 3, None]


def test_without_a_reserve_rank_of_its_label_any_reserve_rank_takes_the_slot() -> None:
    assert next_slots(seats("abbc", [0, 2, 3, None]), 4, 2) == [0, 2, 3, 1]
    # A whole segment lost: no label to prefer; the lowest reserve rank.
    assert next_slots(seats("bbca", [2, 3, None, None]), 4, 2) == [2, 3, 0, 1]


def test_without_reserve_ranks_the_active_ranks_close_up() -> None:
    assert next_slots(seats("abb", [0, 2, 3]), 4, 2) == [0, 1, 2]


def test_reserve_ranks_fill_the_highest_slots_when_the_world_may_grow() -> None:
    # The world shrank to 3 earlier; a joiner (reserve) arrives: it takes slot 3.
    assert next_slots(seats("abbb", [0, 1, 2, None]), 4, 2) == [0, 1, 2, 3]


def test_ranks_agree_through_their_exchange_and_keep_their_places() -> None:
    labels = "aabbba"

    def make(rank: int) -> SegmentSpares:
        return SegmentSpares(4, labels[rank], 2)

    with World(6, make) as world:
        states = states_of(world.step(set()))
        assert_consistent(states)
        assert active_ranks(states) == {0: 0, 1: 1, 2: 2, 3: 3, 4: None, 5: None}
        states = states_of(world.step({1}))  # initial rank 1 (label a, slot 1) fails
        assert_consistent(states)
        # Initial rank 5 (label a) takes slot 1; rank 4 (label b) stays in reserve; nobody else moves.
        assert active_ranks(states) == {0: 0, 2: 2, 3: 3, 4: None, 5: 1}
        states = states_of(world.step_initial({3}))  # label b, slot 3: the b reserve rank takes it
        assert active_ranks(states) == {0: 0, 2: 2, 4: 3, 5: 1}


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(TypeError, match="segment must be a non-empty str, got ''"):
        SegmentSpares(4, "", 2)
    with pytest.raises(ValueError, match="segment_ranks must be a whole number >= 1, got 0"):
        SegmentSpares(4, "a", 0)


def test_ftruns_hand_off_makes_it_the_default() -> None:
    handoff = WorkerHandoff(8, segment="nvl-1", segment_ranks=4)
    assert WorkerHandoff.from_env(handoff.to_env()) == handoff
    with mock.patch.dict(os.environ, handoff.to_env()):
        policy = default_rank_assignment()
    assert isinstance(policy, SegmentSpares)
    assert (policy.active_world_size, policy.segment, policy.segment_ranks) == (8, "nvl-1", 4)
    with pytest.raises(ValueError, match='optionally "segment"'):
        WorkerHandoff.from_env({WORKER_ENV: '{"active_world_size": 8, "joining": false, "segment": "x"}'})
