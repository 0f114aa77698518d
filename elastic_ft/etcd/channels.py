"""What an :class:`~elastic_ft.etcd.client.EtcdClient` keeps open: a gRPC channel per endpoint, which endpoint
requests go to first, the streams open on them (the one watch stream all its watches share, the keep-alive
streams), and the auth token every request carries when the cluster uses RBAC."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import grpc
from etcd3 import etcdrpc

from elastic_ft.etcd.endpoints import EndpointError, EtcdCredentials, EtcdEndpoint, TlsFiles
from elastic_ft.etcd.kv import EtcdRequestError, EtcdUnavailableError
from elastic_ft.etcd.shield import shielded
from elastic_ft.etcd.watch import Stream, WatchStream

# Pings more often than etcd's --grpc-keepalive-min-time (5 s), or without an
# active call (etcd does not permit those), make the server hang up with
# GOAWAY "too_many_pings"; so ping every 10 s, and only while a call (a watch,
# a keep-alive stream) is open. A dead peer is still noticed within ~15 s on a
# silent link, and at once when its TCP connection is reset.
#
# gRPC backs off reconnecting for up to 120 s by default; a coordination
# client must be back within its request bound once a member answers again,
# so reconnect attempts stay between 0.1 and 1 s apart.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]
#: The codes after which a request is resent (to the next endpoint).
_RETRYABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
#: What etcd says, with ``UNKNOWN``, when a request ran out of time inside the server (a member that lost its
#: leader, or was frozen, while it held the request): etcd away for that request, not a refusal.
_SERVER_TIMEOUTS = (
    "context deadline exceeded",
    "context canceled",
    "etcdserver: request timed out",
    "etcdserver: leader changed",
    "etcdserver: no leader",
)


def transient(error: grpc.RpcError) -> bool:
    """Whether a failed request may be resent: etcd did not answer it (a refusal is not transient)."""
    code = error.code()
    if code in _RETRYABLE_CODES:
        return True
    details = error.details() or ""
    return code is grpc.StatusCode.UNKNOWN and any(reason in details for reason in _SERVER_TIMEOUTS)


_StreamT = TypeVar("_StreamT", bound=Stream)


class TokenAuth:
    """The auth token of a client with credentials: asked for on first use, forgotten when etcd rejects it."""

    def __init__(self, credentials: EtcdCredentials | None, request_timeout: float) -> None:
        self._credentials = credentials
        self._request_timeout = request_timeout
        self._token: str | None = None
        self._lock = threading.Lock()

    @property
    def user(self) -> str | None:
        return None if self._credentials is None else self._credentials.user

    def metadata(self, channel: grpc.Channel, timeout: float) -> tuple[tuple[str, str], ...]:
        """The token metadata every request carries when the client has credentials (authenticating first)."""
        credentials = self._credentials
        if credentials is None:
            return ()
        with self._lock:
            token = self._token
        if token is None:
            try:
                password = credentials.password()
            except EndpointError as error:
                raise EtcdRequestError(str(error)) from None
            request = etcdrpc.AuthenticateRequest(name=credentials.user, password=password)
            try:
                token = etcdrpc.AuthStub(channel).Authenticate(request, timeout=timeout).token
            except grpc.RpcError as exc:
                if transient(exc):
                    raise
                raise EtcdRequestError(
                    f"etcd refused user {credentials.user!r}: {exc.details()} "
                    f"(check the user and its password_file {credentials.password_file!r})"
                ) from None  # the request held the password: keep it out of tracebacks
            with self._lock:
                self._token = token
        return (("token", token),)

    def forget(self) -> None:
        with self._lock:
            self._token = None

    def stream_metadata(self, channel: grpc.Channel) -> tuple[tuple[str, str], ...]:
        """Metadata for a new stream (a watch, a keep-alive): the auth token, if any."""
        try:
            return self.metadata(channel, self._request_timeout)
        except grpc.RpcError as exc:
            raise EtcdUnavailableError(f"cannot authenticate to etcd: {exc.details()}") from exc


class Connections:
    """A client's channels, its current endpoint, and the streams open on them."""

    def __init__(self, endpoints: tuple[EtcdEndpoint, ...], tls: TlsFiles) -> None:
        self.endpoints = endpoints
        self._tls = tls
        self._lock = threading.Lock()
        self._channels: dict[EtcdEndpoint, grpc.Channel] = {}
        self._current = 0
        self._closed = False
        self._streams: set[Stream] = set()
        self._watches: WatchStream | None = None

    def channel(self, endpoint: EtcdEndpoint) -> grpc.Channel:
        with self._lock:
            if self._closed:
                raise EtcdRequestError("the etcd client is closed")
            channel = self._channels.get(endpoint)
            if channel is None:
                if endpoint.secure:
                    channel = grpc.secure_channel(endpoint.target, self._tls.credentials(), _CHANNEL_OPTIONS)
                else:
                    channel = grpc.insecure_channel(endpoint.target, _CHANNEL_OPTIONS)
                self._channels[endpoint] = channel
            return channel

    def order(self) -> list[EtcdEndpoint]:
        """The endpoints, the current one first."""
        with self._lock:
            start = self._current
        n = len(self.endpoints)
        return [self.endpoints[(start + i) % n] for i in range(n)]

    def mark_good(self, endpoint: EtcdEndpoint) -> None:
        with self._lock:
            self._current = self.endpoints.index(endpoint)

    def avoid(self, endpoint: EtcdEndpoint) -> None:
        """A stream on ``endpoint`` broke: send what comes next to the following endpoint."""
        with self._lock:
            if self.endpoints[self._current] == endpoint:
                self._current = (self._current + 1) % len(self.endpoints)

    def track(self, stream: _StreamT) -> _StreamT:
        """Close ``stream`` with the client."""
        with self._lock:
            self._streams = {s for s in self._streams if not s.cancelled}
            self._streams.add(stream)
        return stream

    @shielded
    def watch_stream(self, metadata: Callable[[grpc.Channel], tuple[tuple[str, str], ...]]) -> WatchStream:
        """The stream every watch of the client shares, opened (on the current endpoint) when there is none."""
        with self._lock:
            stream = self._watches
        if stream is not None and not stream.ended:
            return stream
        endpoint = self.order()[0]
        channel = self.channel(endpoint)
        opened = WatchStream(channel, endpoint, metadata(channel))
        with self._lock:
            if self._closed:
                extra: WatchStream | None = opened
                stream = None
            elif self._watches is None or self._watches.ended:
                self._watches, extra, stream = opened, None, opened
                self._streams = {s for s in self._streams if not s.cancelled}
                self._streams.add(opened)
            else:
                extra, stream = opened, self._watches
        if extra is not None:
            extra.close()  # another thread opened one first
        if stream is None:
            raise EtcdRequestError("the etcd client is closed")
        return stream

    @shielded
    def close(self) -> None:
        """Close every stream (joining its reader thread), then the channels."""
        with self._lock:
            self._closed = True
            streams, self._streams = self._streams, set()
            channels = list(self._channels.values())
            self._channels.clear()
        for stream in streams:
            stream.close()
        for channel in channels:
            channel.close()
