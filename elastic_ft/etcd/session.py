"""Sessions: etcd leases, all of a client's kept alive over one long-lived stream.

As etcd's Go ``concurrency.Session``: everything a node keeps alive hangs on
its session's lease, refreshed every ``ttl / 3`` seconds. As etcd's Go
lessor, the sessions of one :class:`EtcdClient` share one keep-alive stream
and one thread (:class:`_Lessor`; one per :data:`LEASES_PER_STREAM` leases):
a process that simulates a thousand nodes costs etcd 16 streams, not a
thousand, and itself 48 threads, not three thousand. A stream is reopened,
on another endpoint if need be, only when it breaks or stops answering.

A session is *lost* (:attr:`Session.expired`) when etcd reports its lease
gone: a refresh answered with no TTL left. Silence is not a loss: etcd keeps
a lease through a restart, a leader change and a quorum lost and regained
(each new leader extends every lease by its TTL), and drops it after a
freeze longer than the TTL (measured on etcd 3.4 and 3.5,
``tests/etcd/test_lease_outages.py``). So while etcd is silent the session
keeps refreshing, and only says until when the lease is *proven* alive
(:meth:`Session.valid_until`): what the node's workers may rely on. Whether
the lease outlived the outage is etcd's answer once it is back.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
import weakref

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.kv import EtcdRequestError, EtcdUnavailableError
from elastic_ft.etcd.outage import OUTAGES
from elastic_ft.etcd.watch import KeepAliveStream
from elastic_ft.runtime.waits import pause

log = logging.getLogger(__name__)

_RETRY_PAUSE = 0.1

#: Leases one keep-alive stream carries. etcd answers a stream's refreshes one after another (a follower
#: forwards each to the leader), so one stream renews a few hundred leases a second at best: a process that
#: holds many leases (the scale benchmark's simulated nodes) gets a stream per this many.
LEASES_PER_STREAM = 64


class Session:
    """Grants a lease of ``ttl`` seconds and keeps it alive until :meth:`close`.

    Raises (from the constructor) what :meth:`EtcdClient.grant_lease` raises.
    """

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        self._client = client
        asked = time.monotonic()
        self.id, self.ttl = client.grant_lease(ttl)
        #: When the lease was last proven alive from etcd's side: the send time of the last answered
        #: refresh (etcd restarted its TTL no earlier), or of the grant.
        self.proven_at = asked
        self.expired = threading.Event()
        #: Seconds between refreshes.
        self.interval = max(0.1, self.ttl / 3)
        self.last_refresh = time.monotonic()
        self.next_refresh = self.last_refresh + self.interval
        #: When each refresh still unanswered was sent, oldest first (etcd answers a stream's in order).
        self.pending: collections.deque[float] = collections.deque()
        #: Notified at every answer about the lease (refreshed, or gone).
        self.answered = threading.Condition()
        self._lessor = _Lessor.of(client)
        self._lessor.add(self)

    def valid_until(self) -> float:
        """Until when (``time.monotonic()``) etcd cannot have dropped the lease; 0 once it is lost.

        What the node's workers check before committing a step (``elastic_ft.runtime.local_board``).
        """
        return 0.0 if self.expired.is_set() else self.proven_at + self.ttl

    def refresh_soon(self) -> None:
        """Send the next refresh now (its answer proves the lease alive, or lost, from now on)."""
        self._lessor.refresh_now(self)

    def prove(self, since: float, timeout: float) -> bool | None:
        """Whether the lease is alive at some time after ``since`` (``time.monotonic()``), as etcd answers a
        refresh sent now: True, False once it is lost, None when no answer came within ``timeout``."""
        deadline = time.monotonic() + timeout
        self._lessor.refresh_now(self)
        with self.answered:
            while not (self.expired.is_set() or self.proven_at >= since):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.answered.wait(left)
        return not self.expired.is_set()

    def mark_lost(self, why: str) -> None:
        silent = time.monotonic() - self.last_refresh
        log.warning("etcd lease %x lost (%s; last refreshed %.1f s ago, TTL %d s)", self.id, why, silent, self.ttl)
        self.expired.set()
        with self.answered:
            self.answered.notify_all()

    def close(self, *, revoke: bool) -> None:
        """Stop refreshing; with ``revoke``, delete the lease and every key on it at once."""
        self._lessor.remove(self)
        if revoke and not self.expired.is_set():
            self._client.revoke_lease(self.id)


class _Lessor:
    """Refreshes up to :data:`LEASES_PER_STREAM` sessions of one client over one keep-alive stream, from one
    thread.

    Refreshes due within a quarter of a session's interval go out together,
    so sessions granted at different times settle into few wake-ups. A
    refresh unanswered for ``request_timeout`` (a frozen member) counts as a
    broken stream: it is closed, its endpoint avoided, and every session
    refreshed on the next one at once.
    """

    @classmethod
    def of(cls, client: EtcdClient) -> _Lessor:
        """A lessor of ``client`` with room for one more session."""
        with _LESSORS_LOCK:
            lessors = _LESSORS.setdefault(client, [])
            for lessor in lessors:
                if lessor.size() < LEASES_PER_STREAM:
                    return lessor
            lessor = cls(client)
            lessors.append(lessor)
            return lessor

    def size(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._sessions: dict[int, Session] = {}
        self._thread: threading.Thread | None = None
        self._broken: Exception | None = None
        self._opened = 0  # streams opened so far: tells the current one's end from a replaced one's
        #: Since when streams keep breaking with no answer in between (None: the last one answered), and how
        #: many broke: the first break is logged, then one line when an answer comes again.
        self._failing_since: float | None = None
        self._breaks = 0

    def add(self, session: Session) -> None:
        with self._lock:
            self._sessions[session.id] = session
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="etcd-session", daemon=True)
                self._thread.start()
        self._wake.set()

    def remove(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)
        self._wake.set()

    def refresh_now(self, session: Session) -> None:
        """Send ``session``'s next refresh at once."""
        with self._lock:
            if session.id in self._sessions:
                session.next_refresh = time.monotonic() - session.interval
        self._wake.set()

    def _on_answer(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            session = self._sessions.get(lease_id)
            if session is None:
                return
            failing_since, breaks = self._failing_since, self._breaks
            self._failing_since, self._breaks = None, 0
            sent = session.pending.popleft() if session.pending else None
            if ttl <= 0:
                del self._sessions[lease_id]
            else:
                if sent is not None:  # etcd restarted the TTL no earlier than this refresh was sent
                    session.proven_at = max(session.proven_at, sent)
                session.last_refresh = time.monotonic()
        OUTAGES.answered(self._client.describe_endpoints())
        if failing_since is not None:
            log.debug(
                "etcd keep-alive answered again, after %.1f s and %d broken stream(s)",
                time.monotonic() - failing_since,
                breaks,
            )
        if ttl <= 0:
            session.mark_lost("etcd reports it expired")
        else:
            with session.answered:
                session.answered.notify_all()

    def _note_break(self, endpoint: object, why: object) -> None:
        """A stream broke or went silent: the process's outage record says so once; each reopen is debug."""
        with self._lock:
            if self._failing_since is None:
                self._failing_since = time.monotonic()
            self._breaks += 1
        OUTAGES.failed(self._client.describe_endpoints(), f"keep-alive: {why}")
        log.debug("etcd keep-alive stream to %s: %s; reopening", endpoint, why)

    def _on_end(self, opened: int, error: Exception) -> None:
        with self._lock:
            if opened == self._opened:  # not a stream already replaced
                self._broken = error
        self._wake.set()

    def _run(self) -> None:
        stream: KeepAliveStream | None = None
        try:
            while True:
                self._wake.clear()
                now = time.monotonic()
                with self._lock:
                    if not self._sessions:
                        self._thread = None
                        return
                    sessions = list(self._sessions.values())
                    broken, self._broken = self._broken, None
                live = sessions  # silence loses no lease: etcd's answer does (the module docstring)
                late = [s for s in live if s.pending and now - s.pending[0] >= self._client.request_timeout]
                if stream is not None and (broken is not None or late):
                    self._note_break(stream.endpoint, broken or f"no answer within {self._client.request_timeout:g} s")
                    stream.close()
                    self._client.avoid(stream.endpoint)
                    stream = None
                    pause(_RETRY_PAUSE)  # a member that refuses at once is not retried in a busy loop
                    now = time.monotonic()
                if stream is None:
                    try:
                        with self._lock:
                            self._opened += 1
                            opened = self._opened
                        stream = self._client.keep_alive_stream(
                            self._on_answer, functools.partial(self._on_end, opened)
                        )
                    except (EtcdUnavailableError, EtcdRequestError) as exc:
                        self._note_break("etcd", f"cannot open one yet: {exc}")
                        self._wake.wait(_RETRY_PAUSE)
                        continue
                    with self._lock:
                        for session in live:  # what was sent on the old stream is lost with it
                            session.next_refresh = now
                            session.pending.clear()
                with self._lock:
                    for session in live:
                        if session.next_refresh - now <= session.interval / 4:
                            session.pending.append(now)
                            session.next_refresh = now + session.interval
                            stream.send(session.id)
                    timeout = self._client.request_timeout
                    wake_at = min(
                        (min(s.next_refresh, s.pending[0] + timeout if s.pending else s.next_refresh) for s in live),
                        default=now,
                    )
                self._wake.wait(max(0.0, wake_at - time.monotonic()))
        finally:
            if stream is not None:
                stream.close()


_LESSORS: weakref.WeakKeyDictionary[EtcdClient, list[_Lessor]] = weakref.WeakKeyDictionary()
_LESSORS_LOCK = threading.Lock()
