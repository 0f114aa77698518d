"""The cross-replica process group of one group rank, rebuilt when the quorum changes (TorchFT's
``ProcessGroupGloo``).

Only the replica dimension changes on a fault, so only this group is
rebuilt: a replica group's own groups (its FSDP shards, its default group)
are never touched. torch 2.13 and 2.15 offer ``torch.distributed.shrink_group``
(``ncclCommShrink``), which removes ranks from an NCCL communicator without
a rendezvous; gloo does not support it (``supports_shrinking`` is False), and
no backend can *add* a rank (a group back from a fault), so a new gloo group
is built for every quorum: on CPU, a few milliseconds for a few members.

:meth:`ProcessGroupGloo.abort` releases every peer blocked on the group:
gloo cannot cancel a pending operation, and neither its ``abort()`` nor its
``shutdown()`` wakes a peer, so the group's own TCP connections (the sockets
the process opened while the group was built) are shut down, which ends
every blocked read and write on both sides
(:mod:`elastic_ft.inprocess.delivery.connections`). A member that sees a
collective fail aborts, so the failure spreads to every member at once.

Building a group can be given up too. Once the members' addresses are in
the store, gloo waits for a peer that stopped, or died before it connected,
far longer than the group's timeout (measured with torch 2.13: 50 s for a
10 s timeout, 100 s for 20 s), and nothing from outside wakes that wait.
So the group is built on a thread of its own, and the caller stops waiting
as soon as its ``cancelled()`` gives a reason (a member's records gone, a
newer quorum). The connections the build opened so far are shut down, which
releases any member that finished building. The build's own wait ends too:
gloo's listener hands an incoming connection to the pair whose sequence
number it reads first, so a connection to the build's listener for each
sequence number, closed at once, gives the waiting pair a peer that is gone,
and gloo fails the build within milliseconds. The thread must not outlive
its use: a process that exits while one is blocked in gloo can abort
(``terminate called without an active exception``, 2 exits of 8 here).
"""

from __future__ import annotations

import datetime
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic_ft.etcd.store import EtcdStore
from elastic_ft.inprocess.delivery.connections import listeners_among, shut_down_sockets, socket_inodes
from elastic_ft.runtime.waits import pause

log = logging.getLogger(__name__)

#: Seconds between two looks at whether a group's build was given up (a build on loopback takes a few ms).
_BUILD_POLL = 0.005


class ProcessGroupGloo:
    """A gloo group across the replica groups of a quorum, reconfigured by the :class:`~elastic_ft.replicas.manager.
    Manager` at each quorum that changes (TorchFT's name; ``timeout`` bounds every operation)."""

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"ProcessGroupGloo timeout {timeout!r}: expected a positive datetime.timedelta")
        self.timeout = timeout
        #: torch's gloo backend (its stubs leave out the collectives).
        self._backend: Any = None
        self._sockets: frozenset[int] = frozenset()
        self._rank = 0
        self._size = 0

    def configure_in(
        self, store: dist.Store, rank: int, world_size: int, cancelled: Callable[[], str | None] | None = None
    ) -> None:
        """Build the group as rank ``rank`` of ``world_size``, meeting in ``store``; the last group is aborted first.

        Raises what gloo raises, or :class:`GroupBuildCancelled` as soon as ``cancelled()`` (when given) gives a
        reason: it is called every few milliseconds while the build runs.
        """
        self.abort()
        before = socket_inodes()
        build = _GroupBuild()
        build.start(store, rank, world_size, self.timeout)
        while not build.done.wait(_BUILD_POLL):
            reason = cancelled() if cancelled is not None else None
            if reason is not None:
                build.give_up()
                opened = socket_inodes() - before
                released = shut_down_sockets(opened)
                _end_the_wait_for_peers(opened, world_size)
                raise GroupBuildCancelled(
                    f"building the cross-replica group was given up ({reason}); {released} connection(s) it had "
                    "opened were shut down"
                )
        if build.error is not None:
            raise build.error
        self._backend = build.backend
        self._sockets = socket_inodes() - before
        self._rank, self._size = rank, world_size

    @property
    def backend(self) -> Any:
        """The gloo group; an aborted or unbuilt group raises, so no collective on it passes for a one-member
        group's (which would let a step commit that the others did not take part in)."""
        if self._backend is None:
            raise RuntimeError(
                "the cross-replica group is aborted or not configured yet (the Manager's start_quorum() builds it)"
            )
        return self._backend

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allreduce_sum(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` across the group, in place; raises what gloo raises (a peer gone, the timeout), and on an
        aborted group."""
        backend = self.backend
        if self._size > 1:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
            backend.allreduce(tensors, options).wait()

    def allreduce_max(self, tensor: torch.Tensor) -> None:
        backend = self.backend
        if self._size > 1:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
            backend.allreduce([tensor], options).wait()

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor``, in rank order."""
        backend = self.backend
        if self._size == 1:
            return [tensor.clone()]
        out = [torch.empty_like(tensor) for _ in range(self._size)]
        backend.allgather([out], [tensor]).wait()
        return out

    def abort(self) -> None:
        """Release every member blocked on the group, then drop it."""
        if self._backend is None:
            return
        released = shut_down_sockets(self._sockets)
        log.debug("cross-replica group aborted: %d connection(s) shut down", released)
        self._backend, self._sockets, self._size = None, frozenset(), 0

    def errored(self) -> Exception | None:
        """TorchFT's: an error the group saw asynchronously. Every operation here is waited on, so none."""
        return None


def _end_the_wait_for_peers(opened: frozenset[int], world_size: int) -> None:
    """Connect to each listener among the sockets ``opened`` and write every sequence number a pair of a group of
    ``world_size`` can wait for (gloo numbers a device's pairs from 0, or by rank), each on a connection closed at
    once: the pair waiting for that number takes it, finds its peer gone, and the build fails. Numbers no pair
    waits for are set aside by gloo and dropped with the listener."""
    for listener in listeners_among(opened):
        host = listener.local_host if listener.local_host not in ("", "0.0.0.0", "::") else "localhost"
        for sequence in range(world_size + 1):
            try:
                with socket.create_connection((host, listener.local_port), timeout=1.0) as connection:
                    connection.sendall(struct.pack("=q", sequence))  # gloo's sequence_number_t: a native ssize_t
            except OSError:
                break  # the build already ended and closed this listener


class GroupBuildCancelled(RuntimeError):
    """The caller of :meth:`ProcessGroupGloo.configure_in` stopped waiting for the group: the reason says why."""


class _GroupBuild:
    """One gloo group being built on a daemon thread, so that its caller can stop waiting for it.

    A build given up and finished later drops the group it built: nobody will use it, and dropping it closes
    its connections.
    """

    def __init__(self) -> None:
        self.done = threading.Event()
        self.backend: Any = None
        self.error: Exception | None = None
        self._lock = threading.Lock()
        self._given_up = False

    def start(self, store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
        threading.Thread(
            target=self._build, args=(store, rank, world_size, timeout), name="elastic_ft-gloo-build", daemon=True
        ).start()

    def _build(self, store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
        try:
            backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        except Exception as error:  # noqa: BLE001 - handed to the caller, which raises it
            self.error = error
        else:
            with self._lock:
                if not self._given_up:
                    self.backend = backend
        finally:
            self.done.set()

    def give_up(self) -> None:
        with self._lock:
            self._given_up = True
            self.backend = None


class CancellableStore(dist.Store):
    """The store a group is built in, whose waits end as soon as ``cancelled()`` gives a reason.

    gloo waits for each peer's address in the store for the group's whole timeout; a member lost while the
    group is built would hold every other member that long. Waits here poll in short slices instead and raise
    ``DistStoreError`` with the reason.
    """

    def __init__(self, store: EtcdStore, cancelled: Callable[[], str | None], poll: float = 0.005) -> None:
        super().__init__()
        self._store = store
        self._cancelled = cancelled
        self._poll = poll

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._store.compare_set(key, expected_value, desired_value)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = (timeout or self._store.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self._store.check(keys):
            reason = self._cancelled()
            if reason is not None:
                raise dist.DistStoreError(f"waiting for {keys}: {reason}")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: {keys}")
            pause(self._poll)
