"""NVIDIA's ProgressWatchdog API (timestamp_watchdog): what its timestamps say of the main thread, and its pauses."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from elastic_ft.inprocess import progress_watchdog
from elastic_ft.inprocess.compat.timestamp_watchdog import ProgressWatchdog, Timestamp


class Collected:
    def __init__(self) -> None:
        self.timestamps: list[Timestamp] = []
        self.lock = threading.Lock()

    def send_timestamp(self, timestamp: Timestamp) -> None:
        with self.lock:
            self.timestamps.append(Timestamp(timestamp.auto, timestamp.manual))

    def latest(self) -> Timestamp:
        with self.lock:
            return self.timestamps[-1]


def test_nvidias_module_path_serves_the_class() -> None:
    assert progress_watchdog.ProgressWatchdog is ProgressWatchdog
    assert progress_watchdog.Timestamp is Timestamp


def test_the_automatic_timestamp_stops_while_the_main_thread_is_blocked_in_c_code() -> None:
    collected = Collected()
    watchdog = ProgressWatchdog(3, collected, timedelta(milliseconds=5))
    assert watchdog.name == "ProgressWatchdog-3"
    watchdog.start()
    try:
        for _ in range(20):
            time.sleep(0.005)  # bytecode between the sleeps: progress
        before = time.monotonic()
        time.sleep(0.4)  # one C call: no bytecode for 0.4 s
        during = collected.latest()
        assert during.auto is not None and during.auto <= before + 0.02
        assert during.is_timed_out(timedelta(seconds=0.3))
        for _ in range(20):
            time.sleep(0.005)
        assert collected.latest().auto > before + 0.4
    finally:
        watchdog.shutdown()


def test_a_ping_sends_a_manual_timestamp_at_once() -> None:
    collected = Collected()
    watchdog = ProgressWatchdog(0, collected, timedelta(seconds=10))
    watchdog.start()
    try:
        at = time.monotonic()
        watchdog.ping()
        assert collected.latest().manual is not None and collected.latest().manual >= at
    finally:
        watchdog.shutdown()


def test_a_pause_takes_effect_while_the_main_thread_is_blocked_in_c_code() -> None:
    """NVIDIA's pause waits for the main thread to run its pending calls; here it does not need to."""
    collected = Collected()
    watchdog = ProgressWatchdog(0, collected, timedelta(milliseconds=2))
    watchdog.start()
    paused_in: list[float] = []

    def pause() -> None:
        started = time.monotonic()
        watchdog.pause_and_synchronize()
        paused_in.append(time.monotonic() - started)

    pauser = threading.Thread(target=pause)
    time.sleep(0.02)
    pauser.start()
    time.sleep(0.5)  # blocked in C while the other thread pauses the watchdog
    pauser.join(5)
    assert paused_in and paused_in[0] < 0.4
    count = len(collected.timestamps)
    time.sleep(0.05)
    assert len(collected.timestamps) == count  # paused: nothing sent
    watchdog.resume()
    time.sleep(0.05)
    assert len(collected.timestamps) > count
    watchdog.shutdown()


def test_a_stopped_watchdog_cannot_resume_and_bad_arguments_are_clear_errors() -> None:
    watchdog = ProgressWatchdog(0, Collected(), timedelta(milliseconds=1))
    watchdog.start()
    watchdog.shutdown()
    watchdog.shutdown()  # a second shutdown does nothing
    with pytest.raises(RuntimeError, match="ProgressWatchdog-0 is not running"):
        watchdog.resume()
    with pytest.raises(ValueError, match="positive datetime.timedelta, got 0.005"):
        ProgressWatchdog(0, Collected(), 0.005)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a connection with send_timestamp"):
        ProgressWatchdog(0, object(), timedelta(seconds=1))  # type: ignore[arg-type]
