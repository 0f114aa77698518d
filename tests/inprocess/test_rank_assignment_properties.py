"""Property-based tests: random trees, world sizes and termination sequences."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_ft.inprocess.compose import Compose
from elastic_ft.inprocess.rank_assignment import (
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    MaxActiveWorldSize,
    RankAssignmentCtx,
    ShiftRanks,
    Tree,
)
from elastic_ft.inprocess.rank_assignment.tree_engine import (
    Layer,
    LayerFlag,
    TreeAssignment,
    TreeTopology,
    build_tree_topology,
    initial_tree_assignment,
    reassign_tree,
)
from elastic_ft.inprocess.state import Mode, State
from tests.inprocess.rank_world import World, assert_consistent, states_of

FLAGS = [None, LayerFlag.RESERVE, LayerFlag.BACKFILL, LayerFlag.RESERVE | LayerFlag.BACKFILL]


@dataclasses.dataclass
class Scenario:
    layers: list[Layer]
    keys: list[list[str]]  # keys[d][rank]
    world_size_filter: Callable[[int], int] | None
    filter_name: str
    steps: list[list[int]]  # raw draws, reduced modulo the world size at each step

    def __repr__(self) -> str:  # readable falsifying examples
        layers = [(layer.min_ranks, layer.max_ranks, layer.flag) for layer in self.layers]
        return f"Scenario(layers={layers}, keys={self.keys}, filter={self.filter_name}, steps={self.steps})"


@st.composite
def layer_lists(draw: st.DrawFn) -> list[Layer]:
    layers = []
    for _ in range(draw(st.integers(1, 3))):
        min_ranks = draw(st.integers(1, 3))
        max_ranks = draw(st.one_of(st.none(), st.integers(min_ranks, 8)))
        layers.append(Layer(min_ranks=min_ranks, max_ranks=max_ranks, flag=draw(st.sampled_from(FLAGS))))
    return layers


@st.composite
def scenarios(draw: st.DrawFn, max_world_size: int = 40, max_steps: int = 5) -> Scenario:
    layers = draw(layer_lists())
    world_size = draw(st.integers(1, max_world_size))
    keys = [["root"] * world_size]
    for _ in layers[1:]:
        keys.append(draw(st.lists(st.sampled_from("abcd"), min_size=world_size, max_size=world_size)))
    filter_kind = draw(st.sampled_from(["none", "divisible", "cap"]))
    bound = draw(st.integers(1, 6))
    world_size_filter: Callable[[int], int] | None
    if filter_kind == "divisible":
        world_size_filter = lambda size: size // bound * bound
    elif filter_kind == "cap":
        world_size_filter = lambda size: min(size, bound)
    else:
        world_size_filter = None
    steps = draw(st.lists(st.lists(st.integers(0, 10_000), max_size=6), min_size=1, max_size=max_steps))
    return Scenario(layers, keys, world_size_filter, f"{filter_kind}({bound})", steps)


def terminated_at(step: list[int], world_size: int) -> set[int]:
    return {draw % world_size for draw in step} if world_size else set()


def check_invariants(topology: TreeTopology, assignment: TreeAssignment) -> None:
    alive = [position for position, mode in enumerate(assignment.mode) if mode is not Mode.TERMINATED]
    assert alive == assignment.alive
    # Ranks are exactly 0..world_size-1.
    assert [assignment.rank_of(position) for position in alive] == list(range(assignment.world_size))
    # Active ranks are exactly 0..active_world_size-1, with no duplicates, held by active ranks only.
    active_slots = [assignment.slot[p] for p in range(topology.size) if assignment.mode[p] is Mode.ACTIVE]
    assert sorted(active_slots) == list(range(assignment.active_world_size))
    for position, mode in enumerate(assignment.mode):
        assert (mode is Mode.ACTIVE) == (assignment.slot[position] >= 0)
        assert mode in (Mode.ACTIVE, Mode.INACTIVE, Mode.TERMINATED)
    for depth in range(topology.depth):
        for node, (start, end) in enumerate(zip(topology.node_start[depth], topology.node_end[depth], strict=True)):
            modes = assignment.mode[start:end]
            healthy = sum(mode is not Mode.TERMINATED for mode in modes)
            active = sum(mode is Mode.ACTIVE for mode in modes)
            assert (healthy, active) == (assignment.alive_count[depth][node], assignment.active_count[depth][node])
            # No subtree holds more active ranks than its max_ranks ...
            assert active <= topology.capacity[depth]
            # ... and no surviving subtree has fewer healthy ranks than its min_ranks.
            assert healthy == 0 or healthy >= topology.min_ranks[depth]


def build(scenario: Scenario) -> tuple[TreeTopology, TreeAssignment]:
    world_size = len(scenario.keys[0])
    topology = build_tree_topology(scenario.layers, list(range(world_size)), scenario.keys)
    return topology, initial_tree_assignment(topology, scenario.world_size_filter)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_tree_reassignment_keeps_its_invariants(scenario: Scenario) -> None:
    topology, assignment = build(scenario)
    check_invariants(topology, assignment)
    # The same inputs give the same outputs (every rank runs this same computation).
    assert build(scenario)[1] == assignment

    for step in scenario.steps:
        terminated = terminated_at(step, assignment.world_size)
        following = reassign_tree(topology, assignment, terminated, scenario.world_size_filter)
        check_invariants(topology, following)
        assert reassign_tree(topology, assignment, terminated, scenario.world_size_filter) == following

        # The failed ranks, and every rank that failed before, are terminated.
        for rank in terminated:
            assert following.mode[assignment.alive[rank]] is Mode.TERMINATED
        for position, mode in enumerate(assignment.mode):
            if mode is Mode.TERMINATED:
                assert following.mode[position] is Mode.TERMINATED

        # A call with no terminations changes nothing.
        assert reassign_tree(topology, following, set(), scenario.world_size_filter) is following

        # The active world never grows, and active ranks only ever move down.
        assert following.active_world_size <= assignment.active_world_size
        kept_active = [
            position
            for position in range(topology.size)
            if assignment.mode[position] is Mode.ACTIVE and following.mode[position] is Mode.ACTIVE
        ]
        for position in kept_active:
            assert following.slot[position] <= assignment.slot[position]
        # If every failed active rank was replaced by a spare, no survivor was renumbered.
        if scenario.world_size_filter is None and following.active_world_size == assignment.active_world_size:
            assert all(following.slot[p] == assignment.slot[p] for p in kept_active)
        assignment = following


@settings(max_examples=300, deadline=None)
@given(scenarios(max_steps=1))
def test_initial_activation_is_the_rank_by_rank_greedy_over_survivors(scenario: Scenario) -> None:
    topology, assignment = build(dataclasses.replace(scenario, world_size_filter=None))
    # Reference: visit the surviving ranks in tree order, activate each while all ancestors have room.
    active: dict[tuple[int, int], int] = {}
    expected_slots = []
    for position in range(topology.size):
        path = [(depth, topology.node_of[depth][position]) for depth in range(topology.depth)]
        if assignment.mode[position] is not Mode.TERMINATED and all(
            active.get(node, 0) < topology.capacity[node[0]] for node in path
        ):
            for node in path:
                active[node] = active.get(node, 0) + 1
            expected_slots.append(sum(slot >= 0 for slot in expected_slots))
        else:
            expected_slots.append(-1)
    assert assignment.slot == expected_slots


@settings(max_examples=300, deadline=None)
@given(scenarios(max_world_size=30, max_steps=1))
def test_spares_of_an_all_reserve_tree_are_used_before_the_active_world_shrinks(scenario: Scenario) -> None:
    # With RESERVE on every layer, no max_ranks below the root and no min_ranks, every spare is
    # eligible for every failed active rank: the active world shrinks only once spares run out.
    layers = [dataclasses.replace(layer, min_ranks=1, flag=LayerFlag.RESERVE) for layer in scenario.layers]
    layers = [layers[0]] + [dataclasses.replace(layer, max_ranks=None) for layer in layers[1:]]
    world_size = len(scenario.keys[0])
    topology = build_tree_topology(layers, list(range(world_size)), scenario.keys)
    assignment = initial_tree_assignment(topology)
    terminated = terminated_at(scenario.steps[0], world_size)
    following = reassign_tree(topology, assignment, terminated)
    lost_active = sum(assignment.mode[assignment.alive[rank]] is Mode.ACTIVE for rank in terminated)
    spares_left = sum(mode is Mode.INACTIVE for mode in assignment.mode) - (len(terminated) - lost_active)
    expected = assignment.active_world_size - max(0, lost_active - spares_left)
    assert following.active_world_size == expected


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(max_world_size=10, max_steps=3))
def test_threaded_tree_world_agrees_with_the_pure_computation(scenario: Scenario) -> None:
    world_size = len(scenario.keys[0])
    # Each layer's key function reads the key this rank was given at the start.
    layers = [
        dataclasses.replace(layer, key_or_fn=lambda state, column=column: column[state.initial_rank])
        for layer, column in zip(scenario.layers, scenario.keys, strict=True)
    ]
    topology, assignment = build(scenario)
    with World(world_size, lambda _: Tree(layers, scenario.world_size_filter)) as world:
        for index, step in enumerate([[], *scenario.steps]):
            if not world.states:
                break
            terminated = terminated_at(step, len(world.states))
            if index:
                assignment = reassign_tree(topology, assignment, terminated, scenario.world_size_filter)
            states = states_of(world.step(terminated))
            if states:
                assert_consistent(states)
            expected = {
                topology.ranks[position]: (
                    assignment.rank_of(position),
                    assignment.world_size,
                    assignment.active_rank_of(position),
                    assignment.active_world_size,
                    assignment.mode[position],
                )
                for position in assignment.alive
            }
            actual = {
                rank: (s.rank, s.world_size, s.active_rank, s.active_world_size, s.mode) for rank, s in states.items()
            }
            assert actual == expected


@st.composite
def terminations(draw: st.DrawFn) -> tuple[int, set[int]]:
    world_size = draw(st.integers(1, 30))
    return world_size, draw(st.sets(st.integers(0, world_size - 1), max_size=world_size - 1))


def renumber(policy: ShiftRanks | FillGaps, world_size: int, terminated: set[int]) -> dict[int, int]:
    new_ranks = {}
    for rank in sorted(set(range(world_size)) - terminated):
        state = policy(RankAssignmentCtx(State(rank, world_size), None, terminated)).state  # type: ignore[arg-type]
        assert state.world_size == world_size - len(terminated)
        assert state.rank is not None
        new_ranks[rank] = state.rank
    return new_ranks


@settings(max_examples=200, deadline=None)
@given(terminations())
def test_shift_ranks_keeps_order_and_closes_every_gap(case: tuple[int, set[int]]) -> None:
    world_size, terminated = case
    new_ranks = renumber(ShiftRanks(), world_size, terminated)
    assert list(new_ranks.values()) == list(range(world_size - len(terminated)))


@settings(max_examples=200, deadline=None)
@given(terminations())
def test_fill_gaps_keeps_low_ranks_and_fills_every_gap(case: tuple[int, set[int]]) -> None:
    world_size, terminated = case
    new_world_size = world_size - len(terminated)
    new_ranks = renumber(FillGaps(), world_size, terminated)
    assert sorted(new_ranks.values()) == list(range(new_world_size))
    assert all(new_ranks[rank] == rank for rank in new_ranks if rank < new_world_size)
    movers = [new_ranks[rank] for rank in sorted(new_ranks) if rank >= new_world_size]
    assert movers == sorted(movers)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 64))
def test_divisible_after_max_is_the_largest_multiple_not_above_the_limit(
    world_size: int, divisor: int, limit: int
) -> None:
    policy = Compose(ActiveWorldSizeDivisibleBy(divisor), MaxActiveWorldSize(limit))
    expected = max(m for m in range(min(world_size, limit) + 1) if m % divisor == 0)
    for rank in {0, world_size - 1, expected - 1} & set(range(world_size)):
        state = policy(RankAssignmentCtx(State(rank, world_size), None, set())).state  # type: ignore[arg-type]
        assert state.active_world_size == expected
        assert (state.mode is Mode.ACTIVE) == (rank < expected)
