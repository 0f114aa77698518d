"""Abort: unblock the main thread when the wrapped function must restart.

The Wrapper calls its ``abort`` once per restart on each rank, as NVIDIA's
does: usually from the monitor thread, while the main thread may be
blocked, typically inside a collective waiting for a rank that died or
hung; from the main thread when it left the function first (its own
exception). Whichever thread comes second does not call it again
(:mod:`elastic_ft.inprocess.restart.iteration`).

Before the call the Wrapper has already released the function's gloo
connections (:mod:`elastic_ft.inprocess.delivery.connections`), which is what unblocks a
gloo collective; an abort hook only adds what a backend needs beyond that.
Once the function has unwound, the Wrapper itself destroys the process
groups it left registered, whatever the hook did, so that the next
iteration's ``init_process_group`` starts from an empty registry.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_ft.inprocess.state import State
from elastic_ft.runtime.torch_compat import (
    dump_flight_recorder,
    forget_group_numbers,
    group_backend,
    group_names,
    stop_dcp_async_save_process,
)

log = logging.getLogger(__name__)

#: The variables that size torch's Flight Recorder buffer; a positive one turns it on.
FR_BUFFER_VARIABLES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")


def flight_recorder_on(environ: Mapping[str, str]) -> bool:
    """Whether torch records collectives (a Flight Recorder buffer size above 0).

    Raises:
        ValueError: a buffer size that is not an integer.
    """
    on = False
    for name in FR_BUFFER_VARIABLES:
        value = environ.get(name, "0")
        try:
            on = on or int(value) > 0
        except ValueError:
            raise ValueError(f"{name} must be an integer (a Flight Recorder buffer size), got {value!r}") from None
    return on


class Abort(abc.ABC):
    """Base class of the ``abort`` argument; compose several with :class:`elastic_ft.Compose`."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Unblock the main thread; return ``state`` unchanged."""


class AbortTorchDistributed(Abort):
    """Abort NCCL communicators; destroy every ``torch.distributed`` process group once the function unwound.

    With ``torch_fr_trace_path`` (or ``NVRX_FR_TRACE_PATH``) and torch's
    Flight Recorder on (``TORCH_FR_BUFFER_SIZE`` or
    ``TORCH_NCCL_TRACE_BUFFER_SIZE`` above 0), the first call of each
    iteration first writes this rank's recorded collectives, while its groups
    still exist, to ``<path>/iter_<iteration>/_dump_<rank>`` (a pickle, as
    torch's ``_dump_fr_trace`` makes it; no stack traces), for finding which
    collective a hung rank never joined.

    From the monitor thread (the main thread may be blocked in a
    collective) it aborts the NCCL communicators, which ends their pending
    kernels and calls. It destroys the process groups only when called from
    the main thread, after the function has unwound: destroying a group
    under a main thread that still uses it strands the work the group had
    queued (DDP's reducer then waits forever for a bucket's all-reduce),
    whereas left alone that work fails at once on the released connections.
    Under the Wrapper the groups are destroyed once the function unwound in
    any case (``ProcessGroupKeeper.unregister``).
    """

    def __init__(self, torch_fr_trace_path: str | os.PathLike[str] | None = None) -> None:
        path = torch_fr_trace_path if torch_fr_trace_path is not None else os.environ.get("NVRX_FR_TRACE_PATH")
        self.torch_fr_trace_path = str(path) if path else None
        self._recording = self.torch_fr_trace_path is not None and flight_recorder_on(os.environ)
        self._dumped_iteration: int | None = None

    def collect_fr_trace(self, state: State) -> Path | None:
        """Write this rank's Flight Recorder entries for ``state``'s iteration, once; the file, or None."""
        path = self.torch_fr_trace_path
        if (
            path is None
            or not self._recording
            or not dist.is_initialized()
            or self._dumped_iteration == state.iteration
        ):
            return None
        self._dumped_iteration = state.iteration
        directory = Path(path) / f"iter_{state.iteration}"
        target = directory / f"_dump_{dist.get_rank()}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            target.write_bytes(dump_flight_recorder())
        except (OSError, RuntimeError) as error:
            log.warning("could not write the Flight Recorder trace to %s: %s", target, error)
            return None
        return target

    @staticmethod
    def shutdown_process_group_backend(group: dist.ProcessGroup, device: torch.device) -> None:
        """Abort ``group``'s NCCL communicator on ``device``, if it has one (other backends: nothing)."""
        if not isinstance(group, dist.ProcessGroup):
            return
        backend, nccl = group_backend(group, device), getattr(dist, "ProcessGroupNCCL", None)
        if nccl is not None and isinstance(backend, nccl):
            backend.abort()

    @staticmethod
    def shutdown_all_process_group_backends() -> None:
        """Abort the NCCL communicators of every process group of this process."""
        if not dist.is_available() or not dist.is_initialized() or not torch.cuda.is_available():
            return
        for group in group_names():
            AbortTorchDistributed.shutdown_process_group_backend(group, torch.device("cuda"))

    def __call__(self, state: State) -> State:
        if not dist.is_available():
            return state
        self.collect_fr_trace(state)
        self.shutdown_all_process_group_backends()
        if threading.current_thread() is not threading.main_thread():
            return state
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_group_numbers()  # an init interrupted before it registered its group took a number
        return state


class AbortTransformerEngine(Abort):
    """Destroy Transformer Engine's userbuffers (its communication-overlap buffers); nothing without TE."""

    def __call__(self, state: State) -> State:
        try:
            import transformer_engine.pytorch as te
        except ImportError:
            return state
        te.module.base.destroy_ub()
        return state


class AbortPersistentCheckpointProcesses(Abort):
    """End the checkpoint writers that outlive a save, which a restart leaves holding the old world.

    Torch DCP's process-based ``async_save`` keeps a daemon process in a
    process group of the world it started in: it is ended, and the next
    ``async_save`` starts one in the new world. NVIDIA's async checkpoint
    queues (``nvidia_resiliency_ext.checkpointing``), when installed, are
    closed as NVIDIA's namesake does.
    """

    def __call__(self, state: State) -> State:
        pid = stop_dcp_async_save_process()
        if pid is not None:
            log.info("ended torch DCP's async_save process %s", pid)
        try:
            from nvidia_resiliency_ext.checkpointing.async_ckpt.core import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
                abort_nvrx_checkpoint,
            )
        except ImportError:
            return state
        abort_nvrx_checkpoint()
        return state
