"""Exceptions of the in-process restart :class:`~elastic_ft.inprocess.wrapper.Wrapper`.

Two families, because they end in different places:

* :class:`RestartError` and its subclasses are ordinary ``Exception`` s: a
  problem the Wrapper (or a rank assignment) reports on the rank that hit it.
  Every error of the worker side derives from it.
* :class:`RankShouldRestart` and :class:`RestartAbort` derive from
  ``BaseException`` directly, so that the ``except Exception`` handlers of
  training code let them through: the first unwinds the wrapped function so
  that it can be called again, the second ends the Wrapper.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import types
from collections.abc import Iterator

from elastic_ft.coordination.errors import (
    BarrierError,
    BarrierOverflow,
    BarrierTimeout,
    RestartError,
    TimeoutError,
)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
#: elastic_ft's own directory, with a separator: the frames whose locals :func:`release_frames` clears.
_ELASTIC_FT_DIR = os.path.join(os.path.dirname(_PACKAGE_DIR), "")


class InternalError(RestartError):
    """The Wrapper's own machinery failed; the rank leaves the job."""


class HealthCheckError(RestartError):
    """The health check failed on this rank; its ``__cause__`` is the check's exception."""


class RankDiscarded(RestartError):
    """This rank takes no further part in the job: it was terminated or discarded by the rank assignment."""


class Fenced(RestartError):
    """This rank's node announced itself on a new etcd lease since the iteration began: the others may have
    counted it out and gone on without it. Nothing it computed for the old membership may count: the
    iteration restarts, into the membership the job has now (which discards the rank if it was counted out)."""


class RankAssignmentTimeout(TimeoutError):
    """Ranks did not all publish their rank-assignment data to the store in time."""


class StateTransferError(RestartError):
    """Healing a rank's state from a peer failed: a send or receive failed or timed out, or the state
    arrived malformed or with a wrong checksum. The iteration restarts; its plan is computed afresh."""


class HealingError(RestartError):
    """``load_state_dict`` raised on the healed state (the rank's state may be half loaded), or a sender's
    ``state_dict`` raised: the rank leaves the job and the node side escalates (``ftrun`` restarts the
    workers); its ``__cause__`` is the error."""


class RestartAbort(BaseException):
    """Raised (for example by :class:`~elastic_ft.inprocess.initialize.RetryController`) to stop restarting.

    A ``BaseException`` so that it leaves the Wrapper instead of starting
    another restart iteration.
    """


class RestartLimitError(RestartAbort):
    """The Wrapper stopped restarting: a fault repeats (``max_identical_faults``) or restarts make no progress
    (``max_restarts_without_progress``). Raised alike on every rank after the same restart.

    ``fatal``: the fault repeated identically, so the job ends (a process
    restart would only repeat it; ``ftrun``'s agent does not restart the
    workers); otherwise the node side may still escalate.
    """

    def __init__(self, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


class RankShouldRestart(BaseException):
    """Raised asynchronously in the main thread to unwind the wrapped function.

    The function must let it propagate (handlers, ``finally`` blocks and
    context managers still run on the way out). The monitor thread raises
    the exception type of the iteration's :class:`RestartDelivery`, a
    subclass of this one bound to that delivery: an instance tells it when it
    is raised (created), and when one is destroyed outside this package (the
    function caught and dropped it), so that the monitor thread raises it
    again; at ``DEBUG`` level the place where that happened is logged, since
    a swallowed restart stalls the job until the exception is raised again.
    ``RankShouldRestart`` raised by hand belongs to no delivery.
    """

    #: The delivery this exception type belongs to (None: raised by hand); set on a delivery's own subclass only.
    _delivery: RestartDelivery | None = None

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        if self._delivery is not None:
            self._delivery.delivered.set()

    def __del__(self) -> None:
        if sys.is_finalizing():
            return
        frame = sys._getframe(1)
        if os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR:
            return
        if self._delivery is not None:
            self._delivery.swallowed.set()
        log = logging.getLogger("elastic_ft.inprocess.exception")
        if not log.isEnabledFor(logging.DEBUG):
            return
        locations: list[str] = []
        caller: types.FrameType | None = frame
        while caller is not None and len(locations) < 8:
            locations.append(f"{caller.f_code.co_filename}:{caller.f_lineno} in {caller.f_code.co_name}")
            caller = caller.f_back
        log.debug("RankShouldRestart suppressed at %s", " <- ".join(locations))


class RestartDelivery:
    """Where one restart's delivery to the main thread stands: an object of the iteration, which the monitor
    thread arms and the interrupt signal reads.

    ``exception_type`` is what is raised in the main thread: a scheduled
    (asynchronous) exception can only be given as a type, so the type itself
    carries the delivery, and each delivery has a subclass of
    :class:`RankShouldRestart` of its own, named like it.
    """

    def __init__(self) -> None:
        self.delivered = threading.Event()
        self.swallowed = threading.Event()
        namespace = {"_delivery": self, "__module__": __name__, "__qualname__": "RankShouldRestart"}
        self.exception_type: type[RankShouldRestart] = type("RankShouldRestart", (RankShouldRestart,), namespace)


__all__ = [
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "Fenced",
    "HealingError",
    "HealthCheckError",
    "InternalError",
    "RankAssignmentTimeout",
    "RankDiscarded",
    "RankShouldRestart",
    "RestartAbort",
    "RestartDelivery",
    "RestartError",
    "RestartLimitError",
    "StateTransferError",
    "TimeoutError",
]


def release_frames(error: BaseException) -> None:
    """Clear the locals of elastic-ft's own finished frames in ``error``'s traceback and in every exception
    chained to it.

    Those frames hold the call's store, its monitors and its state: without
    this, a caller that keeps the exception (``unittest``'s
    ``assertRaises``, a logged record, a retry loop) keeps the Wrapper's
    TCPStore listening. The user's frames keep their locals, and every
    traceback still prints in full (file, line, code).
    """
    for current in exception_chain(error):
        trace = current.__traceback__
        while trace is not None:
            frame = trace.tb_frame
            if frame.f_code.co_filename.startswith(_ELASTIC_FT_DIR):
                with contextlib.suppress(RuntimeError):  # still executing: the raise under way passes through it
                    frame.clear()
            trace = trace.tb_next


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception chained to it (causes and contexts), each once, a cycle included."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
