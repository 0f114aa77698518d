"""State, Compose, the composable rank assignments and filters, and the store exchange."""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading
from collections.abc import Callable

import pytest
import torch.distributed

from elastic_ft.inprocess.compose import Compose
from elastic_ft.inprocess.rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    FilterCountGroupedByKey,
    MaxActiveWorldSize,
    RankAssignment,
    RankAssignmentCtx,
    RankAssignmentTimeout,
    RankDiscarded,
    RankFilter,
    ShiftRanks,
    ranks_failing_group_condition,
)
from elastic_ft.inprocess.state import Mode, State
from tests.inprocess.rank_world import World, assert_consistent, discarded, states_of

# The seeds' diagrams: eight ranks, 1, 4 and 5 terminated.
DIAGRAM_TERMINATED = {1, 4, 5}


def call_each_rank(policy: RankAssignment, world_size: int, terminated: set[int]) -> dict[int, State | Exception]:
    """Run a store-free policy for every rank of a world, in one thread."""
    outcomes: dict[int, State | Exception] = {}
    for rank in range(world_size):
        try:
            outcomes[rank] = policy(RankAssignmentCtx(State(rank, world_size), None, terminated)).state  # type: ignore[arg-type]
        except (RankDiscarded, ValueError) as error:
            outcomes[rank] = error
    return outcomes


# --- State --------------------------------------------------------------------------------------


def test_state_starts_initialized_and_records_initial_position() -> None:
    state = State(3, 8)
    assert (state.rank, state.world_size, state.initial_rank, state.initial_world_size) == (3, 8, 3, 8)
    assert state.active_rank is None and state.active_world_size is None
    assert state.iteration == 0 and state.mode is Mode.INITIALIZED
    assert {Mode.ACTIVE, Mode.INACTIVE, Mode.TERMINATED} <= set(Mode)


def test_state_keeps_initial_position_through_replace() -> None:
    state = dataclasses.replace(State(3, 8), rank=1, world_size=5)
    assert (state.initial_rank, state.initial_world_size) == (3, 8)


def test_state_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        State(0, 1).rank = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rank": 8, "world_size": 8}, ValueError, r"rank must be in \[0, world_size=8\), got 8"),
        ({"rank": -1, "world_size": 8}, ValueError, "rank must be >= 0"),
        ({"rank": 0, "world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
        ({"rank": "0", "world_size": 2}, TypeError, "rank must be an int"),
        ({"rank": 0, "world_size": 2, "active_rank": 2, "active_world_size": 2}, ValueError, "active_rank"),
        ({"rank": 0, "world_size": 2, "mode": "ACTIVE"}, TypeError, "mode must be a Mode"),
    ],
)
def test_state_rejects_inconsistent_values(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        State(**kwargs)


# --- Compose ------------------------------------------------------------------------------------


def test_compose_applies_the_last_argument_first() -> None:
    assert Compose(lambda x: x + ["a"], lambda x: x + ["b"], lambda x: x + ["c"])([]) == ["c", "b", "a"]


def test_compose_of_rank_assignments_is_a_rank_assignment() -> None:
    mixed = Compose(MaxActiveWorldSize(2), ShiftRanks())
    filters = Compose(ActiveWorldSizeDivisibleBy(2), MaxActiveWorldSize(4))
    assert isinstance(mixed, RankAssignment) and not isinstance(mixed, RankFilter)
    assert isinstance(filters, RankFilter)
    assert isinstance(Compose(filters, ShiftRanks()), RankAssignment)
    assert not isinstance(Compose(ShiftRanks(), FillGaps()), ShiftRanks)  # only what every part is
    assert type(Compose(len)) is Compose


def test_compose_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Compose()
    with pytest.raises(TypeError, match="argument 1 must be callable, got 3"):
        Compose(len, 3)


# --- ShiftRanks and FillGaps ---------------------------------------------------------------------


def test_shift_ranks_matches_the_seed_diagram() -> None:
    outcomes = call_each_rank(ShiftRanks(), 8, DIAGRAM_TERMINATED)
    assert {rank: state.rank for rank, state in outcomes.items() if isinstance(state, State)} == {
        0: 0,
        2: 1,
        3: 2,
        6: 3,
        7: 4,
    }
    assert {rank for rank, outcome in outcomes.items() if isinstance(outcome, RankDiscarded)} == DIAGRAM_TERMINATED


def test_fill_gaps_matches_the_seed_diagram() -> None:
    outcomes = call_each_rank(FillGaps(), 8, DIAGRAM_TERMINATED)
    assert {rank: state.rank for rank, state in outcomes.items() if isinstance(state, State)} == {
        0: 0,
        2: 2,
        3: 3,
        6: 1,
        7: 4,
    }
    assert {rank for rank, outcome in outcomes.items() if isinstance(outcome, RankDiscarded)} == DIAGRAM_TERMINATED


@pytest.mark.parametrize("policy", [ShiftRanks(), FillGaps()])
def test_renumbering_activates_every_survivor_and_clears_terminations(policy: RankAssignment) -> None:
    ctx = policy(RankAssignmentCtx(State(6, 8), None, {1, 4, 5}))  # type: ignore[arg-type]
    assert ctx.terminated_ranks == set()
    assert ctx.state.world_size == 5
    assert ctx.state.mode is Mode.ACTIVE
    assert (ctx.state.active_rank, ctx.state.active_world_size) == (ctx.state.rank, 5)
    assert ctx.state.initial_rank == 6


@pytest.mark.parametrize("policy", [ShiftRanks(), FillGaps(), FilterCountGroupedByKey("k", bool)])
def test_terminated_ranks_outside_the_world_are_rejected(policy: RankAssignment) -> None:
    with pytest.raises(ValueError, match=r"terminated_ranks must be ranks in \[0, world_size=4\), got \[4\]"):
        policy(RankAssignmentCtx(State(0, 4), torch.distributed.HashStore(), {4}))


# --- filters ------------------------------------------------------------------------------------


def test_activate_all_ranks() -> None:
    state = ActivateAllRanks()(RankAssignmentCtx(State(2, 5), None, set())).state  # type: ignore[arg-type]
    assert (state.mode, state.active_rank, state.active_world_size) == (Mode.ACTIVE, 2, 5)


@pytest.mark.parametrize(
    ("policy", "expected_active_world_size"),
    [
        (MaxActiveWorldSize(4), 4),
        (MaxActiveWorldSize(None), 10),
        (MaxActiveWorldSize(20), 10),
        (ActiveWorldSizeDivisibleBy(4), 8),
        (ActiveWorldSizeDivisibleBy(3), 9),
        (ActiveWorldSizeDivisibleBy(11), 0),
    ],
)
def test_filters_activate_the_lowest_ranks(policy: RankFilter, expected_active_world_size: int) -> None:
    outcomes = call_each_rank(policy, 10, set())
    for rank, state in outcomes.items():
        assert isinstance(state, State)
        assert state.active_world_size == expected_active_world_size
        if rank < expected_active_world_size:
            assert (state.mode, state.active_rank) == (Mode.ACTIVE, rank)
        else:
            assert (state.mode, state.active_rank) == (Mode.INACTIVE, None)


@pytest.mark.parametrize(("divisor", "limit", "world_size"), [(4, 10, 16), (4, 10, 9), (3, 7, 20), (8, 7, 20)])
def test_divisible_after_max_gives_the_largest_multiple_not_above_the_limit(
    divisor: int, limit: int, world_size: int
) -> None:
    policy = Compose(ActiveWorldSizeDivisibleBy(divisor), MaxActiveWorldSize(limit))
    expected = min(limit, world_size) // divisor * divisor
    states = call_each_rank(policy, world_size, set())
    assert {state.active_world_size for state in states.values() if isinstance(state, State)} == {expected}


def test_spares_are_activated_after_a_shift() -> None:
    def make(_: int) -> RankAssignment:
        return Compose(MaxActiveWorldSize(4), ShiftRanks())

    with World(6, make) as world:
        initial = states_of(world.step(set()))
        assert {rank for rank, state in initial.items() if state.mode is Mode.ACTIVE} == {0, 1, 2, 3}
        after = states_of(world.step_initial({1}))
        assert_consistent(after)
        assert {rank: state.active_rank for rank, state in after.items()} == {0: 0, 2: 1, 3: 2, 4: 3, 5: None}
        assert after[5].mode is Mode.INACTIVE


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: ActiveWorldSizeDivisibleBy(0), ValueError, "divisor must be >= 1, got 0"),
        (lambda: ActiveWorldSizeDivisibleBy(1.5), TypeError, "divisor must be an int, got 1.5"),
        (lambda: MaxActiveWorldSize(0), ValueError, "max_active_world_size must be >= 1, got 0"),
        (lambda: MaxActiveWorldSize(-3), ValueError, "max_active_world_size must be >= 1, got -3"),
        (lambda: FilterCountGroupedByKey(b"x", bool), TypeError, "key_or_fn must be a key"),
        (lambda: FilterCountGroupedByKey("k", 3), TypeError, "condition must be callable"),
        (lambda: FilterCountGroupedByKey("k", bool, datetime.timedelta(0)), ValueError, "timeout must be positive"),
        (lambda: FilterCountGroupedByKey("k", bool, 5), TypeError, "timeout must be a datetime.timedelta"),
        (lambda: FilterCountGroupedByKey("k", bool, name=""), TypeError, "name must be a non-empty str"),
    ],
)
def test_bad_configuration_is_rejected_at_construction(
    make: Callable[[], object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make()


# --- FilterCountGroupedByKey --------------------------------------------------------------------


def pair_key(state: State) -> str:
    return str(state.rank // 2)


def test_filter_marks_ranks_and_a_shift_drops_them() -> None:
    def make(_: int) -> RankAssignment:
        return Compose(ShiftRanks(), FilterCountGroupedByKey(pair_key, lambda count: count == 2))

    with World(8, make) as world:
        outcomes = world.step(DIAGRAM_TERMINATED)
        assert discarded(outcomes) == {0, 1, 4, 5}
        states = states_of(outcomes)
        assert {rank: state.rank for rank, state in states.items()} == {2: 0, 3: 1, 6: 2, 7: 3}
        assert_consistent(states)
        # A second call on the same store and instances: keys are namespaced per call, so the
        # earlier round's keys do not leak in (they would make the pair counts wrong).
        states = states_of(world.step_initial({7}))
        assert {rank: state.rank for rank, state in states.items()} == {2: 0, 3: 1}
        assert discarded(world.history[-1]) == {6, 7}


def test_filter_matches_the_seed_diagram_on_every_healthy_rank() -> None:
    results: dict[int, set[int]] = {}
    store = torch.distributed.HashStore()

    def run(rank: int) -> None:
        policy = FilterCountGroupedByKey(pair_key, lambda count: count == 2, name="grown")
        results[rank] = set(policy(RankAssignmentCtx(State(rank, 8), store, DIAGRAM_TERMINATED)).terminated_ranks)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    healthy = set(range(8)) - DIAGRAM_TERMINATED
    assert {rank: results[rank] for rank in healthy} == {rank: {0, 1, 4, 5} for rank in healthy}
    # Terminated ranks take no part and hand their context on unchanged.
    assert {rank: results[rank] for rank in DIAGRAM_TERMINATED} == {
        rank: DIAGRAM_TERMINATED for rank in DIAGRAM_TERMINATED
    }
    # Keys travel as JSON, namespaced by instance name and call number.
    assert json.loads(store.get("elastic_ft/rank_assignment/grown/0/keys/2")) == ["1"]


def test_two_filters_in_one_policy_use_separate_namespaces_by_default() -> None:
    def make(_: int) -> RankAssignment:
        return Compose(
            ShiftRanks(),
            FilterCountGroupedByKey(lambda state: str(state.rank // 4), lambda count: count == 4),
            FilterCountGroupedByKey(pair_key, lambda count: count == 2),
        )

    with World(8, make) as world:
        # Pairs run first: rank 1 takes pair {0, 1} down; quad {0..3} is then left with 2 ranks, so it goes too.
        states = states_of(world.step({1}))
    assert {rank: state.rank for rank, state in states.items()} == {4: 0, 5: 1, 6: 2, 7: 3}


def test_filter_key_must_be_a_key_every_rank_encodes_alike() -> None:
    policy = FilterCountGroupedByKey(lambda state: {"rank": state.rank}, bool, name="dict-key")
    with pytest.raises(TypeError, match="must give a str, int, float, bool, None or a tuple of them, got {'rank': 0}"):
        policy(RankAssignmentCtx(State(0, 1), torch.distributed.HashStore(), set()))
    with pytest.raises(TypeError, match="FilterCountGroupedByKey key_or_fn must be a key"):
        FilterCountGroupedByKey(object(), bool)


def test_filter_times_out_naming_the_ranks_that_never_published() -> None:
    store = torch.distributed.HashStore()
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        policy = FilterCountGroupedByKey("k", bool, datetime.timedelta(seconds=0.5), name="late")
        try:
            policy(RankAssignmentCtx(State(rank, 4), store, set()))
        except RankAssignmentTimeout as error:
            errors[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 2)]  # 1 and 3 never come
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(errors) == {0, 2}
    for error in errors.values():
        message = str(error)
        assert "'late' call 0" in message and "0.5 s" in message
        assert "2 of 4 ranks did not publish: [1, 3]" in message


def test_terminated_rank_skips_the_exchange() -> None:
    ctx = RankAssignmentCtx(State(1, 4), torch.distributed.HashStore(), {1})
    assert FilterCountGroupedByKey("k", bool, name="skip")(ctx) is ctx


def test_ranks_failing_group_condition_counts_each_group_once() -> None:
    calls: list[int] = []

    def condition(count: int) -> bool:
        calls.append(count)
        return count == 2

    failing = ranks_failing_group_condition([0, 2, 3, 6, 7], ["0", "1", "1", "3", "3"], condition)
    assert failing == {0}
    assert sorted(calls) == [1, 2, 2]
