"""Rank assignments and filters: renumber the survivors, choose the active ranks.

* rank assignments renumber the survivors: :class:`ShiftRanks`,
  :class:`FillGaps`, or mark more ranks for termination:
  :class:`FilterCountGroupedByKey`;
* rank filters choose the active ranks: :class:`ActivateAllRanks`,
  :class:`MaxActiveWorldSize`, :class:`ActiveWorldSizeDivisibleBy`.

Compose them with :class:`elastic_ft.inprocess.compose.Compose`, rightmost
first; :class:`~elastic_ft.inprocess.rank_assignment.tree.Tree` does all of
it at once over a topology tree.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections import Counter
from collections.abc import Callable, Sequence

from elastic_ft.inprocess.rank_assignment.base import (
    DEFAULT_TIMEOUT,
    RankAssignment,
    RankAssignmentCtx,
    RankFilter,
    activate_all,
    check_timeout,
    discard,
    grouping_key,
    is_grouping_key,
    policy_name,
    rank_and_terminated,
    require_rank,
)
from elastic_ft.inprocess.rank_assignment.exchange import gather_keys
from elastic_ft.inprocess.state import Mode, State
from elastic_ft.keys import rank_assignment_exchange


class ShiftRanks(RankAssignment):
    """Close the gaps left by terminated ranks by shifting later ranks down.

    Survivors keep their relative order; every rank after the first
    terminated one gets a new index::

        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+
        | 0 | X | 2 | 3 | X | X | 6 | 7 | --> | 0 | 2 | 3 | 6 | 7 |
        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+

    Every survivor becomes active with ``active_rank == rank``; compose a
    :class:`RankFilter` on the left to keep spares.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, terminated = rank_and_terminated(ctx, "ShiftRanks")
        if rank in terminated:
            raise discard(rank, terminated)
        state = dataclasses.replace(
            ctx.state,
            rank=rank - sum(1 for other in terminated if other < rank),
            world_size=ctx.state.world_size - len(terminated),
        )
        return dataclasses.replace(ctx, state=activate_all(state), terminated_ranks=set())


class FillGaps(RankAssignment):
    """Fill the gaps left by terminated ranks with the highest ranks.

    Ranks below the new world size keep their index; survivors at or above
    it move, in increasing order, into the gaps below it, lowest first::

        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+
        | 0 | X | 2 | 3 | X | X | 6 | 7 | --> | 0 | 6 | 2 | 3 | 7 |
        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+

    Every survivor becomes active with ``active_rank == rank``; compose a
    :class:`RankFilter` on the left to keep spares.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, terminated = rank_and_terminated(ctx, "FillGaps")
        if rank in terminated:
            raise discard(rank, terminated)
        world_size = ctx.state.world_size - len(terminated)
        if rank >= world_size:
            # This rank is the k-th survivor at or above the new size; it takes
            # the k-th gap below the new size.
            skipped = sum(1 for other in terminated if world_size <= other < rank)
            gaps = sorted(other for other in terminated if other < world_size)
            rank = gaps[rank - world_size - skipped]
        state = dataclasses.replace(ctx.state, rank=rank, world_size=world_size)
        return dataclasses.replace(ctx, state=activate_all(state), terminated_ranks=set())


class ActivateAllRanks(RankFilter):
    """Make every rank active: ``active_rank = rank``, ``active_world_size = world_size``."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        require_rank(ctx.state, "ActivateAllRanks")
        return dataclasses.replace(ctx, state=activate_all(ctx.state))


def _activate_below(state: State, active_world_size: int) -> State:
    """Activate exactly the ranks below ``active_world_size``."""
    rank = state.rank
    active = rank is not None and rank < active_world_size
    return dataclasses.replace(
        state,
        mode=Mode.ACTIVE if active else Mode.INACTIVE,
        active_rank=rank if active else None,
        active_world_size=active_world_size,
    )


def _current_active_world_size(state: State) -> int:
    if state.active_world_size is None:
        return state.world_size
    return min(state.active_world_size, state.world_size)


def _check_positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner} {name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{owner} {name} must be >= 1, got {value}")


class MaxActiveWorldSize(RankFilter):
    """Keep at most ``max_active_world_size`` ranks active: those with the lowest ranks.

    Args:
        max_active_world_size: the largest active world size; ``None`` for no
            limit beyond the current one.
    """

    def __init__(self, max_active_world_size: int | None = None) -> None:
        if max_active_world_size is not None:
            _check_positive_int("MaxActiveWorldSize", "max_active_world_size", max_active_world_size)
        self.max_active_world_size = max_active_world_size

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        require_rank(ctx.state, "MaxActiveWorldSize")
        size = _current_active_world_size(ctx.state)
        if self.max_active_world_size is not None:
            size = min(size, self.max_active_world_size)
        return dataclasses.replace(ctx, state=_activate_below(ctx.state, size))


class ActiveWorldSizeDivisibleBy(RankFilter):
    """Round the active world size down to a multiple of ``divisor``.

    The ranks below the rounded size are active, the others are spares.
    ``Compose(ActiveWorldSizeDivisibleBy(M), MaxActiveWorldSize(N))`` keeps the
    largest multiple of ``M`` not greater than ``N`` active.

    Args:
        divisor: a positive int.
    """

    def __init__(self, divisor: int = 1) -> None:
        _check_positive_int("ActiveWorldSizeDivisibleBy", "divisor", divisor)
        self.divisor = divisor

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        require_rank(ctx.state, "ActiveWorldSizeDivisibleBy")
        size = _current_active_world_size(ctx.state) // self.divisor * self.divisor
        return dataclasses.replace(ctx, state=_activate_below(ctx.state, size))


def ranks_failing_group_condition(
    ranks: Sequence[int], keys: Sequence[str], condition: Callable[[int], bool]
) -> set[int]:
    """The ranks whose group's size fails ``condition``.

    ``keys[i]`` is the group of ``ranks[i]``; ``condition`` is evaluated once
    per group with the number of ranks in it.
    """
    sizes = Counter(keys)
    failing = {key for key, size in sizes.items() if not condition(size)}
    return {rank for rank, key in zip(ranks, keys, strict=True) if key in failing}


class FilterCountGroupedByKey(RankAssignment):
    """Mark for termination every rank whose group's healthy count fails a condition.

    Healthy ranks (those not in ``terminated_ranks``) are grouped by
    ``key_or_fn``; a group whose size ``n`` gives ``condition(n) == False`` is
    added to ``terminated_ranks`` as a whole. Compose it to the right of an
    assignment that then drops the ranks::

        condition = lambda count: count == 2
        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+---+---+---+
        | 0 | X | 2 | 3 | X | X | 6 | 7 | --> | X | X | 2 | 3 | X | X | 6 | 7 |
        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+---+---+---+
        | key=0 | key=1 | key=2 | key=3 |
        |count=1|count=2|count=0|count=2|

        Compose(ShiftRanks(), FilterCountGroupedByKey(lambda s: host_of(s), lambda n: n == 8))

    Healthy ranks exchange their keys through the store once per call.

    Args:
        key_or_fn: the group key: a string, or a callable taking the
            :class:`~elastic_ft.State` and returning one.
        condition: called with a group's healthy count; ``False`` terminates
            the group.
        timeout: how long to wait for every healthy rank's key.
        name: namespace of this instance's store keys; must be the same on
            every rank and differ between instances sharing a store. By
            default the n-th instance a thread builds is named
            ``FilterCountGroupedByKey-n``.
    """

    #: Its exchanges are numbered by call, which a joiner's instance cannot know.
    admits_new_ranks = False

    def __init__(
        self,
        key_or_fn: object,
        condition: Callable[[int], bool],
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        *,
        name: str | None = None,
    ) -> None:
        if not callable(key_or_fn) and not is_grouping_key(key_or_fn):
            raise TypeError(
                f"{type(self).__name__} key_or_fn must be a key (a str, int, float, bool, None or a tuple of them) "
                f"or a callable taking a State and returning one, got {key_or_fn!r}"
            )
        if not callable(condition):
            raise TypeError(f"FilterCountGroupedByKey condition must be callable, got {condition!r}")
        check_timeout("FilterCountGroupedByKey", timeout)
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout
        self.name = policy_name(type(self), name)
        self._calls = 0

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        call = self._calls
        self._calls += 1
        rank, terminated = rank_and_terminated(ctx, "FilterCountGroupedByKey")
        if rank in terminated:
            return ctx
        healthy = [other for other in range(ctx.state.world_size) if other not in terminated]
        (keys,) = gather_keys(
            ctx.store,
            rank_assignment_exchange(self.name, call),
            rank,
            healthy,
            [grouping_key(self.key_or_fn, ctx.state, "FilterCountGroupedByKey")],
            self.timeout,
            f"FilterCountGroupedByKey {self.name!r} call {call}",
        )
        failing = ranks_failing_group_condition(healthy, keys, self.condition)
        return dataclasses.replace(ctx, terminated_ranks=terminated | failing)


class FilterGroupedByKey(FilterCountGroupedByKey):
    """The older form of :class:`FilterCountGroupedByKey`: a callable ``key_or_fn`` takes ``(rank, world_size)``.

    The name and call form NVIDIA's usage guide still shows
    (``key_or_fn=lambda rank, _: rank // 8``); it groups exactly as
    :class:`FilterCountGroupedByKey` does with ``lambda state:
    key_or_fn(state.rank, state.world_size)``.
    """

    def __init__(
        self,
        key_or_fn: object,
        condition: Callable[[int], bool],
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        *,
        name: str | None = None,
    ) -> None:
        if callable(key_or_fn):
            rank_key = key_or_fn

            def state_key(state: State) -> object:
                return rank_key(state.rank, state.world_size)

            key_or_fn = state_key
        super().__init__(key_or_fn, condition, timeout, name=name)
