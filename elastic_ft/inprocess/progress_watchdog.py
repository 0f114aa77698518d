"""NVIDIA's ``progress_watchdog`` module: its ``ProgressWatchdog`` and ``Timestamp``, and the Wrapper's own heartbeat.

NVIDIA's API (a thread sending the main thread's progress timestamps to a
connection) is :mod:`elastic_ft.inprocess.compat.timestamp_watchdog`; the
Wrapper's heartbeat, which shares its timestamps with the monitor process
through memory, is :mod:`elastic_ft.inprocess.hangs.heartbeats`.
"""

from elastic_ft.inprocess.compat.timestamp_watchdog import ProgressWatchdog, Timestamp, TimestampConnection
from elastic_ft.inprocess.hangs.heartbeats import HeartbeatWatchdog, ProgressTimestamps, StepClock, progress_age

__all__ = [
    "HeartbeatWatchdog",
    "ProgressTimestamps",
    "ProgressWatchdog",
    "StepClock",
    "Timestamp",
    "TimestampConnection",
    "progress_age",
]
