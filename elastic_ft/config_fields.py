"""The value types every elastic-ft setting is made of: one check, one bound, one message per kind of value.

The job config (:mod:`elastic_ft.job_config`, YAML) and the rendezvous
settings (:mod:`elastic_ft.rendezvous.config`, ``--rdzv-conf`` text) are
pydantic models built from these types, so a count, a duration or an
event-log size is checked the same way wherever it is set. The two differ
only in where values come from: YAML gives numbers as numbers, so quoted
text there is a mistake, while ``--rdzv-conf`` gives every value as text.
Validating with ``context=TEXT`` lets text through.

A failed check raises a :class:`~pydantic_core.PydanticCustomError` of type
``config_field`` whose context holds ``problem`` ("is invalid", "is not a
number", ...) and ``expected``; each config renders it in its own voice
(``rendezvous.lease_ttl=1.5 is invalid; expected ...`` for the job config,
``rdzv conf lease_ttl='1.5' is not whole; expected ...`` for ``--rdzv-conf``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationInfo
from pydantic_core import PydanticCustomError

from elastic_ft.timeouts import MAX_SECONDS, SecondsError, check_seconds

#: The largest count any field may hold (nodes, processes, ranks, restarts): far beyond any job.
MAX_COUNT = 1_000_000
#: The most events the run's event log keeps per stream (etcd/event_log.py's bound).
MAX_EVENTS_KEPT = 100_000
#: The validation context of settings given as text (``--rdzv-conf``): numbers may be spelled out.
TEXT: dict[str, Any] = {"text": True}
#: The pydantic error type of every check here.
ERROR_TYPE = "config_field"


def shown(value: Any) -> str:
    """``repr(value)``, cut to 200 characters (a value may be huge: an integer of thousands of digits)."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + f"... ({len(text)} characters)"


def invalid(expected: str, problem: str = "is invalid") -> PydanticCustomError:
    """The error of a value that fails its check; ``expected`` without its leading "expected "."""
    return PydanticCustomError(ERROR_TYPE, "{problem}; expected {expected}", {"problem": problem, "expected": expected})


def _as_text_allowed(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("text"))


def count_check(minimum: int, maximum: int = MAX_COUNT) -> Callable[[Any, ValidationInfo], int]:
    """Whole numbers from ``minimum`` to ``maximum``: ints, integral floats (JSON's 2.0), and digits when text is allowed."""

    def check(value: Any, info: ValidationInfo) -> int:
        if isinstance(value, str) and _as_text_allowed(info):
            text = value.strip()
            value = int(text) if text.isascii() and text.isdigit() and len(text) <= len(str(maximum)) else value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise invalid(f"an integer from {minimum} to {maximum}")
        return value

    return check


def seconds_check(may_be_zero: bool) -> Callable[[Any, ValidationInfo], float]:
    """A duration in seconds (:func:`~elastic_ft.timeouts.check_seconds`)."""

    def check(value: Any, info: ValidationInfo) -> float:
        if isinstance(value, str) and not _as_text_allowed(info):
            raise invalid("a number of seconds")
        try:
            return check_seconds(value, may_be_zero=may_be_zero)
        except SecondsError as error:
            raise invalid(error.expected.removeprefix("expected "), error.problem) from None

    return check


def _whole_seconds_check(value: Any, info: ValidationInfo) -> int:
    seconds = seconds_check(False)(value, info)
    if not seconds.is_integer():
        raise invalid("whole seconds (etcd leases)", "is not whole")
    return int(seconds)


#: A count of 0 or more (restarts, spares) and of 1 or more (nodes, processes, ranks).
Count0 = Annotated[int, Field(ge=0, le=MAX_COUNT), BeforeValidator(count_check(0))]
Count1 = Annotated[int, Field(ge=1, le=MAX_COUNT), BeforeValidator(count_check(1))]
#: A duration: more than 0 s, or 0 s and more; at most :data:`~elastic_ft.timeouts.MAX_SECONDS` either way.
Seconds = Annotated[float, Field(gt=0.0, le=MAX_SECONDS), BeforeValidator(seconds_check(False))]
SecondsOrZero = Annotated[float, Field(ge=0.0, le=MAX_SECONDS), BeforeValidator(seconds_check(True))]
#: An etcd lease's time to live: whole seconds.
LeaseSeconds = Annotated[int, Field(gt=0, le=int(MAX_SECONDS)), BeforeValidator(_whole_seconds_check)]
#: How many events the run's event log in etcd keeps.
EventsKept = Annotated[int, Field(ge=1, le=MAX_EVENTS_KEPT), BeforeValidator(count_check(1, MAX_EVENTS_KEPT))]

#: Defaults and meanings shared by the job config and ``--rdzv-conf``.
JOIN_TIMEOUT_HELP = "seconds next_rendezvous() may take before it raises RendezvousTimeoutError"
LAST_CALL_TIMEOUT_HELP = "seconds to wait for more nodes once min_nodes have joined"
LEASE_TTL_HELP = "whole seconds a node stays in the rendezvous after its agent stops refreshing its lease"
EVENTS_KEPT_HELP = "events the run's event log in etcd keeps; the oldest are overwritten (1 to 100000)"
EVENTS_KEPT_DEFAULT = 4096
