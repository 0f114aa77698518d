"""Tests of the simulated world the rank-assignment tests run in (``rank_world.py``)."""

from __future__ import annotations

import pytest

from elastic_ft.inprocess.rank_assignment import RankDiscarded, ShiftRanks
from tests.inprocess.rank_world import World, discarded, states_of


def test_world_runs_iterations_in_sequence_and_retires_discarded_ranks() -> None:
    with World(4, lambda _: ShiftRanks()) as world:
        first = states_of(world.step({1}))
        assert discarded(world.history[0]) == {1}
        assert {rank: state.rank for rank, state in first.items()} == {0: 0, 2: 1, 3: 2}
        second = states_of(world.step_initial({3}))
        assert set(world.history[1]) == {0, 2, 3}
        assert discarded(world.history[1]) == {3}
        assert {rank: (state.rank, state.iteration) for rank, state in second.items()} == {0: (0, 1), 2: (1, 1)}


def test_states_of_surfaces_unexpected_errors() -> None:
    with pytest.raises(RuntimeError, match=r"ranks \[0, 2\] failed") as failure:
        states_of({0: ValueError("boom"), 1: RankDiscarded("gone"), 2: KeyError("k")})
    assert isinstance(failure.value.__cause__, ValueError)
