"""A simulated world for rank-assignment tests (the tests of the simulation itself are in test_rank_assignment_world.py).

Each rank is a long-lived thread that builds its own policy (so per-thread
default names match across ranks, as they do across processes) and shares
one ``torch.distributed.HashStore`` with the others. The test drives restart
iterations one at a time: every rank still in the job calls its policy with
the state it got last time and the same ``terminated_ranks``.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Collection
from types import TracebackType

import torch.distributed

from elastic_ft.inprocess.rank_assignment import RankAssignment, RankAssignmentCtx, RankDiscarded
from elastic_ft.inprocess.state import Mode, State

STEP_TIMEOUT_S = 60.0

Outcome = State | BaseException


class World:
    """``world_size`` ranks as threads, each with its own policy, one shared store."""

    def __init__(self, world_size: int, make_policy: Callable[[int], RankAssignment]) -> None:
        self.world_size = world_size
        self.store = torch.distributed.HashStore()
        #: Latest state of every rank still in the job, by initial rank.
        self.states: dict[int, State] = {rank: State(rank, world_size) for rank in range(world_size)}
        #: Every outcome so far: one dict per iteration, by initial rank.
        self.history: list[dict[int, Outcome]] = []
        self._inbox: dict[int, queue.Queue[Collection[int] | None]] = {}
        self._outbox: queue.Queue[tuple[int, Outcome]] = queue.Queue()
        self._threads = []
        for rank in range(world_size):
            self._inbox[rank] = queue.Queue()
            thread = threading.Thread(target=self._serve, args=(rank, make_policy), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, rank: int, make_policy: Callable[[int], RankAssignment]) -> None:
        policy: RankAssignment | None = None
        while (terminated := self._inbox[rank].get()) is not None:
            try:
                if policy is None:
                    policy = make_policy(rank)
                ctx = policy(RankAssignmentCtx(self.states[rank], self.store, terminated))
                outcome: Outcome = ctx.state
            except BaseException as error:  # noqa: BLE001 - every error is handed to the test, which decides
                outcome = error
            self._outbox.put((rank, outcome))

    def step(self, terminated: Collection[int]) -> dict[int, Outcome]:
        """One restart iteration with ``terminated`` (current ranks); outcomes by initial rank."""
        callers = sorted(self.states)
        for rank in callers:
            self._inbox[rank].put(set(terminated))
        outcomes: dict[int, Outcome] = {}
        for _ in callers:
            rank, outcome = self._outbox.get(timeout=STEP_TIMEOUT_S)
            outcomes[rank] = outcome
        for rank, outcome in outcomes.items():
            if isinstance(outcome, State):
                self.states[rank] = dataclasses.replace(outcome, iteration=outcome.iteration + 1)
            else:
                del self.states[rank]
        self.history.append(outcomes)
        return outcomes

    def step_initial(self, initial_ranks: Collection[int]) -> dict[int, Outcome]:
        """Like :meth:`step`, naming the failed ranks by their initial rank."""
        return self.step({self.current_rank(rank) for rank in initial_ranks})

    def current_rank(self, initial_rank: int) -> int:
        rank = self.states[initial_rank].rank
        assert rank is not None
        return rank

    def close(self) -> None:
        for rank in range(self.world_size):
            self._inbox[rank].put(None)
        for thread in self._threads:
            thread.join(timeout=STEP_TIMEOUT_S)

    def __enter__(self) -> World:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def states_of(outcomes: dict[int, Outcome]) -> dict[int, State]:
    """The outcomes that are states; fails on any error other than RankDiscarded."""
    unexpected = {
        rank: outcome
        for rank, outcome in outcomes.items()
        if isinstance(outcome, BaseException) and not isinstance(outcome, RankDiscarded)
    }
    if unexpected:
        rank, error = min(unexpected.items(), key=lambda item: item[0])
        raise RuntimeError(f"ranks {sorted(unexpected)} failed; rank {rank}'s error follows") from error
    return {rank: outcome for rank, outcome in outcomes.items() if isinstance(outcome, State)}


def discarded(outcomes: dict[int, Outcome]) -> set[int]:
    return {rank for rank, outcome in outcomes.items() if isinstance(outcome, RankDiscarded)}


def assert_consistent(states: dict[int, State]) -> None:
    """The invariants every assignment must keep across the ranks of a world."""
    assert states, "no rank survived"
    world_sizes = {state.world_size for state in states.values()}
    active_world_sizes = {state.active_world_size for state in states.values()}
    assert len(world_sizes) == 1 and len(active_world_sizes) == 1, (world_sizes, active_world_sizes)
    (world_size,) = world_sizes
    (active_world_size,) = active_world_sizes
    assert sorted(state.rank for state in states.values()) == list(range(world_size))
    active = sorted(state.active_rank for state in states.values() if state.mode is Mode.ACTIVE)
    assert active == list(range(active_world_size or 0))
    for state in states.values():
        assert (state.mode is Mode.ACTIVE) == (state.active_rank is not None), state


def active_ranks(states: dict[int, State]) -> dict[int, int | None]:
    """``active_rank`` by initial rank."""
    return {rank: state.active_rank for rank, state in sorted(states.items())}
