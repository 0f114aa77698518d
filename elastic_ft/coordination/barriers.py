"""Barriers on any store with torch's ``Store`` primitives: the base of both views of the protocol.

A barrier counts each rank's arrival once (a monitor process or the agent
may arrive for a dead rank), and whoever completes it publishes its result
(:meth:`Barriers.barrier_result`), which every waiting rank reads back. On
an etcd store (:class:`CountingStore`) an arrival is one transaction and a
wait is a watch; on any other store, ``compare_set`` and ``add``, and a poll.

Waiting is done by polling with a short back-off rather than with
``Store.wait``: a TCPStore client holds its connection lock for the whole of
a ``wait``, which would stall the other threads of the process sharing the
connection, and the polling loop executes Python bytecode, so an
asynchronous restart exception can interrupt it at any time.

A barrier's timeout bounds everything it does, etcd away included
(:func:`elastic_ft.etcd.outage.bounded`): an etcd store waits for etcd within
it, and a barrier that etcd's absence ends raises :class:`BarrierTimeout`
saying so.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.errors import BarrierOverflow, BarrierTimeout
from elastic_ft.etcd.outage import bounded, grace
from elastic_ft.etcd.shield import shield
from elastic_ft.runtime.waits import pause, poll

#: How long a barrier that timed out may still take to read how many ranks arrived, for its error.
_COUNT_GRACE = 2.0
#: A barrier timeout meaning "arrive, do not wait".
NO_WAIT = datetime.timedelta(0)

#: The Wrapper's logger covers its records (``elastic_ft.inprocess``); the node side logs them there too.
log = logging.getLogger("elastic_ft.inprocess.store")


class KeyWatch(Protocol):
    """A watch for one key to exist (:class:`elastic_ft.etcd.store.KeyWatch`): ``appeared`` is set when there is
    something to look at, ``value`` is the value the watch saw (None: not yet), ``broken`` says the watch ended,
    :meth:`must_read` whether the caller reads the key itself, and ``stop()`` ends the watch."""

    appeared: threading.Event
    value: bytes | None
    broken: bool

    def must_read(self) -> bool: ...

    def stop(self) -> None: ...


@runtime_checkable
class CountingStore(Protocol):
    """A store that counts a barrier's arrival in one request and watches for a key (:class:`EtcdStore
    <elastic_ft.etcd.store.EtcdStore>`): the barriers use these where a store has them."""

    def arrive_once(self, arrived: str, counter: str, token: str) -> tuple[bool, int]: ...

    def arrivals(self, counter: str) -> int: ...

    def watch_for(self, key: str) -> KeyWatch: ...


@runtime_checkable
class BatchReadStore(Protocol):
    """A store that reads many keys, those that exist, in a few requests (:class:`EtcdStore
    <elastic_ft.etcd.store.EtcdStore>`: one per 128 keys)."""

    def get_existing(self, keys: list[str]) -> dict[str, bytes]: ...


def _store_under(view: object) -> tuple[object, str]:
    """The store under a prefix view, with the view's key prefix; any other store itself, with none."""
    prefix = getattr(view, "key_prefix", None)
    if prefix is not None and isinstance(view, dist.PrefixStore):
        return view.underlying_store, f"{prefix}/"
    return view, ""


class KeyReader(Protocol):
    """What :func:`read_existing` needs of a store it cannot batch on."""

    get: Callable[[str], bytes]
    check: Callable[[list[str]], bool]


def counting_store(view: object) -> tuple[CountingStore, str] | None:
    """The store under ``view`` if it counts a barrier's arrivals in one request (an etcd store's
    ``arrive_once``), and the key prefix of the view; None for any other store (its ``add`` counts).

    A counter that every rank reads, changes and writes back costs each rank
    retries that grow with the number arriving at once; one transaction per
    arrival does not.
    """
    store, prefix = _store_under(view)
    return (store, prefix) if isinstance(store, CountingStore) else None


def read_existing(view: KeyReader, names: Sequence[str]) -> dict[str, bytes]:
    """The values of those of ``names`` (keys of ``view``) that exist.

    On an etcd store, one request per 128 keys (:class:`BatchReadStore`):
    a monitor that reads every peer's heartbeat must not cost a request per
    peer, or its reads outgrow its bound in a large world, or in a long job
    with many respawned ranks. On another store, a ``check`` and a ``get``
    per key.
    """
    store, prefix = _store_under(view)
    if not isinstance(store, BatchReadStore):
        return {name: view.get(name) for name in names if view.check([name])}
    found = store.get_existing([prefix + name for name in names])
    return {name: found[prefix + name] for name in names if prefix + name in found}


#: How often a rank waiting at a barrier reads the barrier itself, past the watch: a lost watch event
#: then costs this long, and a last arriver lost before it published is noticed. Longer in a large
#: world, so that all the waiting ranks together read at most ``_STALL_READS_PER_SECOND`` times a second.
_STALL_CHECK = 1.0
_STALL_READS_PER_SECOND = 500
#: How long a completed barrier may stay unpublished before a waiting rank publishes its result: once
#: the last arriver is recorded gone from the iteration (it is recorded so once dead, or, leaving on
#: its own, just before it arrives and publishes), and when not even the last arriver is known (it
#: died between counting itself and recording itself: a window of one request).
_STALL_GONE = 1.0
_STALL_UNKNOWN = 10.0


class _StalledBarrier:
    """A waiter's check for a barrier every rank arrived at but nobody published.

    The rank whose arrival completes a barrier publishes its result; if
    that rank's process dies in between (a hard timeout's SIGKILL, a node
    lost), every other rank would wait out the barrier timeout although
    all arrived. A waiter publishes in its place, through ``compare_set`` so
    that the first result published holds, once the stall outlasted a
    grace period and the last arriver is recorded gone from the iteration
    (or unknown).
    """

    def __init__(self, store: Barriers, name: str, world_size: int) -> None:
        self.store, self.name, self.world_size = store, name, world_size
        self.interval = max(_STALL_CHECK, world_size / _STALL_READS_PER_SECOND)
        self.next_check = time.monotonic() + self.interval
        self.stalled_since: float | None = None

    def repaired(self) -> bool:
        """True once the barrier's result is published (by anyone); reads the store at most every interval."""
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + self.interval
        store = self.store
        if store.check([keys.barrier_done(self.name)]):
            return True
        if store._arrivals(self.name) < self.world_size:
            self.stalled_since = None
            return store.stand_in_for_lost(self.name, self.world_size)
        if self.stalled_since is None:
            self.stalled_since = now
        last_key = keys.barrier_last(self.name)
        last = keys.parse_count(as_text(store.get(last_key))) if store.check([last_key]) else None
        grace = _STALL_UNKNOWN if last is None else _STALL_GONE
        if now - self.stalled_since < grace or (last is not None and last not in store.gone_ranks()):
            return False
        log.warning(
            "%s: all %d ranks arrived %.1f s ago, but the last (%s) published no result: publishing it in its place",
            self.name,
            self.world_size,
            now - self.stalled_since,
            "unknown" if last is None else f"rank {last}, gone",
        )
        store._publish(self.name, self.world_size, admit=False)
        return True


#: The longest a barrier's wait blocks on its watch in one go: a restart raised meanwhile lands that soon.
_WAIT_SLICE = 0.05


def _await_watch(watch: KeyWatch, look: Callable[[], bool], limit: float | None) -> tuple[bool, bytes | None]:
    """Wait on ``watch`` for the key: ``(True, value)`` once the watch brings it, ``(True, None)`` once ``look()``
    finds it (a read, where the watch cannot tell; the stalled barrier's repair), ``(False, None)`` after
    ``limit`` seconds (``None``: never)."""
    deadline = None if limit is None else time.monotonic() + limit
    while True:
        if watch.value is not None:
            return True, watch.value
        if look():
            return True, None
        left = _WAIT_SLICE if deadline is None else min(_WAIT_SLICE, deadline - time.monotonic())
        if left <= 0:
            return False, None
        if watch.broken:  # no watch left: the look reads, at most once a slice
            pause(left)
            continue
        with shield():  # a restart raised inside the event's wait could leave its lock held (elastic_ft.etcd.shield)
            watch.appeared.wait(left)


def as_text(value: bytes) -> str:
    """A store value as text (a store returns bytes; a test double may return str)."""
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


def underlying(store: object) -> object:
    """The store below any number of prefix views."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class Barriers:
    """Barriers, on top of the primitive operations of the ``torch.distributed.Store`` this is mixed into."""

    # Provided by the torch.distributed.Store this is mixed into.
    set: Callable[..., None]
    get: Callable[[str], bytes]
    add: Callable[[str, int], int]
    append: Callable[[str, str], None]
    check: Callable[[list[str]], bool]
    compare_set: Callable[[str, str, str], bytes]
    wait: Callable[..., None]
    multi_get: Callable[[list[str]], list[bytes]]

    def arrive_and_wait(
        self,
        name: str,
        ranks: Iterable[int],
        world_size: int,
        timeout: datetime.timedelta,
    ) -> str | None:
        """Arrive at barrier ``name`` for ``ranks`` and wait until ``world_size`` ranks arrived.

        Arrival is idempotent per rank, so a monitor process or another rank
        may arrive on behalf of a rank that died, before or after it arrived
        itself. Whoever arrives last publishes the barrier's result
        (:meth:`barrier_result`), which every waiting rank gets back: a
        snapshot all ranks agree on. A zero ``timeout`` arrives without
        waiting and returns ``None``; ``timedelta.max`` waits forever.

        Raises:
            BarrierTimeout: the barrier did not complete in time (the store unreachable meanwhile included).
            BarrierOverflow: more than ``world_size`` distinct ranks arrived.
        """
        limit = (
            None if timeout <= datetime.timedelta(0) or timeout == datetime.timedelta.max else timeout.total_seconds()
        )
        if limit is None:  # arrive only, or wait for ever: the store's own bound applies
            return self._arrive_and_wait(name, ranks, world_size, timeout)
        try:
            with bounded(limit, f"the {name} barrier's timeout ({limit:g} s)"):
                return self._arrive_and_wait(name, ranks, world_size, timeout)
        except ConnectionError as error:  # the store did not answer within the barrier's timeout
            raise BarrierTimeout(f"{name}: did not complete within {limit:g} s: {error}") from error

    def _arrive_and_wait(
        self, name: str, ranks: Iterable[int], world_size: int, timeout: datetime.timedelta
    ) -> str | None:
        done_key = keys.barrier_done(name)
        counting = counting_store(self)
        for rank in ranks:
            token = uuid.uuid4().hex
            if counting is not None:
                base, prefix = counting
                counted, count = base.arrive_once(
                    prefix + keys.barrier_arrived(name, rank), prefix + keys.barrier_count(name), token
                )
                if not counted:
                    continue  # this rank had already arrived
            else:
                if as_text(self.compare_set(keys.barrier_arrived(name, rank), "", token)) != token:
                    continue  # this rank had already arrived
                count = self.add(keys.barrier_count(name), 1)
            if count > world_size:
                raise BarrierOverflow(f"{name}: rank {rank} arrived as number {count} of {world_size}")
            if count == world_size:
                self.set(keys.barrier_last(name), str(rank))
                self._publish(name, world_size, admit=True)
        if timeout <= datetime.timedelta(0):
            return None
        limit = None if timeout == datetime.timedelta.max else timeout.total_seconds()
        stalled = _StalledBarrier(self, name, world_size)
        unreachable: list[ConnectionError] = []  # the last time the store did not answer, while it does not

        def answered(look: Callable[[], bool]) -> Callable[[], bool]:
            def resilient() -> bool:
                try:
                    done = look()
                except ConnectionError as error:  # not yet: the barrier's own timeout ends the wait
                    unreachable[:] = [error]
                    return False
                unreachable.clear()
                return done

            return resilient

        if counting is not None:
            # One watch per rank, not a request every few milliseconds; the result comes with its event (a
            # barrier's result is written once).
            watch = counting[0].watch_for(counting[1] + done_key)
            try:
                completed, published = _await_watch(
                    watch,
                    answered(lambda: (watch.must_read() and self.check([done_key])) or stalled.repaired()),
                    limit,
                )
            finally:
                watch.stop()
            if published is not None:
                return as_text(published)
        else:
            completed = poll(answered(lambda: self.check([done_key]) or stalled.repaired()), limit)
        if not completed:
            if unreachable:
                raise BarrierTimeout(f"{name}: did not complete within {limit:g} s: {unreachable[0]}")
            try:
                with grace(_COUNT_GRACE, "the read of a timed-out barrier's arrivals"):
                    arrived = str(self._arrivals(name))
            except ConnectionError:
                arrived = "?"
            raise BarrierTimeout(f"{name}: {arrived} of {world_size} ranks arrived within {limit:g} s")
        return as_text(self.get(done_key))

    def _arrivals(self, name: str) -> int:
        counting = counting_store(self)
        if counting is not None:
            return counting[0].arrivals(counting[1] + keys.barrier_count(name))
        return self.add(keys.barrier_count(name), 0)

    def _publish(self, name: str, world_size: int, *, admit: bool) -> None:
        """Publish barrier ``name``'s result unless one is already published (the first one holds)."""
        done_key = keys.barrier_done(name)
        result = self.barrier_result(name, world_size, admit=admit)
        held = as_text(self.compare_set(done_key, "", result))
        if held != result:
            log.warning("%s: a result was published before this one, which is dropped: %.200s", name, result)

    def barrier_result(self, name: str, world_size: int, *, admit: bool = True) -> str:
        """What the rank completing barrier ``name`` publishes: nothing here; a view whose barriers decide
        something (:class:`~elastic_ft.coordination.iteration.IterationRecords`) says what."""
        return ""

    def gone_ranks(self) -> list[int]:
        """Ranks recorded gone from the barriers' world: none here; an iteration's view says which."""
        return []

    def stand_in_for_lost(self, name: str, world_size: int) -> bool:
        """Arrive at barrier ``name`` for ranks known lost before they could arrive; True once it is complete.

        Nothing here; an iteration's view stands in for the joiners it
        admitted that died before taking their place.
        """
        return False

    def has_arrived(self, name: str, rank: int) -> bool:
        return self.check([keys.barrier_arrived(name, rank)])
