"""A local, watch-fed copy of the rendezvous keys, and the node's lease.

:class:`KeyView` lists ``<run>/rdzv/`` once and then follows etcd's watch
stream, so questions torch's agent asks many times a second
(``num_nodes_waiting()``, ``is_closed()``) are answered from memory with no
request.  If the stream breaks, it lists again and resumes (the informer
pattern).  :class:`LeaseKeeper` holds the node's lease and refreshes it from a
daemon thread.
"""

from __future__ import annotations

import logging
import threading
import time

from elastic_ft.etcd_client import EtcdClient, EtcdRequestError, EtcdUnavailableError, EtcdWatch, WatchEvent
from elastic_ft.rendezvous.state import Fact, RawKey, RendezvousState, build_state, parse_key

log = logging.getLogger(__name__)


class KeyView:
    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._cond = threading.Condition()
        self._facts: dict[str, Fact] = {}
        self._revision = 0
        self._version = 0
        self._state: RendezvousState | None = None
        self._watch: EtcdWatch | None = None
        self._stopped = False
        self._broken_since: float | None = None
        self._resync()

    def _resync(self) -> None:
        kvs, revision = self._client.get_prefix(self._prefix)
        with self._cond:
            if self._stopped:
                return
            self._facts = {}
            for kv in kvs:
                self._apply(kv.key[len(self._prefix) :], RawKey(kv.value, kv.lease, kv.create_revision))
            self._revision = revision
            self._broken_since = None
            self._changed()
            self._watch = self._client.watch_prefix(self._prefix, revision + 1, self._on_events, self._on_error)

    def _apply(self, key: str, raw: RawKey | None) -> None:
        fact = parse_key(key, raw) if raw is not None else None
        if fact is None:
            self._facts.pop(key, None)
        else:
            self._facts[key] = fact

    def _changed(self) -> None:
        self._version += 1
        self._state = None
        self._cond.notify_all()

    def _on_events(self, events: list[WatchEvent], revision: int) -> None:
        with self._cond:
            for event in events:
                key = event.kv.key[len(self._prefix) :]
                raw = None if event.deleted else RawKey(event.kv.value, event.kv.lease, event.kv.create_revision)
                self._apply(key, raw)
            self._revision = max(self._revision, revision)
            self._changed()

    def _on_error(self, error: Exception) -> None:
        with self._cond:
            if self._stopped:
                return
            self._broken_since = time.monotonic()
            self._cond.notify_all()
        log.warning("rendezvous watch on %s broke (%s); re-listing", self._prefix, error)
        threading.Thread(target=self._recover, name="etcdft-resync", daemon=True).start()

    def _recover(self) -> None:
        delay = 0.05
        while not self._stopped:
            try:
                self._resync()
                return
            except (EtcdUnavailableError, EtcdRequestError) as exc:
                if self._stopped:
                    return
                log.warning("rendezvous re-list failed: %s", exc)
                time.sleep(delay)
                delay = min(1.0, delay * 2)

    def disconnected_for(self) -> float:
        """Seconds since the watch broke without being restored (0 when live)."""
        with self._cond:
            return 0.0 if self._broken_since is None else time.monotonic() - self._broken_since

    def snapshot(self) -> tuple[RendezvousState, int]:
        with self._cond:
            if self._state is None:
                self._state = build_state(self._facts.values())
            return self._state, self._version

    def wait_for_change(self, version: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._version != version or self._stopped, max(0.0, timeout))

    def wait_for_revision(self, revision: int, timeout: float) -> bool:
        """Block until the view includes ``revision`` (read-your-writes)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._revision >= revision or self._stopped, max(0.0, timeout))

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            watch, self._watch = self._watch, None
            self._cond.notify_all()
        if watch is not None:
            watch.cancel()


class LeaseKeeper:
    """Grants a lease and refreshes it every ``ttl / 3`` seconds.

    ``expired`` is set once etcd reports the lease gone (the node was out of
    touch for longer than its TTL); everything attached to it is gone too, and
    the handler must start a new session.
    """

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        self._client = client
        self.id, self.ttl = client.grant_lease(ttl)
        self.expired = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcdft-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(0.1, self.ttl / 3)
        while not self._stop.wait(interval):
            try:
                if self._client.keep_alive(self.id) <= 0:
                    log.warning("etcd lease %x expired; this node has dropped out of the rendezvous", self.id)
                    self.expired.set()
                    return
            except Exception as exc:  # noqa: BLE001 - keep trying until the TTL runs out
                log.warning("cannot refresh etcd lease %x: %s", self.id, exc)

    def stop(self, *, revoke: bool) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if revoke and not self.expired.is_set():
            self._client.revoke_lease(self.id)
