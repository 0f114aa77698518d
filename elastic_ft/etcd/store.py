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
* ``compare_set(key, expected, desired)`` sets ``desired`` when the current
  value equals ``expected`` (or when the key is missing and ``expected`` is
  empty) and returns the value the key holds afterwards; a missing key with a
  non-empty ``expected`` returns ``expected``, as TCPStore does.
* ``num_keys`` counts the keys of this store only.

Values are opaque bytes; etcd limits one value to 1.5 MiB by default.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from elastic_ft.etcd.client import (
    EtcdClient,
    EtcdWatch,
    KeyValue,
    WatchEvent,
    get_op,
    key_missing,
    key_modified_at,
    put_op,
)

# etcd's default --max-txn-ops.
_TXN_OPS = 128


def _as_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(dist.Store):
    """Keys live under ``prefix`` in etcd; see the module docstring."""

    #: ``wait`` is a watch, not a poll: callers may block in it freely.
    waits_without_polling = True

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        if not prefix.endswith("/"):
            raise ValueError(f"EtcdStore prefix {prefix!r} must end with '/'")
        self._client = client
        self.prefix = prefix
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _timeout_seconds(self, timeout: timedelta | None) -> float:
        return (timeout if timeout is not None else self.timeout).total_seconds()

    # ---- reads ----

    def _fetch(self, keys: Sequence[str]) -> tuple[dict[str, KeyValue], int]:
        """Read many keys consistently (one transaction per 128 keys)."""
        found: dict[str, KeyValue] = {}
        revision = 0
        for start in range(0, len(keys), _TXN_OPS):
            chunk = keys[start : start + _TXN_OPS]
            result = self._client.txn([], [get_op(self._key(k)) for k in chunk])
            revision = max(revision, result.revision)
            for key, kvs in zip(chunk, result.ranges, strict=True):
                if kvs:
                    found[key] = kvs[0]
        return found, revision

    def _wait_for(self, keys: Sequence[str], timeout: timedelta | None) -> dict[str, KeyValue]:
        """Block until every key exists; return their key-values."""
        seconds = self._timeout_seconds(timeout)
        deadline = time.monotonic() + seconds
        found, revision = self._fetch(keys)
        missing = {self._key(k) for k in keys if k not in found}
        if not missing:
            return found
        events: queue.Queue[list[WatchEvent] | Exception] = queue.Queue()
        watch = self._watch(keys, revision + 1, events)
        try:
            while missing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise dist.DistStoreError(
                        f"wait timeout after {seconds * 1000:.0f}ms, keys: "
                        + ", ".join(sorted(k[len(self.prefix) :] for k in missing))
                    )
                try:
                    item = events.get(timeout=remaining)
                except queue.Empty:
                    continue
                if isinstance(item, Exception):
                    # The stream broke; fall back to a fresh read, then keep waiting.
                    watch.close()
                    found, revision = self._fetch(keys)
                    missing = {self._key(k) for k in keys if k not in found}
                    watch = self._watch(keys, revision + 1, events)
                    continue
                for event in item:
                    if not event.deleted:
                        missing.discard(event.kv.key)
        finally:
            watch.close()
        found, _ = self._fetch(keys)
        if len(found) < len(keys):  # deleted again meanwhile: wait for the rest
            return self._wait_for(keys, timedelta(seconds=max(0.0, deadline - time.monotonic())))
        return found

    def _watch(
        self, keys: Sequence[str], start_revision: int, events: queue.Queue[list[WatchEvent] | Exception]
    ) -> EtcdWatch:
        """Watch only what the wait needs: the one key, or the store's prefix for several."""
        if len(set(keys)) == 1:
            return self._client.watch_key(self._key(keys[0]), start_revision, lambda b, _r: events.put(b), events.put)
        return self._client.watch_prefix(self.prefix, start_revision, lambda b, _r: events.put(b), events.put)

    def get(self, key: str) -> bytes:
        return self._wait_for([key], None)[key].value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        found = self._wait_for(keys, None)
        return [found[k].value for k in keys]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        found, _ = self._fetch(keys)
        return len(found) == len(set(keys))

    def num_keys(self) -> int:
        return self._client.count_prefix(self.prefix)

    # ---- writes ----

    def set(self, key: str, value: str | bytes) -> None:
        self._client.put(self._key(key), _as_bytes(value))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        ops = [put_op(self._key(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)]
        for start in range(0, len(ops), _TXN_OPS):
            self._client.txn([], ops[start : start + _TXN_OPS])

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key)) > 0

    def _read_modify_write(self, key: str, change: Callable[[bytes | None], bytes]) -> bytes:
        """Atomically replace the value with ``change(current or None)``.

        Not retried on an unknown outcome (the change may not be idempotent):
        a timed-out request surfaces as an error instead of being applied twice.
        """
        full = self._key(key)
        while True:
            kv, _ = self._client.get(full)
            new = change(kv.value if kv else None)
            guard = key_modified_at(full, kv.mod_revision) if kv else key_missing(full)
            if self._client.txn([guard], [put_op(full, new)], idempotent=False).succeeded:
                return new

    def add(self, key: str, amount: int) -> int:
        def increment(current: bytes | None) -> bytes:
            try:
                base = int(current) if current is not None else 0
            except ValueError:
                raise dist.DistStoreError(f"add({key!r}): the value {current!r} is not an integer") from None
            return str(base + amount).encode()

        return int(self._read_modify_write(key, increment))

    def append(self, key: str, value: str | bytes) -> None:
        data = _as_bytes(value)
        self._read_modify_write(key, lambda current: (current or b"") + data)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        full = self._key(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            kv, _ = self._client.get(full)
            if kv is None:
                if expected:
                    return expected
                guard = key_missing(full)
            elif kv.value != expected:
                return kv.value
            else:
                guard = key_modified_at(full, kv.mod_revision)
            # Safe to resend after an unknown outcome: if the first attempt
            # landed, the retry sees ``desired`` and returns it.
            if self._client.txn([guard], [put_op(full, desired)]).succeeded:
                return desired

    def __repr__(self) -> str:
        return f"EtcdStore({self._client.describe_endpoints()}, prefix={self.prefix!r})"
