"""The node relay: a host's ranks reach etcd through one process, so the worker side costs etcd per node.

Every rank of a restart arrives at the same barriers, writes the same
records and waits for the same results; every rank's monitor process
heartbeats and looks at its peers. Sent one rank at a time, that costs etcd
requests in proportion to the ranks; at 16,384 ranks it is the job's
coordination bound, not the training. The relay runs in one process per
host (``ftrun``'s agent) and serves its host's ranks over a Unix socket.
Each kind of request is batched:

* **arrivals** at one barrier: one :meth:`EtcdStore.arrive_batch
  <elastic_ft.etcd.store.EtcdStore.arrive_batch>` transaction, once every
  local rank has arrived or ``linger`` seconds after the first (a rank that
  is late or dead does not hold the others back by more);
* **store writes** (``set``, ``add``, ``compare_set``, ...: each one guarded
  transaction with its own token): nested in one etcd request, by group
  commit (what came while the previous request was in flight), two writes
  of one key never in the same request;
* **latest-value writes** (heartbeats, each with the keys its monitor's
  ring check reads) and **periodic reads** (the monitors' looks at their
  peers): one transaction for the host's requests of the moment, within
  ``gather`` seconds of the first (the monitors send them at the same
  wall-clock instants); other reads by group commit, as the writes;
* **watches**: one etcd watch per key, whatever the number of local ranks
  waiting on it, its value fanned out to each of them.

No batch leaves while the previous one of its kind is in flight.

The relay holds no state a rank cannot rebuild. An arrival or a write
travels with the rank's own token, so a rank whose relay does not answer
(it died, it is stuck, it was never started) sends the same request to etcd
itself, and it applies once whether or not the relay had committed it; a
heartbeat the relay does not take at once is written by the monitor
itself; a watch the relay drops is a broken watch, after which the waiter
reads the key itself (:mod:`elastic_ft.coordination.barriers`). A relay
that dies therefore costs its ranks their batching, never a request, and
records no fault.

The wire format is one JSON object a line, in both directions; values are
base64 (a write is its serialized ``TxnRequest``). What a client sends is
untrusted: a key outside the relay's prefix, a malformed line, request or
batch is answered with an error (the client then goes to etcd itself) and
logged once.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from etcd3 import etcdrpc

from elastic_ft.etcd.client import EtcdClient, txn_keys
from elastic_ft.etcd.event_log import APPEND_BATCH, EventLog
from elastic_ft.etcd.kv import BATCH_ARRIVALS, RelayUnavailable
from elastic_ft.etcd.outage import bounded, patiently, time_left
from elastic_ft.etcd.shield import shield
from elastic_ft.etcd.store import EtcdStore, KeyWatch
from elastic_ft.etcd.store_ops import TXN_OPS
from elastic_ft.keys import EVENTS_MAIN, EVENTS_PROGRESS
from elastic_ft.observability.events import JobEvent
from elastic_ft.untrusted import MalformedRecord

log = logging.getLogger(__name__)

#: The environment variable that tells a worker where its node's relay listens.
RELAY_ENV = "ELASTIC_FT_NODE_RELAY"
#: How long a batch waits for the rest of the host's ranks after its first arrival.
DEFAULT_LINGER = 0.02
#: The longest a rank waits for its relay's answer to an arrival before it sends the arrival to etcd itself (with
#: the same token: it counts once): a relay that is stuck costs a barrier this much, not its timeout.
RELAY_PATIENCE = 5.0
#: The longest a monitor process waits for its relay to take a heartbeat (the relay takes it at once: only a
#: stopped relay takes longer) before it writes the heartbeat itself.
_PUT_PATIENCE = 0.25
#: How long a client that could not reach its relay, or had no answer from it, goes to etcd itself before it tries
#: the relay again.
_RETRY_RELAY_AFTER = 5.0
#: The longest a client's wait for an answer blocks in one go: a restart raised meanwhile lands that soon.
_WAIT_SLICE = 0.05
#: The longest line either side accepts (a batch of 32 arrivals is about 6 KiB; a barrier's result up to 1 MiB).
_MAX_LINE = 4 << 20
#: How long a batch of periodic requests (heartbeats, the monitors' reads of their peers) waits for the rest of
#: the host's ranks after the first: the monitors send them at the same wall-clock instants, within their loop's
#: period (``monitor_process_interval``, 0.1 s by default).
DEFAULT_GATHER = 0.12
#: The kinds of request the relay batches, each sent by a thread of its own.
_KINDS = ("arrive", "txn", "put", "read", "look", "event")
#: The most bytes of store writes one request carries (etcd takes requests of up to 1.5 MiB by default).
_BATCH_BYTES = 1 << 20
#: The most keys one read through the relay names.
_READ_KEYS = 4096
#: Batches the relay remembers (a barrier's, to know when all local ranks arrived).
_BATCHES_REMEMBERED = 64
#: Values of watched keys the relay keeps for ranks that ask after the value came (a barrier's result is written
#: once).
_VALUES_REMEMBERED = 256


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _lines(sock: socket.socket) -> Any:
    """The JSON objects read from ``sock``, one a line, until it closes; a line that is not one ends the stream."""
    buffer = b""
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            raw, buffer = buffer.split(b"\n", 1)
            message = json.loads(raw)
            if not isinstance(message, dict):
                raise ValueError(f"expected a JSON object, got {raw[:80]!r}")  # noqa: TRY004 - a malformed line
            yield message
        if len(buffer) > _MAX_LINE:
            raise ValueError(f"a line longer than {_MAX_LINE} bytes")


# ---- the relay (one per host) ----------------------------------------------------------------------------


class _Peer:
    """One connected process: its socket, and a lock so that answers from several threads do not interleave."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.alive = True

    def send(self, message: dict[str, Any]) -> None:
        if not self.alive:
            return
        try:
            with self.lock:
                self.sock.sendall(_line(message))
        except OSError:
            self.alive = False  # its reader sees the end too


@dataclass
class _Request:
    peer: _Peer
    request: int
    body: Any  # arrive: [(key, token)]; put: (key, value, [key read] or None); read: [key]


@dataclass
class _Batch:
    """Requests of one kind that leave together: one barrier's arrivals, the latest-value writes, the reads.

    ``seen`` is what says every local rank is in: the arrived keys of a
    barrier (kept across its batches), the peers of this batch for the
    others. A batch leaves once ``seen`` counts every local rank, or its
    linger after the first request, and never while the previous batch of
    its kind is in flight.
    """

    kind: str
    linger: float
    pending: list[_Request] = field(default_factory=list)
    first_pending: float = 0.0
    seen: set[object] = field(default_factory=set)
    in_flight: bool = False


class _SharedWatch:
    """One etcd watch for a key, answered to every local subscriber."""

    def __init__(self) -> None:
        self.subscribers: dict[tuple[_Peer, int], None] = {}


class NodeRelay:
    """The relay of one host: see the module docstring. No I/O until :meth:`start`.

    Args:
        client: the etcd connection (shared with the agent's).
        prefix: the run's key prefix; every key a client names must be under it.
        local_ranks: how many ranks the host runs (a batch leaves once that many are in).
        path: the Unix socket's path.
        linger: how long a barrier's batch waits for the rest of the host's ranks after its first arrival.
        gather: the same for the periodic requests (heartbeats, the monitors' reads), which come spread over
            the monitors' loop period.
        timeout: the bound of each etcd request the relay makes for its ranks.
        events: the run's event log, where the relay stores its ranks' events (None: it takes none).
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        local_ranks: int,
        path: str,
        *,
        linger: float = DEFAULT_LINGER,
        gather: float = DEFAULT_GATHER,
        timeout: float = 300.0,
        events: EventLog | None = None,
    ) -> None:
        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise ValueError(f"NodeRelay prefix {prefix!r}: expected an absolute key prefix ending with '/'")
        if local_ranks < 1:
            raise ValueError(f"NodeRelay local_ranks={local_ranks!r}: expected a positive count")
        for name, value in (("linger", linger), ("gather", gather)):
            if not 0 <= value <= 1:
                raise ValueError(f"NodeRelay {name}={value!r}: expected seconds between 0 and 1")
        self.prefix, self.local_ranks, self.path = prefix, local_ranks, path
        self.linger, self.gather = linger, gather
        self._store = EtcdStore(client, prefix, timedelta(seconds=timeout))
        self._events = events
        self._lock = threading.Condition()
        self._batches: collections.OrderedDict[str, _Batch] = collections.OrderedDict()
        self._watches: dict[str, _SharedWatch] = {}
        self._values: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._server: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._peers: list[_Peer] = []
        self._closed = False
        self._refused: set[str] = set()
        #: Transactions sent, and the requests they carried, by kind (arrive, put, read): what the relay saved
        #: its ranks (and etcd).
        self.sent: collections.Counter[str] = collections.Counter()
        self.carried: collections.Counter[str] = collections.Counter()

    @property
    def batches(self) -> int:
        """Arrival transactions sent."""
        return self.sent["arrive"]

    @property
    def arrivals(self) -> int:
        """Arrivals those transactions carried."""
        return self.carried["arrive"]

    def start(self) -> NodeRelay:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        server.bind(self.path)
        server.listen(256)
        self._server = server
        # One sender per kind of request: a slow kind (events contending for the log's counter, reads during an
        # outage) never holds back another (a restart's arrivals and writes).
        threads = [threading.Thread(target=self._accept, name="elastic-ft-relay-accept", daemon=True)]
        threads += [
            threading.Thread(target=self._flush_loop, args=(kind,), name=f"elastic-ft-relay-{kind}", daemon=True)
            for kind in _KINDS
        ]
        for thread in threads:
            thread.start()
        self._threads += threads
        return self

    def env(self) -> dict[str, str]:
        """What a worker needs to find this relay."""
        return {RELAY_ENV: self.path}

    def close(self) -> None:
        """Stop serving: the connected ranks see their relay gone and reach etcd themselves."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            peers, self._peers = self._peers, []
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
        for peer in peers:
            peer.alive = False
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # ---- connections ----

    def _accept(self) -> None:
        server = self._server
        while server is not None and not self._closed:
            try:
                sock, _ = server.accept()
            except OSError:
                return
            peer = _Peer(sock)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._peers.append(peer)
            thread = threading.Thread(target=self._serve, args=(peer,), name="elastic-ft-relay-peer", daemon=True)
            thread.start()

    def _serve(self, peer: _Peer) -> None:
        try:
            for message in _lines(peer.sock):
                self._dispatch(peer, message)
        except (OSError, ValueError) as error:
            self._refuse("a connection", f"ended: {error}")
        finally:
            peer.alive = False
            with self._lock:
                if peer in self._peers:
                    self._peers.remove(peer)
                for watch in self._watches.values():
                    for subscriber in [s for s in watch.subscribers if s[0] is peer]:
                        del watch.subscribers[subscriber]
            peer.sock.close()

    def _dispatch(self, peer: _Peer, message: dict[str, Any]) -> None:
        request = message.get("id")
        if not isinstance(request, int):
            self._refuse("a request", f"has no integer id: {str(message)[:200]}")
            return
        try:
            op = message.get("op")
            if op == "arrive":
                self._enqueue(
                    f"arrive:{self._relative(message.get('slots'))}", _Request(peer, request, self._arrivals(message))
                )
            elif op == "put":
                key, value = self._relative(message.get("key")), _decoded(message.get("value"))
                read = self._names(message["read"]) if "read" in message else None
                self._enqueue("put", _Request(peer, request, (key, value, read)))
                # Taken, not yet written: a heartbeat does not wait; one that reads waits for its read after this.
                peer.send({"id": request, "taken": True, **({} if read is None else {"more": True})})
            elif op == "read":
                kind = "look" if message.get("periodic") is True else "read"
                self._enqueue(kind, _Request(peer, request, self._names(message.get("keys"))))
            elif op == "txn":
                self._enqueue("txn", _Request(peer, request, self._transaction(message.get("request"))))
            elif op == "event":
                event, event_id = self._event(message)
                stream = EVENTS_PROGRESS if event.name == "progress" else EVENTS_MAIN
                self._enqueue(f"event:{stream}", _Request(peer, request, (event, event_id)))
            elif op == "watch":
                self._watch(peer, request, self._relative(message.get("key")))
            elif op == "unwatch":
                with self._lock:
                    for watch in self._watches.values():
                        watch.subscribers.pop((peer, request), None)
            else:
                raise ValueError(f"op={op!r}: expected arrive, put, read, txn, event, watch or unwatch")
        except ValueError as error:
            self._refuse("a request", str(error))
            peer.send({"id": request, "error": str(error)})

    def _names(self, keys: object) -> list[str]:
        if not isinstance(keys, list) or not 0 < len(keys) <= _READ_KEYS:
            raise ValueError(f"keys: expected a list of 1 to {_READ_KEYS} keys")
        return [self._relative(key) for key in keys]

    def _relative(self, key: object) -> str:
        if not isinstance(key, str) or not key.startswith(self.prefix) or len(key) > 4096:
            raise ValueError(f"key {str(key)[:200]!r}: expected a key under {self.prefix!r}")
        return key[len(self.prefix) :]

    def _transaction(self, encoded: object) -> tuple[Any, set[bytes], int]:
        """A store write's ``TxnRequest`` from its bytes, checked: every key under the run's prefix, no nested
        transaction; with the keys it may write and its size."""
        raw = _decoded(encoded)
        try:
            request = etcdrpc.TxnRequest.FromString(raw)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError: a malformed request
            raise ValueError("request: expected a serialized TxnRequest") from None
        if any(op.WhichOneof("request") == "request_txn" for op in [*request.success, *request.failure]):
            raise ValueError("request: a nested transaction is not carried")
        touched, written = txn_keys(request)
        prefix = self.prefix.encode()
        outside = [key for key in touched if not key.startswith(prefix)]
        if outside:
            raise ValueError(f"key {outside[0][:200]!r}: expected a key under {self.prefix!r}")
        if len(request.compare) > TXN_OPS or len(request.success) > TXN_OPS or len(request.failure) > TXN_OPS:
            raise ValueError(f"request: more than {TXN_OPS} operations in a branch")
        return request, set(written), len(raw)

    def _event(self, message: dict[str, Any]) -> tuple[JobEvent, str]:
        if self._events is None:
            raise ValueError("this relay stores no events")
        event_id, text = message.get("event_id"), message.get("event")
        if not isinstance(event_id, str) or not 0 < len(event_id) <= 64 or not isinstance(text, str):
            raise ValueError("event: expected an event's JSON and its id")
        try:
            return JobEvent.from_json(text), event_id
        except MalformedRecord as error:
            raise ValueError(f"event: {error}") from None

    def _arrivals(self, message: dict[str, Any]) -> list[tuple[str, str]]:
        pairs = message.get("arrivals")
        if not isinstance(pairs, list) or not 0 < len(pairs) <= BATCH_ARRIVALS:
            raise ValueError(f"arrivals: expected a list of 1 to {BATCH_ARRIVALS} [key, token] pairs")
        arrivals = []
        for pair in pairs:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], str) and 0 < len(pair[1]) < 256):
                raise ValueError(f"arrival {str(pair)[:200]!r}: expected a [key, token] pair")
            arrivals.append((self._relative(pair[0]), pair[1]))
        return arrivals

    def _refuse(self, what: str, why: str) -> None:
        level = logging.WARNING if why not in self._refused else logging.DEBUG
        self._refused.add(why)
        log.log(level, "node relay: %s %s", what, why)

    # ---- batches ----

    def _enqueue(self, name: str, request: _Request) -> None:
        kind = name.split(":", 1)[0]
        with self._lock:
            batch = self._batches.get(name)
            if batch is None:
                linger = {"arrive": self.linger, "txn": 0.0, "read": 0.0}.get(kind, self.gather)
                batch = self._batches[name] = _Batch(kind, linger)
                while len(self._batches) > _BATCHES_REMEMBERED:
                    self._batches.popitem(last=False)
            if not batch.pending:
                batch.first_pending = time.monotonic()
            batch.pending.append(request)
            if kind == "arrive":
                batch.seen.update(key for key, _ in request.body)
            else:
                batch.seen.add(request.peer)
            self._lock.notify_all()

    def _due(self, kind: str, now: float) -> tuple[str, _Batch, list[_Request]] | None:
        """The batch of ``kind`` that leaves now, with its requests (taken out), or None."""
        for name, batch in self._batches.items():
            if batch.kind != kind or not batch.pending or batch.in_flight:
                continue
            if len(batch.seen) >= self.local_ranks or now - batch.first_pending >= batch.linger:
                taken, batch.pending = _writable(batch.pending) if batch.kind == "txn" else (batch.pending, [])
                if batch.kind != "arrive":
                    batch.seen = {item.peer for item in batch.pending}
                batch.in_flight = True
                return name, batch, taken
        return None

    def _next_deadline(self, kind: str) -> float | None:
        waiting = [
            b.first_pending + b.linger
            for b in self._batches.values()
            if b.kind == kind and b.pending and not b.in_flight
        ]
        return min(waiting) if waiting else None

    def _flush_loop(self, kind: str) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    due = self._due(kind, time.monotonic())
                    if due is not None:
                        break
                    deadline = self._next_deadline(kind)
                    self._lock.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            name, batch, taken = due
            try:
                # No longer than its ranks wait for it: past that they asked etcd themselves, and a batch
                # stuck on an unreachable etcd must not hold the next ones back for the store's timeout.
                with bounded(RELAY_PATIENCE, "the node relay's patience"):
                    self._senders()[batch.kind](name.partition(":")[2], taken)
            except Exception as error:  # noqa: BLE001 - each rank is told, and goes to etcd itself
                self._refuse(f"a batch of {batch.kind}", f"failed: {error}")
                for item in taken:
                    item.peer.send({"id": item.request, "error": f"the relay's batch failed: {error}"})
            finally:
                with self._lock:
                    batch.in_flight = False
                    batch.first_pending = time.monotonic()  # what came meanwhile leaves at once or soon
                    self._lock.notify_all()

    def _senders(self) -> dict[str, Callable[[str, list[_Request]], None]]:
        return {
            "arrive": self._send_arrivals,
            "put": self._send_puts,
            "read": functools.partial(self._send_reads, "read"),
            "look": functools.partial(self._send_reads, "look"),
            "txn": self._send_txns,
            "event": self._send_events,
        }

    def _send_events(self, _stream: str, taken: list[_Request]) -> None:
        """The host's events of the moment, numbered together in one transaction per :data:`APPEND_BATCH`."""
        events = self._events
        if events is None:
            raise RuntimeError("this relay stores no events")
        numbers: list[int] = []
        limit = min(events.capacity, APPEND_BATCH)
        for start in range(0, len(taken), limit):
            chunk = [item.body for item in taken[start : start + limit]]
            numbers += patiently(functools.partial(events.append_many, chunk), "the node relay's events")
        self._count("event", len(taken))
        for item, seq in zip(taken, numbers, strict=True):
            item.peer.send({"id": item.request, "seq": seq})

    def _send_txns(self, _name: str, taken: list[_Request]) -> None:
        """The host's store writes of the moment, each its own transaction (its guards, its token), nested in
        one request; a resend after an unknown outcome finds each committed write's token."""
        client = self._store.client
        responses = patiently(lambda: client.txns([item.body[0] for item in taken]), "the node relay's writes")
        self._count("txn", len(taken))
        for item, response in zip(taken, responses, strict=True):
            item.peer.send({"id": item.request, "response": base64.b64encode(response.SerializeToString()).decode()})

    def _send_arrivals(self, slots: str, taken: list[_Request]) -> None:
        pairs = [pair for item in taken for pair in item.body]
        numbers: list[int | None] = []
        for start in range(0, len(pairs), BATCH_ARRIVALS):
            numbers += self._store.arrive_batch(pairs[start : start + BATCH_ARRIVALS], slots)
        self._count("arrive", len(pairs))
        offset = 0
        for item in taken:
            item.peer.send({"id": item.request, "numbers": numbers[offset : offset + len(item.body)]})
            offset += len(item.body)

    def _send_puts(self, _name: str, taken: list[_Request]) -> None:
        """The latest value of each key and the keys the writers read, in one transaction (several past
        :data:`TXN_OPS` operations); a writer that reads nothing was answered when the relay took its value."""
        latest = {item.body[0]: item.body[1] for item in taken}
        readers = [item for item in taken if item.body[2] is not None]
        found = self._store.put_latest(latest, sorted({name for item in readers for name in item.body[2]}))
        self._count("put", len(taken))
        for item in readers:
            self._answer_read(item, item.body[2], found)

    def _send_reads(self, kind: str, _name: str, taken: list[_Request]) -> None:
        union = sorted({name for item in taken for name in item.body})
        found = self._store.get_existing(union)
        self._count(kind, len(taken))
        for item in taken:
            self._answer_read(item, item.body, found)

    def _answer_read(self, item: _Request, names: list[str], found: dict[str, bytes]) -> None:
        values = {self.prefix + name: base64.b64encode(found[name]).decode() for name in names if name in found}
        item.peer.send({"id": item.request, "values": values})

    def _count(self, kind: str, requests: int) -> None:
        """A batch went to etcd (counted before its ranks are answered, so an answered rank sees it counted)."""
        self.sent[kind] += 1
        self.carried[kind] += requests

    # ---- watches ----

    def _watch(self, peer: _Peer, request: int, key: str) -> None:
        with self._lock:
            value = self._values.get(key)
            if value is None:
                watch = self._watches.get(key)
                if watch is None:
                    watch = self._watches[key] = _SharedWatch()
                    thread = threading.Thread(
                        target=self._follow, args=(key, watch), name="elastic-ft-relay-watch", daemon=True
                    )
                    thread.start()
                watch.subscribers[(peer, request)] = None
                return
        peer.send({"id": request, "value": base64.b64encode(value).decode()})

    def _follow(self, key: str, watch: _SharedWatch) -> None:
        """Hold the key's one etcd watch while anybody waits on it; answer each subscriber once."""
        found: KeyWatch | None = None
        answer: dict[str, Any] = {"broken": True}
        try:
            found = self._store.watch_for(key)
            while not self._closed:
                if found.value is None and found.must_read():
                    if found.broken:
                        break
                    existing = self._store.get_existing([key])
                    if key in existing:
                        found.saw(existing[key])
                if found.value is not None:
                    answer = {"value": base64.b64encode(found.value).decode()}
                    with self._lock:
                        self._values[key] = found.value
                        while len(self._values) > _VALUES_REMEMBERED:
                            self._values.popitem(last=False)
                    break
                with self._lock:
                    if not watch.subscribers:
                        break
                found.appeared.wait(0.5)
        except Exception as error:  # noqa: BLE001 - its subscribers read the key themselves (a broken watch)
            self._refuse("a watch", f"failed: {error}")
        finally:
            if found is not None:
                found.stop()
            with self._lock:
                if self._watches.get(key) is watch:
                    del self._watches[key]
                subscribers = list(watch.subscribers)
            for peer, request in subscribers:
                peer.send({"id": request, **answer})


def _writable(pending: list[_Request]) -> tuple[list[_Request], list[_Request]]:
    """The store writes that go together (in order, none writing a key another one writes, within one request's
    size, the first one always), and those left for the next batch."""
    taken: list[_Request] = []
    left: list[_Request] = []
    written: set[bytes] = set()
    size = 0
    for item in pending:
        _, keys, length = item.body
        if taken and (left or keys & written or len(taken) >= TXN_OPS or size + length > _BATCH_BYTES):
            left.append(item)
            continue
        taken.append(item)
        written |= keys
        size += length
    return taken, left


def _decoded(value: object) -> bytes:
    if not isinstance(value, str) or len(value) > _MAX_LINE:
        raise ValueError("value: expected base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise ValueError("value: expected base64 text") from None


# ---- a rank's side ---------------------------------------------------------------------------------------


class _Call:
    def __init__(self) -> None:
        #: The relay took the request and its answer follows (a heartbeat that reads).
        self.taken = threading.Event()
        self.done = threading.Event()
        self.answer: dict[str, Any] | None = None


class RelayClient:
    """A process's connection to its node's relay, opened on first use; every method returns ``None`` (or raises
    :class:`RelayUnavailable`) when the relay cannot serve it, and the caller then asks etcd itself."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._down_until = 0.0
        self._pid = os.getpid()
        self._next_id = 0
        self._calls: dict[int, _Call] = {}
        self._watches: dict[int, KeyWatch] = {}
        #: Requests the relay answered, and those that went to etcd instead: for tests and benchmarks.
        self.relayed = 0
        self.bypassed = 0

    def arrive_batch(self, arrivals: Sequence[tuple[str, str]], slots: str, timeout: float) -> list[int | None]:
        """The relay's :meth:`EtcdStore.arrive_batch` (full etcd keys), answered within ``timeout`` seconds.

        Raises:
            RelayUnavailable: no answer: the arrivals may have been committed (their tokens make a resend safe).
        """
        message = {"op": "arrive", "slots": slots, "arrivals": [list(pair) for pair in arrivals]}
        answer = self._call(message, min(timeout, RELAY_PATIENCE), "an arrival")
        numbers = answer.get("numbers")
        if (
            not isinstance(numbers, list)
            or len(numbers) != len(arrivals)
            or not all(number is None or (isinstance(number, int) and number > 0) for number in numbers)
        ):
            raise self._bypass(f"the relay answered an arrival with {str(answer)[:200]}")
        return numbers

    def put_latest(self, key: str, value: bytes, timeout: float, read: Sequence[str] = ()) -> dict[str, bytes]:
        """Hand the relay a value of ``key`` (a full etcd key) to write with its host's others.

        Without ``read``, returns (nothing) once the relay took the value: its write follows within the relay's
        gather time. With ``read`` (full keys: a heartbeat's ring check), the same transaction reads them after
        the host's writes; returns the values of those that exist, once written and read.

        Raises:
            RelayUnavailable: the relay did not take the value within :data:`_PUT_PATIENCE` (it may be stopped),
                or did not answer the read.
        """
        message: dict[str, Any] = {"op": "put", "key": key, "value": base64.b64encode(value).decode()}
        if not read:
            answer = self._call(message, min(timeout, _PUT_PATIENCE), "a write")
            if answer.get("taken") is not True:
                raise self._bypass(f"the relay answered a write with {str(answer)[:200]}")
            return {}
        message["read"] = list(read)
        answer = self._call(message, min(timeout, RELAY_PATIENCE), "a write and its read", taken_within=_PUT_PATIENCE)
        return self._values(answer, read, "a read")

    def get_existing(self, keys: Sequence[str], timeout: float, *, periodic: bool = False) -> dict[str, bytes]:
        """The values of those of ``keys`` (full etcd keys) that exist, read by the relay with its host's other
        reads of the moment (``periodic``: gathered with the host's reads made at the same instants, within the
        relay's gather time; otherwise only with those that came while its previous read was in flight).

        Raises:
            RelayUnavailable: no answer.
        """
        message = {"op": "read", "keys": list(keys), "periodic": periodic}
        return self._values(self._call(message, min(timeout, RELAY_PATIENCE), "a read"), keys, "a read")

    def _values(self, answer: dict[str, Any], keys: Sequence[str], what: str) -> dict[str, bytes]:
        """The values a read's ``answer`` carries for ``keys`` (untrusted: a malformed answer bypasses the relay)."""
        values = answer.get("values")
        if not isinstance(values, dict):
            raise self._bypass(f"the relay answered {what} with {str(answer)[:200]}")
        wanted = set(keys)
        try:
            return {key: _decoded(value) for key, value in values.items() if key in wanted}
        except ValueError as error:
            raise self._bypass(f"the relay answered {what} with {error}") from None

    def txn(self, request: Any, timeout: float) -> Any:
        """A store write's ``TxnRequest``, sent by the relay with its host's others; its ``TxnResponse``.

        Raises:
            RelayUnavailable: no answer: the write may have committed (its token makes a resend safe).
        """
        encoded = base64.b64encode(request.SerializeToString()).decode()
        answer = self._call({"op": "txn", "request": encoded}, min(timeout, RELAY_PATIENCE), "a write")
        try:
            return etcdrpc.TxnResponse.FromString(_decoded(answer.get("response")))
        except Exception:  # noqa: BLE001 - a malformed answer: etcd is asked directly
            raise self._bypass(f"the relay answered a write with {str(answer)[:200]}") from None

    def append_event(self, event: JobEvent, event_id: str) -> int:
        """Store ``event`` in the run's log through the relay, with the host's other events of the moment; its
        number.

        Raises:
            RelayUnavailable: no answer (the sink then stores it itself).
        """
        message = {"op": "event", "event": event.to_json(), "event_id": event_id}
        answer = self._call(message, RELAY_PATIENCE, "an event")
        seq = answer.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise self._bypass(f"the relay answered an event with {str(answer)[:200]}")
        return seq

    def _call(
        self, message: dict[str, Any], patience: float, what: str, *, taken_within: float | None = None
    ) -> dict[str, Any]:
        """Send ``message`` and wait for its answer, at most ``patience`` seconds (less under a shorter bound);
        ``taken_within``: the relay must say it took the request that soon (a stopped relay is left quickly)."""
        call = _Call()
        request = self._send(message, call)
        started = time.monotonic()
        deadline = started + time_left(patience)
        take_by = deadline if taken_within is None else min(deadline, started + taken_within)
        while not call.done.is_set():
            untaken = not call.taken.is_set()
            left = (take_by if untaken else deadline) - time.monotonic()
            if left <= 0:
                self._calls.pop(request, None)
                # A relay that does not answer (its agent stopped, or stuck on etcd) is left alone for a while:
                # the requests that follow go to etcd at once, not each after its own patience.
                self._down_until = time.monotonic() + _RETRY_RELAY_AFTER
                bound = taken_within if untaken and taken_within is not None else patience
                raise self._bypass(f"no answer to {what} within {bound:g} s")
            with shield():  # a restart raised inside the event's wait could leave its lock held
                call.done.wait(min(_WAIT_SLICE, left))
        answer = call.answer
        if answer is None or "error" in answer:
            raise self._bypass(f"{what}: {'the relay went away' if answer is None else answer['error']}")
        self.relayed += 1
        return answer

    def watch_for(self, key: str) -> KeyWatch:
        """A watch for ``key`` (a full etcd key) held by the relay: the same contract as
        :meth:`EtcdStore.watch_for`; a relay that goes away breaks it.

        Raises:
            RelayUnavailable: the relay could not be asked.
        """
        found = KeyWatch()
        request = self._send({"op": "watch", "key": key}, found)

        def stop() -> None:
            if self._watches.pop(request, None) is not None:
                with contextlib.suppress(RelayUnavailable):
                    self._send({"op": "unwatch", "id": request}, None, request=request)

        found.stop = stop
        self.relayed += 1
        return found

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _bypass(self, why: str) -> RelayUnavailable:
        self.bypassed += 1
        log.debug("node relay at %s: %s; asking etcd directly", self.path, why)
        return RelayUnavailable(f"node relay at {self.path}: {why}")

    def _send(self, message: dict[str, Any], waiter: _Call | KeyWatch | None, request: int | None = None) -> int:
        with shield(), self._lock:  # one whole line per message, whatever a restart does meanwhile
            sock = self._connected()
            if request is None:
                self._next_id += 1
                request = self._next_id
            if isinstance(waiter, _Call):
                self._calls[request] = waiter
            elif waiter is not None:
                self._watches[request] = waiter
            try:
                sock.sendall(_line({**message, "id": request}))
            except OSError as error:
                self._calls.pop(request, None)
                self._watches.pop(request, None)
                self._lost_locked(sock)
                raise self._bypass(f"could not send: {error}") from None
            return request

    def _connected(self) -> socket.socket:
        if self._sock is not None and self._pid != os.getpid():  # a forked child: the connection is the parent's
            self._sock, self._calls, self._watches = None, {}, {}
        if time.monotonic() < self._down_until:
            raise self._bypass("unreachable or silent a moment ago")
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(1.0)
        try:
            sock.connect(self.path)
        except OSError as error:
            sock.close()
            self._down_until = time.monotonic() + _RETRY_RELAY_AFTER
            raise self._bypass(f"could not connect: {error}") from None
        sock.settimeout(None)
        self._sock, self._pid = sock, os.getpid()
        threading.Thread(target=self._read, args=(sock,), name="elastic-ft-relay-client", daemon=True).start()
        return sock

    def _read(self, sock: socket.socket) -> None:
        try:
            for message in _lines(sock):
                self._answer(message)
        except (OSError, ValueError):
            pass
        with self._lock:
            self._lost_locked(sock)

    def _answer(self, message: dict[str, Any]) -> None:
        request = message.get("id")
        if not isinstance(request, int):
            return
        call = self._calls.get(request)
        if call is not None:
            if message.get("more") is True:
                call.taken.set()
                return
            self._calls.pop(request, None)
            call.answer = message
            call.done.set()
            return
        watch = self._watches.get(request)
        if watch is None:
            return
        value = message.get("value")
        if isinstance(value, str):
            try:
                watch.saw(base64.b64decode(value, validate=True))
                return
            except ValueError:
                pass
        self._watches.pop(request, None)
        watch.lost()

    def _lost_locked(self, sock: socket.socket) -> None:
        """The connection ended: every waiter learns it now (an arrival goes to etcd, a watch is broken)."""
        if self._sock is sock:
            self._sock = None
            self._down_until = time.monotonic() + _RETRY_RELAY_AFTER
        calls, self._calls = self._calls, {}
        watches, self._watches = self._watches, {}
        for call in calls.values():
            call.done.set()  # no answer: the caller goes to etcd
        for watch in watches.values():
            watch.lost()
        with contextlib.suppress(OSError):
            sock.close()


def relay_from_env(environ: dict[str, str] | os._Environ[str]) -> RelayClient | None:
    """The client of the relay a worker's agent named (:data:`RELAY_ENV`), or None."""
    path = environ.get(RELAY_ENV)
    if not path:
        return None
    if not os.path.isabs(path):
        raise ValueError(f"{RELAY_ENV}={path!r}: expected the absolute path of the node relay's socket")
    return RelayClient(path)
