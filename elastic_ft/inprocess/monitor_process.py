"""NVIDIA's ``monitor_process`` module: the rank's monitor process, which the Wrapper forks.

It is :mod:`elastic_ft.inprocess.hangs.monitor`: the process that outlives a
frozen or dead rank, heartbeats for it, judges its hangs
(:mod:`elastic_ft.inprocess.hangs.verdicts`) and terminates it.
"""

from elastic_ft.inprocess.hangs.monitor import MonitorConfig, MonitorProcess

__all__ = ["MonitorConfig", "MonitorProcess"]
