"""Whole replica groups of a sharded model: the placement (pure) and ShardedReplicas over a simulated world."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic_ft.inprocess.rank_assignment import ShardedReplicas
from elastic_ft.inprocess.rank_assignment.replicas import ReplicaMesh, _shard_of, mesh_of, place_replicas, state_mesh
from elastic_ft.inprocess.state import Mode, State
from tests.inprocess.rank_world import World, assert_consistent, discarded, states_of


def test_the_first_iteration_places_ranks_in_order() -> None:
    placement = place_replicas([None] * 5, 2, None)
    assert placement.slots == (0, 1, 2, 3, None) and placement.active_world_size == 4
    assert "from scratch" in placement.reason


def test_a_lost_rank_takes_its_group_out_and_keeps_every_survivor_in_place() -> None:
    # 2 x 2 lost its rank 0 (shard 0 of replica 0): survivors hold shards 1, 0, 1.
    placement = place_replicas([(1, 2), (0, 2), (1, 2)], 2, None)
    assert placement.slots == (1, 0, None)  # old rank 2 takes shard 0's place, old rank 1 keeps shard 1
    assert placement.active_world_size == 2 and "1 whole replica group(s) of 2 from 3 survivor(s), 1 in reserve" in (
        placement.reason
    )


def test_a_new_rank_completes_the_broken_group_in_the_missing_shards_place() -> None:
    # The reserve holds shard 1 of the broken group; the new process holds nothing: it takes shard 0.
    placement = place_replicas([(1, 2), (0, 2), (1, 2), None], 2, None)
    assert placement.slots == (1, 0, 3, 2)  # group 1: the new rank as shard 0, the reserve keeps shard 1


def test_a_hot_spare_fills_the_hole_up_to_the_cap() -> None:
    # 3 nodes x 2, 4 active (2 x 2) and a spare node's 2 ranks; rank 3 of the active world died.
    placement = place_replicas([(0, 2), (1, 2), (0, 2), None, None], 2, 4)
    assert placement.slots == (0, 1, 2, 3, None) and placement.active_world_size == 4


def test_a_shard_held_by_no_survivor_falls_back_to_the_checkpoint() -> None:
    placement = place_replicas([(0, 2), (0, 2), None], 2, None)
    assert placement.slots == (0, 1, None) and "shard(s) [1] of 2 are held by no survivor" in placement.reason


def test_fsdp_alone_is_one_group_that_shrinks_and_changes_layout() -> None:
    placement = place_replicas([(0, 2)], None, None)  # FSDP on 2 ranks lost one
    assert placement.slots == (0,) and placement.shard_size == 1 and "from scratch" in placement.reason


def test_the_mesh_of_an_active_rank() -> None:
    assert mesh_of(3, 4, 2) == ReplicaMesh((2, 2), (1, 1)) and ReplicaMesh((2, 2), (1, 1)).shard == (1, 2)
    assert mesh_of(None, 4, 2) is None and mesh_of(1, 3, 2) is None


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_shard_sizes_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="shard_size must be an int >= 1 or None"):
        ShardedReplicas(bad)  # type: ignore[arg-type]


def trained(world: World) -> None:
    """What the Wrapper does once a rank trains in its place: its state holds its mesh's shard."""
    for rank, state in world.states.items():
        mesh = state_mesh(state)
        if mesh is not None:
            world.states[rank] = dataclasses.replace(state, held_shard=mesh.shard)


def test_sharded_replicas_keep_whole_groups_over_a_simulated_world() -> None:
    with World(6, lambda _rank: ShardedReplicas(2)) as world:
        states = states_of(world.step(set()))
        assert_consistent(states)
        assert {r: s.active_rank for r, s in states.items()} == {r: r for r in range(6)}
        trained(world)
        # Initial rank 2 (replica 1, shard 0) dies: two whole groups are left, every survivor keeps its shard
        # (a group's shards need not come from one replica: every replica holds the same model).
        outcomes = world.step_initial({2})
        assert discarded(outcomes) == {2}
        states = states_of(outcomes)
        assert_consistent(states)
        assert states[0].active_world_size == 4 and states[5].mode is Mode.INACTIVE
        for rank in (0, 1, 3, 4):
            mesh = state_mesh(states[rank])
            assert mesh is not None and mesh.coordinates[1] == rank % 2 and mesh.shape == (2, 2), states[rank]
        trained(world)
        # Then initial rank 1 (shard 1) dies: the reserve, holding shard 1, takes its place; nobody heals.
        states = states_of(world.step_initial({1}))
        assert_consistent(states)
        meshes = {r: state_mesh(s) for r, s in states.items()}
        assert {r: m.coordinates[1] for r, m in meshes.items() if m is not None} == {0: 0, 3: 1, 4: 0, 5: 1}
        assert all(states[r].held_shard == (r % 2, 2) for r in (0, 3, 4, 5))  # in place: nothing to heal


def test_a_held_shard_state_is_checked() -> None:
    with pytest.raises(ValueError, match="held_shard must be"):
        State(0, 2, held_shard=(2, 2))


@pytest.mark.parametrize("published", ["[1, 2]", "[0, 4]"])
def test_a_published_held_shard_is_read(published: str) -> None:
    assert _shard_of(published) == tuple(json.loads(published))


@pytest.mark.parametrize(
    "published", ["null", "[2, 2]", "[-1, 2]", "[true, 2]", '["0", 2]', "[0]", "{", "[0, 2, 3]", "1e999"]
)
def test_a_malformed_held_shard_counts_as_none(published: str) -> None:
    """What another rank published is untrusted: anything but ``[index, shards]`` holds nothing usable."""
    assert _shard_of(published) is None
