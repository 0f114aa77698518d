"""HealthCheck: decide, locally, whether this rank may take part in the next iteration.

Runs before the wrapped function in every iteration and again after a
fault (after ``finalize``). It must only look at the local process: other
ranks may be dead or still unwinding. An exception means "unhealthy": the
Wrapper raises :class:`elastic_ft.inprocess.exception.HealthCheckError` from it on
this rank, which leaves the job; the other ranks restart without it.
"""

from __future__ import annotations

import abc
import datetime
import threading

import torch

from elastic_ft.inprocess.exception import RestartError, TimeoutError
from elastic_ft.inprocess.state import State


class HealthCheck(abc.ABC):
    """Base class of the ``health_check`` argument; compose several with :class:`elastic_ft.Compose`."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Raise if this rank is unhealthy; return ``state`` unchanged."""


class CudaHealthCheck(HealthCheck):
    """Wait for this rank's pending CUDA work; fail on a CUDA error or after ``timeout``.

    Passes at once when CUDA is not available.
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=30)) -> None:
        self.timeout = timeout

    def __call__(self, state: State) -> State:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return state
        errors: list[BaseException] = []

        def synchronize() -> None:
            try:
                torch.cuda.synchronize()
            except RuntimeError as error:
                errors.append(error)

        # In a thread, so that a device that never finishes cannot block the check itself.
        worker = threading.Thread(target=synchronize, name="elastic_ft-cuda-health-check", daemon=True)
        worker.start()
        worker.join(self.timeout.total_seconds())
        if worker.is_alive():
            raise TimeoutError(f"CUDA did not synchronize within {self.timeout.total_seconds():g} s")
        if errors:
            raise RuntimeError("CUDA synchronization failed") from errors[0]
        return state


class FaultCounterExceeded(RestartError):
    """Raised by :class:`FaultCounter` when this rank caused more faults than allowed."""


class FaultCounter(HealthCheck):
    """Take a rank out of the job once its own function failed more than ``max_rank_faults`` times.

    A fault counts when the wrapped function raised on this rank
    (``state.fn_exception`` is set), not when another rank's fault
    interrupted it; a rank that keeps failing is then removed rather than
    restarting every rank again and again.

    Args:
        max_rank_faults: the faults this rank may cause; ``None``: no limit.
    """

    def __init__(self, max_rank_faults: int | None = None) -> None:
        if max_rank_faults is not None and (
            isinstance(max_rank_faults, bool) or not isinstance(max_rank_faults, int) or max_rank_faults < 0
        ):
            raise ValueError(f"FaultCounter max_rank_faults must be an int >= 0 or None, got {max_rank_faults!r}")
        self.max_rank_faults = max_rank_faults
        self.faults_count = 0

    def __call__(self, state: State) -> State:
        if state.fn_exception is None:
            return state
        self.faults_count += 1
        if self.max_rank_faults is not None and self.faults_count > self.max_rank_faults:
            raise FaultCounterExceeded(
                f"rank {state.initial_rank} caused {self.faults_count} faults, more than max_rank_faults="
                f"{self.max_rank_faults}; last: {state.fn_exception!r}"
            )
        return state
