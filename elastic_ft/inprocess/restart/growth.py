"""Growing the Wrapper's world between iterations: the states a rank assignment starts from.

At a restart the termination barrier publishes a
:class:`~elastic_ft.coordination.termination.TerminationResult`: the ranks that left
and the joiners admitted (respawned processes, in admission order). Before
the rank assignment runs, the world grows by the joiners: they take ranks
``world_size, world_size + 1, ...`` as reserve ranks, and every rank, old or
new, then runs the same policy on the same inputs, so all of them agree on
the renumbering and on who is active. Pure functions, no I/O.
"""

from __future__ import annotations

import dataclasses

from elastic_ft.coordination.termination import TerminationResult
from elastic_ft.inprocess.state import Mode, State


def next_iteration_state(state: State, result: TerminationResult) -> State:
    """A member's state before the next rank assignment: the next iteration, in the grown world.

    The next iteration starts with no ``fn_exception``: the last one's was
    handed to ``finalize`` and ``health_check`` already.
    """
    return dataclasses.replace(
        state, iteration=state.iteration + 1, world_size=state.world_size + len(result.joined), fn_exception=None
    )


def joiner_state(
    result: TerminationResult,
    initial_rank: int,
    *,
    initial_world_size: int,
    active_world_size: int | None,
    iteration: int,
) -> State:
    """A joiner's state before the rank assignment of ``iteration``, the one that admitted it.

    ``active_world_size``: the previous iteration's, as its ranks published
    it (``None``: unknown, taken as the whole previous world).
    """
    if initial_rank not in result.joined:
        raise ValueError(f"initial rank {initial_rank} is not among the joiners {list(result.joined)[:16]}")
    world_size = result.world_size + len(result.joined)
    return State(
        result.world_size + result.joined.index(initial_rank),
        world_size,
        active_world_size=min(active_world_size or result.world_size, world_size),
        initial_rank=initial_rank,
        initial_world_size=initial_world_size,
        iteration=iteration,
        mode=Mode.INACTIVE,
    )
