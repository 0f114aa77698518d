"""NVIDIA ``nvidia_resiliency_ext.shared_utils``'s names that in-process restart users need.

* :mod:`.inject_fault`: fault injection for rehearsing recoveries;
* :mod:`.wait_daemon`: ``python -m elastic_ft.shared_utils.wait_daemon PIDFILE``,
  waiting for the monitor processes a Slurm step would otherwise end early.
"""
