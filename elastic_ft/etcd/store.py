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
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from elastic_ft.etcd.client import (
    Compare,
    EtcdClient,
    EtcdUnavailableError,
    EtcdWatch,
    KeyValue,
    Op,
    WatchEvent,
    delete_op,
    first_key_op,
    get_op,
    key_missing,
    key_modified_at,
    put_op,
)
from elastic_ft.etcd.outage import OUTAGES, bounded, patiently
from elastic_ft.etcd.shield import shield, shielded
from elastic_ft.keys import parse_store_queue_key, store_queue_prefix, store_queues_prefix, store_write_token

# etcd's default --max-txn-ops.
_TXN_OPS = 128
_T = TypeVar("_T")


#: The longest a blocking wait of the store waits in one shielded slice (see :func:`_next_item`).
_WAIT_SLICE = 0.1


def _next_item(events: queue.Queue[_T], remaining: float) -> _T:
    """The next item of a watch's queue within ``remaining`` seconds, waited for in one shielded slice.

    ``queue.Queue.get`` takes a Python-level lock, which a restart raised
    inside it could leave held (:mod:`elastic_ft.etcd.shield`); the slice is
    short so that a restart raised when it ends still ends a long wait at once.

    Raises:
        queue.Empty: nothing came within the slice.
    """
    with shield():
        return events.get(timeout=min(remaining, _WAIT_SLICE))


class EtcdStoreUnavailable(dist.DistStoreError, EtcdUnavailableError):
    """etcd did not answer within an operation's bound (the store's timeout, or a shorter enclosing one)."""


class StoreWriteOutcomeUnknown(EtcdStoreUnavailable):
    """etcd did not answer a write within its bound: it may or may not have committed (once)."""


#: How long etcd may stay silent during a wait before the store reads the keys again: a watch stream that
#: died without a word (a black-holed connection gRPC has not noticed yet) must not hide a key for long.
_RECHECK_AFTER = 10.0


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


def _unreachable_note() -> str:
    """``"; etcd ... unreachable for the last N s"`` while this process sees an outage, else empty."""
    since = OUTAGES.down_since()
    return "" if since is None else f"; etcd has been unreachable for the last {time.monotonic() - since:.1f} s"


def _as_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


@dataclass(frozen=True)
class _Created:
    """A wait's watch exists: it delivers every change after ``revision``."""

    revision: int


#: What a wait's watches hand its loop: a batch of events, the end of a watch, or a watch's creation.
_WatchItem = list[WatchEvent] | Exception | _Created


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


class _TokenLease:
    """The lease a store's write tokens go on: its id, when to replace it (``time.monotonic()``), and the TTL it
    was asked for; None until the first write."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: tuple[int, float, int] | None = None


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
        tokens: _TokenLease | None = None,
    ) -> None:
        super().__init__()
        if not prefix.endswith("/"):
            raise ValueError(f"EtcdStore prefix {prefix!r} must end with '/'")
        self._client = client
        self.prefix = prefix
        self.set_timeout(timeout)
        #: Writes whose commit was learnt from their token: a resend after an earlier send had committed.
        self.writes_recovered = 0
        #: The lease write tokens go on: shared with the stores made from this one (``group_store``).
        self._tokens = tokens or _TokenLease()
        self._clones_lock = threading.Lock()
        self._clones: list[EtcdStore] = []

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _timeout_seconds(self, timeout: timedelta | None) -> float:
        return (timeout if timeout is not None else self.timeout).total_seconds()

    def _ask(self, call: Callable[[], _T]) -> _T:
        """One etcd request, resent with backoff while etcd is unreachable, within the operation's bound."""
        return patiently(call, f"EtcdStore at {self.prefix}")

    # ---- reads ----

    def _fetch(self, keys: Sequence[str]) -> tuple[dict[str, KeyValue], int]:
        """Read many keys consistently: one range request for one key, one transaction per 128 keys."""
        found: dict[str, KeyValue] = {}
        if len(keys) == 1:
            kv, revision = self._ask(functools.partial(self._client.get, self._key(keys[0])))
            if kv is not None:
                found[keys[0]] = kv
            return found, revision
        revision = 0
        for start in range(0, len(keys), _TXN_OPS):
            chunk = keys[start : start + _TXN_OPS]
            result = self._ask(functools.partial(self._client.txn, [], [get_op(self._key(k)) for k in chunk]))
            revision = max(revision, result.revision)
            for key, kvs in zip(chunk, result.ranges, strict=True):
                if kvs:
                    found[key] = kvs[0]
        return found, revision

    def _missing(self, keys: Sequence[str], queues: bool) -> tuple[set[str], int]:
        """The keys that do not exist (with ``queues``: whose queue is empty too), and the revision read at."""
        if not queues:
            found, revision = self._fetch(keys)
            return {k for k in keys if k not in found}, revision
        missing: set[str] = set()
        revision = 0
        per_txn = _TXN_OPS // 2  # the key, and the first item of its queue
        for start in range(0, len(keys), per_txn):
            chunk = keys[start : start + per_txn]
            ops = [op for k in chunk for op in (get_op(self._key(k)), first_key_op(store_queue_prefix(self.prefix, k)))]
            result = self._ask(functools.partial(self._client.txn, [], ops))
            revision = max(revision, result.revision)
            for index, key in enumerate(chunk):
                if not result.ranges[2 * index] and not result.ranges[2 * index + 1]:
                    missing.add(key)
        return missing, revision

    def _await(
        self, keys: Sequence[str], timeout: timedelta | None, *, queues: bool, read: tuple[set[str], int] | None = None
    ) -> None:
        """Block until every key exists (with ``queues``: or its queue holds an item, as TCPStore's ``wait`` and
        ``check`` count it), on watches; ``DistStoreError`` at the timeout, etcd reachable or not.

        ``read``: the keys missing at a revision the caller read already.

        The watches start from now on, not after the read (a watch that
        starts in the past gets its first events up to 100 ms late, see
        :meth:`EtcdClient.watch_prefix`); once etcd created them, what
        changed between the read and their start is read again.
        """
        seconds = self._timeout_seconds(timeout)
        deadline = time.monotonic() + seconds
        with bounded(seconds, f"the wait's timeout ({seconds:g} s)"):
            try:
                missing, revision = read if read is not None else self._missing(keys, queues)
                while missing:
                    events: queue.Queue[_WatchItem] = queue.Queue()
                    watches = self._ask(functools.partial(self._watch, sorted(missing), events, queues))
                    try:
                        self._await_events(missing, revision, events, deadline, seconds, queues)
                    finally:
                        for watch in watches:
                            watch.close()
                    # Confirm with a read: a key deleted again meanwhile, or a broken stream, means waiting on.
                    missing, revision = self._missing(keys, queues)
            except EtcdStoreUnavailable:
                raise
            except EtcdUnavailableError as error:
                names = ", ".join(sorted(keys))
                raise EtcdStoreUnavailable(
                    f"wait timeout after {seconds * 1000:.0f}ms, keys: {names}: {error}"
                ) from error

    def _await_events(
        self,
        missing: set[str],
        read_at: int,
        events: queue.Queue[_WatchItem],
        deadline: float,
        seconds: float,
        queues: bool,
    ) -> None:
        """Take keys out of ``missing`` as the watches see them put (and, once a watch exists, as a read of what
        changed since ``read_at`` finds them); return when none is left, a watch broke, or nothing came for
        :data:`_RECHECK_AFTER` (the caller reads again)."""
        quiet_until = time.monotonic() + _RECHECK_AFTER
        while missing:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                names = ", ".join(sorted(missing))
                raise dist.DistStoreError(
                    f"wait timeout after {seconds * 1000:.0f}ms, keys: {names}{_unreachable_note()}"
                )
            if now >= quiet_until:
                return
            try:
                item = _next_item(events, remaining)
            except queue.Empty:
                continue
            if isinstance(item, Exception):
                return  # the stream broke: read again, then watch again
            if isinstance(item, _Created):
                if item.revision > read_at:  # something changed between the read and the watch: read again
                    still, read_at = self._missing(sorted(missing), queues)
                    missing.intersection_update(still)
                continue
            quiet_until = time.monotonic() + _RECHECK_AFTER
            for event in item:
                if not event.deleted:
                    missing.discard(self._name_of(event.kv.key))

    def _name_of(self, key: str) -> str | None:
        """The store key a watched etcd key stands for: the key itself, or the queue an item belongs to."""
        if key.startswith(self.prefix):
            return key[len(self.prefix) :]
        return parse_store_queue_key(self.prefix, key)

    def _watch(self, keys: Sequence[str], events: queue.Queue[_WatchItem], queues: bool) -> list[EtcdWatch]:
        """Watch only what the wait needs, from now on: the one key (and its queue), or the store's prefix (and its
        queues). Their batches, their ends and their creations go to ``events``."""

        def put(batch: list[WatchEvent], _revision: int) -> None:
            events.put(batch)

        def created(revision: int) -> None:
            events.put(_Created(revision))

        client = self._client
        if len(keys) == 1:
            watches = [client.watch_key(self._key(keys[0]), 0, put, events.put, created)]
            queues_prefix = store_queue_prefix(self.prefix, keys[0])
        else:
            watches = [client.watch_prefix(self.prefix, 0, put, events.put, created)]
            queues_prefix = store_queues_prefix(self.prefix)
        if queues:
            watches.append(client.watch_prefix(queues_prefix, 0, put, events.put, created))
        return watches

    def _values(self, keys: Sequence[str]) -> dict[str, KeyValue]:
        """The keys' values once they all exist (``get``: a queue of the same name does not count).

        Read first: a key already there (a process group's peers' addresses,
        mostly) costs one request; a missing one is watched from the read's
        revision on, then read.
        """
        found, revision = self._fetch(keys)
        while len(found) < len(set(keys)):
            missing = sorted(set(keys) - set(found))
            self._await(missing, None, queues=False, read=(set(missing), revision))
            more, revision = self._fetch(missing)
            found.update(more)
        return found

    @_bounded_op
    def get(self, key: str) -> bytes:
        return self._values([key])[key].value

    @_bounded_op
    def multi_get(self, keys: list[str]) -> list[bytes]:
        found = self._values(keys)
        return [found[k].value for k in keys]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(keys, timeout, queues=True)

    @_bounded_op
    def check(self, keys: list[str]) -> bool:
        missing, _ = self._missing(keys, queues=True)
        return not missing

    @_bounded_op
    def num_keys(self) -> int:
        return self._ask(lambda: self._client.count_prefix(self.prefix))

    # torch's Python-store trampoline (torch 2.13) looks these two methods up by their C++ names, every
    # other by its Python name: a PrefixStore (or any C++ caller) reaches ``num_keys`` and ``delete_key``
    # only through these.

    def getNumKeys(self) -> int:
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:
        return self.delete_key(key)

    @_bounded_op
    def list_keys(self) -> list[str]:
        kvs, _ = self._ask(lambda: self._client.get_prefix(self.prefix))
        return [kv.key[len(self.prefix) :] for kv in kvs]

    def has_extended_api(self) -> bool:
        """``multi_get``, ``multi_set``, ``append`` and ``queue_*`` are real (torch asks before using them)."""
        return True

    @property
    def client(self) -> EtcdClient:
        """The etcd connection (shared with clones; the Wrapper's event log uses it too)."""
        return self._client

    def clone(self) -> EtcdStore:
        copy = EtcdStore(self._client, self.prefix, self.timeout, tokens=self._tokens)
        with self._clones_lock:
            self._clones.append(copy)
        return copy

    # ---- queues ----

    @_bounded_op
    def queue_push(self, key: str, value: str | bytes) -> None:
        item = store_queue_prefix(self.prefix, key) + uuid.uuid4().hex
        self._write(f"queue_push({key!r})", [put_op(item, _as_bytes(value))])

    @_bounded_op
    def queue_len(self, key: str) -> int:
        return self._ask(lambda: self._client.count_prefix(store_queue_prefix(self.prefix, key)))

    @_bounded_op
    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item of queue ``key``, removed exactly once.

        Raises:
            torch.distributed.QueueEmptyError: the queue is empty and ``block`` is false.
            torch.distributed.DistStoreError: still empty after the store's timeout.
        """
        prefix = store_queue_prefix(self.prefix, key)
        token = uuid.uuid4().hex
        seconds = self._timeout_seconds(None)
        deadline = time.monotonic() + seconds
        while True:
            items, revision = self._ask(lambda: self._client.get_prefix(prefix))
            if items:
                first = min(items, key=lambda kv: kv.create_revision)
                guard = key_modified_at(first.key, first.mod_revision)
                taken = self._commit_once(f"queue_pop({key!r})", [guard], [delete_op(first.key)], token, first.value)
                if taken is not None:
                    return taken
                continue  # another client took it first
            if not block:
                raise dist.QueueEmptyError(f"queue_pop({key!r}): the queue is empty")
            if not self._await_put(prefix, revision, deadline):
                raise dist.DistStoreError(f"wait timeout after {seconds * 1000:.0f}ms, queue: {key}")

    def _await_put(self, prefix: str, revision: int, deadline: float) -> bool:
        """Wait for a key to be put under ``prefix`` after ``revision``; False at ``deadline``."""
        events: queue.Queue[_WatchItem] = queue.Queue()
        watch = self._ask(
            lambda: self._client.watch_prefix(
                prefix, 0, lambda b, _r: events.put(b), events.put, lambda r: events.put(_Created(r))
            )
        )
        quiet_until = time.monotonic() + _RECHECK_AFTER
        try:
            while (remaining := deadline - time.monotonic()) > 0:
                if time.monotonic() >= quiet_until:
                    return True  # read again: a silent watch may be a dead one
                try:
                    item = _next_item(events, remaining)
                except queue.Empty:
                    continue
                if isinstance(item, _Created):
                    if item.revision > revision:
                        return True  # an item may have come between the read and the watch: read again
                    continue
                if isinstance(item, Exception) or any(not event.deleted for event in item):
                    return True  # read again (after a broken stream too)
            return False
        finally:
            watch.close()

    # ---- writes ----

    def _write_lease(self) -> int:
        """The lease write tokens go on: granted lazily, replaced once half its TTL has passed.

        A write is resent for as long as its bound (the store's timeout)
        allows, so a token must outlive that, counted from the moment its
        lease is replaced: the TTL is twice the store's timeout plus the
        longest request, and at least a minute. etcd keeps no token longer:
        a lease outlives a freeze only of less than its TTL.
        """
        tokens = self._tokens
        with tokens.lock:
            now = time.monotonic()
            longest = self._client.connect_timeout + self._client.request_timeout
            wanted = max(60, math.ceil(2 * (self.timeout.total_seconds() + longest)))
            held = tokens.held
            if held is None or now >= held[1] or held[2] < wanted:
                lease, ttl = self._ask(lambda: self._client.grant_lease(wanted))
                tokens.held = held = (lease, now + ttl / 2, wanted)
            return held[0]

    def _commit_once(self, what: str, guards: list[Compare], ops: list[Op], token: str, result: bytes) -> bytes | None:
        """Apply ``ops`` if ``guards`` hold, at most once per ``token``.

        Returns the ``result`` recorded by the write that committed with this
        token (this send or an earlier one whose answer was lost), or None
        when the guards failed and nothing was written.
        """
        token_key = store_write_token(self.prefix, token)
        lease = self._write_lease()  # before the write: failing here, nothing was sent
        compare, success = [*guards, key_missing(token_key)], [*ops, put_op(token_key, result, lease)]
        try:
            # The same request each time, token included: a resend of a write that committed finds the token.
            outcome = self._ask(lambda: self._client.txn(compare, success, [get_op(token_key)]))
        except EtcdUnavailableError as exc:
            raise StoreWriteOutcomeUnknown(f"{what}: etcd did not answer, the write may have committed: {exc}") from exc
        if outcome.succeeded:
            return result
        committed = outcome.ranges[-1]
        if not committed:
            return None
        self.writes_recovered += 1
        return committed[0].value

    def _write(self, what: str, ops: list[Op]) -> None:
        """Unconditional writes, committed exactly once."""
        token = uuid.uuid4().hex
        if self._commit_once(what, [], ops, token, b"") is None:
            raise dist.DistStoreError(f"{what}: etcd refused an unconditional write")

    @_bounded_op
    def set(self, key: str, value: str | bytes) -> None:
        self._write(f"set({key!r})", [put_op(self._key(key), _as_bytes(value))])

    @_bounded_op
    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        ops = [put_op(self._key(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)]
        for start in range(0, len(ops), _TXN_OPS - 1):  # one op of each transaction is its token
            self._write(f"multi_set({keys[start]!r}, ...)", ops[start : start + _TXN_OPS - 1])

    @_bounded_op
    def delete_key(self, key: str) -> bool:
        full = self._key(key)
        token = uuid.uuid4().hex
        while True:
            kv, _ = self._ask(lambda: self._client.get(full))
            if kv is None:
                return False
            guard = key_modified_at(full, kv.mod_revision)
            if self._commit_once(f"delete_key({key!r})", [guard], [delete_op(full)], token, b"1") is not None:
                return True

    def _read_modify_write(self, what: str, key: str, change: Callable[[bytes | None], bytes]) -> bytes:
        """Atomically replace the value with ``change(current or None)``, exactly once; returns the new value."""
        full = self._key(key)
        token = uuid.uuid4().hex
        while True:
            kv, _ = self._ask(lambda: self._client.get(full))
            new = change(kv.value if kv else None)
            guard = key_modified_at(full, kv.mod_revision) if kv else key_missing(full)
            committed = self._commit_once(what, [guard], [put_op(full, new)], token, new)
            if committed is not None:
                return committed

    @_bounded_op
    def arrive_once(self, arrived: str, counter: str, token: str) -> tuple[bool, int]:
        """Count one arrival at a barrier, at most once: ``(counted, arrivals so far)``.

        One transaction creates ``arrived`` with ``token`` and rewrites
        ``counter``, whose version (etcd counts a key's writes) is then the
        number of arrivals: one request however many ranks arrive at once,
        where ``add`` is a read and a compare-and-swap that concurrent ranks
        retry. A resend of an arrival that committed finds its own token and
        counts it once. ``counted`` is False when another token arrived first.
        """
        arrived_key, counter_key = self._key(arrived), self._key(counter)
        try:
            outcome = self._ask(
                lambda: self._client.txn(
                    [key_missing(arrived_key)],
                    [put_op(arrived_key, token.encode()), put_op(counter_key, b""), get_op(counter_key)],
                    [get_op(arrived_key), get_op(counter_key)],
                )
            )
        except EtcdUnavailableError as exc:
            raise StoreWriteOutcomeUnknown(f"arrive({arrived!r}): etcd did not answer, it may count: {exc}") from exc
        count = outcome.ranges[-1]
        arrivals = count[0].version if count else 0
        if outcome.succeeded:
            return True, arrivals
        mine = outcome.ranges[0]
        return bool(mine and mine[0].value == token.encode()), arrivals

    @_bounded_op
    def watch_for(self, key: str) -> KeyWatch:
        """A watch for ``key`` to exist (no request while it does not): see :class:`KeyWatch`."""
        full = self._key(key)
        kv, revision = self._ask(lambda: self._client.get(full))
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

        watch = self._ask(lambda: self._client.watch_key(full, 0, on_events, lambda _error: found.lost(), on_created))
        found.stop = watch.close
        return found

    @_bounded_op
    def arrivals(self, counter: str) -> int:
        """The number of arrivals :meth:`arrive_once` counted under ``counter``."""
        kv, _ = self._ask(lambda: self._client.get(self._key(counter)))
        return kv.version if kv is not None else 0

    @_bounded_op
    def add(self, key: str, amount: int) -> int:
        def increment(current: bytes | None) -> bytes:
            try:
                base = int(current) if current is not None else 0
            except ValueError:
                raise dist.DistStoreError(f"add({key!r}): the value {current!r} is not an integer") from None
            return str(base + amount).encode()

        return int(self._read_modify_write(f"add({key!r}, {amount})", key, increment))

    @_bounded_op
    def append(self, key: str, value: str | bytes) -> None:
        data = _as_bytes(value)
        self._read_modify_write(f"append({key!r})", key, lambda current: (current or b"") + data)

    @_bounded_op
    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        full = self._key(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        token = uuid.uuid4().hex
        while True:
            kv, _ = self._ask(lambda: self._client.get(full))
            if kv is None:
                if expected:
                    return expected
                guard = key_missing(full)
            elif kv.value != expected:
                return kv.value
            else:
                guard = key_modified_at(full, kv.mod_revision)
            if self._commit_once(f"compare_set({key!r})", [guard], [put_op(full, desired)], token, desired) is not None:
                return desired

    def __repr__(self) -> str:
        return f"EtcdStore({self._client.describe_endpoints()}, prefix={self.prefix!r})"
