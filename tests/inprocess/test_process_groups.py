"""ProcessGroupKeeper: an interrupted iteration's gloo groups are never destroyed; a completed one's are."""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist

from elastic_ft.inprocess.delivery.process_groups import ProcessGroupKeeper


def _gloo_group() -> dist.ProcessGroup:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def test_an_interrupted_iterations_gloo_group_outlives_every_reference() -> None:
    keeper = ProcessGroupKeeper()
    group = _gloo_group()
    keeper.observe()  # as the watchdog does while the iteration runs
    dist.destroy_process_group()  # the user's own clean-up, before the Wrapper sees the fault
    before = sys.getrefcount(group)
    assert keeper.retire() == 1
    assert sys.getrefcount(group) == before  # the keeper's own note is gone, one lasting reference instead
    assert keeper.retire() == 0  # kept once, however often a restart path retires
    keeper.forget()  # a later completed iteration does not give it back
    gc.collect()
    assert sys.getrefcount(group) == before


def test_a_completed_iterations_group_is_freed_as_usual() -> None:
    keeper = ProcessGroupKeeper()
    group = _gloo_group()
    keeper.observe()
    dist.destroy_process_group()
    before = sys.getrefcount(group)
    keeper.forget()
    assert sys.getrefcount(group) == before - 1
    assert keeper.retire() == 0


def test_only_the_interrupted_iterations_groups_are_kept() -> None:
    keeper = ProcessGroupKeeper()
    assert keeper.retire() == 0  # nothing seen
    completed = _gloo_group()
    keeper.observe()
    dist.destroy_process_group()
    keeper.forget()  # iteration 0 completed
    interrupted = _gloo_group()
    keeper.observe()
    dist.destroy_process_group()
    completed_refs, interrupted_refs = sys.getrefcount(completed), sys.getrefcount(interrupted)
    assert keeper.retire() == 1
    assert sys.getrefcount(completed) == completed_refs
    assert sys.getrefcount(interrupted) == interrupted_refs


def test_an_init_interrupted_after_torch_took_the_groups_name_does_not_block_the_next_one() -> None:
    """Seen in the soak: a restart landed inside ``init_process_group`` after torch's C++ registry took the name
    "0" and before the Python side knew the group; every later init on that rank then failed. The abort frees
    the name when no group is live."""
    import torch

    from elastic_ft.inprocess.abort import AbortTorchDistributed
    from elastic_ft.inprocess.state import State

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    world = dist.distributed_c10d._world
    # The Python side forgets the group, as if the init had been cut before it recorded it; C++ keeps the name.
    world.pg_map.clear()
    world.pg_names.clear()
    world.pg_group_ranks.clear()
    world.pg_backend_config.clear()
    world.pg_to_tag.clear()
    world.tags_to_pg.clear()
    world.default_pg = None
    AbortTorchDistributed()(State(0, 1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # "already registered" before
    try:
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
        del group
        torch._C._distributed_c10d._unregister_all_process_groups()


def test_an_init_interrupted_after_torch_registered_the_group_does_not_block_the_next_one() -> None:
    """Seen in the soak: a restart landed inside ``init_process_group`` after torch registered the group on the
    Python side but before it became the default group; every later init on that rank failed with "The
    specified group name has already been created", and the same fault ended the job. The abort destroys
    groups left registered without a default group."""
    import torch

    from elastic_ft.inprocess.abort import AbortTorchDistributed
    from elastic_ft.inprocess.state import State

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.distributed_c10d._world
    world.default_pg = None  # registered, not yet the default group: where the restart cut the init
    assert world.pg_map and not dist.is_initialized()
    AbortTorchDistributed()(State(0, 1))
    assert not world.pg_map and not world.pg_names
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # "already created" before
    try:
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
        torch._C._distributed_c10d._unregister_all_process_groups()
