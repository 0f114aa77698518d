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
