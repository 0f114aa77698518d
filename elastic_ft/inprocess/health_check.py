"""HealthCheck: decide, locally, whether this rank may take part in the next iteration.

Runs before the wrapped function in every iteration and again after a
fault (after ``finalize``). It must only look at the local process: other
ranks may be dead or still unwinding. An exception means "unhealthy": the
Wrapper raises :class:`elastic_ft.inprocess.exception.HealthCheckError` from it on
this rank, which leaves the job; the other ranks restart without it.

The Wrapper chains :class:`ChainedNicHealthCheck`,
:class:`ChainedNVLHealthCheck` and :class:`ChainedGPUHealthCheck` (in that
run order) before the user's checks whenever ``LOCAL_RANK`` is set, as
NVIDIA's ``inprocess`` 0.6 does (``Wrapper.restart_health_check``). On a
host without CUDA the GPU and NVLink checks pass, and say so once in the
log; the NIC check reads link state from sysfs on every host.
"""

from __future__ import annotations

import abc
import datetime
import logging

import torch

from elastic_ft.inprocess.exception import HealthCheckError, RestartError, TimeoutError
from elastic_ft.inprocess.state import State
from elastic_ft.runtime import node_checks

log = logging.getLogger(__name__)


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
        finished, error = node_checks.synchronize_within(None, self.timeout.total_seconds())
        if not finished:
            raise TimeoutError(f"CUDA did not synchronize within {self.timeout.total_seconds():g} s")
        if error is not None:
            raise RuntimeError("CUDA synchronization failed") from error
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


class _DeviceCheck(HealthCheck):
    """A check of one GPU (``device_index``, the rank's ``LOCAL_RANK``) or of all of them (None)."""

    def __init__(self, device_index: int | None = None) -> None:
        if device_index is not None and (isinstance(device_index, bool) or not isinstance(device_index, int)):
            raise TypeError(f"{type(self).__name__} device_index must be an int or None, got {device_index!r}")
        self.device_index = device_index

    def _no_gpu(self) -> bool:
        """True on a host without CUDA, where there is no GPU to be unhealthy: said at DEBUG (the Wrapper chains
        these checks itself, so a line at INFO would be one the user did not ask for)."""
        if node_checks.cuda_available():
            return False
        log.debug("%s passes: this host has no CUDA device", type(self).__name__)
        return True


class ChainedGPUHealthCheck(_DeviceCheck):
    """The GPU is usable after a fault: no recovery action pending in NVML, or its work finishes (CUDA).

    Raises :class:`HealthCheckError` naming what is wrong; the rank then
    leaves the job.
    """

    def __call__(self, state: State) -> State:
        if self._no_gpu():
            return state
        problems = node_checks.gpu_problems(self.device_index)
        if problems:
            raise HealthCheckError(f"GPU health check failed: {'; '.join(problems)}")
        return state


class ChainedNVLHealthCheck(_DeviceCheck):
    """Inactive NVLinks are logged, never raised: the job may run on fewer links (NVIDIA's 0.6 semantics)."""

    def __call__(self, state: State) -> State:
        if self._no_gpu():
            return state
        problems = node_checks.nvlink_problems(self.device_index)
        if problems:
            log.warning("NVLink health check (ignored): %s", "; ".join(problems))
        return state


class ChainedNicHealthCheck(_DeviceCheck):
    """Every NIC link that was up when the check was made is still up, and has not gone down in between.

    The baseline is taken at construction, when the Wrapper is built on a
    healthy host: a link down from the start is not this host's new fault.
    InfiniBand ports are checked by state and by their ``link_downed``
    counter, Ethernet interfaces by ``operstate``; without ``interfaces``,
    every physical NIC of the host is checked (``device_index`` is kept for
    NVIDIA's signature; a down link fails every rank of its host).

    Args:
        device_index: the rank's GPU (``LOCAL_RANK``), or None.
        interfaces: the links to check (``eth0``, ``mlx5_0/1``); None: every physical one.
        sysfs_root: where sysfs is mounted.
    """

    def __init__(
        self, device_index: int | None = None, *, interfaces: list[str] | None = None, sysfs_root: str = "/sys"
    ) -> None:
        super().__init__(device_index)
        self.sysfs_root = sysfs_root
        self.interfaces = interfaces
        self.baseline = node_checks.nic_links(sysfs_root, interfaces)
        if not any(link.up for link in self.baseline.values()):
            log.info("ChainedNicHealthCheck: no NIC link is up under %s to watch", sysfs_root)

    def __call__(self, state: State) -> State:
        try:
            now = node_checks.nic_links(self.sysfs_root, self.interfaces)
        except ValueError:
            now = node_checks.nic_links(self.sysfs_root)  # a named interface vanished: lost_links says which
        problems = node_checks.lost_links(self.baseline, now)
        if problems:
            raise HealthCheckError(f"NIC health check failed: {'; '.join(problems)}")
        return state
