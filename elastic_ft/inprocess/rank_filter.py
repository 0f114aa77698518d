"""Deprecated rank filters on :class:`State`, for the Wrapper's ``rank_filter`` argument.

NVIDIA's package deprecated these in favour of the filters of
:mod:`elastic_ft.inprocess.rank_assignment`, which take and return a
:class:`~elastic_ft.inprocess.rank_assignment.RankAssignmentCtx` and compose
with the other assignments. They are kept so that code written against
them runs unchanged: each wraps its rank-assignment namesake and warns
with a ``DeprecationWarning`` when built.
"""

from __future__ import annotations

import abc
import warnings

from elastic_ft.inprocess import rank_assignment
from elastic_ft.inprocess.state import State


class RankFilter(abc.ABC):
    """Base class of the deprecated ``rank_filter`` argument: ``State -> State``."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Return ``state`` with its ``mode``, ``active_rank`` and ``active_world_size`` chosen."""


class _Adapter(RankFilter):
    """A rank-assignment filter applied to a state alone (no store, no terminated ranks)."""

    def __init__(self, impl: rank_assignment.RankFilter) -> None:
        warnings.warn(
            f"rank_filter.{type(self).__name__} is deprecated: use rank_assignment.{type(impl).__name__} "
            "in the Wrapper's rank_assignment",
            DeprecationWarning,
            stacklevel=3,
        )
        self.impl = impl

    def __call__(self, state: State) -> State:
        # A filter (NVIDIA's form: a State in, a State out) exchanges nothing: it gets no store.
        return self.impl(rank_assignment.RankAssignmentCtx(state, None, set())).state  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"rank_filter.{type(self).__name__}({self.impl!r})"


class MaxActiveWorldSize(_Adapter):
    """At most ``max_active_world_size`` active ranks (all when ``None``); see the rank-assignment namesake."""

    def __init__(self, max_active_world_size: int | None = None) -> None:
        super().__init__(rank_assignment.MaxActiveWorldSize(max_active_world_size))


class ActiveWorldSizeDivisibleBy(_Adapter):
    """An active world size divisible by ``divisor``; see the rank-assignment namesake."""

    def __init__(self, divisor: int = 1) -> None:
        super().__init__(rank_assignment.ActiveWorldSizeDivisibleBy(divisor))


class WorldSizeDivisibleBy(ActiveWorldSizeDivisibleBy):
    """The older name of :class:`ActiveWorldSizeDivisibleBy` (the seed's usage guide uses it)."""
