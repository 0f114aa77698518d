"""What a node's agent and its workers tell each other on their host, in shared memory.

A small file (under ``/dev/shm`` when it exists) of 8-byte doubles, mapped
by the agent and by every worker of the node (``ELASTIC_FT_LOCAL_BOARD``
names it). No message, no syscall per read: workers read it before every
optimizer step, the agent every ``--monitor-interval``.

* **The fence** (the agent writes): until when the node's lease is proven
  alive, in ``time.monotonic()`` seconds (a system-wide clock on Linux),
  and the lease's generation (1 for the node's first lease, one more for
  each new lease it announces itself on). The agent moves the time forward
  after every refresh etcd answers (the refresh's send time plus the TTL:
  etcd cannot have dropped the lease before), and to 0 when the lease is
  gone. A worker of a node whose lease may be gone may have been counted
  out by the others, who then go on without it: it must not commit an
  optimizer step, nor begin an ``atomic()`` section, of the membership it
  had. The Wrapper waits while the time has passed, and restarts when the
  generation differs from the one its iteration began under: the
  membership it computed for may be gone.
* **May join** (the agent writes): whether new workers of this node may ask
  to join the running world. Cleared while the node, counted out after it
  was cut off, does not reach the other members yet: joiners that cannot
  reach them would only stall the others again.
* **The stalls** (each worker writes its own slot): since when its main
  thread has been blocked in a collective, and since when it has waited at
  one of the Wrapper's barriers (NaN: it is not). The agent suspects the
  other members when a local rank stays blocked too long
  (:mod:`elastic_ft.rendezvous.liveness`).
* **The initial rank** (each worker writes its own slot): the initial rank
  its process holds now, when it took a new one: a rank counted out while
  it lived (its node cut off) joins the running world again in the same
  process, under a new initial rank, and its agent reports and admits it
  under that one (NaN: the one it started with).

Torch-free; used by both sides.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import tempfile
import time
from collections.abc import Iterator, Mapping

LOCAL_BOARD_ENV = "ELASTIC_FT_LOCAL_BOARD"
_HEADER = 4  # the fence's time, the number of rank slots, the fence's generation, may join
_PER_RANK = 3  # in a collective since, at a barrier since, the initial rank it took since it started
_MAX_RANKS = 4096


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class LocalBoard:
    """The mapped file; :meth:`create` (the agent) or :meth:`from_env` (a worker)."""

    def __init__(self, path: str, memory: mmap.mmap, ranks: int) -> None:
        self.path = path
        self._memory = memory
        self._slots = (ctypes.c_double * (_HEADER + _PER_RANK * ranks)).from_buffer(memory)
        self.ranks = ranks

    @classmethod
    def create(cls, ranks: int, name: str) -> LocalBoard:
        """A new board for ``ranks`` local ranks, fenced (no lease proven yet), no stall."""
        if not 1 <= ranks <= _MAX_RANKS:
            raise ValueError(f"a local board holds 1 to {_MAX_RANKS} ranks, got {ranks}")
        safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:80]
        fd, path = tempfile.mkstemp(prefix=f"eft-board-{safe}-", dir=_directory())
        size = ctypes.sizeof(ctypes.c_double) * (_HEADER + _PER_RANK * ranks)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        board = cls(path, memory, ranks)
        board._slots[1] = float(ranks)
        board.set_fence(0.0, 0)
        board.set_may_join(True)
        for rank in range(ranks):
            board.clear_stalls(rank)
        return board

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> LocalBoard | None:
        """The board the agent handed down, or None (no agent of ours: nothing is fenced, nobody reads stalls).

        Raises:
            ValueError: the variable names something that is not a board.
        """
        path = environ.get(LOCAL_BOARD_ENV)
        if not path:
            return None
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as error:
            raise ValueError(f"{LOCAL_BOARD_ENV}={path!r} cannot be opened: {error}") from None
        try:
            size = os.fstat(fd).st_size
            header = ctypes.sizeof(ctypes.c_double) * _HEADER
            if size < header or (size - header) % (ctypes.sizeof(ctypes.c_double) * _PER_RANK):
                raise ValueError(f"{LOCAL_BOARD_ENV}={path!r} is not a local board ({size} bytes)")
            memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        ranks = (size - header) // (ctypes.sizeof(ctypes.c_double) * _PER_RANK)
        return cls(path, memory, ranks)

    def to_env(self) -> dict[str, str]:
        return {LOCAL_BOARD_ENV: self.path}

    # ---- the fence ----

    def set_fence(self, valid_until: float, generation: int) -> None:
        """The node's lease of ``generation`` is proven alive until ``valid_until`` (``time.monotonic()``); 0: it
        is gone."""
        self._slots[2] = float(generation)
        self._slots[0] = valid_until

    def generation(self) -> int:
        """The generation of the node's lease (0: none yet)."""
        return int(self._slots[2])

    def fence_valid(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self._slots[0]

    def fence_left(self, now: float | None = None) -> float:
        """Seconds the lease is still proven alive (negative: for how long it has not been)."""
        return self._slots[0] - (time.monotonic() if now is None else now)

    # ---- may join ----

    def set_may_join(self, allowed: bool) -> None:
        self._slots[3] = 1.0 if allowed else 0.0

    def may_join(self) -> bool:
        return self._slots[3] == 1.0

    # ---- the stalls ----

    def _slot(self, local_rank: int, which: int) -> int:
        if not 0 <= local_rank < self.ranks:
            raise ValueError(f"local rank {local_rank} is outside the board's {self.ranks} ranks")
        return _HEADER + _PER_RANK * local_rank + which

    def set_in_collective(self, local_rank: int, since: float | None) -> None:
        self._slots[self._slot(local_rank, 0)] = math.nan if since is None else since

    def set_at_barrier(self, local_rank: int, since: float | None) -> None:
        self._slots[self._slot(local_rank, 1)] = math.nan if since is None else since

    def clear_stalls(self, local_rank: int) -> None:
        """A new process takes ``local_rank``: what its predecessor left there is void."""
        self.set_in_collective(local_rank, None)
        self.set_at_barrier(local_rank, None)
        self._slots[self._slot(local_rank, 2)] = math.nan

    def set_initial_rank(self, local_rank: int, initial_rank: int) -> None:
        """The process of ``local_rank`` holds ``initial_rank`` now (it joined the world again under it)."""
        self._slots[self._slot(local_rank, 2)] = float(initial_rank)

    def initial_rank(self, local_rank: int) -> int | None:
        """The initial rank the process of ``local_rank`` took since it started; None: the one it started with."""
        value = self._slots[self._slot(local_rank, 2)]
        return None if math.isnan(value) or value < 0 else int(value)

    def stalled_for(self, now: float | None = None) -> float | None:
        """How long the longest-blocked local rank has been blocked (in a collective or at a barrier); None: none."""
        now = time.monotonic() if now is None else now
        starts = [
            value
            for rank in range(self.ranks)
            for value in (self._slots[self._slot(rank, 0)], self._slots[self._slot(rank, 1)])
            if not math.isnan(value)
        ]
        return now - min(starts) if starts else None

    def close(self, *, remove: bool = False) -> None:
        with contextlib.suppress(BufferError):
            del self._slots
            self._memory.close()
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


@contextlib.contextmanager
def at_barrier(board: LocalBoard | None, local_rank: int) -> Iterator[None]:
    """A rank waits at one of the Wrapper's barriers: its node's agent may suspect the other members (nothing
    without a board)."""
    if board is not None:
        board.set_at_barrier(local_rank, time.monotonic())
    try:
        yield
    finally:
        if board is not None:
            board.set_at_barrier(local_rank, None)
