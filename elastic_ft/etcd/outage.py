"""etcd away is not a fault: how a process waits for etcd, and how it records each outage once.

etcd is the job's coordination service, not its data path: the ranks train
over their own connections while etcd is frozen, restarted, or without a
quorum, as Kubernetes' kubelets keep their pods running while the API server
is away. So a caller that needs etcd and finds it unreachable does not fail:

* it waits, retrying with capped exponential backoff and jitter
  (:class:`~elastic_ft.runtime.waits.Backoff`), for as long as its own bound allows, and no longer:
  a bound the user set (a join's ``join_timeout``, a restart's
  ``barrier_timeout``, a store's timeout) is set around the wait with
  :func:`bounded`, and every etcd request inside it is capped by what is left
  of it (:func:`time_left`); with no bound it waits for as long as the job
  runs (:func:`patiently`);
* the process records the outage once (:data:`OUTAGES`): one warning when
  etcd stops answering, one when it answers again with how long it was away,
  and the ``etcd_unavailable`` / ``etcd_available`` events that the metrics,
  ``elastic-ft status`` and the timeline show.

The etcd client feeds :data:`OUTAGES` from every request and stream; nothing
else needs to log an outage.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from elastic_ft.etcd.kv import EtcdUnavailableError
from elastic_ft.runtime.waits import Backoff

log = logging.getLogger(__name__)

T = TypeVar("T")

# ---- bounds -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bound:
    """A wait's deadline (``time.monotonic()``) and what the user calls it, for the error that ends it."""

    deadline: float
    what: str


_BOUND: contextvars.ContextVar[Bound | None] = contextvars.ContextVar("elastic_ft_etcd_bound", default=None)


@contextlib.contextmanager
def bounded(seconds: float | None, what: str) -> Iterator[Bound | None]:
    """Within this block (of this thread), every etcd wait ends by ``seconds`` from now, or earlier under an
    enclosing bound; ``None`` adds no bound."""
    if seconds is None:
        yield _BOUND.get()
        return
    outer = _BOUND.get()
    bound = Bound(time.monotonic() + seconds, what)
    if outer is not None and outer.deadline <= bound.deadline:
        bound = outer
    token = _BOUND.set(bound)
    try:
        yield bound
    finally:
        _BOUND.reset(token)


@contextlib.contextmanager
def grace(seconds: float, what: str) -> Iterator[Bound]:
    """Within this block, etcd waits end ``seconds`` from now, whatever bound encloses it: for the last read a
    wait makes once its own bound ended (what its error says)."""
    bound = Bound(time.monotonic() + seconds, what)
    token = _BOUND.set(bound)
    try:
        yield bound
    finally:
        _BOUND.reset(token)


def current_bound() -> Bound | None:
    return _BOUND.get()


def time_left(default: float) -> float:
    """What a request may take: ``default``, or less when the enclosing bound ends sooner (never below 0)."""
    bound = _BOUND.get()
    if bound is None:
        return default
    return max(0.0, min(default, bound.deadline - time.monotonic()))


def patiently(call: Callable[[], T], what: str, *, seconds: float | None = None) -> T:
    """``call()``, retried with backoff while etcd is unreachable, until ``seconds`` pass (``None``: for as long as
    it takes) or the enclosing bound ends.

    Raises:
        EtcdUnavailableError: etcd did not answer within the bound; the message
            names the bound and how long etcd was away.
    """
    started = time.monotonic()
    with bounded(seconds, what) as bound:
        backoff = Backoff()
        while True:
            try:
                return call()
            except EtcdUnavailableError as error:
                if bound is None:
                    backoff.pause()
                    continue
                left = bound.deadline - time.monotonic()
                if left <= 0:
                    raise EtcdUnavailableError(
                        f"{what}: etcd was unreachable for the last {time.monotonic() - started:.1f} s, and "
                        f"{bound.what} ended: {error}"
                    ) from error
                backoff.pause(left)


# ---- one record of each outage, per process ---------------------------------------------------------------


@dataclasses.dataclass
class _Outage:
    since: float  # time.monotonic()
    since_wall: float
    reason: str
    failures: int = 1


class Outages:
    """The etcd outages this process has seen, per cluster (its endpoints as the client names them).

    An outage starts with the first request or stream that etcd did not
    answer, and ends with the next answer. Each start and end is logged and
    emitted once, however many threads and requests meet it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._current: dict[str, _Outage] = {}
        #: When the last outage of any cluster ended (``clock()``, and wall time), None if none has.
        self.last_ended: float | None = None
        self.last_ended_wall: float | None = None
        #: Outages seen so far, and their total length in seconds (ended ones).
        self.count = 0
        self.seconds = 0.0

    def failed(self, endpoints: str, error: object) -> None:
        """A request to the cluster at ``endpoints`` got no answer (``error``: why)."""
        with self._lock:
            outage = self._current.get(endpoints)
            if outage is not None:
                outage.failures += 1
                return
            outage = _Outage(self._clock(), self._wall(), f"{error}"[:300])
            self._current[endpoints] = outage
            self.count += 1
        log.warning(
            "etcd at %s is unreachable (%s); waiting for it with backoff, training goes on", endpoints, outage.reason
        )
        _emit("etcd_unavailable", endpoints=endpoints, reason=outage.reason, at=outage.since_wall)

    def answered(self, endpoints: str) -> None:
        """The cluster at ``endpoints`` answered a request."""
        if endpoints not in self._current:  # the common case: no lock, nothing to do
            return
        with self._lock:
            outage = self._current.pop(endpoints, None)
            if outage is None:
                return
            now = self._clock()
            seconds = now - outage.since
            self.last_ended, self.last_ended_wall, self.seconds = now, self._wall(), self.seconds + seconds
        log.warning(
            "etcd at %s answers again after %.1f s away (%d request(s) retried)", endpoints, seconds, outage.failures
        )
        _emit("etcd_available", endpoints=endpoints, seconds=round(seconds, 3), since=outage.since_wall)

    def down_since(self) -> float | None:
        """Since when (``clock()``) some cluster has not answered; None while every one answers."""
        with self._lock:
            return min((o.since for o in self._current.values()), default=None)


def _emit(name: str, **fields: object) -> None:
    from elastic_ft.observability import sink

    sink.emit(name, **fields)


#: This process's record of etcd's outages (every :class:`~elastic_ft.etcd.client.EtcdClient` reports to it).
OUTAGES = Outages()
