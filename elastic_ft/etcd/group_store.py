"""The store a process group is bootstrapped from: write-once keys under a fresh prefix, read from a watch.

gloo and NCCL bootstrap a group through a store: each rank publishes its
address (NCCL's rank 0, its unique id) once, under a prefix no other group
uses, and reads every other rank's (gloo: ``set``, then ``wait`` and ``get``
for each peer). On :class:`~elastic_ft.etcd.store.EtcdStore` that is two
requests per peer and rank, 2N² for the group. :class:`GroupStore` keeps
one watch-fed copy of its prefix instead: a key written once never
changes, so its value in the copy is the value, and ``get`` and ``wait``
answer from the copy as soon as the watch brings it, with no request.
Forming a group costs each rank one write, one watch and one list (N²
watch events in all, against 2N² requests). The watch starts from now on
and the list follows its creation, so no key falls between them and the
watch is never one etcd catches up late (``EtcdClient.watch_prefix``).

A key is served from the copy only while etcd says it was written once
(its version is 1) and nothing here changed it (``add``, ``append``,
``compare_set``, ``delete_key``, a queue of its name); any other key, and
``check`` and the rest, go to etcd as on the plain store, with its
semantics. So a caller that writes a key twice gets etcd's answer, not an
old copy. ``wait`` counts a queue of a key's name only when this handle
pushed to it (gloo and NCCL use no queues).
:meth:`close` ends the watch (the group's owner calls it once the group is
gone: NCCL may read the store after the group's creation).

:meth:`abandon` ends the waits on the copy: a group given up while it was
being built (a restart reached the thread that waited for it) must not
leave a thread waiting inside gloo's constructor. Such a thread comes back
into Python at every slice of its wait, and one that does so while the
interpreter exits aborts the process ("terminate called without an active
exception": CPython ends the thread under a C++ frame that cannot unwind).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from elastic_ft.etcd.client import EtcdClient, EtcdWatch
from elastic_ft.etcd.kv import EtcdUnavailableError, KeyValue, WatchEvent
from elastic_ft.etcd.shield import shield
from elastic_ft.etcd.store import EtcdStore, _bounded_op
from elastic_ft.etcd.store_ops import TokenLease


class _Copy:
    """The keys under a prefix as a watch from now on, then a list, bring them (relative key -> key-value)."""

    def __init__(self, client: EtcdClient, prefix: str, bound: float) -> None:
        self.prefix = prefix
        self.keys: dict[str, KeyValue] = {}
        self.changed = threading.Condition()
        self.version = 0
        self.broken: Exception | None = None
        created = threading.Event()
        self.watch: EtcdWatch = client.watch_prefix(
            prefix, 0, self._on_events, self._on_error, lambda _revision: created.set()
        )
        if not created.wait(bound):
            self.watch.close()
            raise EtcdUnavailableError(f"etcd did not create a watch on {prefix} within {bound:g} s")
        kvs, _ = client.get_prefix(prefix)  # read after the watch exists: nothing falls between them
        with self.changed:
            for kv in kvs:
                self.keys.setdefault(kv.key[len(prefix) :], kv)
            self._moved()

    def _moved(self) -> None:
        self.version += 1
        self.changed.notify_all()

    def _on_events(self, events: list[WatchEvent], _revision: int) -> None:
        with self.changed:
            for event in events:
                relative = event.kv.key[len(self.prefix) :]
                if event.deleted:
                    self.keys.pop(relative, None)
                else:
                    self.keys[relative] = event.kv
            self._moved()

    def _on_error(self, error: Exception) -> None:
        with self.changed:
            self.broken = error
            self._moved()

    def close(self) -> None:
        self.watch.close()


#: The longest a wait on the copy blocks in one go: a restart raised asynchronously ends it that soon.
_WAIT_SLICE = 0.1


class GroupStore(EtcdStore):
    """An :class:`EtcdStore` whose write-once keys are read from a watch (see the module docstring)."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        timeout: timedelta = timedelta(seconds=300),
        *,
        tokens: TokenLease | None = None,
    ) -> None:
        super().__init__(client, prefix, timeout, tokens=tokens)
        self._view: _Copy | None = None
        self._view_lock = threading.Lock()
        #: Keys changed through this handle after their first write: read from etcd.
        self._changed: set[str] = set()
        #: Why the waits on the copy end at once (:meth:`abandon`); None while they wait.
        self._abandoned: str | None = None

    def _copy(self) -> _Copy:
        """The watch-fed copy of the prefix (a new one if its watch broke: the keys are read again)."""
        with self._view_lock:
            if self._view is None or self._view.broken is not None:
                if self._view is not None:
                    self._view.close()
                bound = self.client.request_timeout
                self._view = self._keys.ask(lambda: _Copy(self.client, self.prefix, bound))
            return self._view

    def _written_once(self, keys: list[str], timeout: timedelta | None = None) -> dict[str, bytes] | None:
        """The keys' values from the copy, once all are there (within ``timeout``, by default the store's), written
        once; None if one was written more often, or changed here (etcd answers those)."""
        seconds = (timeout if timeout is not None else self.timeout).total_seconds()
        deadline = time.monotonic() + seconds
        while True:
            if self._abandoned is not None:
                raise dist.DistStoreError(f"waiting for {', '.join(sorted(set(keys)))}: {self._abandoned}")
            view = self._copy()
            # One slice at a time, shielded: a restart raised inside the condition's wait could leave its lock held
            # (elastic_ft.etcd.shield); it is raised at the slice's end instead.
            with shield(), view.changed:
                found = {key: view.keys[key] for key in keys if key in view.keys}
                if any(kv.version != 1 or key in self._changed for key, kv in found.items()):
                    return None
                if len(found) == len(set(keys)):
                    return {key: kv.value for key, kv in found.items()}
                left = deadline - time.monotonic()
                if left <= 0:
                    names = ", ".join(sorted(set(keys) - set(found)))
                    raise dist.DistStoreError(f"wait timeout after {seconds * 1000:.0f}ms, keys: {names}")
                if view.broken is None:
                    view.changed.wait(min(left, _WAIT_SLICE))

    @_bounded_op
    def get(self, key: str) -> bytes:
        if key in self._changed:
            return super().get(key)
        values = self._written_once([key])
        return values[key] if values is not None else super().get(key)

    @_bounded_op
    def multi_get(self, keys: list[str]) -> list[bytes]:
        if self._changed.intersection(keys):
            return super().multi_get(keys)
        values = self._written_once(list(keys))
        return [values[key] for key in keys] if values is not None else super().multi_get(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if self._changed.intersection(keys) or self._written_once(list(keys), timeout) is None:
            super().wait(keys, timeout)

    # Writes after the first make a key etcd's to answer from then on (through this handle).

    def add(self, key: str, amount: int) -> int:
        self._changed.add(key)
        return super().add(key, amount)

    def append(self, key: str, value: str | bytes) -> None:
        self._changed.add(key)
        super().append(key, value)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        self._changed.add(key)
        return super().compare_set(key, expected_value, desired_value)

    def delete_key(self, key: str) -> bool:
        self._changed.add(key)
        return super().delete_key(key)

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._changed.add(key)
        super().queue_push(key, value)

    def clone(self) -> GroupStore:
        copy = GroupStore(self.client, self.prefix, self.timeout, tokens=self._writes.tokens)
        copy._changed = self._changed
        with self._clones_lock:
            self._clones.append(copy)
        return copy

    def abandon(self, reason: str) -> None:
        """Make every wait on the copy, now (within one slice) and later, raise ``DistStoreError`` saying ``reason``:
        whoever waits was given up (see the module docstring)."""
        self._abandoned = reason
        with self._view_lock:
            view = self._view
        if view is not None:
            with view.changed:
                view.changed.notify_all()

    def close(self) -> None:
        """End the watch (the store's own requests still work)."""
        with self._view_lock:
            view, self._view = self._view, None
        if view is not None:
            view.close()


def group_store(base: EtcdStore, name: str) -> GroupStore:
    """A :class:`GroupStore` under ``name`` in ``base``'s prefix, on its client, sharing its write tokens' lease."""
    if not name or name.startswith("/") or not name.endswith("/"):
        raise ValueError(f"a group store's name must be a relative prefix ending with '/', got {name!r}")
    return GroupStore(base.client, base.prefix + name, base.timeout, tokens=base._writes.tokens)
