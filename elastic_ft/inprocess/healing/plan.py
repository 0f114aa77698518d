"""Who heals from whom at the start of an iteration: a pure function of every active rank's progress.

After a restart, the active ranks of the new iteration publish their
progress (:class:`RankProgress`: the optimizer steps their state has taken,
and whether they hold the world's state at all). Every rank then computes
the same :class:`RecoveryPlan` from the same records (TorchFT's
``compute_quorum_results``, over the Wrapper's store instead of a
lighthouse):

* the **up-to-date** ranks hold the world's state at the highest step any
  such rank reached;
* a rank is **behind** when it holds no state of the world (a new,
  respawned, or activated reserve rank: *fresh*) or its step is lower (an
  optimizer step interrupted on it but completed elsewhere);
* behind ranks, in rank order, are spread round robin over the up-to-date
  ranks, the rotation moving with the iteration, so that several receivers
  load several senders and a retried plan does not always pick the same
  sender.

A sender that dies during the transfer interrupts the iteration like any
fault; the next iteration's plan is computed afresh without it.

A **sharded** model (``shards``: the mesh's shard dimension, HSDP) is
healed shard by shard: active rank ``r`` needs shard ``r % shards``, and
holds it when its published shard is that one, of that layout. Up-to-date
ranks are those holding their own shard at the highest step; a rank behind
receives exactly its own shard, from an up-to-date rank of another replica
holding the same one. A rank no such rank exists for is *unhealable*: the
plan says why, sends it nothing, and it loads the user's checkpoint
instead. No rank is ever sent a shard it does not need.

A state that holds **DTensors** is keyed by their layout whatever the rank
assignment: each rank that holds state publishes its :class:`ShardLayout`
(the root mesh's shape, the mesh dimensions some tensor is split on, its
coordinate, and a digest of every tensor's path, global shape and
placements). The next iteration is taken to build a mesh of the same shape
over its active ranks in rank order (``init_device_mesh`` does), so active
rank ``r`` needs the shard at ``r``'s coordinate; a mesh that no longer
covers the active ranks, or up-to-date ranks that disagree on the layout,
mean nobody holds a usable shard, and every rank loads the checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ShardLayout:
    """Which shard of a DTensor state one rank holds: its place on the root mesh the tensors share."""

    #: The root mesh's shape.
    mesh: tuple[int, ...]
    #: The mesh dimensions some tensor is split on (``Shard`` or ``Partial``), ascending.
    split: tuple[int, ...]
    #: This rank's coordinate on the mesh.
    coordinate: tuple[int, ...]
    #: What else two states must share to be interchangeable: the mesh's dimension names, and every tensor's
    #: path, global shape, mesh dimensions and placements.
    digest: str

    def __post_init__(self) -> None:
        mesh, split, coordinate = self.mesh, self.split, self.coordinate
        if not mesh or not all(_is_int(size) and size > 0 for size in mesh):
            raise ValueError(f"a mesh shape is a non-empty list of sizes > 0, got {mesh!r}")
        if not all(_is_int(dim) and 0 <= dim < len(mesh) for dim in split) or list(split) != sorted(set(split)):
            raise ValueError(f"split dimensions are ascending dimensions of mesh {list(mesh)}, got {split!r}")
        if len(coordinate) != len(mesh) or not all(
            _is_int(c) and 0 <= c < size for c, size in zip(coordinate, mesh, strict=True)
        ):
            raise ValueError(f"a coordinate on mesh {list(mesh)} is one index per dimension, got {coordinate!r}")
        if not isinstance(self.digest, str) or not 0 < len(self.digest) <= 64:
            raise ValueError(f"a layout digest is a text of 1 to 64 characters, got {self.digest!r:.80}")

    @property
    def size(self) -> int:
        return math.prod(self.mesh)

    @property
    def shard(self) -> tuple[int, int]:
        """``(index, shards)``: the shard this rank holds, of the shards the split dimensions make."""
        return self._shard_at(self.coordinate)

    def shard_of(self, rank: int) -> tuple[int, int]:
        """The shard the rank at ``rank`` of a mesh of this shape holds (ranks laid out in row-major order)."""
        coordinate, rest = [], rank
        for size in reversed(self.mesh):
            rest, index = divmod(rest, size)
            coordinate.append(index)
        return self._shard_at(tuple(reversed(coordinate)))

    def _shard_at(self, coordinate: Sequence[int]) -> tuple[int, int]:
        index, shards = 0, 1
        for dim in self.split:
            index, shards = index * self.mesh[dim] + coordinate[dim], shards * self.mesh[dim]
        return index, shards

    def same_layout(self, other: ShardLayout) -> bool:
        """The two states are shards of one layout (each may hold a different shard of it)."""
        return (self.mesh, self.split, self.digest) == (other.mesh, other.split, other.digest)

    def describe(self) -> str:
        index, shards = self.shard
        return f"shard {index} of {shards} of mesh {list(self.mesh)} (split on dims {list(self.split)})"

    def to_json(self) -> dict[str, object]:
        return {
            "mesh": list(self.mesh),
            "split": list(self.split),
            "coordinate": list(self.coordinate),
            "digest": self.digest,
        }

    @classmethod
    def from_json(cls, document: object) -> ShardLayout:
        """Decode (untrusted): ``ValueError`` or ``TypeError`` naming what is wrong."""
        if not isinstance(document, dict):
            raise TypeError(f"a shard layout is a JSON object, got {document!r:.80}")
        fields = [document.get(name) for name in ("mesh", "split", "coordinate")]
        if not all(isinstance(value, list) for value in fields):
            raise TypeError(f"a shard layout has lists mesh, split and coordinate, got {document!r:.120}")
        mesh, split, coordinate = (tuple(value) for value in fields)  # type: ignore[arg-type]
        return cls(mesh, split, coordinate, document.get("digest"))  # type: ignore[arg-type]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RankProgress:
    """One active rank's progress, as it publishes it at the start of an iteration."""

    rank: int
    #: Optimizer steps the rank's state has taken (set to the sender's step when it is healed).
    step: int
    #: The rank holds no state of the world yet: a new, respawned, or activated reserve rank.
    fresh: bool
    #: The shard its state holds, ``(index, shards)``; None when the model is not sharded (or it holds none).
    shard: tuple[int, int] | None = None
    #: Where its state's DTensors place it; None when its state holds none (or it holds no state).
    layout: ShardLayout | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"a rank is an integer >= 0, got {self.rank!r}")
        if not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0:
            raise ValueError(f"rank {self.rank}: a step is an integer >= 0, got {self.step!r}")
        if not isinstance(self.fresh, bool):
            raise TypeError(f"rank {self.rank}: fresh is a boolean, got {self.fresh!r}")
        shard = self.shard
        if shard is not None and not (
            isinstance(shard, tuple)
            and len(shard) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
            and 0 <= shard[0] < shard[1]
        ):
            raise ValueError(f"rank {self.rank}: a shard is (index, shards) with 0 <= index < shards, got {shard!r}")
        if self.layout is not None and not isinstance(self.layout, ShardLayout):
            raise TypeError(f"rank {self.rank}: a layout is a ShardLayout, got {self.layout!r:.80}")


@dataclass(frozen=True)
class RecoveryPlan:
    """The transfers of one iteration: ``sources[receiver] = sender``, and why."""

    #: The step the up-to-date ranks are at (the step receivers take); 0 when no rank holds state.
    max_step: int
    sources: Mapping[int, int] = field(default_factory=dict)
    reason: str = ""
    #: Ranks behind that no rank can heal (a sharded model whose shard no up-to-date rank holds), and why.
    unhealable: Mapping[int, str] = field(default_factory=dict)
    #: Some rank holds the world's state (else every rank starts from the user's checkpoint).
    state_held: bool = True
    #: A DTensor state's layout, which every receiver checks what it is sent against; None otherwise.
    layout: ShardLayout | None = None

    def shard_needed(self, rank: int) -> tuple[int, int] | None:
        """The shard of :attr:`layout` that ``rank`` needs, None when the state holds no DTensor."""
        return None if self.layout is None else self.layout.shard_of(rank)

    @property
    def heals(self) -> bool:
        return bool(self.sources)

    def source_of(self, rank: int) -> int | None:
        """The rank ``rank`` receives its state from, None if it is up to date."""
        return self.sources.get(rank)

    def receivers_of(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` sends its state to, in rank order."""
        return tuple(sorted(receiver for receiver, sender in self.sources.items() if sender == rank))

    @property
    def senders(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.sources.values())))

    def holds_state(self, rank: int) -> bool:
        """Whether ``rank`` holds the world's state once the plan is carried out (else it loads a checkpoint)."""
        return self.state_held and rank not in self.unhealable


def plan_recovery(progress: Sequence[RankProgress], rotation: int = 0, shards: int | None = None) -> RecoveryPlan:
    """The recovery plan for the active ranks' ``progress`` (one record per rank, any order).

    ``rotation`` (the iteration number) shifts the round robin, so that
    every rank computes the same plan and successive plans vary the sender.
    ``shards``: the mesh's shard dimension of a sharded model (see the
    module docstring); None when the rank assignment says nothing of shards,
    in which case the ranks' DTensor layouts, if they published any, key the
    plan.
    """
    ranks = [p.rank for p in progress]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"one progress record per rank, got ranks {sorted(ranks)}")
    if shards is not None:
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards is an integer >= 1, got {shards!r}")
        return _plan_shards(
            progress,
            rotation,
            need=lambda rank: (rank % shards, shards),
            held=lambda p: p.shard,
            what=f"of {shards}",
        )
    if any(p.layout is not None for p in progress if not p.fresh):
        return _plan_layout(progress, rotation)
    holders = [p for p in progress if not p.fresh]
    if not holders:
        fresh = sorted(ranks)
        return RecoveryPlan(
            0, {}, f"no rank holds the world's state (fresh ranks {fresh}): nothing to heal from", state_held=False
        )
    max_step = max(p.step for p in holders)
    up_to_date = sorted(p.rank for p in holders if p.step == max_step)
    behind = sorted(p.rank for p in progress if p.fresh or p.step < max_step)
    if not behind:
        return RecoveryPlan(max_step, {}, f"all {len(up_to_date)} active ranks are at step {max_step}")
    sources = {rank: up_to_date[(index + rotation) % len(up_to_date)] for index, rank in enumerate(behind)}
    fresh = sorted(p.rank for p in progress if p.fresh)
    lagging = sorted(f"{p.rank}@{p.step}" for p in progress if not p.fresh and p.step < max_step)
    details = ", ".join(
        part for part in (f"fresh {fresh}" if fresh else "", f"behind {lagging}" if lagging else "") if part
    )
    transfers = ", ".join(f"{sender}->{receiver}" for receiver, sender in sorted(sources.items()))
    return RecoveryPlan(
        max_step,
        sources,
        f"{len(behind)} rank(s) heal to step {max_step} ({details}) from {up_to_date}: {transfers}",
    )


def _plan_layout(progress: Sequence[RankProgress], rotation: int) -> RecoveryPlan:
    """:func:`plan_recovery` for a state of DTensors: keyed by the layout of the ranks at the highest step."""
    placed = [(p.step, p.layout) for p in progress if not p.fresh and p.layout is not None]
    max_step = max(step for step, _ in placed)
    layouts = {layout for step, layout in placed if step == max_step}
    reference = min(layouts, key=lambda layout: layout.coordinate)
    if any(not reference.same_layout(layout) for layout in layouts):
        described = sorted(
            {
                f"mesh {list(layout.mesh)} split on {list(layout.split)}, layout {layout.digest[:8]}"
                for layout in layouts
            }
        )
        return RecoveryPlan(
            0,
            {},
            f"the ranks at step {max_step} hold DTensor states of different layouts ({'; '.join(described)}): "
            "every rank loads the checkpoint",
            state_held=False,
        )
    if reference.size != len(progress):
        return RecoveryPlan(
            0,
            {},
            f"the state's DTensors are on a mesh {list(reference.mesh)} of {reference.size} ranks, this iteration "
            f"has {len(progress)} active ranks: no rank holds its shard of the new layout; every rank loads the "
            "checkpoint",
            state_held=False,
        )

    def held(p: RankProgress) -> tuple[int, int] | None:
        return p.layout.shard if p.layout is not None and reference.same_layout(p.layout) else None

    plan = _plan_shards(progress, rotation, need=reference.shard_of, held=held, what=f"of mesh {list(reference.mesh)}")
    return dataclasses.replace(plan, layout=reference)


def _plan_shards(
    progress: Sequence[RankProgress],
    rotation: int,
    need: Callable[[int], tuple[int, int]],
    held: Callable[[RankProgress], tuple[int, int] | None],
    what: str,
) -> RecoveryPlan:
    """:func:`plan_recovery` for a sharded state: active rank ``r`` needs shard ``need(r)``, and a rank holds
    shard ``held(p)`` of its progress ``p``; ``what`` names the layout in the reasons."""

    def in_place(p: RankProgress) -> bool:
        return not p.fresh and held(p) == need(p.rank)

    holders = [p for p in progress if in_place(p)]
    if not holders:
        return RecoveryPlan(
            0,
            {},
            f"no rank holds its own shard {what} (ranks {sorted(p.rank for p in progress)}): every rank "
            "loads the checkpoint",
            state_held=False,
        )
    max_step = max(p.step for p in holders)
    up_to_date: dict[tuple[int, int], list[int]] = {}
    for p in sorted(holders, key=lambda p: p.rank):
        if p.step == max_step:
            up_to_date.setdefault(need(p.rank), []).append(p.rank)
    behind = sorted(p.rank for p in progress if not (in_place(p) and p.step == max_step))
    sources: dict[int, int] = {}
    unhealable: dict[int, str] = {}
    waiting: dict[tuple[int, int], int] = {}  # receivers per shard so far: the round robin's index
    for rank in behind:
        shard = need(rank)
        senders = up_to_date.get(shard, [])
        if not senders:
            unhealable[rank] = f"no rank holds shard {shard[0]} {what} at step {max_step}"
            continue
        index = waiting.get(shard, 0)
        waiting[shard] = index + 1
        sources[rank] = senders[(index + rotation) % len(senders)]
    if not behind:
        return RecoveryPlan(max_step, {}, f"all {len(progress)} active ranks hold their shard at step {max_step}")
    if unhealable:
        # A shard nobody holds at the highest step exists only in the checkpoint: the model is whole only if every
        # rank goes back to it (shards of one model at different steps are no model), and DCP's load is a
        # collective of every rank.
        return RecoveryPlan(
            max_step,
            {},
            f"{sorted(unhealable)} cannot heal: "
            + "; ".join(sorted(set(unhealable.values())))
            + ": every rank loads the checkpoint",
            unhealable,
            state_held=False,
        )
    transfers = ", ".join(f"{sender}->{receiver} (shard {need(receiver)[0]})" for receiver, sender in sources.items())
    return RecoveryPlan(
        max_step, sources, f"{len(sources)} rank(s) heal their shard {what} to step {max_step}: {transfers}"
    )
