"""Terminate: what a rank does when it leaves the job.

Runs on a rank that leaves (terminated by the rank assignment, failed
health check or finalize, a give-up error such as ``RestartAbort``, or any
``BaseException`` out of the function), after the other ranks were told and
the iteration's connections were released, and before the Wrapper raises
the reason on this rank. Its state has ``mode`` :attr:`Mode.TERMINATED`.
What it raises is raised from the reason.
"""

from __future__ import annotations

import abc

from elastic_ft.inprocess.state import State


class Terminate(abc.ABC):
    """Base class of the ``terminate`` argument; compose several with :class:`elastic_ft.Compose`."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Clean up this rank before it leaves; return ``state`` unchanged."""
