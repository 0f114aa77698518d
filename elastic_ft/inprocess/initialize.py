"""Initialize: per-rank checks at the start of every restart iteration.

Raising an ``Exception`` from an :class:`Initialize` restarts the iteration
on every rank; raising a ``BaseException`` (such as
:class:`elastic_ft.inprocess.exception.RestartAbort`) makes this rank leave the
Wrapper with that exception.
"""

from __future__ import annotations

import abc

from elastic_ft.inprocess.exception import RestartAbort
from elastic_ft.inprocess.state import State


class Initialize(abc.ABC):
    """Base class of the ``initialize`` argument; compose several with :class:`elastic_ft.Compose`."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Check or prepare this rank; return ``state`` unchanged."""


class RetryController(Initialize):
    """Stop restarting after too many iterations or when too few ranks remain.

    Args:
        max_iterations: the iteration index (0 is the first call) from which
            to stop; ``None`` for no limit.
        min_world_size: the fewest ranks (active and spare) worth continuing with.
        min_active_world_size: the fewest active ranks worth continuing with.

    Raises :class:`elastic_ft.inprocess.exception.RestartAbort` on every rank alike,
    since every rank sees the same iteration and world sizes.
    """

    def __init__(self, max_iterations: int | None = None, min_world_size: int = 1, min_active_world_size: int = 1):
        if max_iterations is not None and max_iterations < 1:
            raise ValueError(f"max_iterations must be >= 1 or None, got {max_iterations}")
        if min_world_size < 1 or min_active_world_size < 1:
            raise ValueError("min_world_size and min_active_world_size must be >= 1")
        self.max_iterations = max_iterations
        self.min_world_size = min_world_size
        self.min_active_world_size = min_active_world_size

    def __call__(self, state: State) -> State:
        active_world_size = state.active_world_size if state.active_world_size is not None else state.world_size
        if self.max_iterations is not None and state.iteration >= self.max_iterations:
            reason = f"iteration {state.iteration} reached max_iterations={self.max_iterations}"
        elif state.world_size < self.min_world_size:
            reason = f"world size {state.world_size} is below min_world_size={self.min_world_size}"
        elif active_world_size < self.min_active_world_size:
            reason = (
                f"active world size {active_world_size} is below min_active_world_size={self.min_active_world_size}"
            )
        else:
            return state
        # Then every field, as NVIDIA's message spells them (tests and log searches match them).
        raise RestartAbort(
            f"{reason} (iteration={state.iteration} max_iterations={self.max_iterations} "
            f"world_size={state.world_size} min_world_size={self.min_world_size} "
            f"active_world_size={active_world_size} min_active_world_size={self.min_active_world_size})"
        )
