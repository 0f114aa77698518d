"""The agent asks a restart to admit its node's ready joiners once, even when a restart admits them meanwhile."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.iteration import iteration_store
from elastic_ft.coordination.job import job_store
from elastic_ft.keys import TERMINATION_BARRIER
from elastic_ft.launcher.agent import admission_request

NO_WAIT = datetime.timedelta(0)
WORLD_SIZE = 4
JOINERS = [10, 11]  # a host that rejoins: every rank of its node is a joiner


class InterleavingStore(dist.Store):
    """A ``HashStore`` that runs ``before_read`` once, on the first read of a key ending in ``suffix``: what
    another process does between two of the agent's reads."""

    def __init__(self, suffix: str) -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.suffix = suffix
        self.before_read: Callable[[], None] | None = None

    def _maybe_interleave(self, keys_read: list[str]) -> None:
        if self.before_read is not None and any(key.endswith(self.suffix) for key in keys_read):
            hook, self.before_read = self.before_read, None
            hook()

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._maybe_interleave([key])
        return self.inner.get(key)

    def check(self, keys_read: list[str]) -> bool:
        self._maybe_interleave(keys_read)
        return self.inner.check(keys_read)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def wait(self, keys_waited: list[str], timeout: datetime.timedelta | None = None) -> None:
        self.inner.wait(keys_waited) if timeout is None else self.inner.wait(keys_waited, timeout)


def _job_in_iteration_1(base: InterleavingStore) -> None:
    job = job_store(base)
    job.set_accepts_joiners()
    job.store.set(keys.LATEST_ITERATION, "1")
    for rank in JOINERS:
        job.register_joiner(rank)
        job.liveness.send_heartbeat(rank)  # ready


def _restart_of_iteration_1(base: InterleavingStore) -> None:
    """The last rank arrives at iteration 1's termination barrier: it admits the joiners into iteration 2."""
    iteration_store(base, 1).arrive_and_wait(TERMINATION_BARRIER, range(WORLD_SIZE), WORLD_SIZE, NO_WAIT)


def test_joiners_admitted_while_the_agent_reads_are_not_asked_for_again() -> None:
    base = InterleavingStore(keys.LATEST_ITERATION)
    _job_in_iteration_1(base)
    job = job_store(base)
    waiting = [rank for rank in JOINERS if job.admission(rank) is None]  # as the agent read them first
    assert waiting == JOINERS
    # A restart completes between that read and the agent's read of the iteration the job is in.
    base.before_read = lambda: _restart_of_iteration_1(base)
    iteration, _, still_waiting = admission_request(job, JOINERS, WORLD_SIZE, waiting)
    assert (job.admission(10), job.admission(11), job.latest_iteration()) == ("2", "2", 2)
    assert (iteration, still_waiting) == (2, [])  # nothing to ask: iteration 2 has them


def test_joiners_still_waiting_are_asked_for_in_the_iteration_the_job_is_in() -> None:
    base = InterleavingStore(keys.LATEST_ITERATION)
    _job_in_iteration_1(base)
    iteration, rank, still_waiting = admission_request(job_store(base), JOINERS, WORLD_SIZE, JOINERS)
    assert (iteration, rank, still_waiting) == (1, 0, JOINERS)
