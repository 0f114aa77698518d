"""The errors of the coordination protocol, and the root of the worker side's error family.

They live here, beside the protocol both sides share, so that the node side
(``ftrun``'s agent) reports to the store without importing the worker side;
:mod:`elastic_ft.inprocess.exception` exports them under their public names.
"""

from __future__ import annotations

import builtins


class RestartError(Exception):
    """Base class of the errors the Wrapper raises on the rank where they happen."""


class TimeoutError(RestartError, builtins.TimeoutError):
    """Something the Wrapper or one of its hooks waited for did not happen in time."""


class BarrierError(RestartError):
    """A Wrapper barrier failed."""


class BarrierTimeout(BarrierError, TimeoutError):
    """Not every rank reached a Wrapper barrier within its timeout."""


class BarrierOverflow(BarrierError):
    """More ranks arrived at a Wrapper barrier than it was built for."""
