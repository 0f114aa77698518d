"""Replica groups of a sharded model (HSDP, or FSDP alone): the active world is whole groups, each shard in place.

An HSDP job trains on a 2-D mesh, ``(replicas, shard_size)``: active rank
``g * shard_size + s`` holds shard ``s`` of the model, the same shard every
other replica's rank ``s`` holds. A lost rank leaves its replica group
without one shard, so that group cannot train; the other groups can, without
resharding and without reading a checkpoint, on a mesh with one replica less.
The group's survivors wait as reserve ranks, and when a process arrives (a
respawned worker, a hot spare) the group is whole again: the new rank takes
the missing shard's place and heals that shard from another replica's rank
holding it (:func:`~elastic_ft.inprocess.healing.plan.plan_recovery`).

:func:`place_replicas` decides (pure, with its reason), from the shard each
surviving rank holds (``State.held_shard``), who is active and where;
:class:`ShardedReplicas` is the rank assignment that carries it out: the
ranks exchange their held shards through the store once per restart.

FSDP alone is ``ShardedReplicas(shard_size=None)``: one group of every
surviving rank (up to the cap), which shrinks with the world; the shard
layout then changes, no rank holds a shard of the new one, and every rank
reloads the checkpoint (DCP reshards it).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Sequence

from elastic_ft.handoff import WorkerHandoff
from elastic_ft.inprocess.rank_assignment.base import (
    DEFAULT_TIMEOUT,
    RankAssignment,
    RankAssignmentCtx,
    check_timeout,
    discard,
    policy_name,
    rank_and_terminated,
)
from elastic_ft.inprocess.rank_assignment.exchange import gather_keys
from elastic_ft.inprocess.state import Mode, State
from elastic_ft.keys import rank_assignment_exchange
from elastic_ft.untrusted import json_value

#: A rank's held shard: ``(index, shards)``, shard ``index`` of a model sharded ``shards`` ways.
Shard = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class ReplicaMesh:
    """The mesh of one iteration, as a script builds it (``init_device_mesh(..., shape)``), and this rank's place."""

    #: ``(replicas, shard_size)``.
    shape: tuple[int, int]
    #: This rank's ``(replica, shard)``.
    coordinates: tuple[int, int]

    @property
    def shard(self) -> Shard:
        """The shard this rank holds in it: ``(index, shards)``."""
        return self.coordinates[1], self.shape[1]


def mesh_of(active_rank: int | None, active_world_size: int | None, shard_size: int) -> ReplicaMesh | None:
    """The mesh an active rank trains on, with replica groups of ``shard_size`` ranks; None for a reserve rank."""
    if active_rank is None or not active_world_size or active_world_size % shard_size:
        return None
    return ReplicaMesh((active_world_size // shard_size, shard_size), divmod(active_rank, shard_size))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Who is active and where: ``slots[i]`` is survivor ``i``'s active rank (None: reserve)."""

    slots: tuple[int | None, ...]
    shard_size: int
    reason: str

    @property
    def active_world_size(self) -> int:
        return sum(slot is not None for slot in self.slots)


def place_replicas(held: Sequence[Shard | None], shard_size: int | None, max_active: int | None) -> Placement:
    """Place the survivors (``held[i]``: the shard survivor ``i`` holds, in rank order) into whole replica groups.

    ``shard_size``: ranks per group (None: one group of every survivor, FSDP
    alone); ``max_active``: at most this many active ranks (None: no cap).

    The first group is built from ranks that hold each shard; every later
    group takes, for each shard, a rank holding it if one is left, else a
    rank holding nothing (it heals the shard from the first group), else any
    rank left (it heals too). Groups that cannot be completed stay out: their
    ranks are reserves. When no rank holds a shard of this layout (the first
    iteration, or a layout that changed), the ranks are placed in order.
    """
    count = len(held)
    size = count if shard_size is None else shard_size
    if size < 1:
        return Placement((None,) * count, 1, "no rank survives")
    cap = count if max_active is None else min(count, max_active)
    groups = cap // size
    in_layout = [h if h is not None and h[1] == size and 0 <= h[0] < size else None for h in held]
    if all(h is None for h in in_layout):
        active = groups * size
        slots = tuple(i if i < active else None for i in range(count))
        return Placement(
            slots, size, f"no rank holds a shard of {size}: {groups} group(s) of {size} in rank order, from scratch"
        )
    free = list(range(count))
    slots_by_rank: dict[int, int] = {}
    formed = 0
    for group in range(groups):
        members = []
        for shard in range(size):
            holders = [i for i in free if in_layout[i] == (shard, size)]
            if holders:
                chosen = holders[0]
            elif group == 0:
                break  # this shard exists nowhere whole: no group can heal it
            else:
                empty = [i for i in free if in_layout[i] is None]
                if not (empty or free):
                    break
                chosen = (empty or free)[0]
            members.append(chosen)
            free.remove(chosen)
        if len(members) < size:
            free.extend(members)
            free.sort()
            break
        for shard, member in enumerate(members):
            slots_by_rank[member] = group * size + shard
        formed += 1
    slots = tuple(slots_by_rank.get(i) for i in range(count))
    if formed == 0:
        missing = [s for s in range(size) if (s, size) not in in_layout]
        return Placement(
            tuple(i if i < groups * size else None for i in range(count)),
            size,
            f"shard(s) {missing} of {size} are held by no survivor: {groups} group(s) in rank order, from the "
            "checkpoint",
        )
    reserves = count - formed * size
    return Placement(
        slots,
        size,
        f"{formed} whole replica group(s) of {size} from {count} survivor(s), {reserves} in reserve"
        + (f" (at most {cap} active)" if max_active is not None and max_active < count else ""),
    )


class ShardedReplicas(RankAssignment):
    """The active world is whole replica groups of ``shard_size`` ranks, every shard in its place.

    See the module docstring. ``max_active_world_size`` caps the active
    ranks (by default, under ``ftrun``, the round's active world size, as
    for the default assignment; the hot spares' ranks wait in reserve).

    Args:
        shard_size: ranks per replica group (the mesh's shard dimension);
            None: FSDP alone, one group of every surviving rank.
        max_active_world_size: at most this many active ranks.
        timeout: how long to wait for every surviving rank's held shard.
        name: namespace of this instance's store keys (as for
            :class:`~elastic_ft.inprocess.rank_assignment.FilterCountGroupedByKey`).
    """

    def __init__(
        self,
        shard_size: int | None,
        max_active_world_size: int | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        *,
        name: str | None = None,
    ) -> None:
        for label, value in (("shard_size", shard_size), ("max_active_world_size", max_active_world_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ShardedReplicas {label} must be an int >= 1 or None, got {value!r}")
        check_timeout("ShardedReplicas", timeout)
        if max_active_world_size is None:
            handoff = WorkerHandoff.from_env(os.environ)
            max_active_world_size = handoff.active_world_size if handoff is not None else None
        self.shard_size = shard_size
        self.max_active_world_size = max_active_world_size
        self.timeout = timeout
        self.name = policy_name(type(self), name)

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, terminated = rank_and_terminated(ctx, "ShardedReplicas")
        if rank in terminated:
            raise discard(rank, terminated)
        state = ctx.state
        survivors = [other for other in range(state.world_size) if other not in terminated]
        (published,) = gather_keys(
            ctx.store,
            rank_assignment_exchange(self.name, state.iteration),
            rank,
            survivors,
            [json.dumps(state.held_shard)],
            self.timeout,
            f"ShardedReplicas {self.name!r} iteration {state.iteration}",
        )
        held = [_shard_of(text) for text in published]
        placement = place_replicas(held, self.shard_size, self.max_active_world_size)
        index = survivors.index(rank)
        slot = placement.slots[index]
        new = dataclasses.replace(
            state,
            rank=index,
            world_size=len(survivors),
            mode=Mode.ACTIVE if slot is not None else Mode.INACTIVE,
            active_rank=slot,
            active_world_size=placement.active_world_size,
            shard_size=placement.shard_size,
        )
        return dataclasses.replace(ctx, state=new, terminated_ranks=set())


def _shard_of(text: str) -> Shard | None:
    """A survivor's published held shard (untrusted): ``[index, shards]``, else None (holds nothing usable)."""
    value = json_value(text)
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 0 <= value[0] < value[1]
    ):
        return value[0], value[1]
    return None


def state_mesh(state: State) -> ReplicaMesh | None:
    """The mesh ``state``'s rank trains on this iteration, None when it is in reserve or not sharded."""
    if state.shard_size is None or state.mode is not Mode.ACTIVE:
        return None
    return mesh_of(state.active_rank, state.active_world_size, state.shard_size)
