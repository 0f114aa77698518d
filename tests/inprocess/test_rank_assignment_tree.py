"""Tree: threaded worlds sharing one HashStore, driven through restart iterations."""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable

import pytest
import torch.distributed

from elastic_ft.inprocess.compose import Compose
from elastic_ft.inprocess.rank_assignment import (
    Layer,
    LayerFlag,
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
    ShiftRanks,
    Tree,
)
from elastic_ft.inprocess.rank_assignment.base import grouping_key
from elastic_ft.inprocess.state import Mode, State
from tests.inprocess.rank_world import (
    World,
    active_ranks,
    assert_consistent,
    discarded,
    states_of,
)

RESERVE = LayerFlag.RESERVE
BACKFILL = LayerFlag.BACKFILL


def host(size: int) -> Callable[[State], str]:
    """Group consecutive ranks into hosts of ``size``."""
    return lambda state: f"host{state.rank // size}"


def tree(*layers: Layer, **kwargs: object) -> Callable[[int], RankAssignment]:
    return lambda _: Tree(list(layers), **kwargs)


def test_initial_activation_is_depth_first_and_bounded_by_every_ancestor() -> None:
    # Hosts of 4 allow 3 active ranks; the root allows 7 in all.
    make = tree(Layer(max_ranks=7, key_or_fn="root"), Layer(max_ranks=3, key_or_fn=host(4)))
    with World(12, make) as world:
        states = states_of(world.step(set()))
    assert_consistent(states)
    assert active_ranks(states) == {
        0: 0,
        1: 1,
        2: 2,
        3: None,
        4: 3,
        5: 4,
        6: 5,
        7: None,
        8: 6,
        9: None,
        10: None,
        11: None,
    }
    assert {state.mode for rank, state in states.items() if rank in (3, 7, 9)} == {Mode.INACTIVE}
    assert all(state.world_size == 12 and state.active_world_size == 7 for state in states.values())


def test_spare_from_the_nearest_reserve_domain_takes_the_exact_active_rank() -> None:
    # Two hosts of 4, 3 active each: each host keeps one spare of its own.
    make = tree(Layer(key_or_fn="root", flag=RESERVE), Layer(max_ranks=3, key_or_fn=host(4), flag=RESERVE))
    with World(8, make) as world:
        states_of(world.step(set()))
        states = states_of(world.step_initial({4}))  # host 1, active rank 3
        assert_consistent(states)
        assert discarded(world.history[-1]) == {4}
        # Host 1's own spare (7) replaces it, though host 0's spare (3) has a lower rank.
        assert active_ranks(states) == {0: 0, 1: 1, 2: 2, 3: None, 5: 4, 6: 5, 7: 3}
        assert states[7].rank == 6 and states[7].world_size == 7

        # Host 1 has no spare left. The root may search other hosts, but host 0 already has its
        # 3 active ranks, so activating its spare would break max_ranks: the gap is shifted.
        states = states_of(world.step_initial({5}))
        assert_consistent(states)
        assert active_ranks(states) == {0: 0, 1: 1, 2: 2, 3: None, 6: 4, 7: 3}
        assert states[6].active_world_size == 5


def test_reserve_search_climbs_while_layers_carry_reserve() -> None:
    root = Layer(max_ranks=4, key_or_fn="root", flag=RESERVE)
    with World(8, tree(root, Layer(key_or_fn=host(4), flag=RESERVE))) as world:
        states_of(world.step(set()))
        states = states_of(world.step_initial({1}))
    assert_consistent(states)
    assert active_ranks(states) == {0: 0, 2: 2, 3: 3, 4: 1, 5: None, 6: None, 7: None}

    # Without RESERVE on the host layer the search stops there, before reaching the root.
    with World(8, tree(root, Layer(key_or_fn=host(4)))) as world:
        states_of(world.step(set()))
        states = states_of(world.step_initial({1}))
    assert_consistent(states)
    assert active_ranks(states) == {0: 0, 2: 1, 3: 2, 4: None, 5: None, 6: None, 7: None}


def test_replacement_never_overfills_an_ancestor_above_the_search() -> None:
    # Rack 0: host a (0, 1). Rack 1 (at most 2 active): host b (2, 3, 4, 5), spares 4 and 5.
    make = tree(
        Layer(key_or_fn="root", flag=RESERVE),
        Layer(max_ranks=2, key_or_fn=lambda s: "rack0" if s.rank < 2 else "rack1", flag=RESERVE),
        Layer(key_or_fn=lambda s: "a" if s.rank < 2 else "b", flag=RESERVE),
    )
    with World(6, make) as world:
        states = states_of(world.step(set()))
        assert active_ranks(states) == {0: 0, 1: 1, 2: 2, 3: 3, 4: None, 5: None}
        # Rank 0 goes first and takes spare 4 from rack 1, which fills rack 1. Rank 2's host still
        # has spare 5, but activating it would put 3 active ranks in rack 1: its gap is shifted.
        states = states_of(world.step({0, 2}))
    assert_consistent(states)
    assert active_ranks(states) == {1: 1, 3: 2, 4: 0, 5: None}


def test_reserve_exhaustion_over_several_iterations() -> None:
    # Three hosts of 2; two hosts' worth active, one host of spares.
    make = tree(Layer(max_ranks=4, key_or_fn="root", flag=RESERVE), Layer(key_or_fn=host(2), flag=RESERVE))
    with World(6, make) as world:
        states = states_of(world.step(set()))
        assert active_ranks(states) == {0: 0, 1: 1, 2: 2, 3: 3, 4: None, 5: None}

        states = states_of(world.step_initial({1}))
        assert active_ranks(states) == {0: 0, 2: 2, 3: 3, 4: 1, 5: None}

        states = states_of(world.step_initial({2}))
        assert active_ranks(states) == {0: 0, 3: 3, 4: 1, 5: 2}

        # No spare left: the gap closes by shifting, and the active world shrinks.
        states = states_of(world.step_initial({0}))
        assert active_ranks(states) == {3: 2, 4: 0, 5: 1}
        assert {state.active_world_size for state in states.values()} == {3}

        states = states_of(world.step_initial({4}))
        assert active_ranks(states) == {3: 1, 5: 0}
        assert_consistent(states)
        assert len(world.history) == 5


def test_backfill_closes_gaps_inside_the_domain_before_the_shift() -> None:
    make = tree(Layer(key_or_fn="root"), Layer(key_or_fn=host(4), flag=BACKFILL))
    with World(8, make) as world:
        states_of(world.step(set()))
        states = states_of(world.step_initial({1}))
    assert_consistent(states)
    # Host 0's highest active rank (3) moves down into the gap; then slot 3 is shifted away.
    assert active_ranks(states) == {0: 0, 2: 2, 3: 1, 4: 3, 5: 4, 6: 5, 7: 6}

    # The same without BACKFILL: a plain shift.
    with World(8, tree(Layer(key_or_fn="root"), Layer(key_or_fn=host(4)))) as world:
        states_of(world.step(set()))
        states = states_of(world.step_initial({1}))
    assert active_ranks(states) == {0: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 5, 7: 6}


def test_backfill_at_the_root_is_fill_gaps_as_in_the_seed_diagram() -> None:
    make = tree(Layer(key_or_fn="root", flag=BACKFILL), Layer(key_or_fn=host(2), flag=BACKFILL))
    with World(8, make) as world:
        states_of(world.step(set()))
        states = states_of(world.step({1, 4, 5}))
    assert_consistent(states)
    assert active_ranks(states) == {0: 0, 2: 2, 3: 3, 6: 1, 7: 4}


def test_backfill_never_moves_a_rank_up() -> None:
    # Host 1 holds active ranks 4..7; losing 7 leaves nothing above the gap to move down.
    make = tree(Layer(key_or_fn="root"), Layer(key_or_fn=host(4), flag=BACKFILL))
    with World(8, make) as world:
        states_of(world.step(set()))
        states = states_of(world.step_initial({7}))
    assert active_ranks(states) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}


def test_undersized_subtree_is_terminated_and_its_ranks_discarded() -> None:
    make = tree(
        Layer(min_ranks=5, max_ranks=8, key_or_fn="root", flag=RESERVE),
        Layer(min_ranks=3, max_ranks=4, key_or_fn=host(4), flag=RESERVE),
    )
    with World(12, make) as world:
        states_of(world.step(set()))
        outcomes = world.step_initial({1, 2})
        # Host 0 keeps 2 healthy ranks < 3: its other ranks go too.
        assert discarded(outcomes) == {0, 1, 2, 3}
        assert "fell below its min_ranks" in str(outcomes[0])
        assert "among the terminated ranks" in str(outcomes[1])
        states = states_of(outcomes)
        assert_consistent(states)
        # Host 2's spares take host 0's active ranks, in order.
        assert active_ranks(states) == {4: 4, 5: 5, 6: 6, 7: 7, 8: 0, 9: 1, 10: 2, 11: 3}

        # Host 1 falls below 3 as well; 4 healthy ranks remain, below the root's 5: the job ends.
        outcomes = world.step_initial({4, 5})
        assert discarded(outcomes) == set(range(4, 12))
        assert world.states == {}


def test_undersized_subtrees_are_dropped_at_the_first_call() -> None:
    # Ranks 0..4 on host0, 5..6 on host1: host1 is below min_ranks from the start.
    make = tree(Layer(key_or_fn="root"), Layer(min_ranks=3, key_or_fn=lambda s: "host0" if s.rank < 5 else "host1"))
    with World(7, make) as world:
        outcomes = world.step(set())
    assert discarded(outcomes) == {5, 6}
    states = states_of(outcomes)
    assert_consistent(states)
    assert active_ranks(states) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}


def test_rank_terminated_at_the_first_call_is_left_out_of_the_tree() -> None:
    with World(4, tree(Layer(key_or_fn="root"), Layer(key_or_fn=host(2)))) as world:
        outcomes = world.step({2})
    assert discarded(outcomes) == {2}
    states = states_of(outcomes)
    assert_consistent(states)
    assert {rank: state.rank for rank, state in states.items()} == {0: 0, 1: 1, 3: 2}


def test_world_size_filter_turns_the_highest_active_ranks_into_spares() -> None:
    def divisible_by_4(size: int) -> int:
        return size // 4 * 4

    with World(10, tree(Layer(key_or_fn="root", flag=RESERVE), world_size_filter=divisible_by_4)) as world:
        states = states_of(world.step(set()))
        assert active_ranks(states) == {**{rank: rank for rank in range(8)}, 8: None, 9: None}

        states = states_of(world.step_initial({3}))
        assert active_ranks(states) == {0: 0, 1: 1, 2: 2, 4: 4, 5: 5, 6: 6, 7: 7, 8: 3, 9: None}

        # Rank 0's slot goes to spare 9; rank 1's finds no spare, so 7 remain and the filter
        # keeps 4: the ranks holding active ranks 4..6 (initial ranks 5..7) become spares.
        states = states_of(world.step_initial({0, 1}))
        assert_consistent(states)
        assert active_ranks(states) == {2: 1, 4: 3, 5: None, 6: None, 7: None, 8: 2, 9: 0}

        # Those spares are used again at the next fault.
        states = states_of(world.step_initial({2}))
        assert_consistent(states)
        assert active_ranks(states) == {4: 3, 5: 1, 6: None, 7: None, 8: 2, 9: 0}


def test_world_size_filter_runs_only_when_the_assignment_changes() -> None:
    sizes_seen: list[int] = []

    def shrink_by_one(size: int) -> int:
        sizes_seen.append(size)
        return size - 1

    policy = Tree([Layer(key_or_fn="root", flag=RESERVE)], shrink_by_one, name="shrink")
    store = torch.distributed.HashStore()
    state = policy(RankAssignmentCtx(State(0, 1), store, set())).state
    assert (state.mode, state.active_world_size, sizes_seen) == (Mode.INACTIVE, 0, [1])
    again = policy(RankAssignmentCtx(state, store, set())).state
    assert again == state and sizes_seen == [1]


def test_call_without_terminations_changes_nothing() -> None:
    make = tree(Layer(max_ranks=5, key_or_fn="root", flag=RESERVE), Layer(key_or_fn=host(3), flag=BACKFILL))
    with World(9, make) as world:
        states_of(world.step(set()))
        before = states_of(world.step_initial({4}))
        after = states_of(world.step(set()))
    assert {rank: (s.rank, s.world_size, s.active_rank, s.active_world_size, s.mode) for rank, s in before.items()} == {
        rank: (s.rank, s.world_size, s.active_rank, s.active_world_size, s.mode) for rank, s in after.items()
    }
    assert {state.iteration for state in after.values()} == {2}


def test_ranks_are_renumbered_in_tree_order() -> None:
    # Hosts interleave in rank order; the tree groups them, in order of first appearance.
    with World(6, tree(Layer(key_or_fn="root"), Layer(key_or_fn=lambda s: f"host{s.rank % 2}"))) as world:
        states = states_of(world.step(set()))
    assert_consistent(states)
    assert {rank: state.rank for rank, state in states.items()} == {0: 0, 2: 1, 4: 2, 1: 3, 3: 4, 5: 5}
    assert {rank: state.initial_rank for rank, state in states.items()} == {rank: rank for rank in range(6)}


def test_three_layers_search_reserve_across_racks() -> None:
    # 2 racks x 2 hosts x 2 ranks; each host allows 1 active rank, each rack 1.
    make = tree(
        Layer(key_or_fn="root", flag=RESERVE),
        Layer(max_ranks=1, key_or_fn=lambda s: f"rack{s.rank // 4}", flag=RESERVE),
        Layer(max_ranks=1, key_or_fn=host(2), flag=RESERVE),
    )
    with World(8, make) as world:
        states = states_of(world.step(set()))
        assert active_ranks(states) == {0: 0, 1: None, 2: None, 3: None, 4: 1, 5: None, 6: None, 7: None}
        states = states_of(world.step_initial({0}))
        assert_consistent(states)
        # Its host-mate 1 is the nearest spare.
        assert active_ranks(states)[1] == 0


# --- errors -------------------------------------------------------------------------------------


def test_multiple_roots_are_rejected_on_every_rank() -> None:
    with World(3, tree(Layer(key_or_fn=lambda s: f"root{s.rank}"))) as world:
        outcomes = world.step(set())
    assert set(outcomes) == {0, 1, 2}
    for outcome in outcomes.values():
        assert isinstance(outcome, ValueError)
        assert "multiple roots" in str(outcome) and "3 distinct keys" in str(outcome)


def test_key_function_must_give_a_key_every_rank_encodes_alike() -> None:
    policy = Tree([Layer(key_or_fn=lambda s: object())], name="object-key")
    with pytest.raises(TypeError, match="must give a str, int, float, bool, None or a tuple of them, got <object"):
        policy(RankAssignmentCtx(State(0, 1), torch.distributed.HashStore(), set()))
    with pytest.raises(TypeError, match="Layer key_or_fn must be a key"):
        Layer(key_or_fn=object())


def test_int_keys_group_as_nvidia_tests_use_them_and_differ_from_string_keys() -> None:
    # Pairs by rank // 2 (ints); rank 1 fails and, with min_ranks=2, takes rank 0 with it.
    def make(rank: int) -> RankAssignment:
        return Tree([Layer(key_or_fn=0), Layer(min_ranks=2, key_or_fn=lambda s: s.rank // 2)])

    with World(6, make) as world:
        states = states_of(world.step({1}))
    assert {rank: state.rank for rank, state in states.items()} == {2: 0, 3: 1, 4: 2, 5: 3}
    assert grouping_key(1, State(0, 1), "t") != grouping_key("1", State(0, 1), "t")
    assert grouping_key("\x1f1", State(0, 1), "t") != grouping_key(1, State(0, 1), "t")


def test_ranks_with_different_layer_counts_get_a_clear_error() -> None:
    def make(rank: int) -> RankAssignment:
        layers = [Layer(key_or_fn="root")] + ([Layer(key_or_fn="host")] if rank == 0 else [])
        return Tree(layers)

    with World(2, make) as world:
        outcomes = world.step(set())
    assert all(isinstance(outcome, ValueError) and "publish" in str(outcome) for outcome in outcomes.values())


def test_keys_that_are_not_json_get_a_clear_error() -> None:
    store = torch.distributed.HashStore()
    from elastic_ft.keys import exchange_arrived, exchange_published

    store.set(exchange_published("elastic_ft/rank_assignment/garbled/0", 1), "not json")
    store.add(exchange_arrived("elastic_ft/rank_assignment/garbled/0"), 1)
    policy = Tree([Layer(key_or_fn="root")], name="garbled")
    with pytest.raises(ValueError, match="Tree 'garbled': a rank published keys that are not JSON"):
        policy(RankAssignmentCtx(State(0, 2), store, set()))


@pytest.mark.parametrize(
    ("world_size_filter", "error", "match"),
    [
        (lambda size: size + 1, ValueError, r"must return a size in \[0, 4\], got 5 for 4"),
        (lambda size: -1, ValueError, r"must return a size in \[0, 4\], got -1"),
        (lambda size: size / 2, TypeError, "must return an int, got 2.0 for 4"),
    ],
)
def test_bad_world_size_filter_is_reported_at_the_first_call(
    world_size_filter: Callable[[int], object], error: type[Exception], match: str
) -> None:
    with World(4, tree(Layer(key_or_fn="root"), world_size_filter=world_size_filter)) as world:
        outcomes = world.step(set())
    for outcome in outcomes.values():
        assert isinstance(outcome, error)
        assert re.search(match, str(outcome)), str(outcome)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Layer(min_ranks=3, max_ranks=2), ValueError, "min_ranks=3 must not exceed max_ranks=2"),
        (lambda: Layer(min_ranks=0), ValueError, "min_ranks must be >= 1, got 0"),
        (lambda: Layer(max_ranks=0), ValueError, "max_ranks must be >= 1, got 0"),
        (lambda: Layer(max_ranks=-2), ValueError, "max_ranks must be >= 1, got -2"),
        (lambda: Layer(min_ranks=1.0), TypeError, "min_ranks must be an int"),
        (lambda: Layer(key_or_fn=b"x"), TypeError, "key_or_fn must be a key"),
        (lambda: Layer(flag="RESERVE"), TypeError, "flag must be a LayerFlag"),
        (lambda: Tree([]), ValueError, "at least one Layer"),
        (lambda: Tree([object()]), TypeError, r"layers\[0\] must be a Layer"),
        (lambda: Tree([Layer()], world_size_filter=4), TypeError, "world_size_filter must be callable"),
        (lambda: Tree([Layer()], timeout=datetime.timedelta(seconds=-1)), ValueError, "timeout must be positive"),
    ],
)
def test_bad_tree_configuration_is_rejected_at_construction(
    make: Callable[[], object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make()


def test_flags_combine() -> None:
    layer = Layer(flag=RESERVE | BACKFILL)
    assert layer.has(RESERVE) and layer.has(BACKFILL)
    assert not Layer(flag=RESERVE).has(BACKFILL) and not Layer().has(RESERVE)


def test_terminated_ranks_outside_the_world_are_rejected() -> None:
    with World(4, tree(Layer(key_or_fn="root"))) as world:
        states_of(world.step(set()))
        outcomes = world.step({9})
    assert all(isinstance(outcome, ValueError) and "got [9]" in str(outcome) for outcome in outcomes.values())


def test_tree_detects_composition_with_a_renumbering_assignment() -> None:
    def make(_: int) -> RankAssignment:
        return Compose(Tree([Layer(key_or_fn="root")]), ShiftRanks())

    with World(4, make) as world:
        states_of(world.step(set()))
        outcomes = world.step({0})
    assert discarded(outcomes) == {0}
    for rank in (1, 2, 3):
        assert isinstance(outcomes[rank], ValueError)
        assert "cannot be composed" in str(outcomes[rank])


def test_tree_times_out_naming_missing_ranks() -> None:
    policy = Tree([Layer(key_or_fn="root")], timeout=datetime.timedelta(seconds=0.3), name="alone")
    with pytest.raises(TimeoutError, match=r"2 of 3 ranks did not publish: \[1, 2\]"):
        policy(RankAssignmentCtx(State(0, 3), torch.distributed.HashStore(), set()))


def test_discarded_rank_error_type() -> None:
    policy = Tree([Layer(key_or_fn="root")], name="self-terminated")
    with pytest.raises(RankDiscarded, match="rank 0 is among the terminated ranks"):
        policy(RankAssignmentCtx(State(0, 2), torch.distributed.HashStore(), {0}))
