"""Abort: unblock the main thread when the wrapped function must restart.

The monitor thread calls the ``abort`` of the Wrapper while the main thread
may be blocked, typically inside a collective waiting for a rank that died
or hung. The Wrapper calls it a second time from the main thread once the
wrapped function has unwound, to catch a process group created while the
first call ran; implementations must therefore be idempotent.
"""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist

from elastic_ft.state import State


class Abort(abc.ABC):
    """Base class of the ``abort`` argument; compose several with :class:`elastic_ft.Compose`."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Unblock the main thread; return ``state`` unchanged."""


class AbortTorchDistributed(Abort):
    """Abort NCCL communicators and destroy every ``torch.distributed`` process group.

    Destroying the groups closes this rank's connections, so that peers
    blocked in a collective with it fail at once ("connection closed by
    peer") instead of waiting for the backend's timeout. A Gloo collective
    that this rank itself is blocked in is not interrupted by it (Gloo has no
    way to cancel a pending operation): it ends when a peer's connections
    close or at the process group's timeout, so give Gloo a short ``timeout``
    in ``init_process_group``.
    """

    def __call__(self, state: State) -> State:
        if not dist.is_available():
            return state
        if dist.is_initialized():
            if torch.cuda.is_available():
                for group in list(dist.distributed_c10d._world.pg_names):
                    backend = group._get_backend(torch.device("cuda"))
                    if isinstance(backend, getattr(dist, "ProcessGroupNCCL", ())):
                        backend.abort()
            dist.destroy_process_group()
        # An init_process_group interrupted before it registered its group still
        # took a number for the group's name; destroy_process_group never saw it.
        # Forget it as destroy_process_group would, or the next init on this rank
        # would name its group differently from the ranks whose init succeeded.
        dist.distributed_c10d._world.group_count = 0
        return state
