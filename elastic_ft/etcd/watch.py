"""etcd's long-lived streams: watches, and leases' keep-alives, each kind on one stream per client.

Both are bidirectional gRPC streams whose answers a daemon thread reads; as
in etcd's Go client, one stream carries all of a client's watches (told
apart by id), and one all of its leases' refreshes.
:meth:`Stream.close` cancels the call *and joins the thread* before the
client closes its channels: a reader thread cut off inside gRPC while the
interpreter shuts down can block it forever in a finaliser.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2

from elastic_ft.etcd.endpoints import EtcdEndpoint
from elastic_ft.etcd.kv import (
    EtcdCompactedError,
    EtcdRequestError,
    EtcdUnavailableError,
    KeyValue,
    WatchEvent,
)
from elastic_ft.etcd.shield import shielded

_JOIN_TIMEOUT = 5.0

log = logging.getLogger(__name__)


class Stream:
    """A bidirectional stream with its reader thread; subclasses read the answers."""

    def __init__(
        self,
        open_call: Callable[..., Any],
        endpoint: EtcdEndpoint,
        name: str,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.endpoint = endpoint
        self._requests: queue.Queue[Any] = queue.Queue()
        self._cancelled = threading.Event()
        self._call = open_call(self._request_stream(), metadata=metadata)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def _request_stream(self) -> Iterator[Any]:
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def _run(self) -> None:
        raise NotImplementedError

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @shielded
    def close(self) -> None:
        """Cancel the stream and wait for its reader thread (unless called from it), each for a bounded time."""
        self._cancelled.set()
        self._requests.put(None)
        if not self._cancel_within(_JOIN_TIMEOUT):
            log.warning(
                "cancelling the %s stream to %s did not return within %g s; going on",
                self._thread.name,
                self.endpoint,
                _JOIN_TIMEOUT,
            )
        if threading.current_thread() is not self._thread and self._thread.ident is not None:
            self._thread.join(_JOIN_TIMEOUT)

    def _cancel_within(self, seconds: float) -> bool:
        """``cancel()`` the call from a helper thread; True if it returned within ``seconds``.

        gRPC's ``cancel`` takes the call's lock, and was once seen blocked on
        it for good: a rank waiting on the store then stalled until its
        barrier timed out. Whatever holds that lock, closing a stream must not
        hang the caller.
        """
        returned = threading.Event()

        def cancel() -> None:
            try:
                self._call.cancel()
            finally:
                returned.set()

        threading.Thread(target=cancel, name="etcd-stream-cancel", daemon=True).start()
        return returned.wait(seconds)


class EtcdWatch:
    """One watch on a key range, carried by its client's shared :class:`WatchStream`.

    ``on_events(events, revision)`` runs for each batch, in the stream's
    reader thread, so it must be quick (record and return); ``on_error``
    runs once at the end: the stream broke, etcd cancelled the watch, or its
    history was compacted. After that the watch is over and the caller
    re-lists and watches again. ``on_created(revision)``, when given, runs
    once etcd has created the watch: it delivers every change after
    ``revision``.
    """

    def __init__(
        self,
        watch_id: int,
        request: Any,
        on_events: Callable[[list[WatchEvent], int], None],
        on_error: Callable[[Exception], None],
        on_created: Callable[[int], None] | None = None,
    ) -> None:
        self.id = watch_id
        self.request = request
        self.on_events = on_events
        self.on_error = on_error
        self.on_created = on_created
        self.stream: WatchStream | None = None
        self._closed = threading.Event()

    @property
    def cancelled(self) -> bool:
        """Closed, or its stream cancelled (the client closed)."""
        return self._closed.is_set() or (self.stream is not None and self.stream.cancelled)

    @shielded
    def close(self) -> None:
        """Stop watching; no callback runs once this has returned, except one already running."""
        self._closed.set()
        if self.stream is not None:
            self.stream.remove(self)


class WatchStream(Stream):
    """Every watch of one client on one stream, told apart by watch ids the client picks (etcd 3.4+).

    As etcd's Go client: a node that watches several ranges costs etcd one
    stream and the node one reader thread, however many watches come and go.
    When the stream ends, every watch on it ends with the same error.
    """

    def __init__(self, channel: grpc.Channel, endpoint: EtcdEndpoint, metadata: tuple[tuple[str, str], ...]) -> None:
        super().__init__(etcdrpc.WatchStub(channel).Watch, endpoint, "etcd-watch", metadata)
        self._lock = threading.Lock()
        self._watches: dict[int, EtcdWatch] = {}
        self._ended = False
        self._start()

    @property
    def ended(self) -> bool:
        return self._ended or self.cancelled

    def add(self, watch: EtcdWatch) -> bool:
        """Start ``watch`` on this stream; False if the stream has ended (open another)."""
        with self._lock:
            if self.ended:
                return False
            self._watches[watch.id] = watch
            watch.stream = self
            self._requests.put(watch.request)
        return True

    def remove(self, watch: EtcdWatch) -> None:
        with self._lock:
            if self._watches.pop(watch.id, None) is None or self.ended:
                return
            self._requests.put(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch.id)))

    def _end_one(self, watch_id: int, error: Exception) -> None:
        with self._lock:
            watch = self._watches.pop(watch_id, None)
        if watch is not None and not watch.cancelled:
            _report_end(watch, error)

    def _created(self, watch: EtcdWatch, revision: int) -> None:
        callback = watch.on_created
        if callback is None:
            return
        try:
            callback(revision)
        except Exception as exc:  # reported to that watch's owner
            log.exception("a watch's on_created raised; ending that watch (%s)", self.endpoint)
            self._end_one(watch.id, exc)

    def _deliver(self, watch: EtcdWatch, events: list[WatchEvent], revision: int) -> None:
        """Hand ``events`` to ``watch``; a callback that raises ends its own watch, not the others'."""
        try:
            watch.on_events(events, revision)
        except Exception as exc:  # reported to that watch's owner
            log.exception("a watch callback raised; ending that watch (%s)", self.endpoint)
            self._end_one(watch.id, exc)

    def _run(self) -> None:
        try:
            for response in self._call:
                watch = self._watches.get(response.watch_id)
                if watch is None or watch.cancelled:
                    continue  # cancelled by us, or the answer to a cancel
                if response.created and watch.on_created is not None:
                    self._created(watch, response.header.revision)
                if response.compact_revision:
                    self._end_one(watch.id, EtcdCompactedError(response.compact_revision))
                elif response.canceled:
                    self._end_one(watch.id, EtcdRequestError(f"etcd cancelled the watch: {response.cancel_reason}"))
                elif response.events:
                    events = [
                        WatchEvent(e.type == kv_pb2.Event.DELETE, KeyValue.from_proto(e.kv)) for e in response.events
                    ]
                    self._deliver(watch, events, response.header.revision)
            raise EtcdUnavailableError("the etcd watch stream ended")
        except Exception as exc:  # noqa: BLE001 - every end of the stream is reported to each watch on it
            if isinstance(exc, grpc.RpcError):
                exc = EtcdUnavailableError(f"the etcd watch stream broke: {exc.details()}")
            with self._lock:
                self._ended = True
                watches = list(self._watches.values())
                self._watches.clear()
            if not self.cancelled:
                for watch in watches:
                    if not watch.cancelled:
                        _report_end(watch, exc)


def _report_end(watch: EtcdWatch, error: Exception) -> None:
    """Tell a watch's owner it ended; an ``on_error`` that raises is logged, and the other watches still hear."""
    try:
        watch.on_error(error)
    except Exception:  # logged: the stream's other watches must still be told
        log.exception("a watch's on_error raised")


class KeepAliveStream(Stream):
    """One keep-alive stream for every lease of a client (see :mod:`elastic_ft.etcd.session`).

    :meth:`send` asks for one lease's refresh; ``on_answer(lease_id, ttl)``
    runs in the reader thread for each answer (``ttl`` 0: the lease has
    expired), and ``on_end(error)`` once when the stream ends.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        endpoint: EtcdEndpoint,
        on_answer: Callable[[int, int], None],
        on_end: Callable[[Exception], None],
        metadata: tuple[tuple[str, str], ...] = (),
        on_send: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(etcdrpc.LeaseStub(channel).LeaseKeepAlive, endpoint, "etcd-keepalive", metadata)
        self._on_answer = on_answer
        self._on_end = on_end
        self._on_send = on_send
        self._start()

    def send(self, lease_id: int) -> None:
        """Ask etcd to renew lease ``lease_id`` (``on_send`` counts the message, as the client counts requests)."""
        self._on_send()
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))

    def _run(self) -> None:
        try:
            for response in self._call:
                self._on_answer(int(response.ID), max(0, int(response.TTL)))
            error: Exception = EtcdUnavailableError("the etcd keep-alive stream ended")
        except grpc.RpcError as exc:
            error = EtcdUnavailableError(f"the etcd keep-alive stream broke: {exc.details()}")
        if not self.cancelled:
            self._on_end(error)
