"""Tools for rehearsing faults: :mod:`.inject_fault` (NVIDIA inprocess 0.4.1's ``inprocess.tools``)."""

from elastic_ft.inprocess.tools import inject_fault

__all__ = ["inject_fault"]
