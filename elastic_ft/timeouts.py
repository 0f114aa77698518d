"""Durations: the Wrapper's timeout table and the one check of a number of seconds.

The in-process ``Wrapper`` and the job config both need the Wrapper's
durations, their defaults and the orderings between them; this module holds
them, importing neither side, so neither imports the other.
:func:`check_seconds` is the single validator of a duration given in
seconds, wrapped by each caller in its own error type.
"""

from __future__ import annotations

import math
from typing import Any

#: The Wrapper's durations and their defaults, in seconds.
WRAPPER_DEFAULTS: dict[str, float] = {
    "monitor_thread_interval": 0.05,
    "monitor_process_interval": 0.1,
    "progress_watchdog_interval": 0.1,
    "heartbeat_interval": 1.0,
    "heartbeat_timeout": 30.0,
    "soft_timeout": 60.0,
    "hard_timeout": 90.0,
    "barrier_timeout": 120.0,
    "completion_timeout": 120.0,
    "last_call_wait": 0.02,
    "termination_grace_time": 5.0,
}
#: The longest duration any setting may take: 30 days. Longer values are
#: mistakes, and some overflow later (a gRPC deadline, a monotonic clock
#: plus the timeout, an etcd lease), after a job has already written to etcd.
MAX_SECONDS = 30 * 24 * 3600.0

#: The only Wrapper durations that may be zero; the others must be positive.
MAY_BE_ZERO = ("last_call_wait", "termination_grace_time")
#: Pairs (shorter, longer) of Wrapper durations that must be strictly ordered.
WRAPPER_ORDER = (
    ("soft_timeout", "hard_timeout"),
    ("hard_timeout", "barrier_timeout"),
    ("heartbeat_interval", "heartbeat_timeout"),
    ("heartbeat_timeout", "barrier_timeout"),
    ("monitor_process_interval", "heartbeat_timeout"),
    ("monitor_process_interval", "soft_timeout"),
    ("monitor_thread_interval", "soft_timeout"),
    ("progress_watchdog_interval", "soft_timeout"),
)


class SecondsError(ValueError):
    """A value that is not a valid number of seconds; its text completes "<name>=<value> ..."."""

    def __init__(self, problem: str, expected: str) -> None:
        super().__init__(f"{problem}; {expected}")
        self.problem = problem
        self.expected = expected


def check_seconds(value: Any, *, may_be_zero: bool) -> float:
    """``value`` as a number of seconds, positive (or zero when allowed), at most :data:`MAX_SECONDS`.

    Accepts numbers and numeric strings (``--rdzv-conf`` values arrive as
    text); rejects booleans.

    Raises:
        SecondsError: e.g. "is out of range; expected seconds > 0".
    """
    expected = f"expected seconds {'>= 0' if may_be_zero else '> 0'} and <= {MAX_SECONDS:.0f} (30 days)"
    try:
        if isinstance(value, bool):
            raise TypeError
        seconds = float(value)
    except (TypeError, ValueError):
        raise SecondsError("is not a number", expected) from None
    except OverflowError:  # an integer beyond any float
        raise SecondsError("is out of range", expected) from None
    if not math.isfinite(seconds):
        raise SecondsError("is not finite", expected)
    if seconds < 0 or (seconds == 0 and not may_be_zero) or seconds > MAX_SECONDS:
        raise SecondsError("is out of range", expected)
    return seconds
