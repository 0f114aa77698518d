"""etcd's long-lived streams: a watch, and a lease's keep-alive, each read by one thread.

Both are bidirectional gRPC streams whose answers a daemon thread reads.
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

    def close(self) -> None:
        """Cancel the stream and wait for its reader thread (unless called from it), each for a bounded time."""
        self._cancelled.set()
        self._requests.put(None)
        if not self._cancel_within(_JOIN_TIMEOUT):
            log.warning("cancelling the %s stream to %s did not return within %g s; going on", self._thread.name,
                        self.endpoint, _JOIN_TIMEOUT)  # fmt: skip
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


class EtcdWatch(Stream):
    """A watch on a key range; ``on_events(events, revision)`` for each batch, ``on_error`` once at the end."""

    def __init__(
        self,
        channel: grpc.Channel,
        endpoint: EtcdEndpoint,
        request: Any,
        on_events: Callable[[list[WatchEvent], int], None],
        on_error: Callable[[Exception], None],
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(etcdrpc.WatchStub(channel).Watch, endpoint, "etcd-watch", metadata)
        self._on_events = on_events
        self._on_error = on_error
        self._requests.put(request)
        self._start()

    def _run(self) -> None:
        try:
            for response in self._call:
                if response.compact_revision:
                    raise EtcdCompactedError(response.compact_revision)
                if response.canceled:
                    raise EtcdRequestError(f"etcd cancelled the watch: {response.cancel_reason}")
                if response.events:
                    events = [
                        WatchEvent(e.type == kv_pb2.Event.DELETE, KeyValue.from_proto(e.kv)) for e in response.events
                    ]
                    self._on_events(events, response.header.revision)
            raise EtcdUnavailableError("the etcd watch stream ended")
        except Exception as exc:  # noqa: BLE001 - every end of the stream is reported
            if not self.cancelled:
                if isinstance(exc, grpc.RpcError):
                    exc = EtcdUnavailableError(f"the etcd watch stream broke: {exc.details()}")
                self._on_error(exc)


class KeepAliveStream(Stream):
    """One lease's keep-alive stream: :meth:`refresh` sends one request and waits for its answer."""

    def __init__(
        self, channel: grpc.Channel, endpoint: EtcdEndpoint, lease_id: int, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(etcdrpc.LeaseStub(channel).LeaseKeepAlive, endpoint, "etcd-keepalive", metadata)
        self.lease_id = lease_id
        self._answers: queue.Queue[int | Exception] = queue.Queue()
        self._start()

    def _run(self) -> None:
        try:
            for response in self._call:
                self._answers.put(max(0, int(response.TTL)))
            self._answers.put(EtcdUnavailableError("the etcd keep-alive stream ended"))
        except grpc.RpcError as exc:
            if not self.cancelled:
                self._answers.put(EtcdUnavailableError(f"the etcd keep-alive stream broke: {exc.details()}"))

    def refresh(self, timeout: float) -> int:
        """Refresh the lease once; its remaining TTL, 0 if it has expired.

        Raises:
            EtcdUnavailableError: no answer within ``timeout`` or the stream
                broke; the stream is unusable afterwards (a late answer would
                be mistaken for the next one), so open a new one.
        """
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=self.lease_id))
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise EtcdUnavailableError(
                f"no keep-alive answer for lease {self.lease_id:x} within {timeout:g} s"
            ) from None
        if isinstance(answer, Exception):
            raise answer
        return answer
