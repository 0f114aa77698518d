"""Completion: what a rank does once the Wrapper completed.

Runs on every rank that is still in the job after the last iteration
completed (active and reserve ranks alike), with the final state. It cannot
change the outcome: what it raises is logged, and the Wrapper still
returns the function's result.
"""

from __future__ import annotations

import abc

from elastic_ft.inprocess.state import State


class Completion(abc.ABC):
    """Base class of the ``completion`` argument; compose several with :class:`elastic_ft.Compose`."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Act on the completed job; return ``state`` unchanged."""
