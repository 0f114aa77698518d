"""Finalize: bring a rank back to a restartable state after a fault.

Runs on every surviving rank after the wrapped function unwound and
``abort`` ran, before the health check: release global state, wait for
asynchronous work the function left behind. An exception from it makes this
rank leave the job (the Wrapper re-raises it there); the other ranks restart
without it.
"""

from __future__ import annotations

import abc

from elastic_ft.inprocess.state import State


class Finalize(abc.ABC):
    """Base class of the ``finalize`` argument; compose several with :class:`elastic_ft.Compose`."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Clean up after a fault; return ``state`` unchanged, raise if this rank cannot go on."""
