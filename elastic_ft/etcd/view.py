"""A local, watch-fed copy of the keys under one prefix (the informer pattern).

:class:`PrefixView` lists the prefix once and then follows etcd's watch
stream, so questions asked many times a second are answered from memory with
no request; if the stream breaks, it lists again and resumes. What the keys
*mean* is injected: ``parse`` turns one key (relative to the prefix) into a
fact, once, when it changes; ``build`` turns the current facts into the
state callers read, once per change, on demand.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.kv import EtcdRequestError, EtcdUnavailableError, KeyValue, WatchEvent
from elastic_ft.etcd.watch import EtcdWatch
from elastic_ft.runtime.waits import Backoff

log = logging.getLogger(__name__)

FactT = TypeVar("FactT")
StateT = TypeVar("StateT")


class PrefixView(Generic[FactT, StateT]):
    """See the module docstring.

    Args:
        client: the etcd connection.
        prefix: the key prefix to follow.
        parse: ``parse(relative_key, key_value)``: the fact a key states, or
            ``None`` for a key of no concern.
        build: the state the facts add up to.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        parse: Callable[[str, KeyValue], FactT | None],
        build: Callable[[Iterable[FactT]], StateT],
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._parse = parse
        self._build = build
        self._cond = threading.Condition()
        self._facts: dict[str, FactT] = {}
        self._revision = 0
        self._version = 0
        self._state: StateT | None = None
        self._watch: EtcdWatch | None = None
        self._stopped = False
        self._broken_since: float | None = None
        #: Watch events received so far (what a node's share of etcd's fan-out is).
        self.events_received = 0
        self._resync()

    def _resync(self) -> None:
        kvs, revision = self._client.get_prefix(self._prefix)
        with self._cond:
            if self._stopped:
                return
            self._facts = {}
            for kv in kvs:
                self._apply(kv.key[len(self._prefix) :], kv)
            self._revision = revision
            self._broken_since = None
            self._changed()
            self._watch = self._client.watch_prefix(self._prefix, revision + 1, self._on_events, self._on_error)

    def _apply(self, key: str, kv: KeyValue | None) -> None:
        fact = self._parse(key, kv) if kv is not None else None
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
            self.events_received += len(events)
            for event in events:
                self._apply(event.kv.key[len(self._prefix) :], None if event.deleted else event.kv)
            self._revision = max(self._revision, revision)
            self._changed()

    def _on_error(self, error: Exception) -> None:
        with self._cond:
            if self._stopped:
                return
            self._broken_since = time.monotonic()
            self._cond.notify_all()
        log.debug("watch on %s broke (%s); re-listing", self._prefix, error)
        threading.Thread(target=self._recover, name="etcd-view-resync", daemon=True).start()

    def _recover(self) -> None:
        backoff = Backoff()
        while not self._stopped:
            try:
                self._resync()
                return
            except EtcdUnavailableError as exc:  # etcd away: the process's outage record logs it once
                if self._stopped:
                    return
                log.debug("re-listing %s failed: %s", self._prefix, exc)
                backoff.pause()
            except EtcdRequestError as exc:
                if self._stopped:
                    return
                log.warning("re-listing %s failed: %s", self._prefix, exc)
                backoff.pause()

    def disconnected_for(self) -> float:
        """Seconds since the watch broke without being restored (0 when live)."""
        with self._cond:
            return 0.0 if self._broken_since is None else time.monotonic() - self._broken_since

    def snapshot(self) -> tuple[StateT, int]:
        """The current state and its version (which changes with every batch of events)."""
        with self._cond:
            if self._state is None:
                self._state = self._build(self._facts.values())
            return self._state, self._version

    def wait_for_change(self, version: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._version != version or self._stopped, max(0.0, timeout))

    def nudge(self) -> None:
        """Wake every :meth:`wait_for_change` now, though nothing changed (its caller has something else to do)."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

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
            watch.close()
