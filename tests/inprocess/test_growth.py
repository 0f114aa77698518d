"""Property tests: a world that loses ranks and grows by joiners stays consistently numbered.

Every simulated process runs its own instance of the policy, as ranks do,
from the states :mod:`elastic_ft.inprocess.restart.growth` builds; after every
restart the ranks must be ``0..world_size-1``, the active ranks
``0..active_world_size-1``, and every process must agree on both sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ft.coordination.termination import TerminationResult
from elastic_ft.inprocess.compose import Compose
from elastic_ft.inprocess.exception import RankDiscarded
from elastic_ft.inprocess.rank_assignment.base import RankAssignment, RankAssignmentCtx, admits_new_ranks
from elastic_ft.inprocess.rank_assignment.policies import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    FilterCountGroupedByKey,
    MaxActiveWorldSize,
    ShiftRanks,
)
from elastic_ft.inprocess.rank_assignment.tree import Tree
from elastic_ft.inprocess.rank_assignment.tree_engine import Layer
from elastic_ft.inprocess.restart.growth import joiner_state, next_iteration_state
from elastic_ft.inprocess.state import Mode, State

POLICIES: dict[str, Callable[[int], RankAssignment]] = {
    "hot spares (the ftrun default)": lambda k: Compose(MaxActiveWorldSize(k), ShiftRanks()),
    "all active": lambda _k: Compose(ActivateAllRanks(), ShiftRanks()),
    "fill gaps, divisible by 2": lambda _k: Compose(ActiveWorldSizeDivisibleBy(2), FillGaps()),
    "at most k, divisible by 2": lambda k: Compose(ActiveWorldSizeDivisibleBy(2), MaxActiveWorldSize(k), ShiftRanks()),
}

STORE = dist.HashStore()


def _check_world(states: dict[int, State]) -> None:
    world_sizes = {s.world_size for s in states.values()}
    active_sizes = {s.active_world_size for s in states.values()}
    assert len(world_sizes) == 1 and len(active_sizes) == 1, states
    world_size, active_world_size = world_sizes.pop(), active_sizes.pop()
    assert sorted(s.rank for s in states.values()) == list(range(world_size))
    active = sorted(s.active_rank for s in states.values() if s.mode is Mode.ACTIVE)
    assert active == list(range(active_world_size or 0))
    assert all(s.active_rank is None for s in states.values() if s.mode is Mode.INACTIVE)


@settings(max_examples=300, deadline=None)
@given(
    policy_name=st.sampled_from(sorted(POLICIES)),
    initial_world_size=st.integers(1, 12),
    max_active=st.integers(1, 12),
    events=st.lists(st.tuples(st.lists(st.integers(0, 40), max_size=6), st.integers(0, 4)), max_size=8),
)
def test_ranks_stay_dense_and_agreed_as_the_world_shrinks_and_grows(
    policy_name: str, initial_world_size: int, max_active: int, events: list[tuple[list[int], int]]
) -> None:
    make = POLICIES[policy_name]
    policies = {r: make(max_active) for r in range(initial_world_size)}
    states = {
        r: policies[r](RankAssignmentCtx(State(r, initial_world_size), STORE, set())).state
        for r in range(initial_world_size)
    }
    _check_world(states)
    next_initial = initial_world_size
    for picks, joining in events:
        world_size = next(iter(states.values())).world_size
        terminated = {p % world_size for p in picks}
        if len(terminated) >= world_size + joining:
            continue  # nobody would be left to restart
        joined = tuple(range(next_initial, next_initial + joining))
        next_initial += joining
        result = TerminationResult(world_size, tuple(sorted(terminated)), joined)
        active_before = next(iter(states.values())).active_world_size
        iteration = next(iter(states.values())).iteration + 1
        new_states: dict[int, State] = {}
        for initial, state in states.items():
            ctx = RankAssignmentCtx(next_iteration_state(state, result), STORE, terminated)
            if state.rank in terminated:
                with pytest.raises(RankDiscarded):
                    policies[initial](ctx)
                continue
            new_states[initial] = policies[initial](ctx).state
        for initial in joined:
            policies[initial] = make(max_active)
            start = joiner_state(
                result,
                initial,
                initial_world_size=initial_world_size,
                active_world_size=active_before,
                iteration=iteration,
            )
            new_states[initial] = policies[initial](RankAssignmentCtx(start, STORE, terminated)).state
        states = new_states
        policies = {r: policies[r] for r in states}  # the discarded ranks' processes are gone
        _check_world(states)
        assert {s.iteration for s in states.values()} == {iteration}


def test_a_joiner_takes_the_ranks_after_the_world_in_admission_order() -> None:
    result = TerminationResult(4, (1,), (9, 7))
    first = joiner_state(result, 9, initial_world_size=4, active_world_size=3, iteration=5)
    second = joiner_state(result, 7, initial_world_size=4, active_world_size=3, iteration=5)
    assert (first.rank, second.rank, first.world_size, first.active_world_size) == (4, 5, 6, 3)
    assert first.mode is Mode.INACTIVE and first.initial_rank == 9 and first.iteration == 5
    with pytest.raises(ValueError, match="initial rank 8 is not among the joiners"):
        joiner_state(result, 8, initial_world_size=4, active_world_size=3, iteration=5)


def test_only_stateless_policies_admit_new_ranks() -> None:
    assert admits_new_ranks(Compose(MaxActiveWorldSize(4), ShiftRanks()))
    assert admits_new_ranks(lambda ctx: ctx)  # any other callable is taken to be stateless
    assert not admits_new_ranks(Tree([Layer(1, 8, "job")]))
    assert not admits_new_ranks(Compose(ShiftRanks(), FilterCountGroupedByKey("k", lambda n: n > 0)))
