"""The one log format of elastic-ft's processes: the agent, the rendezvous and the Wrapper.

torch's own line layout (level letter, month and day, time, pid, source,
``]``), so one job's log reads as one stream with torchrun's lines, plus
where the line comes from: ``[node <id>]`` on the node side, ``[rank <initial
rank>]`` in a worker. For example::

    W1124 08:02:11.204 41250 elastic_ft.launcher.agent] [node host_41250_a1b2c3] rank 3 (pid 41377) ended ...
    W1124 08:02:12.011 41371 elastic_ft.inprocess.monitor_thread] [rank 0] iteration 0 restarts (4 rank(s)): ...
"""

from __future__ import annotations

import logging

FORMAT = "%(levelname).1s%(asctime)s.%(msecs)03d %(process)d %(name)s] %(where)s%(message)s"
DATE_FORMAT = "%m%d %H:%M:%S"

_where = ""


def set_where(text: str) -> None:
    """Name what this process is in every line it logs (``node <id>``, ``rank 3``); empty: nothing."""
    global _where
    _where = f"[{text}] " if text else ""


class Formatter(logging.Formatter):
    """:data:`FORMAT`, with this process's place (:func:`set_where`)."""

    def __init__(self) -> None:
        super().__init__(FORMAT, DATE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.where = _where
        return super().format(record)


def formatter() -> Formatter:
    return Formatter()
