"""NVIDIA's ``ProgressWatchdog`` API: a thread that sends the main thread's progress timestamps to a connection.

``nvidia_resiliency_ext.inprocess.progress_watchdog.ProgressWatchdog(rank,
connection, interval)`` runs a thread that, every ``interval``, learns
whether the main thread executed bytecode (a pending call) and sends a
:class:`Timestamp` (``auto``: the latest time it did; ``manual``: the latest
:meth:`ProgressWatchdog.ping`) with ``connection.send_timestamp``. Code
written against it (NVIDIA's tests, a monitor of one's own) runs unchanged
here. The Wrapper does not use it: its heartbeat is
:class:`elastic_ft.inprocess.hangs.heartbeats.HeartbeatWatchdog`, which
shares its timestamps with the monitor process through memory instead of
messages.

Timestamps are ``time.monotonic()`` seconds. ``auto`` is the moment the
watchdog saw the main thread's latest answer, at most one interval after
the main thread ran; as in NVIDIA's, a :meth:`ProgressWatchdog.reset` sets
it to now only until the next timestamp, which says again when the main
thread last ran. Pausing needs no draining of the pending calls (NVIDIA's
watchdog waits for them to run, since they write to a buffer it owns): the
probe here is a semaphore that is never freed, so a pause takes effect at
once, even while the main thread is blocked in C code.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from datetime import timedelta
from typing import Protocol

from elastic_ft.inprocess.delivery.main_thread import separate_probe
from elastic_ft.inprocess.exception import InternalError
from elastic_ft.runtime.waits import pause


@dataclasses.dataclass
class Timestamp:
    """The main thread's latest progress, in ``time.monotonic()`` seconds: automatic and manual (None: none)."""

    auto: float | None = None
    manual: float | None = None

    def is_timed_out(self, timeout: timedelta) -> bool:
        """Whether either heartbeat is older than ``timeout``."""
        now = time.monotonic()
        return any(beat is not None and now - beat > timeout.total_seconds() for beat in (self.auto, self.manual))


class TimestampConnection(Protocol):
    """Where the timestamps go (NVIDIA's monitor process connection)."""

    def send_timestamp(self, timestamp: Timestamp) -> object: ...


class ProgressWatchdog(threading.Thread):
    """Sends the main thread's :class:`Timestamp` to ``monitor_process`` every ``interval`` (NVIDIA's API).

    Args:
        rank: names the thread (``ProgressWatchdog-<rank>``).
        monitor_process: anything with ``send_timestamp(timestamp)``.
        interval: time between two timestamps.
    """

    def __init__(self, rank: int, monitor_process: TimestampConnection, interval: timedelta) -> None:
        if not isinstance(interval, timedelta) or interval <= timedelta(0):
            raise ValueError(f"ProgressWatchdog interval must be a positive datetime.timedelta, got {interval!r}")
        if not callable(getattr(monitor_process, "send_timestamp", None)):
            raise TypeError(f"ProgressWatchdog needs a connection with send_timestamp(), got {monitor_process!r}")
        super().__init__(name=f"{type(self).__name__}-{rank}", daemon=True)
        self.rank = rank
        self.monitor_process = monitor_process
        self.interval = interval
        self.timestamp = Timestamp(auto=time.monotonic())
        #: When the main thread last answered the probe: the automatic timestamp's value.
        self._answered_at = self.timestamp.auto
        self._probe = separate_probe()
        self._wake = threading.Event()
        self._pause_requested = threading.Event()
        self._paused = threading.Event()
        self._stop_requested = threading.Event()
        #: Held while a timestamp is taken and sent, so that a pause returns with no send under way.
        self._sending = threading.Lock()

    def reset(self) -> None:
        """Progress now: a fresh automatic timestamp, the manual one forgotten, and sent."""
        self.timestamp = Timestamp(auto=time.monotonic())
        self.send()

    def ping(self) -> None:
        """A manual heartbeat, sent at once."""
        self.timestamp.manual = time.monotonic()
        self.send()

    def send(self) -> None:
        self.monitor_process.send_timestamp(self.timestamp)

    def run(self) -> None:
        while not self._stop_requested.is_set():
            self._wake.wait(self.interval.total_seconds())
            self._wake.clear()
            if self._pause_requested.is_set():
                self._paused.set()
                while self._pause_requested.is_set() and not self._stop_requested.is_set():
                    self._observe()  # the main thread's progress while paused shows in the first timestamp after
                    self._wake.wait(self.interval.total_seconds())
                    self._wake.clear()
                self._paused.clear()
                continue
            with self._sending:
                if self._stop_requested.is_set() or self._pause_requested.is_set():
                    continue
                self._observe()
                if not self._probe.pending:
                    self._probe.schedule()  # the next question (refused: asked again next round)
                self.timestamp.auto = self._answered_at
                self.send()

    def _observe(self) -> None:
        """Note when the main thread answered the question asked (it ran bytecode since)."""
        asked = self._probe.pending
        if self._probe.answered() and asked:
            self._answered_at = time.monotonic()

    def pause_and_synchronize(self) -> None:
        """Stop sending, wait until the thread has stopped, then send a fresh timestamp (:meth:`reset`)."""
        self._pause_requested.set()
        self._wake.set()
        if self.is_alive():
            self._paused.wait()
        with self._sending:
            pass  # a send under way when the pause was asked for is over
        self.reset()

    def resume(self) -> None:
        """Send again after :meth:`pause_and_synchronize` (nothing to do if not paused).

        Raises:
            RuntimeError: the thread is not running (never started, or shut down).
        """
        if not self.is_alive():
            raise RuntimeError(f"{self.name} is not running: it cannot resume")
        self._pause_requested.clear()
        self._wake.set()
        while self._paused.is_set() and self.is_alive():
            pause(sys.getswitchinterval())

    def shutdown(self, timeout: float | None = None) -> None:
        """Pause (sending one last timestamp), stop the thread and join it; nothing to do if it is not running.

        Raises:
            InternalError: the thread did not end within ``timeout`` seconds.
        """
        if not self.is_alive():
            return
        self.pause_and_synchronize()
        self._stop_requested.set()
        self._wake.set()
        self.join(timeout)
        if self.is_alive():
            raise InternalError(f"{self.name} did not stop within {timeout} s")
