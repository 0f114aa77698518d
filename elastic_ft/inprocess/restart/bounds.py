"""How long the Wrapper's store calls wait for an unreachable store (etcd away), and what ends the wait.

etcd away is not a fault (:mod:`elastic_ft.etcd.outage`): a store call
waits for it within the bound its caller sets. The Wrapper's bounds are the
user's ``barrier_timeout``: a restart's writes give up with a
``BarrierTimeout`` that says the store did not answer; a rank's last
records (it leaves the job) are left unwritten with a warning; a poll
treats a store that does not answer as "not yet".
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from elastic_ft.coordination.errors import BarrierTimeout
from elastic_ft.etcd.outage import bounded
from elastic_ft.inprocess.restart.logs import get_logger

log = get_logger("wrapper")


@contextmanager
def restart_bound(barrier_timeout: datetime.timedelta) -> Iterator[None]:
    """A restart's store writes wait for an unreachable store within ``barrier_timeout``, the user's bound on a
    restart, and then raise ``BarrierTimeout`` saying the store did not answer."""
    seconds = barrier_timeout.total_seconds()
    try:
        with bounded(seconds, f"barrier_timeout ({seconds:g} s)"):
            yield
    except ConnectionError as error:
        raise BarrierTimeout(f"the store did not answer within barrier_timeout: {error}") from error


@contextmanager
def leaving_bound(barrier_timeout: datetime.timedelta, rank: int | None, what: str) -> Iterator[None]:
    """The rank leaves: ``what`` waits for an unreachable store within ``barrier_timeout``, then the rank leaves
    without it (what it returns or raises is the caller's, not the store's)."""
    seconds = barrier_timeout.total_seconds()
    try:
        with bounded(seconds, f"barrier_timeout ({seconds:g} s)"):
            yield
    except ConnectionError as error:
        log.warning("rank %s leaves without %s: the store did not answer: %s", rank, what, error)


def unless_unreachable(predicate: Callable[[], bool]) -> Callable[[], bool]:
    """``predicate``, false while the store does not answer (etcd away): the poll waits on, within its own bound."""

    def look() -> bool:
        try:
            return predicate()
        except ConnectionError:
            return False

    return look
