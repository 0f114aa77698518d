"""NVIDIA's ``monitor_thread`` module: the thread that turns a fault anywhere into a restart here, and the helpers
that raise an exception in another thread.

The thread is :mod:`elastic_ft.inprocess.delivery.watcher` (the Wrapper
builds it); the raising helpers are :mod:`elastic_ft.inprocess.delivery.interrupt`.
"""

from elastic_ft.inprocess.delivery.interrupt import (
    InterruptSignal,
    async_abort_main_thread,
    async_raise,
    delayed_async_raise,
    reraise_if_unraisable,
)
from elastic_ft.inprocess.delivery.watcher import MonitorThread
from elastic_ft.inprocess.exception import RankShouldRestart

__all__ = [
    "InterruptSignal",
    "MonitorThread",
    "RankShouldRestart",
    "async_abort_main_thread",
    "async_raise",
    "delayed_async_raise",
    "reraise_if_unraisable",
]
