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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


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
    module docstring); None when every rank holds the whole model.
    """
    ranks = [p.rank for p in progress]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"one progress record per rank, got ranks {sorted(ranks)}")
    if shards is not None:
        return _plan_shards(progress, rotation, shards)
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


def _plan_shards(progress: Sequence[RankProgress], rotation: int, shards: int) -> RecoveryPlan:
    """:func:`plan_recovery` for a model sharded ``shards`` ways: each rank needs shard ``rank % shards``."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards is an integer >= 1, got {shards!r}")

    def in_place(p: RankProgress) -> bool:
        return not p.fresh and p.shard == (p.rank % shards, shards)

    holders = [p for p in progress if in_place(p)]
    if not holders:
        return RecoveryPlan(
            0,
            {},
            f"no rank holds its own shard of {shards} (ranks {sorted(p.rank for p in progress)}): every rank "
            "loads the checkpoint",
            state_held=False,
        )
    max_step = max(p.step for p in holders)
    up_to_date: dict[int, list[int]] = {}
    for p in sorted(holders, key=lambda p: p.rank):
        if p.step == max_step:
            up_to_date.setdefault(p.rank % shards, []).append(p.rank)
    behind = sorted(p.rank for p in progress if not (in_place(p) and p.step == max_step))
    sources: dict[int, int] = {}
    unhealable: dict[int, str] = {}
    waiting: dict[int, int] = {}  # receivers per shard so far: the round robin's index
    for rank in behind:
        shard = rank % shards
        senders = up_to_date.get(shard, [])
        if not senders:
            unhealable[rank] = f"no rank holds shard {shard} of {shards} at step {max_step}"
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
    transfers = ", ".join(f"{sender}->{receiver} (shard {receiver % shards})" for receiver, sender in sources.items())
    return RecoveryPlan(
        max_step, sources, f"{len(sources)} rank(s) heal their shard of {shards} to step {max_step}: {transfers}"
    )
