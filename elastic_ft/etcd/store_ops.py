"""How an :class:`~elastic_ft.etcd.store.EtcdStore` reads, waits and writes: the store's methods are torch's
``Store`` API, and these classes the etcd requests behind it (see ``store.py``'s docstring for the semantics)."""

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
from typing import TypeVar

import torch.distributed as dist

from elastic_ft.etcd.client import (
    Compare,
    EtcdClient,
    EtcdUnavailableError,
    EtcdWatch,
    KeyValue,
    Op,
    TxnResult,
    WatchEvent,
    first_key_op,
    get_op,
    key_missing,
    key_modified_at,
    put_op,
)
from elastic_ft.etcd.outage import OUTAGES, bounded, patiently
from elastic_ft.etcd.shield import shield
from elastic_ft.keys import parse_store_queue_key, store_queue_prefix, store_queues_prefix, store_write_token

#: etcd's default --max-txn-ops.
TXN_OPS = 128
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


def _unreachable_note() -> str:
    """``"; etcd ... unreachable for the last N s"`` while this process sees an outage, else empty."""
    since = OUTAGES.down_since()
    return "" if since is None else f"; etcd has been unreachable for the last {time.monotonic() - since:.1f} s"


@dataclass(frozen=True)
class _Created:
    """A wait's watch exists: it delivers every change after ``revision``."""

    revision: int


#: What a wait's watches hand its loop: a batch of events, the end of a watch, or a watch's creation.
_WatchItem = list[WatchEvent] | Exception | _Created


class TokenLease:
    """The lease a store's write tokens go on: its id, when to replace it (``time.monotonic()``), and the TTL it
    was asked for; None until the first write."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: tuple[int, float, int] | None = None


class StoreKeys:
    """Where a store's keys live (its etcd connection and prefix), and how it asks etcd: each request resent
    with backoff while etcd is unreachable, within the operation's bound (``etcd/outage.py``)."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def key(self, key: str) -> str:
        return self.prefix + key

    def ask(self, call: Callable[[], _T]) -> _T:
        return patiently(call, f"EtcdStore at {self.prefix}")


class StoreReader:
    """A store's reads, and its waits for keys to exist (on watches, never polling)."""

    def __init__(self, keys: StoreKeys, timeout: Callable[[], timedelta]) -> None:
        self._client = keys.client
        self.prefix = keys.prefix
        self._key = keys.key
        self._ask = keys.ask
        #: The store's timeout (``set_timeout`` may change it).
        self._timeout = timeout

    def fetch(self, keys: Sequence[str]) -> tuple[dict[str, KeyValue], int]:
        """Read many keys consistently: one range request for one key, one transaction per 128 keys."""
        found: dict[str, KeyValue] = {}
        if len(keys) == 1:
            kv, revision = self._ask(functools.partial(self._client.get, self._key(keys[0])))
            if kv is not None:
                found[keys[0]] = kv
            return found, revision
        revision = 0
        for start in range(0, len(keys), TXN_OPS):
            chunk = keys[start : start + TXN_OPS]
            result = self._ask(functools.partial(self._client.txn, [], [get_op(self._key(k)) for k in chunk]))
            revision = max(revision, result.revision)
            for key, kvs in zip(chunk, result.ranges, strict=True):
                if kvs:
                    found[key] = kvs[0]
        return found, revision

    def missing(self, keys: Sequence[str], queues: bool) -> tuple[set[str], int]:
        """The keys that do not exist (with ``queues``: whose queue is empty too), and the revision read at."""
        if not queues:
            found, revision = self.fetch(keys)
            return {k for k in keys if k not in found}, revision
        missing: set[str] = set()
        revision = 0
        per_txn = TXN_OPS // 2  # the key, and the first item of its queue
        for start in range(0, len(keys), per_txn):
            chunk = keys[start : start + per_txn]
            ops = [op for k in chunk for op in (get_op(self._key(k)), first_key_op(store_queue_prefix(self.prefix, k)))]
            result = self._ask(functools.partial(self._client.txn, [], ops))
            revision = max(revision, result.revision)
            for index, key in enumerate(chunk):
                if not result.ranges[2 * index] and not result.ranges[2 * index + 1]:
                    missing.add(key)
        return missing, revision

    def await_keys(
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
        seconds = (timeout if timeout is not None else self._timeout()).total_seconds()
        deadline = time.monotonic() + seconds
        with bounded(seconds, f"the wait's timeout ({seconds:g} s)"):
            try:
                missing, revision = read if read is not None else self.missing(keys, queues)
                while missing:
                    events: queue.Queue[_WatchItem] = queue.Queue()
                    watches = self._ask(functools.partial(self._watch, sorted(missing), events, queues))
                    try:
                        self._await_events(missing, revision, events, deadline, seconds, queues)
                    finally:
                        for watch in watches:
                            watch.close()
                    # Confirm with a read: a key deleted again meanwhile, or a broken stream, means waiting on.
                    missing, revision = self.missing(keys, queues)
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
                    still, read_at = self.missing(sorted(missing), queues)
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

    def values(self, keys: Sequence[str]) -> dict[str, KeyValue]:
        """The keys' values once they all exist (``get``: a queue of the same name does not count).

        Read first: a key already there (a process group's peers' addresses,
        mostly) costs one request; a missing one is watched from the read's
        revision on, then read.
        """
        found, revision = self.fetch(keys)
        while len(found) < len(set(keys)):
            missing = sorted(set(keys) - set(found))
            self.await_keys(missing, None, queues=False, read=(set(missing), revision))
            more, revision = self.fetch(missing)
            found.update(more)
        return found

    def await_put(self, prefix: str, revision: int, deadline: float) -> bool:
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


class OnceWriter:
    """A store's writes, each committed at most once (its token, ``store.py``'s docstring)."""

    def __init__(
        self,
        keys: StoreKeys,
        timeout: Callable[[], timedelta],
        tokens: TokenLease,
        txn: Callable[[list[Compare], list[Op], list[Op]], TxnResult] | None = None,
    ) -> None:
        self._client = keys.client
        #: How a write's transaction is sent: to etcd, or through the node's relay (``EtcdStore``).
        self._txn = txn or self._client.txn
        self.prefix = keys.prefix
        self._key = keys.key
        self._ask = keys.ask
        self._timeout = timeout
        #: The lease write tokens go on: shared with the stores made from this one (``group_store``).
        self.tokens = tokens
        #: Writes whose commit was learnt from their token: a resend after an earlier send had committed.
        self.recovered = 0

    def _write_lease(self) -> int:
        """The lease write tokens go on: granted lazily, replaced once half its TTL has passed.

        A write is resent for as long as its bound (the store's timeout)
        allows, so a token must outlive that, counted from the moment its
        lease is replaced: the TTL is twice the store's timeout plus the
        longest request, and at least a minute. etcd keeps no token longer:
        a lease outlives a freeze only of less than its TTL.
        """
        tokens = self.tokens
        with tokens.lock:
            now = time.monotonic()
            longest = self._client.connect_timeout + self._client.request_timeout
            wanted = max(60, math.ceil(2 * (self._timeout().total_seconds() + longest)))
            held = tokens.held
            if held is None or now >= held[1] or held[2] < wanted:
                lease, ttl = self._ask(lambda: self._client.grant_lease(wanted))
                tokens.held = held = (lease, now + ttl / 2, wanted)
            return held[0]

    def commit_once(self, what: str, guards: list[Compare], ops: list[Op], token: str, result: bytes) -> bytes | None:
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
            outcome = self._ask(lambda: self._txn(compare, success, [get_op(token_key)]))
        except EtcdUnavailableError as exc:
            raise StoreWriteOutcomeUnknown(f"{what}: etcd did not answer, the write may have committed: {exc}") from exc
        if outcome.succeeded:
            return result
        committed = outcome.ranges[-1]
        if not committed:
            return None
        self.recovered += 1
        return committed[0].value

    def write(self, what: str, ops: list[Op]) -> None:
        """Unconditional writes, committed exactly once."""
        token = uuid.uuid4().hex
        if self.commit_once(what, [], ops, token, b"") is None:
            raise dist.DistStoreError(f"{what}: etcd refused an unconditional write")

    def read_modify_write(self, what: str, key: str, change: Callable[[bytes | None], bytes]) -> bytes:
        """Atomically replace the value with ``change(current or None)``, exactly once; returns the new value."""
        full = self._key(key)
        token = uuid.uuid4().hex
        while True:
            kv, _ = self._ask(lambda: self._client.get(full))
            new = change(kv.value if kv else None)
            guard = key_modified_at(full, kv.mod_revision) if kv else key_missing(full)
            committed = self.commit_once(what, [guard], [put_op(full, new)], token, new)
            if committed is not None:
                return committed
