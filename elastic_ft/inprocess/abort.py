"""Abort: unblock the main thread when the wrapped function must restart.

The monitor thread calls the ``abort`` of the Wrapper while the main thread
may be blocked, typically inside a collective waiting for a rank that died
or hung. The Wrapper calls it a second time from the main thread once the
wrapped function has unwound, to catch a process group created while the
first call ran; implementations must therefore be idempotent.

Before either call the Wrapper has already released the function's gloo
connections (:mod:`elastic_ft.inprocess.sockets`), which is what unblocks a
gloo collective; an abort hook only adds what a backend needs beyond that.
"""

from __future__ import annotations

import abc
import threading

import torch
import torch.distributed as dist

from elastic_ft.inprocess.state import State
from elastic_ft.runtime.torch_compat import forget_group_numbers, group_backend, group_names


class Abort(abc.ABC):
    """Base class of the ``abort`` argument; compose several with :class:`elastic_ft.Compose`."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Unblock the main thread; return ``state`` unchanged."""


class AbortTorchDistributed(Abort):
    """Abort NCCL communicators; destroy every ``torch.distributed`` process group once the function unwound.

    From the monitor thread (the main thread may be blocked in a
    collective) it aborts the NCCL communicators, which ends their pending
    kernels and calls. It destroys the process groups only when called from
    the main thread, after the function has unwound: destroying a group
    under a main thread that still uses it strands the work the group had
    queued (DDP's reducer then waits forever for a bucket's all-reduce),
    whereas left alone that work fails at once on the released connections.
    """

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
