"""Progress heartbeats of the main thread, shared with the monitor process.

Three heartbeats say that the wrapped function makes progress:

* automatic: a watchdog thread regularly asks the interpreter, through
  ``Py_AddPendingCall``, to have the main thread post a semaphore. The
  interpreter runs pending calls only between bytecode instructions of the
  main thread, so the heartbeat stops as soon as the main thread is stuck in
  C code, whether that code holds the GIL (then the watchdog thread itself
  cannot run either) or released it. The pending call is libc's
  ``sem_post``, not a Python callback: an asynchronous restart exception
  delivered inside a Python callback would be swallowed by ctypes;
* manual: :meth:`HeartbeatWatchdog.ping`, called by the wrapped function
  through ``CallWrapper.ping()``. Once a rank pings in an iteration, it must
  keep pinging, which catches livelocks that keep executing bytecode. A ping
  is also evidence of progress for the automatic heartbeat, so a helper
  thread that pings keeps alive a main thread that is legitimately busy in
  one long C call.

The timestamps live in a small shared-memory block created before the
monitor process is forked, so the monitor process reads them without any
message passing, even when the main process is frozen.

NVIDIA's ``ProgressWatchdog`` (a thread sending ``Timestamp`` objects to a
connection), which the Wrapper does not use, is
:mod:`elastic_ft.inprocess.compat.timestamp_watchdog`; the public
``progress_watchdog`` module serves both.
"""

from __future__ import annotations

import collections
import ctypes
import math
import mmap
import statistics
import threading
import time
from collections.abc import Callable

from elastic_ft.etcd import shield
from elastic_ft.inprocess.delivery.main_thread import main_thread_probe, main_thread_waits_for_peers
from elastic_ft.inprocess.hangs.verdicts import AdaptiveTimeouts, adaptive_timeouts, warmup_timeouts
from elastic_ft.inprocess.restart.logs import get_logger

__all__ = ["HeartbeatWatchdog", "ProgressTimestamps", "StepClock", "progress_age"]

log = get_logger("progress_watchdog")

# Slots of the shared block, each one aligned 8-byte double; times are time.monotonic() seconds.
(_AUTOMATIC, _MANUAL, _THREADS, _SOFT, _HARD, _LONG, _WAITING, _RESTART_PENDING, _DELIVERY, _WARMUP, _UNPROTECTED) = (
    range(11)
)
_Slots = ctypes.c_double * 11


def progress_age(automatic: float, manual: float, now: float) -> float:
    """Seconds since the staler of the two heartbeats; the manual one counts only once used."""
    age = now - automatic
    if not math.isnan(manual):
        age = max(age, now - manual)
    return age


class ProgressTimestamps:
    """The heartbeats and timeouts in memory shared by the main and the monitor process.

    Both processes use ``time.monotonic()``, a system-wide clock on Linux.
    ``MANUAL`` is NaN until the first ping of an iteration; ``SOFT`` and
    ``HARD`` are the timeouts in effect, in seconds (``WARMUP`` is 1 while
    they bound an iteration's warm-up, not its steps); ``LONG`` counts the
    sections marked long the main thread is in, ``UNPROTECTED`` those of them
    whose hang protection is off. ``WAITING`` is 1 while the
    main thread, blocked in C code, waits for other ranks (a collective, a
    backward pass with DDP's all-reduces), 0 while it is blocked elsewhere,
    NaN while it runs Python code: it tells the rank that hung from the
    ranks waiting for it. ``RESTART_PENDING`` is when the monitor thread
    started a restart the main thread has not taken yet (NaN: none).
    ``DELIVERY`` is how long a restart may take to reach the main thread
    before the monitor process terminates the rank: the adaptive hard
    timeout the job's steps last gave, kept across iterations, and at least
    twice the adaptive floor (3 s by default; the configured soft timeout
    without adaptive timeouts).
    """

    def __init__(self, soft: float = math.inf, hard: float = math.inf) -> None:
        self._memory = mmap.mmap(-1, ctypes.sizeof(_Slots), flags=mmap.MAP_SHARED)
        # Each value is one aligned 8-byte store, which the other process
        # never sees half-written. (struct.pack_into zero-fills its target
        # before packing, so a concurrent reader could see 0: an age of the
        # whole uptime.)
        self._slots = _Slots.from_buffer(self._memory)
        self.set_timeouts(soft, hard)
        self._slots[_DELIVERY] = soft
        self._slots[_RESTART_PENDING] = math.nan
        self.reset()

    def reset(self) -> None:
        now = time.monotonic()
        self._slots[_MANUAL] = math.nan
        self._slots[_AUTOMATIC] = now
        self._slots[_THREADS] = now
        self._slots[_WAITING] = math.nan

    def set_waiting(self, waiting: bool | None) -> None:
        """Whether the main thread, blocked in C code, waits for other ranks (None: it runs Python code)."""
        self._slots[_WAITING] = math.nan if waiting is None else float(waiting)

    def waiting(self) -> bool | None:
        value = self._slots[_WAITING]
        return None if math.isnan(value) else value > 0

    def set_restart_pending(self, pending: bool) -> None:
        """The monitor thread started a restart (True) that the main thread has now taken (False).

        The main thread takes it in Python code: that is progress, written before the restart stops pending, so
        the monitor process never reads a taken restart with the progress from before the main thread blocked.
        """
        if not pending:
            self._slots[_AUTOMATIC] = time.monotonic()
        self._slots[_RESTART_PENDING] = time.monotonic() if pending else math.nan

    def restart_pending_for(self) -> float:
        """Seconds since a restart the main thread has not taken was started; 0 when none is pending."""
        since = self._slots[_RESTART_PENDING]
        return 0.0 if math.isnan(since) else time.monotonic() - since

    def set_delivery_bound(self, seconds: float) -> None:
        self._slots[_DELIVERY] = seconds

    def delivery_bound(self) -> float:
        return self._slots[_DELIVERY]

    def beat_automatic(self) -> None:
        self._slots[_AUTOMATIC] = time.monotonic()

    def beat_manual(self) -> None:
        now = time.monotonic()
        self._slots[_MANUAL] = now
        self._slots[_AUTOMATIC] = now

    def beat_threads(self) -> None:
        self._slots[_THREADS] = time.monotonic()

    def set_timeouts(self, soft: float, hard: float, warming_up: bool = False) -> None:
        self._slots[_SOFT] = soft
        self._slots[_HARD] = hard
        self._slots[_WARMUP] = float(warming_up)

    def timeouts(self) -> tuple[float, float]:
        return self._slots[_SOFT], self._slots[_HARD]

    def warming_up(self) -> bool:
        """The timeouts in effect bound an iteration's warm-up (learned from earlier ones)."""
        return self._slots[_WARMUP] > 0

    def enter_long_section(self) -> None:
        self._slots[_LONG] += 1  # only the main thread writes it

    def exit_long_section(self) -> None:
        self._slots[_LONG] = max(0.0, self._slots[_LONG] - 1)

    def in_long_section(self) -> bool:
        return self._slots[_LONG] > 0

    def enter_unprotected(self) -> None:
        self._slots[_UNPROTECTED] += 1  # only the main thread writes it

    def exit_unprotected(self) -> None:
        """Leave an unprotected section: the timeouts count from its end, not from the progress before it."""
        now = time.monotonic()
        self._slots[_AUTOMATIC] = now
        if not math.isnan(self._slots[_MANUAL]):
            self._slots[_MANUAL] = now
        self._slots[_UNPROTECTED] = max(0.0, self._slots[_UNPROTECTED] - 1)

    def unprotected(self) -> bool:
        """The main thread is in a section whose hang protection is off (``disable_hang_protection``)."""
        return self._slots[_UNPROTECTED] > 0

    def read(self) -> tuple[float, float]:
        return self._slots[_AUTOMATIC], self._slots[_MANUAL]

    def age(self) -> float:
        return progress_age(*self.read(), time.monotonic())

    def threads_silent_for(self) -> float:
        return time.monotonic() - self._slots[_THREADS]


class StepClock:
    """Turns step events into adaptive timeouts, written to the shared block for the monitor process.

    Runs in the main thread (the optimizer hook, ``ping()``, section
    markers). Step intervals are sampled except the first ``warmup_steps``
    of each iteration and those that overlap a section marked long; until
    enough samples exist, the configured timeouts apply. Each warm-up of an
    active rank is timed, less its long sections, to bound the next ones
    (:func:`~elastic_ft.inprocess.hangs.verdicts.warmup_timeouts`).
    """

    _WARMUPS_KEPT = 16

    _RECOMPUTE_EVERY = 8

    def __init__(
        self, timestamps: ProgressTimestamps, config: AdaptiveTimeouts | None, soft_limit: float, hard_limit: float
    ) -> None:
        self.timestamps = timestamps
        self.config = config
        self.soft_limit = soft_limit
        self.hard_limit = hard_limit
        self.samples: collections.deque[float] = collections.deque(maxlen=config.window if config else 1)
        self._last_step: float | None = None
        self._steps_in_iteration = 0
        self._adapted: tuple[float, float] = (soft_limit, hard_limit)
        self.warmups: collections.deque[float] = collections.deque(maxlen=self._WARMUPS_KEPT)
        # When this iteration's warm-up started (None: not timed, a reserve rank), and its time in long sections.
        self._warmup_started: float | None = None
        self._warmup_long = 0.0
        self._long_entered: float | None = None
        #: Levels of unprotected sections (``CallWrapper.disable_hang_protection``) the main thread is in.
        self._unprotected = 0
        # How long a restart may take to reach the main thread (the monitor process terminates the rank
        # after that): the adaptive hard timeout, at least AdaptiveTimeouts.delivery_floor (3 s by default),
        # which holds too until the job's steps give one, as a restart abandons whatever the rank does.
        self._delivery_floor = min(hard_limit, config.delivery_floor.total_seconds()) if config else soft_limit
        timestamps.set_delivery_bound(self._delivery_floor)

    def start_iteration(self, active: bool = True) -> None:
        """A new iteration warms up again, bounded by the earlier warm-ups (a reserve rank: the ceilings)."""
        self._last_step = None
        self._steps_in_iteration = 0
        self._warmup_started = time.monotonic() if active else None
        self._warmup_long = 0.0
        self._long_entered = None
        self._apply_warmup_timeouts()

    def _warming_up(self) -> bool:
        return self._steps_in_iteration <= (self.config.warmup_steps if self.config else 0)

    def _apply_warmup_timeouts(self) -> None:
        bound = None
        if self._warmup_started is not None:
            bound = warmup_timeouts(self.warmups, self.samples, self.config, self.soft_limit, self.hard_limit)
        if bound is None:
            self.timestamps.set_timeouts(self.soft_limit, self.hard_limit)
        else:
            self.timestamps.set_timeouts(*bound, warming_up=True)

    @property
    def steps_in_iteration(self) -> int:
        """Optimizer steps (or pings) taken since the iteration started."""
        return self._steps_in_iteration

    def typical_step(self) -> float | None:
        """The median of the sampled step intervals (seconds); None before any sample."""
        return statistics.median(self.samples) if self.samples else None

    def step(self) -> None:
        now = time.monotonic()
        self._steps_in_iteration += 1
        if self.config is None:
            return
        if self._last_step is not None and self._steps_in_iteration > self.config.warmup_steps:
            self.samples.append(now - self._last_step)
            if len(self.samples) % self._RECOMPUTE_EVERY == 0 or len(self.samples) == self.config.min_samples:
                self._adapted = adaptive_timeouts(self.samples, self.config, self.soft_limit, self.hard_limit)
                self.timestamps.set_delivery_bound(max(self._delivery_floor, self._adapted[1]))
        self._last_step = now
        if self._steps_in_iteration == self.config.warmup_steps + 1 and self._warmup_started is not None:
            if not self.timestamps.in_long_section():
                self.warmups.append(now - self._warmup_started - self._warmup_long)
            self._warmup_started = None
        if self._steps_in_iteration > self.config.warmup_steps and not self.timestamps.in_long_section():
            self.timestamps.set_timeouts(*self._adapted)

    def enter_long_section(self, unprotected: bool = False) -> None:
        """A long section: the configured timeouts apply (``unprotected``: none at all) until it ends."""
        if not self.timestamps.in_long_section():
            self._long_entered = time.monotonic()
        self._unprotected += unprotected
        if unprotected:
            self.timestamps.enter_unprotected()
        self.timestamps.enter_long_section()
        self._set_section_timeouts()

    def _set_section_timeouts(self) -> None:
        if self._unprotected:
            self.timestamps.set_timeouts(math.inf, math.inf)
        else:
            self.timestamps.set_timeouts(self.soft_limit, self.hard_limit)

    def exit_long_section(self, unprotected: bool = False) -> None:
        self.timestamps.exit_long_section()
        if unprotected:
            self.timestamps.exit_unprotected()
        self._unprotected = max(0, self._unprotected - unprotected)
        self._last_step = None  # the interval across the section says nothing of step times
        if self.timestamps.in_long_section():
            self._set_section_timeouts()
            return
        if self._long_entered is not None:
            self._warmup_long += time.monotonic() - self._long_entered
            self._long_entered = None
        if self._warming_up():
            self._apply_warmup_timeouts()
        else:
            self.timestamps.set_timeouts(*self._adapted)


class HeartbeatWatchdog(threading.Thread):
    """Takes the automatic heartbeat every ``interval`` seconds (the Wrapper's own watchdog).

    Each round checks whether the main thread ran the call scheduled in the
    previous round; if it did, that is progress, and a new call is
    scheduled. The heartbeat is therefore at most one interval late.

    Args:
        timestamps: where the heartbeats are written.
        interval: seconds between two rounds.
        each_round: also called every round, from this thread (must be cheap; dropped if it raises).
        on_waiting: told, from this thread, when the main thread starts (True) or stops (False) waiting for
            other ranks in C code (a collective).
    """

    def __init__(
        self,
        timestamps: ProgressTimestamps,
        interval: float,
        each_round: Callable[[], None] | None = None,
        on_waiting: Callable[[bool], None] | None = None,
    ) -> None:
        super().__init__(name="elastic_ft-progress-watchdog", daemon=True)
        self.timestamps = timestamps
        self.interval = interval
        self.each_round = each_round
        self.on_waiting = on_waiting
        self._probe = main_thread_probe()
        self._stop_requested = threading.Event()

    def run(self) -> None:
        while not self._stop_requested.wait(self.interval):
            self.timestamps.beat_threads()
            if self.each_round is not None:
                try:
                    self.each_round()
                except Exception:  # the heartbeat must go on
                    log.exception("the watchdog's per-round call failed")
                    self.each_round = None
            if not self._probe.answered():
                # The main thread executed no bytecode since the last round: blocked in C code. Where?
                if self.timestamps.waiting() is None:
                    waiting = main_thread_waits_for_peers()
                    self.timestamps.set_waiting(waiting)
                    if waiting and self.on_waiting is not None:
                        self.on_waiting(True)
                continue
            if self.timestamps.waiting() and self.on_waiting is not None:
                self.on_waiting(False)
            self.timestamps.set_waiting(None)
            if self.timestamps.restart_pending_for() == 0.0 or shield.active():
                # While a restart waits to be taken, the probe is answered by the restart signal's own handler
                # too (it runs pending calls in a lock wait, declining to raise in a finalizer): that is no
                # progress. Only the etcd client's shielded sections, bounded by its timeouts, count.
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
