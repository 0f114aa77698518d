"""The one module that talks to etcd.

Everything elastic-ft stores in etcd goes through :class:`EtcdClient`, a thin
adapter over the etcd v3 gRPC API as packaged by ``python3-etcd3`` (module
``etcd3``; only its generated protocol stubs are used).  Keeping every client
call here means the client library can be swapped without touching the
rendezvous or the store.

The adapter speaks etcd's own vocabulary -- revisions, leases, transactions
and watches -- and nothing else: callers build transactions from the small
``Compare``/``Op`` helpers below.  It counts every request it sends
(:attr:`EtcdClient.requests`) so benchmarks can report requests per round.

Failure handling follows etcd's rules. A request is resent, on the next
endpoint, after UNAVAILABLE or DEADLINE_EXCEEDED -- and neither proves that
the first send was not applied (a connection can break after the server
committed). So every request sent here must be safe to apply twice: reads,
leases, puts of a key with a single writer, and transactions whose guards
make a second application a no-op (the rendezvous's, and
:class:`~elastic_ft.etcd.store.EtcdStore`'s, which carry a per-request
token). Each request ends, one way or another, within ``connect_timeout +
request_timeout``, or sooner when the wait it serves ends sooner
(:func:`elastic_ft.etcd.outage.bounded`): every send is capped by the time
left, and a request that no endpoint answered raises
:class:`EtcdUnavailableError` naming the endpoints. Whether etcd answers is
recorded in the process's outage record (:data:`elastic_ft.etcd.outage.OUTAGES`),
which logs each outage once; callers decide whether to wait on
(:mod:`elastic_ft.etcd.outage`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from etcd3 import etcdrpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from elastic_ft.etcd import accounting
from elastic_ft.etcd.accounting import current_source
from elastic_ft.etcd.channels import Connections, TokenAuth, transient
from elastic_ft.etcd.endpoints import EtcdCredentials, EtcdEndpoint, TlsFiles
from elastic_ft.etcd.kv import (
    EtcdCompactedError,
    EtcdLeaseNotFoundError,
    EtcdRequestError,
    EtcdUnavailableError,
    KeyValue,
    TxnResult,
    WatchEvent,
)
from elastic_ft.etcd.outage import OUTAGES, current_bound, time_left
from elastic_ft.etcd.shield import shield, shielded
from elastic_ft.etcd.watch import EtcdWatch, KeepAliveStream
from elastic_ft.runtime.waits import pause

__all__ = [
    "EtcdClient",
    "EtcdCompactedError",
    "EtcdEndpoint",
    "EtcdLeaseNotFoundError",
    "EtcdRequestError",
    "EtcdUnavailableError",
    "EtcdWatch",
    "KeyValue",
    "TlsFiles",
    "TxnResult",
    "WatchEvent",
]

log = logging.getLogger(__name__)

#: The longest pause between two tries of a request while its time lasts.
_RETRY_PAUSE = 0.2


def _token_rejected(error: grpc.RpcError) -> bool:
    """etcd no longer accepts the auth token (it expired, or the member restarted)."""
    return error.code() is grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in (error.details() or "")


def prefix_end(prefix: str) -> bytes:
    """The exclusive end of the key range that starts with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"


# ---- transaction building blocks -------------------------------------------

Compare = Any  # etcdrpc.Compare
Op = Any  # etcdrpc.RequestOp


def _compare(key: str, target: Any, result: Any, **value: Any) -> Compare:
    return etcdrpc.Compare(key=key.encode(), target=target, result=result, **value)


def key_missing(key: str) -> Compare:
    return _compare(key, etcdrpc.Compare.CREATE, etcdrpc.Compare.EQUAL, create_revision=0)


def key_created_at(key: str, revision: int) -> Compare:
    return _compare(key, etcdrpc.Compare.CREATE, etcdrpc.Compare.EQUAL, create_revision=revision)


def key_modified_at(key: str, revision: int) -> Compare:
    return _compare(key, etcdrpc.Compare.MOD, etcdrpc.Compare.EQUAL, mod_revision=revision)


def put_op(key: str, value: bytes, lease: int = 0) -> Op:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease))


def delete_op(key: str) -> Op:
    return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key.encode()))


def delete_prefix_op(prefix: str) -> Op:
    return etcdrpc.RequestOp(
        request_delete_range=etcdrpc.DeleteRangeRequest(key=prefix.encode(), range_end=prefix_end(prefix))
    )


def get_op(key: str) -> Op:
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key.encode()))


def prefix_op(prefix: str) -> Op:
    """Read every key under ``prefix``."""
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix)))


def first_key_op(prefix: str) -> Op:
    """Read one key under ``prefix`` (its name only): whether there is any."""
    return etcdrpc.RequestOp(
        request_range=etcdrpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), limit=1, keys_only=True)
    )


def txn_request(compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> Any:
    """A ``TxnRequest`` (what :meth:`EtcdClient.txn` sends; a node relay carries it as its bytes)."""
    return etcdrpc.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))


def txn_result(response: Any) -> TxnResult:
    """What a ``TxnResponse`` says: the branch taken, the revision, each operation's key-values (ranges only)."""
    ranges: list[list[KeyValue] | None] = []
    for op in response.responses:
        if op.WhichOneof("response") == "response_range":
            ranges.append([KeyValue.from_proto(kv) for kv in op.response_range.kvs])
        else:
            ranges.append(None)
    return TxnResult(response.succeeded, response.header.revision, ranges)


def txn_keys(request: Any) -> tuple[list[bytes], list[bytes]]:
    """The keys a ``TxnRequest`` touches (its guards', reads' and writes' keys and range ends), and the keys it
    may write (puts and deletes, either branch): what a relay checks before it carries one."""
    touched: list[bytes] = [compare.key for compare in request.compare]
    written: list[bytes] = []
    for op in [*request.success, *request.failure]:
        kind = op.WhichOneof("request")
        inner = getattr(op, kind) if kind else None
        if kind == "request_txn":
            nested_touched, nested_written = txn_keys(inner)
            touched += nested_touched
            written += nested_written
            continue
        if inner is None:
            continue
        touched.append(inner.key)
        if getattr(inner, "range_end", b""):
            touched.append(inner.range_end)
        if kind in ("request_put", "request_delete_range"):
            written.append(inner.key)
    return touched, written


def _watch_create_message() -> Any:
    """A ``WatchCreateRequest`` class that knows ``watch_id`` (field 7; etcd 3.4 on).

    The stubs of the ``etcd3`` package predate that field, so this message
    is declared here, with the fields elastic-ft sets, under their numbers
    and types in etcd's ``rpc.proto``; its bytes parse as the stubs' message,
    which keeps ``watch_id`` as an unknown field and sends it on.
    """
    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="elastic_ft/etcd/watch_create.proto", package="elastic_ft.etcd", syntax="proto3"
    )
    message = file.message_type.add(name="WatchCreateRequest")
    for name, number, kind in (
        ("key", 1, field.TYPE_BYTES),
        ("range_end", 2, field.TYPE_BYTES),
        ("start_revision", 3, field.TYPE_INT64),
        ("watch_id", 7, field.TYPE_INT64),
    ):
        message.field.add(name=name, number=number, type=kind, label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("elastic_ft.etcd.WatchCreateRequest"))


_WatchCreateRequest = _watch_create_message()


def _watch_create_request(key: bytes, range_end: bytes, start_revision: int, watch_id: int) -> Any:
    """A request to create a watch whose id the client picks (so a response names the watch it answers)."""
    if watch_id <= 0:
        raise ValueError(f"a watch id must be positive, got {watch_id}")
    if start_revision < 0:
        raise ValueError(f"a watch's start revision must be 0 (from now on) or positive, got {start_revision}")
    create = _WatchCreateRequest(key=key, range_end=range_end, start_revision=start_revision, watch_id=watch_id)
    return etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest.FromString(create.SerializeToString()))


class EtcdClient:
    """A connection to one etcd cluster, through any of its endpoints.

    ``request_timeout`` bounds one request on one endpoint; ``connect_timeout``
    bounds the whole effort of finding an endpoint that answers.  Requests go
    to the current endpoint and move to the next one when it is unreachable.
    """

    def __init__(
        self,
        endpoints: Sequence[EtcdEndpoint],
        *,
        request_timeout: float = 5.0,
        connect_timeout: float = 10.0,
        tls: TlsFiles | None = None,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint, got none")
        for endpoint in endpoints:
            if not isinstance(endpoint, EtcdEndpoint):
                raise TypeError(
                    f"EtcdClient endpoints must be EtcdEndpoint objects (see parse_endpoints), got {endpoint!r:.100}"
                )
        self.endpoints = tuple(endpoints)
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self._connections = Connections(self.endpoints, tls or TlsFiles())
        self._auth = TokenAuth(credentials, request_timeout)
        self._lock = threading.Lock()
        self._watch_ids = itertools.count(1)
        self.requests_by_kind: Counter[str] = Counter()
        #: The same requests, and the messages sent on long-lived streams (a lease's renewals), by (source,
        #: kind): who asked (:mod:`elastic_ft.etcd.accounting`).
        self.requests_by_source: Counter[tuple[str, str]] = Counter()
        #: Failed sends by request kind and error (``("put", "UNAVAILABLE")``), retried ones included.
        self.errors_by_kind: Counter[tuple[str, str]] = Counter()
        #: When etcd last answered a request of this client (``time.monotonic()``).
        self.last_answer = time.monotonic()
        #: etcd has answered this client once: from then on, not answering is an outage (until then, a first
        #: contact that fails, which its caller reports).
        self.answered_once = False
        accounting.track(self)

    def avoid(self, endpoint: EtcdEndpoint) -> None:
        """A stream on ``endpoint`` broke: send what comes next to the following endpoint."""
        self._connections.avoid(endpoint)

    def describe_endpoints(self) -> str:
        return ",".join(str(e) for e in self.endpoints)

    @property
    def requests(self) -> int:
        """Requests sent so far, retries included."""
        return sum(self.requests_by_kind.values())

    def _count(self, kind: str) -> None:
        source = current_source()
        with self._lock:
            self.requests_by_kind[kind] += 1
            self.requests_by_source[(source, kind)] += 1

    def _count_message(self, kind: str) -> None:
        """A message on a stream: accounted for by source, not a request."""
        source = current_source()
        with self._lock:
            self.requests_by_source[(source, kind)] += 1

    def _call(
        self, kind: str, method: Callable[[grpc.Channel, dict[str, Any]], Any], budget: float | None = None
    ) -> Any:
        """Run one unary request, ``method(channel, {"timeout": ..., "metadata": ...})``, across endpoints.

        The request is resent after UNAVAILABLE or DEADLINE_EXCEEDED, so it
        must be safe to apply twice (see the module docstring). The whole
        call takes at most ``budget`` seconds (by default ``connect_timeout +
        request_timeout``): each send gets ``request_timeout`` or the time
        left, whichever is shorter.
        """
        start = time.monotonic()
        deadline = start + time_left(self.connect_timeout + self.request_timeout if budget is None else budget)
        if deadline <= start:
            bound = current_bound()
            raise EtcdUnavailableError(
                f"{bound.what if bound is not None else 'the wait'} ended before etcd at {self.describe_endpoints()} "
                "could be asked"
            )
        last_error: grpc.RpcError | None = None
        while True:
            for endpoint in self._connections.order():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._count(kind)
                timeout = min(self.request_timeout, left)
                try:
                    with shield():  # a restart raised inside gRPC could leave its locks held (elastic_ft.etcd.shield)
                        channel = self._connections.channel(endpoint)
                        call = {"timeout": timeout, "metadata": self._auth.metadata(channel, timeout)}
                        result = method(channel, call)
                except grpc.RpcError as exc:
                    with self._lock:
                        self.errors_by_kind[(kind, exc.code().name if exc.code() else "UNKNOWN")] += 1
                    if self._auth.user is not None and _token_rejected(exc):
                        self._auth.forget()  # expired (etcd's --auth-token-ttl): authenticate again
                        last_error = exc
                        continue
                    if exc.code() is grpc.StatusCode.PERMISSION_DENIED:
                        who = f"user {self._auth.user!r}" if self._auth.user is not None else "a client without a user"
                        raise EtcdRequestError(
                            f"etcd at {endpoint} refused the request: permission denied for {who} "
                            "(its roles must grant read-write on the run's prefix, <etcd_prefix>/<run_id>/)"
                        ) from exc
                    if exc.code() is grpc.StatusCode.NOT_FOUND and "lease not found" in (exc.details() or ""):
                        raise EtcdLeaseNotFoundError(f"etcd at {endpoint}: {exc.details()}") from exc
                    if not transient(exc):
                        raise EtcdRequestError(f"etcd at {endpoint} refused the request: {exc.details()}") from exc
                    last_error = exc
                    continue
                self._connections.mark_good(endpoint)
                self.last_answer = time.monotonic()
                self.answered_once = True
                OUTAGES.answered(self.describe_endpoints())
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                detail = last_error.details() if last_error is not None else "no answer"
                error = EtcdUnavailableError(
                    f"no answer from etcd at {self.describe_endpoints()} within "
                    f"{time.monotonic() - start:.1f} s (connect_timeout={self.connect_timeout:g} s, "
                    f"request_timeout={self.request_timeout:g} s): {detail}"
                )
                if last_error is not None and self.answered_once:
                    OUTAGES.failed(self.describe_endpoints(), detail)
                raise error from last_error
            pause(min(_RETRY_PAUSE, left))

    # ---- requests ----

    def ensure_reachable(self) -> None:
        """Raise :class:`EtcdUnavailableError` once etcd has not answered for ``connect_timeout + request_timeout``.

        For loops that wait on watches and send nothing: a frozen etcd, or a
        black hole, breaks no stream for a long while (gRPC's keepalive takes
        about 15 s to notice). Probes etcd (a status request) only when it
        has not answered anything for ``request_timeout``; the probe gets
        what is left of the bound, and at least one ``request_timeout``.
        """
        silent = time.monotonic() - self.last_answer
        if silent < self.request_timeout:
            return
        bound = self.connect_timeout + self.request_timeout
        self._status(budget=max(self.request_timeout, bound - silent))

    def _status(self, budget: float | None = None) -> Any:
        return self._call(
            "status", lambda ch, call: etcdrpc.MaintenanceStub(ch).Status(etcdrpc.StatusRequest(), **call), budget
        )

    def check_connection(self) -> str:
        """Ask a member for its status; returns the server version."""
        return str(self._status().version)

    def member_status(self) -> tuple[int, int]:
        """(this member's id, its leader's id) from the first endpoint that answers; equal on the leader."""
        response = self._status()
        return int(response.header.member_id), int(response.leader)

    def get(self, key: str) -> tuple[KeyValue | None, int]:
        kvs, revision = self._range(etcdrpc.RangeRequest(key=key.encode()))
        return (kvs[0] if kvs else None), revision

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        return self._range(etcdrpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix)))

    def count_prefix(self, prefix: str) -> int:
        request = etcdrpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), count_only=True)
        response = self._call("range", lambda ch, call: etcdrpc.KVStub(ch).Range(request, **call))
        return int(response.count)

    def _range(self, request: Any) -> tuple[list[KeyValue], int]:
        response = self._call("range", lambda ch, call: etcdrpc.KVStub(ch).Range(request, **call))
        return [KeyValue.from_proto(kv) for kv in response.kvs], response.header.revision

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        request = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
        response = self._call("put", lambda ch, call: etcdrpc.KVStub(ch).Put(request, **call))
        return response.header.revision

    def delete(self, key: str) -> int:
        """Delete one key; returns how many keys were deleted (0 or 1)."""
        request = etcdrpc.DeleteRangeRequest(key=key.encode())
        response = self._call("delete", lambda ch, call: etcdrpc.KVStub(ch).DeleteRange(request, **call))
        return int(response.deleted)

    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        """One transaction; it may be sent twice, so its guards must make a second application a no-op."""
        return txn_result(self.txn_request(txn_request(compare, success, failure)))

    def txn_request(self, request: Any) -> Any:
        """Send a ``TxnRequest`` as it is; its ``TxnResponse``."""
        return self._call("txn", lambda ch, call: etcdrpc.KVStub(ch).Txn(request, **call))

    def txns(self, requests: Sequence[Any]) -> list[Any]:
        """Several independent transactions in one request (nested in one that has no guard: etcd 3.3 on), each
        with its own guards and its own outcome; their ``TxnResponse``s. They must not write a key twice
        between them (etcd refuses the whole request)."""
        outer = etcdrpc.TxnRequest(success=[etcdrpc.RequestOp(request_txn=request) for request in requests])
        response = self.txn_request(outer)
        return [op.response_txn for op in response.responses]

    def grant_lease(self, ttl: int) -> tuple[int, int]:
        """Create a lease; returns its id and the TTL etcd granted.

        etcd raises TTLs below its minimum (1.5 x election timeout) silently.
        """
        request = etcdrpc.LeaseGrantRequest(TTL=ttl)
        response = self._call(
            "lease_grant",
            lambda ch, call: etcdrpc.LeaseStub(ch).LeaseGrant(request, **call),
        )
        if response.error:
            raise EtcdRequestError(f"etcd refused a lease of {ttl} s: {response.error}")
        return response.ID, response.TTL

    @shielded
    def keep_alive_stream(
        self, on_answer: Callable[[int, int], None], on_end: Callable[[Exception], None]
    ) -> KeepAliveStream:
        """Open one long-lived keep-alive stream (see :mod:`elastic_ft.etcd.session`, which shares it among
        every lease of this client)."""
        endpoint = self._connections.order()[0]
        self._count("keep_alive")  # the stream; each renewal it carries is accounted for by its source
        channel = self._connections.channel(endpoint)
        metadata = self._auth.stream_metadata(channel)
        return self._connections.track(
            KeepAliveStream(
                channel,
                endpoint,
                on_answer,
                on_end,
                metadata,
                on_send=functools.partial(self._count_message, "keep_alive_message"),
            )
        )

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease, deleting every key attached to it; a lease that
        already expired is not an error."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._call(
                "lease_revoke",
                lambda ch, call: etcdrpc.LeaseStub(ch).LeaseRevoke(request, **call),
            )
        except EtcdRequestError as exc:
            if "not found" not in str(exc):
                raise

    def watch_prefix(
        self,
        prefix: str,
        start_revision: int,
        on_events: Callable[[list[WatchEvent], int], None],
        on_error: Callable[[Exception], None],
        on_created: Callable[[int], None] | None = None,
    ) -> EtcdWatch:
        """Stream every change under ``prefix`` from ``start_revision`` on (0: from now on).

        ``on_events(events, revision)`` runs for each batch in the reader
        thread of the stream all this client's watches share, so it must
        return quickly; ``on_error`` runs once if the stream breaks or
        history was compacted, after which the watch is over and the caller
        re-lists; ``on_created(revision)``, once etcd created the watch (it
        delivers every change after ``revision``).

        A watch that starts in the past, behind etcd's current revision, is
        caught up by etcd's background loop every 100 ms, and its first
        events come that late (measured: 78 ms, against 1.4 ms from now on).
        A caller that reads and then waits should watch from now on and read
        again what changed before the watch was created (``on_created``).
        """
        return self._watch(prefix, prefix_end(prefix), start_revision, on_events, on_error, on_created)

    def watch_key(
        self,
        key: str,
        start_revision: int,
        on_events: Callable[[list[WatchEvent], int], None],
        on_error: Callable[[Exception], None],
        on_created: Callable[[int], None] | None = None,
    ) -> EtcdWatch:
        """As :meth:`watch_prefix`, for the one key ``key``."""
        return self._watch(key, b"", start_revision, on_events, on_error, on_created)

    def _watch(
        self,
        key: str,
        range_end: bytes,
        start_revision: int,
        on_events: Callable[[list[WatchEvent], int], None],
        on_error: Callable[[Exception], None],
        on_created: Callable[[int], None] | None = None,
    ) -> EtcdWatch:
        """Add a watch to the client's shared watch stream (opening one if needed), shielded: a restart raised
        meanwhile leaves no watch open that nobody would close."""
        watch_id = next(self._watch_ids)
        request = _watch_create_request(key.encode(), range_end, start_revision, watch_id)
        watch = EtcdWatch(watch_id, request, on_events, on_error, on_created)
        self._count("watch")
        try:
            with shield():
                for _ in range(3):
                    if self._connections.watch_stream(self._auth.stream_metadata).add(watch):
                        return watch
                    # The stream ended between our look and the add: the next look opens another.
        except BaseException:
            watch.close()  # a restart deferred to the section's end: nobody would ever close it
            raise
        raise EtcdUnavailableError(f"etcd watch streams to {self.describe_endpoints()} end as soon as they open")

    def close(self) -> None:
        """Close every stream (joining its reader thread), then the channels."""
        self._connections.close()


class EtcdPlace(Protocol):
    """Where etcd is and how to reach it, as a hand-off to a worker says (``StoreHandoff``, ``ReplicaHandoff``)."""

    @property
    def endpoints(self) -> tuple[EtcdEndpoint, ...]: ...
    @property
    def tls(self) -> TlsFiles: ...
    @property
    def credentials(self) -> EtcdCredentials | None: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def request_timeout(self) -> float: ...


def client_for(place: EtcdPlace) -> EtcdClient:
    """A client of the etcd ``place`` describes (no request is sent yet)."""
    return EtcdClient(
        place.endpoints,
        connect_timeout=place.connect_timeout,
        request_timeout=place.request_timeout,
        tls=place.tls,
        credentials=place.credentials,
    )
