"""Barriers on any store with torch's ``Store`` primitives, used by both views of the protocol.

A barrier counts each rank's arrival once (a monitor process or the agent
may arrive for a dead rank), and whoever completes it publishes its result
(what the view's :class:`BarrierRules` decide), which every waiting rank reads back. On
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.errors import BarrierOverflow, BarrierTimeout
from elastic_ft.etcd.kv import BATCH_ARRIVALS
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
    """A store that counts many ranks' arrivals at a barrier in one request and watches for a key
    (:class:`EtcdStore <elastic_ft.etcd.store.EtcdStore>`, directly or through its node's relay): the barriers
    use these where a store has them."""

    def arrive_batch(self, arrivals: Sequence[tuple[str, str]], slots: str) -> list[int | None]: ...

    def arrivals(self, slots: str) -> int: ...

    def watch_for(self, key: str) -> KeyWatch: ...


@runtime_checkable
class BatchReadStore(Protocol):
    """A store that reads many keys, those that exist, in a few requests (:class:`EtcdStore
    <elastic_ft.etcd.store.EtcdStore>`: one per 128 keys)."""

    def get_existing(self, keys: list[str], *, periodic: bool = False) -> dict[str, bytes]: ...


class KeyedPrefixStore(dist.PrefixStore):
    """torch's prefix view, with its prefix readable (torch keeps it to itself): the barriers count arrivals, and
    read many keys at once, in the store below it, under the prefix."""

    def __init__(self, prefix: str, store: dist.Store) -> None:
        super().__init__(prefix, store)
        self.key_prefix = prefix


def _store_under(view: object) -> tuple[object, str]:
    """The store under a prefix view, with the view's key prefix; any other store itself, with none."""
    prefix = getattr(view, "key_prefix", None)
    if prefix is not None and isinstance(view, dist.PrefixStore):
        return view.underlying_store, f"{prefix}/"
    return view, ""


@runtime_checkable
class LatestWriteStore(Protocol):
    """A store that writes a value whose only contract is that the newest wins in one request, batched with its
    host's others where it can (:class:`EtcdStore <elastic_ft.etcd.store.EtcdStore>`, through the node's relay)."""

    def put_latest(self, values: Mapping[str, bytes], read: Sequence[str] = ()) -> dict[str, bytes]: ...


class KeyReader(Protocol):
    """What :func:`read_existing` needs of a store it cannot batch on."""

    def get(self, key: str, /) -> bytes: ...

    def check(self, keys: list[str], /) -> bool: ...


class KeyWriter(KeyReader, Protocol):
    """What :func:`write_latest` needs of a store it cannot batch on."""

    def set(self, key: str, value: str, /) -> None: ...


def write_latest(view: KeyWriter, name: str, value: str, read: Sequence[str] = ()) -> dict[str, bytes]:
    """Set key ``name`` of ``view`` to ``value``, the newest value winning (a heartbeat): on an etcd store one
    request (through the node's relay, one per host for all its heartbeats); elsewhere ``set``.

    ``read``: keys of ``view`` read after the write, in the same request on an etcd store; returns the values of
    those that exist (as :func:`read_existing`)."""
    store, prefix = _store_under(view)
    if isinstance(store, LatestWriteStore):
        found = store.put_latest({prefix + name: value.encode()}, [prefix + key for key in read])
        return {key: found[prefix + key] for key in read if prefix + key in found}
    view.set(name, value)
    return {key: view.get(key) for key in read if view.check([key])}


def counting_store(view: dist.Store) -> tuple[CountingStore, str] | None:
    """The store under ``view`` if it counts a barrier's arrivals in one request (an etcd store's
    ``arrive_batch``), and the key prefix of the view; None for any other store (its ``add`` counts).

    A counter that every rank reads, changes and writes back costs each rank
    retries that grow with the number arriving at once; one transaction per
    arrival, or per node's batch of arrivals, does not.
    """
    store, prefix = _store_under(view)
    return (store, prefix) if isinstance(store, CountingStore) else None


def read_existing(view: KeyReader, names: Sequence[str], *, periodic: bool = False) -> dict[str, bytes]:
    """The values of those of ``names`` (keys of ``view``) that exist.

    ``periodic``: a read every rank of a host makes at the same instants
    (the monitors' ring checks and looks at their peers): the node relay
    gathers the host's into one read, at the cost of a short wait.

    On an etcd store, one request per 128 keys (:class:`BatchReadStore`):
    a monitor that reads every peer's heartbeat must not cost a request per
    peer, or its reads outgrow its bound in a large world, or in a long job
    with many respawned ranks. On another store, a ``check`` and a ``get``
    per key.
    """
    store, prefix = _store_under(view)
    if not isinstance(store, BatchReadStore):
        return {name: view.get(name) for name in names if view.check([name])}
    found = store.get_existing([prefix + name for name in names], periodic=periodic)
    return {name: found[prefix + name] for name in names if prefix + name in found}


def read_one(view: KeyReader, name: str) -> bytes | None:
    """The value of ``name`` (a key of ``view``), None while it does not exist.

    On an etcd store one request, through the node's relay when there is
    one (merged with the host's reads of the moment): a restart's ranks all
    read the same records at once (the outcome, the termination result, the
    interruptions), and a ``check`` and a ``get`` each would cost etcd two
    requests per rank for each. On another store, a ``check`` and a ``get``.
    """
    return read_existing(view, [name]).get(name)


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

    def __init__(self, barriers: Barriers, name: str, world_size: int) -> None:
        self.barriers, self.name, self.world_size = barriers, name, world_size
        self.interval = max(_STALL_CHECK, world_size / _STALL_READS_PER_SECOND)
        self.next_check = time.monotonic() + self.interval
        self.stalled_since: float | None = None

    def repaired(self) -> bool:
        """True once the barrier's result is published (by anyone); reads the store at most every interval."""
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + self.interval
        barriers, store = self.barriers, self.barriers.store
        if store.check([keys.barrier_done(self.name)]):
            return True
        if barriers._arrivals(self.name) < self.world_size:
            self.stalled_since = None
            return barriers.rules.stand_in_for_lost(self.name, self.world_size)
        if self.stalled_since is None:
            self.stalled_since = now
        last_key = keys.barrier_last(self.name)
        last = keys.parse_count(as_text(store.get(last_key))) if store.check([last_key]) else None
        grace = _STALL_UNKNOWN if last is None else _STALL_GONE
        if now - self.stalled_since < grace or (last is not None and last not in barriers.rules.gone_ranks()):
            return False
        log.warning(
            "%s: all %d ranks arrived %.1f s ago, but the last (%s) published no result: publishing it in its place",
            self.name,
            self.world_size,
            now - self.stalled_since,
            "unknown" if last is None else f"rank {last}, gone",
        )
        barriers._publish(self.name, self.world_size, admit=False)
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


def await_value(view: dist.Store, name: str, timeout: datetime.timedelta) -> bytes | None:
    """The value of key ``name`` of ``view`` once it exists, or None after ``timeout`` (the store unreachable
    meanwhile included).

    On a store that watches, the value comes with the watch's event: through
    the node's relay one etcd watch serves the host's ranks, where a wait
    and a read per rank cost etcd two requests per rank (a rank assignment's
    table, read by every rank at once). Elsewhere ``wait``, then ``get``.
    """
    counting = counting_store(view)
    try:
        if counting is None:
            view.wait([name], timeout)
            return view.get(name)
        watch = counting[0].watch_for(counting[1] + name)
        try:
            found, value = _await_watch(
                watch, lambda: watch.must_read() and view.check([name]), timeout.total_seconds()
            )
        finally:
            watch.stop()
        if not found:
            return None
        return value if value is not None else view.get(name)
    except RuntimeError:  # torch.distributed.DistStoreError: timed out, or the store did not answer in time
        return None


def await_key(
    view: dist.Store, name: str, look: Callable[[], bool], *, poll_interval: float, recheck: float = 1.0
) -> None:
    """Block until ``look()`` holds, for as long as it takes: a reserve rank's wait for the iteration's end, a
    joiner's for its admission.

    On a store that watches (etcd, through the node's relay where there is
    one), ``look`` runs when the watch on key ``name`` (of ``view``) sees it
    put or may have missed it, and every ``recheck`` seconds for what the key
    does not tell (the job finished); a rank waiting in reserve then costs
    etcd one watch, where a read every few milliseconds cost it tens of
    requests a second. Elsewhere, and once the watch broke (or the store did
    not answer when it was made), ``look`` runs every ``poll_interval``. The
    loop executes Python bytecode, so an asynchronous restart interrupts it.
    """
    counting = counting_store(view)
    watch: KeyWatch | None = None
    if counting is not None:
        try:
            watch = counting[0].watch_for(counting[1] + name)
        except ConnectionError:
            watch = None  # etcd away: look as a poll until it is back
    try:
        next_look = 0.0
        while True:
            now = time.monotonic()
            polling = watch is None or watch.broken or watch.value is not None
            if polling or now >= next_look or (watch is not None and watch.must_read()):
                if look():
                    return
                next_look = now + recheck
            if polling or watch is None:
                pause(poll_interval)
                continue
            with shield():  # a restart raised inside the event's wait could leave its lock held
                watch.appeared.wait(min(_WAIT_SLICE, max(0.0, next_look - time.monotonic())))
    finally:
        if watch is not None:
            watch.stop()


def append(store: dist.Store, key: str, text: str) -> None:
    """``store.append(key, text)``: every store the protocol runs on appends (TCPStore, FileStore, etcd's), but
    torch's type stubs leave the method out."""
    cast(Any, store).append(key, text)


def as_text(value: bytes) -> str:
    """A store value as text (a store returns bytes; a test double may return str)."""
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


def underlying(store: object) -> object:
    """The store below any number of prefix views."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class BarrierRules(Protocol):
    """What a view's barriers decide beyond arrivals (an iteration's: its outcome, who left, who joins)."""

    def barrier_result(self, name: str, world_size: int, *, admit: bool) -> str:
        """What the rank completing barrier ``name`` publishes (``admit``: see ``IterationRules``)."""
        ...

    def gone_ranks(self) -> list[int]:
        """Ranks recorded gone from the barriers' world: a last arriver among them is not waited for."""
        ...

    def stand_in_for_lost(self, name: str, world_size: int) -> bool:
        """Arrive at barrier ``name`` for ranks known lost before they could arrive; True once it is complete."""
        ...


class NoRules:
    """Barriers that decide nothing: they publish an empty result, and know of no rank gone or lost."""

    def barrier_result(self, name: str, world_size: int, *, admit: bool) -> str:
        return ""

    def gone_ranks(self) -> list[int]:
        return []

    def stand_in_for_lost(self, name: str, world_size: int) -> bool:
        return False


class Barriers:
    """Barriers on ``store`` (any ``torch.distributed.Store``, a prefix view included); ``rules`` say what they
    publish and which ranks are gone."""

    def __init__(self, store: dist.Store, rules: BarrierRules | None = None) -> None:
        self.store = store
        self.rules: BarrierRules = rules if rules is not None else NoRules()

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
        counting = counting_store(self.store)
        for rank, count in self._count_arrivals(name, list(ranks), counting):
            if count > world_size:
                raise BarrierOverflow(f"{name}: rank {rank} arrived as number {count} of {world_size}")
            if count == world_size:
                self.store.set(keys.barrier_last(name), str(rank))
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
                    answered(lambda: (watch.must_read() and self.store.check([done_key])) or stalled.repaired()),
                    limit,
                )
            finally:
                watch.stop()
            if published is not None:
                return as_text(published)
        else:
            completed = poll(answered(lambda: self.store.check([done_key]) or stalled.repaired()), limit)
        if not completed:
            if unreachable:
                raise BarrierTimeout(f"{name}: did not complete within {limit:g} s: {unreachable[0]}")
            try:
                with grace(_COUNT_GRACE, "the read of a timed-out barrier's arrivals"):
                    arrived = str(self._arrivals(name))
            except ConnectionError:
                arrived = "?"
            raise BarrierTimeout(f"{name}: {arrived} of {world_size} ranks arrived within {limit:g} s")
        return as_text(self.store.get(done_key))

    def _count_arrivals(
        self, name: str, ranks: list[int], counting: tuple[CountingStore, str] | None
    ) -> list[tuple[int, int]]:
        """Count ``ranks``' arrivals at barrier ``name``: ``(rank, its number among the arrivals)`` for each
        rank this call counted (a rank that had arrived already is left out).

        On an etcd store, one transaction per :data:`~elastic_ft.etcd.store.BATCH_ARRIVALS` ranks (a node's
        relay merges its ranks' calls into one); elsewhere a ``compare_set`` and an ``add`` per rank.
        """
        counted: list[tuple[int, int]] = []
        if counting is not None:
            base, prefix = counting
            for start in range(0, len(ranks), BATCH_ARRIVALS):
                chunk = ranks[start : start + BATCH_ARRIVALS]
                arrivals = [(prefix + keys.barrier_arrived(name, rank), uuid.uuid4().hex) for rank in chunk]
                numbers = base.arrive_batch(arrivals, prefix + keys.barrier_count_slots(name))
                counted += [(rank, number) for rank, number in zip(chunk, numbers, strict=True) if number is not None]
            return counted
        for rank in ranks:
            token = uuid.uuid4().hex
            if as_text(self.store.compare_set(keys.barrier_arrived(name, rank), "", token)) == token:
                counted.append((rank, self.store.add(keys.barrier_count(name), 1)))
        return counted

    def _arrivals(self, name: str) -> int:
        counting = counting_store(self.store)
        if counting is not None:
            return counting[0].arrivals(counting[1] + keys.barrier_count_slots(name))
        return self.store.add(keys.barrier_count(name), 0)

    def _publish(self, name: str, world_size: int, *, admit: bool) -> None:
        """Publish barrier ``name``'s result unless one is already published (the first one holds)."""
        done_key = keys.barrier_done(name)
        result = self.rules.barrier_result(name, world_size, admit=admit)
        held = as_text(self.store.compare_set(done_key, "", result))
        if held != result:
            log.warning("%s: a result was published before this one, which is dropped: %.200s", name, result)

    def has_arrived(self, name: str, rank: int) -> bool:
        return self.store.check([keys.barrier_arrived(name, rank)])
