"""Progress heartbeats of the main thread, shared with the monitor process.

Two heartbeats say that the wrapped function makes progress:

* automatic: a watchdog thread regularly asks the interpreter, through
  ``Py_AddPendingCall``, to have the main thread post a semaphore. The
  interpreter runs pending calls only between bytecode instructions of the
  main thread, so the heartbeat stops as soon as the main thread is stuck in
  C code, whether that code holds the GIL (then the watchdog thread itself
  cannot run either) or released it. The pending call is libc's
  ``sem_post``, not a Python callback: an asynchronous restart exception
  delivered inside a Python callback would be swallowed by ctypes;
* manual: :meth:`ProgressWatchdog.ping`, called by the wrapped function
  through ``CallWrapper.ping()``. Once a rank pings in an iteration, it must
  keep pinging, which catches livelocks that keep executing bytecode. A ping
  is also evidence of progress for the automatic heartbeat, so a helper
  thread that pings keeps alive a main thread that is legitimately busy in
  one long C call.

The timestamps live in a small shared-memory block created before the
monitor process is forked, so the monitor process reads them without any
message passing, even when the main process is frozen.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import time

from elastic_ft.inprocess_logging import get_logger

log = get_logger("progress_watchdog")

_Slots = ctypes.c_double * 2  # automatic, manual (NaN: no ping yet); time.monotonic() seconds


def progress_age(automatic: float, manual: float, now: float) -> float:
    """Seconds since the staler of the two heartbeats; the manual one counts only once used."""
    age = now - automatic
    if not math.isnan(manual):
        age = max(age, now - manual)
    return age


class ProgressTimestamps:
    """The two heartbeat timestamps in memory shared by the main and the monitor process.

    Both processes use ``time.monotonic()``, a system-wide clock on Linux.
    """

    def __init__(self) -> None:
        self._memory = mmap.mmap(-1, ctypes.sizeof(_Slots), flags=mmap.MAP_SHARED)
        # Each timestamp is one aligned 8-byte store, which the other process
        # never sees half-written. (struct.pack_into zero-fills its target
        # before packing, so a concurrent reader could see 0: an age of the
        # whole uptime.)
        self._slots = _Slots.from_buffer(self._memory)
        self.reset()

    def reset(self) -> None:
        self._slots[1] = math.nan
        self._slots[0] = time.monotonic()

    def beat_automatic(self) -> None:
        self._slots[0] = time.monotonic()

    def beat_manual(self) -> None:
        now = time.monotonic()
        self._slots[1] = now
        self._slots[0] = now

    def read(self) -> tuple[float, float]:
        return self._slots[0], self._slots[1]

    def age(self) -> float:
        return progress_age(*self.read(), time.monotonic())


_libc = ctypes.CDLL(None, use_errno=True)
_SEM_T_SIZE = 64  # larger than sem_t on every Linux ABI

_add_pending_call = ctypes.pythonapi.Py_AddPendingCall
_add_pending_call.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
_add_pending_call.restype = ctypes.c_int
# The pending call is libc's sem_post itself: it returns 0 and runs no Python code,
# so an asynchronous exception can never be raised inside it and lost.
_SEM_POST = ctypes.cast(_libc.sem_post, ctypes.c_void_p)


class _MainThreadProbe:
    """A semaphore that the main thread posts, via a pending call, when it executes bytecode."""

    def __init__(self) -> None:
        self._semaphore = ctypes.create_string_buffer(_SEM_T_SIZE)
        if _libc.sem_init(self._semaphore, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self.pending = False

    def schedule(self) -> bool:
        self.pending = _add_pending_call(_SEM_POST, ctypes.addressof(self._semaphore)) == 0
        return self.pending

    def answered(self) -> bool:
        """True once the scheduled call ran; consumes the answer."""
        if self.pending and _libc.sem_trywait(self._semaphore) == 0:
            self.pending = False
        return not self.pending


_probe: _MainThreadProbe | None = None


def _main_thread_probe() -> _MainThreadProbe:
    """The process's one probe; never freed, since a pending call may still point to it."""
    global _probe
    if _probe is None:
        _probe = _MainThreadProbe()
    return _probe


class ProgressWatchdog(threading.Thread):
    """Takes the automatic heartbeat every ``interval`` seconds.

    Each round checks whether the main thread ran the call scheduled in the
    previous round; if it did, that is progress, and a new call is
    scheduled. The heartbeat is therefore at most one interval late.

    Args:
        timestamps: where the heartbeats are written.
        interval: seconds between two rounds.
    """

    def __init__(self, timestamps: ProgressTimestamps, interval: float) -> None:
        super().__init__(name="elastic_ft-progress-watchdog", daemon=True)
        self.timestamps = timestamps
        self.interval = interval
        self._probe = _main_thread_probe()
        self._stop_requested = threading.Event()

    def run(self) -> None:
        while not self._stop_requested.wait(self.interval):
            if not self._probe.answered():
                continue  # the main thread executed no bytecode since the last round
            self.timestamps.beat_automatic()
            if not self._probe.schedule():
                log.debug("Py_AddPendingCall refused the probe; retrying next round")

    def ping(self) -> None:
        self.timestamps.beat_manual()

    def reset(self) -> None:
        self.timestamps.reset()

    def shutdown(self) -> None:
        self._stop_requested.set()
        self.join()
