"""A ``torch.distributed.Store`` kept in etcd.

The etcdft rendezvous hands one to every round (under
``<etcd_prefix>/<run_id>/round/<n>/store/``), so the round's coordination data
lives in the etcd cluster rather than in any one process.  Semantics follow
torch's ``TCPStore`` (the tests run the same assertions against both):

* ``get``/``multi_get``/``wait`` block until the keys exist, up to the store's
  timeout (or the one given), then raise ``torch.distributed.DistStoreError``.
  Blocking uses an etcd watch, never polling.
* ``add`` keeps the counter as a decimal string, as TCPStore does, and is
  atomic (compare-and-swap on the key's mod revision).
* Every write commits at most once, whatever the transport does. The client
  resends a request whose answer it did not get, and the first send may have
  committed; so each write is a transaction that also creates a *token* key
  unique to the write (:func:`elastic_ft.keys.store_write_token`, on a lease
  that outlives any resend) and requires it to be absent. A resend of a write
  that had committed finds its token and reports the first outcome instead
  of applying the write again. When no answer comes at all within the
  operation's bound, the write raises :class:`StoreWriteOutcomeUnknown`.
* etcd away is a wait, not an error (:mod:`elastic_ft.etcd.outage`), as a
  TCPStore client waits for its server: every operation retries with
  backoff while etcd is unreachable, resending the same request, for as long
  as its bound allows: the store's timeout (``wait``'s own, when given), or
  less inside a shorter wait (:func:`~elastic_ft.etcd.outage.bounded`). Then
  it raises :class:`EtcdStoreUnavailable` (a ``DistStoreError``, and a
  ``ConnectionError``), saying how long etcd was away.
* ``compare_set(key, expected, desired)`` sets ``desired`` when the current
  value equals ``expected`` (or when the key is missing and ``expected`` is
  empty) and returns the value the key holds afterwards; a missing key with a
  non-empty ``expected`` returns ``expected``, as TCPStore does.
* Queues (``queue_push``, ``queue_pop``, ``queue_len``) are first in,
  first out by etcd's create revision; a pop removes its item exactly once
  (a resend of a pop that committed returns the item it took), and a
  blocking pop waits on a watch up to the store's timeout. As in TCPStore,
  a queue holding items counts as its name for ``check`` and ``wait``, but
  not for ``num_keys`` or ``list_keys``.
* ``clone()`` returns another handle on the same keys and client, for
  another thread; the store keeps every clone alive (torch drops the
  Python side of a store returned to C++, after which its methods fail).

Values are opaque bytes; etcd limits one value to 1.5 MiB by default.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from elastic_ft.etcd.client import (
    Compare,
    EtcdClient,
    EtcdUnavailableError,
    Op,
    TxnResult,
    WatchEvent,
    delete_op,
    get_op,
    key_missing,
    key_modified_at,
    prefix_op,
    put_op,
    txn_request,
    txn_result,
)
from elastic_ft.etcd.kv import BATCH_ARRIVALS, RelayUnavailable
from elastic_ft.etcd.outage import bounded
from elastic_ft.etcd.shield import shielded
from elastic_ft.etcd.store_ops import (
    TXN_OPS,
    EtcdStoreUnavailable,
    OnceWriter,
    StoreKeys,
    StoreReader,
    StoreWriteOutcomeUnknown,
    TokenLease,
)
from elastic_ft.keys import store_queue_prefix

__all__ = ["BATCH_ARRIVALS", "EtcdStore", "EtcdStoreUnavailable", "KeyWatch", "StoreWriteOutcomeUnknown"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _bounded_op(method: _F) -> _F:
    """Run a store operation within the store's timeout, retrying while etcd is unreachable (the module
    docstring); at the bound, :class:`EtcdStoreUnavailable`."""

    @functools.wraps(method)
    def run(self: EtcdStore, *args: Any, **kwargs: Any) -> Any:
        seconds = self.timeout.total_seconds()
        with bounded(seconds, f"the store's timeout ({seconds:g} s)"):
            try:
                return method(self, *args, **kwargs)
            except EtcdStoreUnavailable:
                raise
            except EtcdUnavailableError as error:
                raise EtcdStoreUnavailable(f"{method.__name__} on {self.prefix}: {error}") from error

    return run  # type: ignore[return-value]  # the same signature as method


def _as_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class KeyWatch:
    """What :meth:`EtcdStore.watch_for` keeps of one key. ``appeared`` is set when there is something to look
    at: the key's ``value`` (the watch saw it put), a read to make once (the key may have come between the
    caller's read and the watch's creation), or a broken watch (``broken``: the caller reads from then on).
    :meth:`must_read` says whether to read; ``stop()`` ends the watch.

    No lock: the waiting thread may be interrupted by a restart at any moment, and a lock it held would stall
    the watch's thread. The one race, a value arriving as :meth:`must_read` clears ``appeared``, costs the
    waiter one wait slice: it checks ``value`` before each wait.
    """

    def __init__(self) -> None:
        self.appeared = threading.Event()
        self.value: bytes | None = None
        self.broken = False
        self._read_once = False
        self.stop: Callable[[], None] = lambda: None

    def saw(self, value: bytes) -> None:
        if self.value is None:
            self.value = value
        self.appeared.set()

    def missed_maybe(self) -> None:
        self._read_once = True
        self.appeared.set()

    def lost(self) -> None:
        self.broken = True
        self.appeared.set()

    @shielded  # clearing the event takes its lock: no restart may cut that
    def must_read(self) -> bool:
        """Whether the caller must read the key itself: always once the watch broke, once after it may have
        missed the key (``appeared`` is then cleared, to wait for the watch again)."""
        if self.broken:
            return True
        if not self._read_once:
            return False
        self._read_once = False
        if self.value is None:
            self.appeared.clear()
        return True


class Relay(Protocol):
    """What a store asks of its node's relay (:class:`elastic_ft.etcd.node_relay.RelayClient`): full etcd keys in,
    :class:`RelayUnavailable` when the relay cannot serve."""

    def arrive_batch(self, arrivals: Sequence[tuple[str, str]], slots: str, timeout: float) -> list[int | None]: ...

    def watch_for(self, key: str) -> KeyWatch: ...

    def put_latest(self, key: str, value: bytes, timeout: float, read: Sequence[str] = ()) -> dict[str, bytes]: ...

    def txn(self, request: Any, timeout: float) -> Any: ...

    def append_event(self, event: Any, event_id: str) -> int: ...

    def get_existing(self, keys: Sequence[str], timeout: float, *, periodic: bool = False) -> dict[str, bytes]: ...

    def close(self) -> None: ...


class EtcdStore(dist.Store):
    """Keys live under ``prefix`` in etcd; see the module docstring."""

    #: ``wait`` is a watch, not a poll: callers may block in it freely.
    waits_without_polling = True
    #: torch's ``Store.timeout`` property (``set_timeout`` changes it), which torch's stubs leave out.
    timeout: timedelta

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        timeout: timedelta = timedelta(seconds=300),
        *,
        tokens: TokenLease | None = None,
        relay: Relay | None = None,
    ) -> None:
        super().__init__()
        if not prefix.endswith("/"):
            raise ValueError(f"EtcdStore prefix {prefix!r} must end with '/'")
        #: The etcd connection (shared with clones; the Wrapper's event log uses it too).
        self.client = client
        self.prefix = prefix
        self.set_timeout(timeout)
        self._keys = StoreKeys(client, prefix)
        self._reads = StoreReader(self._keys, lambda: self.timeout)
        #: ``tokens``: the lease write tokens go on, shared with the stores made from this one (``group_store``).
        self._writes = OnceWriter(self._keys, lambda: self.timeout, tokens or TokenLease(), self._txn)
        self._clones_lock = threading.Lock()
        self._clones: list[EtcdStore] = []
        #: The node's relay (:mod:`elastic_ft.etcd.node_relay`), which batches barrier arrivals and shares watches
        #: among the host's ranks; None: every request goes to etcd.
        self.relay = relay

    def _txn(self, compare: list[Compare], success: list[Op], failure: list[Op]) -> TxnResult:
        """A write's transaction: through the node's relay, merged with its host's writes of the moment, when
        there is one; else to etcd. The same request either way, its token included: a resend to etcd after
        the relay, which may have committed it, applies it at most once."""
        request = txn_request(compare, success, failure)
        if self.relay is not None:
            try:
                return txn_result(self.relay.txn(request, self.timeout.total_seconds()))
            except RelayUnavailable:
                pass
        return txn_result(self.client.txn_request(request))

    @property
    def writes_recovered(self) -> int:
        """Writes whose commit was learnt from their token: a resend after an earlier send had committed."""
        return self._writes.recovered

    @_bounded_op
    def get(self, key: str) -> bytes:
        return self._reads.values([key])[key].value

    @_bounded_op
    def multi_get(self, keys: list[str]) -> list[bytes]:
        found = self._reads.values(keys)
        return [found[k].value for k in keys]

    @_bounded_op
    def get_existing(self, keys: list[str], *, periodic: bool = False) -> dict[str, bytes]:
        """The values of those of ``keys`` that exist (no wait for the others): one request per 128 keys; through
        the node's relay when there is one, merged with the host's other reads of the moment (``periodic``: a
        read every rank of the host makes at the same instants, which the relay gathers)."""
        if not keys:
            return {}
        if self.relay is not None:
            full = {self._keys.key(key): key for key in keys}
            try:
                found = self.relay.get_existing(list(full), self.timeout.total_seconds(), periodic=periodic)
                return {full[key]: value for key, value in found.items()}
            except RelayUnavailable:
                pass
        read, _ = self._reads.fetch(keys)
        return {key: kv.value for key, kv in read.items()}

    @_bounded_op
    def put_latest(self, values: Mapping[str, bytes], read: Sequence[str] = ()) -> dict[str, bytes]:
        """Write values whose only contract is that the newest one of each key wins (a heartbeat): one request,
        without the exactly-once token of ``set`` (a resend writes the same value again). One key goes through
        the node's relay when there is one, which writes its host's heartbeats in one transaction.

        ``read``: keys the same request reads after its writes (a monitor's heartbeat carries its ring check:
        one request a second for both); returns the values of those that exist. Through the relay, the read
        rides in the same transaction as the host's heartbeats of the moment."""
        names = {self._keys.key(key): key for key in read}
        if self.relay is not None and len(values) == 1:
            ((key, value),) = values.items()
            try:
                relayed = self.relay.put_latest(self._keys.key(key), value, self.timeout.total_seconds(), list(names))
                return {names[full]: read_value for full, read_value in relayed.items()}
            except RelayUnavailable:
                pass
        ops = [put_op(self._keys.key(key), value) for key, value in values.items()]
        ops += [get_op(full) for full in names]
        found: dict[str, bytes] = {}
        for start in range(0, len(ops), TXN_OPS):
            result = self._keys.ask(functools.partial(self.client.txn, [], ops[start : start + TXN_OPS]))
            for kvs in result.ranges:
                for kv in kvs or ():
                    if kv.key in names:
                        found[names[kv.key]] = kv.value
        return found

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._reads.await_keys(keys, timeout, queues=True)

    @_bounded_op
    def check(self, keys: list[str]) -> bool:
        missing, _ = self._reads.missing(keys, queues=True)
        return not missing

    @_bounded_op
    def num_keys(self) -> int:
        return self._keys.ask(lambda: self.client.count_prefix(self.prefix))

    # torch's Python-store trampoline (torch 2.13) looks these two methods up by their C++ names, every
    # other by its Python name: a PrefixStore (or any C++ caller) reaches ``num_keys`` and ``delete_key``
    # only through these.

    def getNumKeys(self) -> int:
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:
        return self.delete_key(key)

    @_bounded_op
    def list_keys(self) -> list[str]:
        kvs, _ = self._keys.ask(lambda: self.client.get_prefix(self.prefix))
        return [kv.key[len(self.prefix) :] for kv in kvs]

    def has_extended_api(self) -> bool:
        """``multi_get``, ``multi_set``, ``append`` and ``queue_*`` are real (torch asks before using them)."""
        return True

    def clone(self) -> EtcdStore:
        copy = EtcdStore(self.client, self.prefix, self.timeout, tokens=self._writes.tokens, relay=self.relay)
        with self._clones_lock:
            self._clones.append(copy)
        return copy

    # ---- queues ----

    @_bounded_op
    def queue_push(self, key: str, value: str | bytes) -> None:
        item = store_queue_prefix(self.prefix, key) + uuid.uuid4().hex
        self._writes.write(f"queue_push({key!r})", [put_op(item, _as_bytes(value))])

    @_bounded_op
    def queue_len(self, key: str) -> int:
        return self._keys.ask(lambda: self.client.count_prefix(store_queue_prefix(self.prefix, key)))

    @_bounded_op
    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item of queue ``key``, removed exactly once.

        Raises:
            torch.distributed.QueueEmptyError: the queue is empty and ``block`` is false.
            torch.distributed.DistStoreError: still empty after the store's timeout.
        """
        prefix = store_queue_prefix(self.prefix, key)
        token = uuid.uuid4().hex
        seconds = self.timeout.total_seconds()
        deadline = time.monotonic() + seconds
        while True:
            items, revision = self._keys.ask(lambda: self.client.get_prefix(prefix))
            if items:
                first = min(items, key=lambda kv: kv.create_revision)
                guard = key_modified_at(first.key, first.mod_revision)
                taken = self._writes.commit_once(
                    f"queue_pop({key!r})", [guard], [delete_op(first.key)], token, first.value
                )
                if taken is not None:
                    return taken
                continue  # another client took it first
            if not block:
                raise dist.QueueEmptyError(f"queue_pop({key!r}): the queue is empty")
            if not self._reads.await_put(prefix, revision, deadline):
                raise dist.DistStoreError(f"wait timeout after {seconds * 1000:.0f}ms, queue: {key}")

    # ---- writes ----

    @_bounded_op
    def set(self, key: str, value: str | bytes) -> None:
        self._writes.write(f"set({key!r})", [put_op(self._keys.key(key), _as_bytes(value))])

    @_bounded_op
    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        ops = [put_op(self._keys.key(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)]
        for start in range(0, len(ops), TXN_OPS - 1):  # one op of each transaction is its token
            self._writes.write(f"multi_set({keys[start]!r}, ...)", ops[start : start + TXN_OPS - 1])

    @_bounded_op
    def delete_key(self, key: str) -> bool:
        full = self._keys.key(key)
        token = uuid.uuid4().hex
        while True:
            kv, _ = self._keys.ask(lambda: self.client.get(full))
            if kv is None:
                return False
            guard = key_modified_at(full, kv.mod_revision)
            if self._writes.commit_once(f"delete_key({key!r})", [guard], [delete_op(full)], token, b"1") is not None:
                return True

    @_bounded_op
    def arrive_batch(self, arrivals: Sequence[tuple[str, str]], slots: str) -> list[int | None]:
        """Count many ranks' arrivals at one barrier, each at most once, in one transaction.

        ``arrivals`` holds ``(arrived key, token)`` pairs (at most
        :data:`BATCH_ARRIVALS`); ``slots`` is the barrier's counter prefix
        (:func:`elastic_ft.keys.barrier_count_slots`). The transaction creates
        every arrived key with its token and rewrites slots ``0 .. k-1`` once
        each, so the sum of the slots' versions is the number of arrivals,
        and reads the slots back: one request for a node's ranks, where a
        request per rank made a barrier's cost grow with the ranks. etcd
        applies transactions one after another, so the sums the arrivals see
        are distinct and the one that completes the barrier is unique.

        Returns, for each pair, its number among the barrier's arrivals
        (``1 .. world``) when this call counted it, ``None`` when another token
        had arrived for that key first. A resend of a transaction that had
        committed finds its own tokens and counts them once; their numbers are
        then read from the current sum (a later arrival may be in it: whoever
        then publishes the barrier's result does so with ``compare_set``, and
        the first result holds).

        Raises:
            StoreWriteOutcomeUnknown: etcd did not answer within the bound; the arrivals may have counted (a
                resend with the same tokens counts them once).
        """
        if not 0 < len(arrivals) <= BATCH_ARRIVALS:
            raise ValueError(f"arrive_batch takes 1 to {BATCH_ARRIVALS} arrivals, got {len(arrivals)}")
        full = [(self._keys.key(key), token.encode()) for key, token in arrivals]
        slot_prefix = self._keys.key(slots)
        if self.relay is not None:
            relayed = [(key, token) for (key, _), (_, token) in zip(full, arrivals, strict=True)]
            try:
                return self.relay.arrive_batch(relayed, slot_prefix, self.timeout.total_seconds())
            except RelayUnavailable:
                pass  # to etcd with the same tokens: an arrival the relay did commit counts once
        numbers: list[int | None] = [None] * len(full)
        todo = list(range(len(full)))
        while todo:
            batch = [full[i] for i in todo]
            puts = [put_op(key, token) for key, token in batch]
            puts += [put_op(f"{slot_prefix}{slot}", b"") for slot in range(len(batch))]
            try:
                outcome = self._keys.ask(
                    functools.partial(
                        self.client.txn,
                        [key_missing(key) for key, _ in batch],
                        [*puts, prefix_op(slot_prefix)],
                        [*(get_op(key) for key, _ in batch), prefix_op(slot_prefix)],
                    )
                )
            except EtcdUnavailableError as exc:
                raise StoreWriteOutcomeUnknown(
                    f"arrive_batch({len(batch)} under {slots!r}): etcd did not answer, they may count: {exc}"
                ) from exc
            total = sum(kv.version for kv in outcome.ranges[-1] or [])
            if outcome.succeeded:
                mine = todo
                todo = []
            else:
                held = {i: kvs[0].value if kvs else None for i, kvs in zip(todo, outcome.ranges[:-1], strict=True)}
                mine = [i for i in todo if held[i] == full[i][1]]
                todo = [i for i in todo if held[i] is None]  # arrived for by nobody yet: try them again
            for offset, i in enumerate(mine):
                numbers[i] = total - len(mine) + 1 + offset
        return numbers

    @_bounded_op
    def watch_for(self, key: str) -> KeyWatch:
        """A watch for ``key`` to exist (no request while it does not): see :class:`KeyWatch`. Through the node's
        relay when there is one: one etcd watch per host, whatever the number of its ranks waiting."""
        full = self._keys.key(key)
        if self.relay is not None:
            try:
                return self.relay.watch_for(full)
            except RelayUnavailable:
                pass
        kv, revision = self._keys.ask(lambda: self.client.get(full))
        found = KeyWatch()
        if kv is not None:
            found.saw(kv.value)
            return found

        def on_events(events: list[WatchEvent], _revision: int) -> None:
            for event in events:
                if not event.deleted:
                    found.saw(event.kv.value)

        def on_created(created_at: int) -> None:
            if created_at > revision:  # the key may have come between the read and the watch: the caller reads
                found.missed_maybe()

        watch = self._keys.ask(
            lambda: self.client.watch_key(full, 0, on_events, lambda _error: found.lost(), on_created)
        )
        found.stop = watch.close
        return found

    @_bounded_op
    def arrivals(self, slots: str) -> int:
        """The number of arrivals :meth:`arrive_batch` counted under the counter prefix ``slots``."""
        kvs, _ = self._keys.ask(lambda: self.client.get_prefix(self._keys.key(slots)))
        return sum(kv.version for kv in kvs)

    @_bounded_op
    def add(self, key: str, amount: int) -> int:
        def increment(current: bytes | None) -> bytes:
            try:
                base = int(current) if current is not None else 0
            except ValueError:
                raise dist.DistStoreError(f"add({key!r}): the value {current!r} is not an integer") from None
            return str(base + amount).encode()

        return int(self._writes.read_modify_write(f"add({key!r}, {amount})", key, increment))

    @_bounded_op
    def append(self, key: str, value: str | bytes) -> None:
        data = _as_bytes(value)
        self._writes.read_modify_write(f"append({key!r})", key, lambda current: (current or b"") + data)

    @_bounded_op
    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        full = self._keys.key(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        token = uuid.uuid4().hex
        while True:
            kv, _ = self._keys.ask(lambda: self.client.get(full))
            if kv is None:
                if expected:
                    return expected
                guard = key_missing(full)
            elif kv.value != expected:
                return kv.value
            else:
                guard = key_modified_at(full, kv.mod_revision)
            if (
                self._writes.commit_once(f"compare_set({key!r})", [guard], [put_op(full, desired)], token, desired)
                is not None
            ):
                return desired

    def __repr__(self) -> str:
        return f"EtcdStore({self.client.describe_endpoints()}, prefix={self.prefix!r})"
