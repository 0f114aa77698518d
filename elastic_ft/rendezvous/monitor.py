"""The monitor: the one node that follows every rendezvous key, and writes the board the others watch.

A node becomes the monitor by creating ``rdzv/monitor`` on its lease (an
election by creation, as etcd's ``concurrency.Election``). It then follows
the whole ``rdzv/`` prefix and rewrites ``rdzv/board``, also on its lease,
each time :func:`rules.board_moved` says what the other nodes act on has
changed. Its writes are guarded by its election key's create revision, so a
monitor whose lease ran out can never overwrite its successor's board. When
its lease ends both keys go: the others see the board vanish and the next
node to look takes over (``EtcdftRendezvousHandler``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from elastic_ft.etcd.client import (
    EtcdClient,
    EtcdLeaseNotFoundError,
    EtcdRequestError,
    EtcdUnavailableError,
    key_created_at,
    key_missing,
    put_op,
)
from elastic_ft.etcd.session import Session
from elastic_ft.etcd.view import PrefixView
from elastic_ft.keys import RunKeys
from elastic_ft.rendezvous import model, rules
from elastic_ft.rendezvous.views import WholeState
from elastic_ft.runtime.waits import Backoff

log = logging.getLogger(__name__)

#: Changes closer together than this are published as one board: a burst of joins costs one rebuild
#: of the state per interval, not one per join.
_SETTLE = 0.005


class Monitor:
    """Publishes the board for ``view``'s state until :meth:`stop`, or until it loses its term.

    ``term``: the create revision of its election key. ``quiet_until()``:
    the monotonic time before which it reports no member dead.
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        limits: rules.Limits,
        node: str,
        lease: int,
        term: int,
        view: PrefixView[model.Fact, model.RendezvousState],
        quiet_until: Callable[[], float],
    ) -> None:
        self._client = client
        self._keys = keys
        self._limits = limits
        self.node = node
        self.lease = lease
        self._term = term
        self._view = view
        self._quiet_until = quiet_until
        self._stop = threading.Event()
        #: Set when the term ended: the election key is gone (lease lost) or the node stopped.
        self.ended = threading.Event()
        self.published: model.Board | None = None
        #: Notified when a board is published or the term ends (wait_published waits on it).
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="etcdft-monitor", daemon=True)

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                state, version = self._view.snapshot()
                board = rules.board(state, self._limits, self.node, quiet=time.monotonic() < self._quiet_until())
                if rules.board_moved(self.published, board) and not self._publish(board):
                    return
                self._view.wait_for_change(version, 1.0)
                self._stop.wait(_SETTLE)
        finally:
            with self._changed:
                self.ended.set()
                self._changed.notify_all()

    def _publish(self, board: model.Board) -> bool:
        """Write the board; False when this term is over."""
        backoff = Backoff()
        while not self._stop.is_set():
            try:
                outcome = self._client.txn(
                    [key_created_at(self._keys.monitor, self._term)],
                    [put_op(self._keys.board, board.to_json(), self.lease)],
                )
            except EtcdUnavailableError as exc:  # etcd away: the process's outage record logs it once
                log.debug("the rendezvous monitor cannot publish its board yet: %s", exc)
                self._stop.wait(backoff.next())
                continue
            except EtcdRequestError as exc:
                log.warning("the rendezvous monitor cannot publish its board yet: %s", exc)
                self._stop.wait(backoff.next())
                continue
            if not outcome.succeeded:
                log.warning("node %s is no longer the rendezvous monitor (its lease ended)", self.node)
                return False
            if self.published is None or self.published.open_round != board.open_round or board.dead:
                log.info("rendezvous board: round %d open, %s", board.open_round, _describe(board))
            with self._changed:
                self.published = board
                self._changed.notify_all()
            return True
        return False

    def wait_published(self, check: Callable[[model.Board], bool], timeout: float) -> bool:
        """Block until a published board passes ``check``, the term ends or ``timeout`` passes; whether the last
        published board passes it."""
        with self._changed:
            self._changed.wait_for(
                lambda: self.ended.is_set() or (self.published is not None and check(self.published)), timeout
            )
            return self.published is not None and check(self.published)

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread and self._thread.ident is not None:
            self._thread.join(5)


def _describe(board: model.Board) -> str:
    last = "no round closed yet" if board.last is None else f"round {board.last.round} has {board.last.size} node(s)"
    dead = f"; dead: {', '.join(board.dead)}" if board.dead else ""
    return f"{last}{dead}"


class MonitorSeat:
    """This node's seat as the monitor: empty, or holding the :class:`Monitor` it won by election."""

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        node: str,
        whole: WholeState,
        quiet_until: Callable[[], float],
        request_timeout: float,
    ) -> None:
        self._client = client
        self._keys = keys
        self.node = node
        self._whole = whole
        self._quiet_until = quiet_until
        self._request_timeout = request_timeout
        self.monitor: Monitor | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def held(self) -> bool:
        monitor = self.monitor
        return monitor is not None and not monitor.ended.is_set()

    def campaign(self, session: Session, limits: rules.Limits) -> None:
        """Become the monitor if there is none: create ``rdzv/monitor`` on ``session``'s lease, then follow every
        key (an expired lease marks ``session`` expired, so the next look opens a new one)."""
        with self._lock:
            if self._closed or self.held:
                return
            self._retire()
            mark = json.dumps({"node": self.node}).encode()
            try:
                outcome = self._client.txn(
                    [key_missing(self._keys.monitor)], [put_op(self._keys.monitor, mark, session.id)]
                )
            except EtcdLeaseNotFoundError:
                session.expired.set()
                return
            if not outcome.succeeded:
                return
            view = self._whole.follow()
            view.wait_for_revision(outcome.revision, self._request_timeout)
            monitor = Monitor(
                self._client, self._keys, limits, self.node, session.id, outcome.revision, view, self._quiet_until
            ).start()
            self.monitor = monitor
        log.info("node %s is the rendezvous monitor of '%s'", self.node, self._keys.run_id)
        monitor.wait_published(lambda _board: True, self._request_timeout)

    def wait_published(self, check: Callable[[model.Board], bool]) -> None:
        """While this node monitors, wait (one request timeout at most) until its board passes ``check``."""
        monitor = self.monitor
        if monitor is not None:
            monitor.wait_published(check, self._request_timeout)

    def _retire(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
            self._whole.release()

    def close(self) -> None:
        """Leave the seat for good: no campaign after this (the node's lease is about to go)."""
        with self._lock:
            self._closed = True
            self._retire()
