"""A session: one etcd lease, kept alive over one long-lived keep-alive stream.

As etcd's Go ``concurrency.Session``: everything a node keeps alive hangs on
its session's lease, and a daemon thread refreshes it every ``ttl / 3``
seconds over a single stream (reopened, on another endpoint if need be, only
when it breaks). The session is *lost* (:attr:`Session.expired`) as soon as
etcd reports the lease gone, or when no refresh has succeeded for a whole
TTL: by then etcd has dropped the lease and every key on it, whatever the
client hears later, so waiting longer would only hide the loss.
"""

from __future__ import annotations

import logging
import threading
import time

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.kv import EtcdRequestError, EtcdUnavailableError
from elastic_ft.etcd.watch import KeepAliveStream

log = logging.getLogger(__name__)

_RETRY_PAUSE = 0.1


class Session:
    """Grants a lease of ``ttl`` seconds and keeps it alive until :meth:`close`.

    Raises (from the constructor) what :meth:`EtcdClient.grant_lease` raises.
    """

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        self._client = client
        self.id, self.ttl = client.grant_lease(ttl)
        self.expired = threading.Event()
        self._stop = threading.Event()
        self._last_refresh = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="etcd-session", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(0.1, self.ttl / 3)
        stream: KeepAliveStream | None = None
        try:
            while not self._stop.wait(interval if stream is not None else _RETRY_PAUSE):
                try:
                    if stream is None:
                        stream = self._client.keep_alive_stream(self.id)
                    remaining = self.ttl - (time.monotonic() - self._last_refresh)
                    ttl = stream.refresh(timeout=max(0.05, min(self._client.request_timeout, remaining)))
                except (EtcdUnavailableError, EtcdRequestError) as exc:
                    if stream is not None:
                        stream.close()
                        self._client.avoid(stream.endpoint)
                        stream = None
                    if time.monotonic() - self._last_refresh >= self.ttl:
                        self._mark_lost(f"no refresh for a whole TTL: {exc}")
                        return
                    log.warning("cannot refresh etcd lease %x yet: %s", self.id, exc)
                    continue
                if ttl <= 0:
                    self._mark_lost("etcd reports it expired")
                    return
                self._last_refresh = time.monotonic()
        finally:
            if stream is not None:
                stream.close()

    def _mark_lost(self, why: str) -> None:
        silent = time.monotonic() - self._last_refresh
        log.warning("etcd lease %x lost (%s; last refreshed %.1f s ago, TTL %d s)", self.id, why, silent, self.ttl)
        self.expired.set()

    def close(self, *, revoke: bool) -> None:
        """Stop refreshing; with ``revoke``, delete the lease and every key on it at once."""
        self._stop.set()
        self._thread.join(timeout=5)
        if revoke and not self.expired.is_set():
            self._client.revoke_lease(self.id)
