"""The coordination store of the in-process restart Wrapper.

Ranks coordinate only through a ``torch.distributed.Store``: barriers,
fault records, the list of terminated ranks, heartbeats. The Wrapper gets
its store from ``store_factory(**store_kwargs)``; any ``Store`` with
TCPStore's semantics works (``set``, ``get``, ``add``, ``append``,
``compare_set``, ``check``), for example
:class:`elastic_ft.etcd.store.EtcdStore`, so that no single rank has to host
the job's coordination. The default, :class:`TCPStore`, is hosted by the
process of initial rank 0, which therefore must outlive the job.

The protocol itself lives in :class:`StoreMixin` and only uses those
primitives. The Wrapper applies it through :class:`PrefixStore` views: one
job-wide view and one per restart iteration, so that the keys of an
iteration never collide with those of the previous one.

The job-wide view also tells the node side (``ftrun``'s agent) what each
process is doing, keyed by initial rank: ``wrapped/<r>`` once it entered the
Wrapper, ``position/<r>`` (iteration, rank, world size) at the start of each
iteration, and ``left/<r>`` (how it left: completed, gave up, or left the
job alone). With these, the agent can tell a fault the Wrapper absorbs from
one it cannot, and can report a dead process without waiting for a
heartbeat timeout (:func:`report_process_gone`).

Under ``ftrun`` the default store (:func:`default_store`) is the etcd store
of the current rendezvous round, described in the environment
(:class:`elastic_ft.handoff.StoreHandoff`), so that no rank hosts the
coordination. Every key name comes from :mod:`elastic_ft.keys`.

Every value is plain text or JSON; nothing is pickled.

Waiting is done by polling ``check`` with a short back-off rather than with
``Store.wait``: a TCPStore client holds its connection lock for the whole of
a ``wait``, which would stall the other threads of the process sharing the
connection, and the polling loop executes Python bytecode, so an
asynchronous restart exception can interrupt it at any time.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.fault_records import (
    FaultHistory,
    Heartbeat,
    Interruption,
    encode_heartbeat,
    encode_interruption,
    next_history,
    parse_heartbeat_record,
    parse_interruptions,
)
from elastic_ft.handoff import StoreHandoff
from elastic_ft.inprocess.exception import BarrierError, BarrierOverflow, BarrierTimeout
from elastic_ft.inprocess.logs import get_logger
from elastic_ft.keys import COMPLETION_BARRIER, EXIT_BARRIER, HEAL_BARRIER, ITERATION_BARRIER, TERMINATION_BARRIER
from elastic_ft.untrusted import is_count, json_object

#: The per-iteration outcome: exactly one of these wins the ``compare_set``.
COMPLETED = "completed"
INTERRUPTED = "interrupted"
#: A restart nothing forces (admitting joiners): it waits for a step boundary (:data:`keys.RESTART_STEP`),
#: and either final outcome above replaces it.
PLANNED = "planned"
#: A joiner's admission when it died before any restart admitted it.
WITHDRAWN = "withdrawn"

#: A barrier timeout meaning "arrive, do not wait".
NO_WAIT = datetime.timedelta(0)
_POLL_FIRST = 0.0005
_POLL_MAX = 0.02

log = get_logger("store")


def poll(predicate: Callable[[], bool], timeout: float | None, interval_max: float = _POLL_MAX) -> bool:
    """Call ``predicate`` with a growing pause until it is true; False on timeout (``None``: never)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = _POLL_FIRST
    while not predicate():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, interval_max)
    return True


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

    def __init__(self, store: StoreMixin, name: str, world_size: int) -> None:
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
            return False
        if self.stalled_since is None:
            self.stalled_since = now
        last_key = keys.barrier_last(self.name)
        last = keys.parse_count(_text(store.get(last_key))) if store.check([last_key]) else None
        grace = _STALL_UNKNOWN if last is None else _STALL_GONE
        if now - self.stalled_since < grace or (last is not None and last not in store.terminated_ranks()):
            return False
        log.warning(
            "%s: all %d ranks arrived %.1f s ago, but the last (%s) published no result: publishing it in its place",
            self.name, self.world_size, now - self.stalled_since, "unknown" if last is None else f"rank {last}, gone",
        )  # fmt: skip
        store._publish(self.name, self.world_size, admit=False)
        return True



def _text(value: bytes) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


def _underlying(store: object) -> object:
    """The store below any number of prefix views."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class StoreMixin:
    """The Wrapper's coordination protocol, on top of a store's primitive operations.

    Mix it into any ``torch.distributed.Store`` subclass. ``critical_ranks``
    lists the initial ranks whose process must stay alive until every rank
    has left the Wrapper (the ranks hosting the store).
    """

    # Provided by the torch.distributed.Store this is mixed into.
    set: Callable[..., None]
    get: Callable[[str], bytes]
    add: Callable[[str, int], int]
    append: Callable[[str, str], None]
    check: Callable[[list[str]], bool]
    compare_set: Callable[[str, str, str], bytes]
    wait: Callable[..., None]

    @property
    def critical_ranks(self) -> tuple[int, ...]:
        return ()

    # ---- barriers ----

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
            BarrierTimeout: the barrier did not complete in time.
            BarrierOverflow: more than ``world_size`` distinct ranks arrived.
        """
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
                if _text(self.compare_set(keys.barrier_arrived(name, rank), "", token)) != token:
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
        if counting is not None and callable(getattr(counting[0], "watch_for", None)):
            # The loop stays a short-sleep poll the Wrapper can interrupt, but what it polls is a watch's
            # flag: one watch per rank, not a request every few milliseconds.
            appeared, stop = counting[0].watch_for(counting[1] + done_key)
            try:
                completed = poll(lambda: (appeared.is_set() and self.check([done_key])) or stalled.repaired(), limit)
            finally:
                stop()
        else:
            completed = poll(lambda: self.check([done_key]) or stalled.repaired(), limit)
        if not completed:
            raise BarrierTimeout(f"{name}: {self._arrivals(name)} of {world_size} ranks arrived within {limit:g} s")
        return _text(self.get(done_key))

    def _arrivals(self, name: str) -> int:
        counting = counting_store(self)
        if counting is not None:
            return int(counting[0].arrivals(counting[1] + keys.barrier_count(name)))
        return self.add(keys.barrier_count(name), 0)

    def _publish(self, name: str, world_size: int, *, admit: bool) -> None:
        """Publish barrier ``name``'s result unless one is already published (the first one holds)."""
        done_key = keys.barrier_done(name)
        result = self.barrier_result(name, world_size, admit=admit)
        held = _text(self.compare_set(done_key, "", result))
        if held != result:
            log.warning("%s: a result was published before this one, which is dropped: %.200s", name, result)

    def barrier_result(self, name: str, world_size: int, *, admit: bool = True) -> str:
        """What the last rank arriving at barrier ``name`` publishes.

        The completion barrier decides the iteration's outcome (completed,
        unless an interruption came first); the termination barrier freezes
        what the next rank assignment gets (:class:`TerminationResult`): the
        terminated ranks, and the joiners admitted into the next iteration
        (with ``admit=False``, only those admitted already: a rank that
        publishes in place of a lost last arriver admits no one new, so
        that no admission it makes can miss the result that holds).
        """
        if name == COMPLETION_BARRIER:
            return self.decide_outcome(COMPLETED)
        if name == HEAL_BARRIER:
            return json.dumps([self.heal_progress(rank) for rank in range(world_size)])
        if name == TERMINATION_BARRIER:
            iteration = getattr(self, "iteration", None)
            if iteration is None:
                return TerminationResult(world_size, tuple(self.terminated_ranks())).to_json()
            base = cast(dist.PrefixStore, self).underlying_store  # every view is a PrefixStore
            job = job_store(base)
            joined = admit_joiners(job, iteration + 1) if admit else admitted_joiners(job, iteration + 1)
            job.set(keys.LATEST_ITERATION, str(iteration + 1))
            recorded = _text(self.get(keys.INTERRUPTIONS)) if self.check([keys.INTERRUPTIONS]) else ""
            records, _ = parse_interruptions(recorded)
            history = next_history(previous_history(base, iteration), records, self.progressed())
            return TerminationResult(world_size, tuple(self.terminated_ranks()), tuple(joined), history).to_json()
        return ""

    def has_arrived(self, name: str, rank: int) -> bool:
        return self.check([keys.barrier_arrived(name, rank)])

    # ---- the iteration's outcome and the fault records ----

    def decide_outcome(self, outcome: str) -> str:
        """Propose the iteration's outcome; returns the one that won (the first final one proposed: a
        :data:`PLANNED` restart gives way to either final outcome)."""
        held = _text(self.compare_set(keys.OUTCOME, "", outcome))
        if held == PLANNED and outcome != PLANNED:
            held = _text(self.compare_set(keys.OUTCOME, PLANNED, outcome))
        return held

    def request_restart(self, rank: int, kind: str, message: str = "") -> str:
        """Ask for a :data:`PLANNED` restart on ``rank``'s behalf (recorded like an interruption, which it
        becomes at the next step boundary); returns the outcome that holds."""
        self.append(keys.INTERRUPTIONS, encode_interruption(rank, kind, message, time.time()))
        return self.decide_outcome(PLANNED)

    def restart_step(self, proposed: int) -> int:
        """The planned restart's step boundary: the first proposed (a malformed record reads as 0: at once)."""
        held = _text(self.compare_set(keys.RESTART_STEP, "", str(int(proposed))))
        return keys.parse_count(held) or 0

    def outcome(self) -> str | None:
        return _text(self.get(keys.OUTCOME)) if self.check([keys.OUTCOME]) else None

    def wait_for_outcome(self, timeout: float, poll_interval: float) -> str | None:
        """The iteration's outcome once decided, or None after ``timeout`` seconds.

        Event-driven on a store that waits without polling (an etcd store
        watches the key); elsewhere polled every ``poll_interval``, since a
        TCPStore client holds its connection for the whole of a ``wait``.
        """
        if getattr(_underlying(self), "waits_without_polling", False):
            try:
                self.wait([keys.OUTCOME], datetime.timedelta(seconds=timeout))
            except dist.DistStoreError:
                return None
            return self.outcome()
        deadline = time.monotonic() + timeout
        while (outcome := self.outcome()) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(poll_interval, remaining))
        return outcome

    def record_interruption(
        self,
        rank: int,
        kind: str,
        message: str = "",
        *,
        step: int | None = None,
        origin: str | None = None,
        traceback: str | None = None,
    ) -> str:
        """Record why ``rank`` interrupts the iteration (and when), then propose :data:`INTERRUPTED`.

        An exception also records the rank's step, where it was raised, and
        its traceback (:class:`~elastic_ft.fault_records.Interruption`).
        """
        line = encode_interruption(rank, kind, message, time.time(), step=step, origin=origin, traceback=traceback)
        self.append(keys.INTERRUPTIONS, line)
        return self.decide_outcome(INTERRUPTED)

    def mark_progressed(self) -> None:
        """A rank made a step in this iteration (the give-up rule counts iterations without one)."""
        self.set(keys.PROGRESSED, "1")

    def progressed(self) -> bool:
        return self.check([keys.PROGRESSED])

    def interruptions(self) -> list[Interruption]:
        """The iteration's well-formed interruption records (a malformed line is logged and skipped)."""
        if not self.check([keys.INTERRUPTIONS]):
            return []
        records, malformed = parse_interruptions(_text(self.get(keys.INTERRUPTIONS)))
        for line in malformed:
            log.warning("skipping a malformed interruption record: %.200s", line)
        return records

    def record_terminated(self, ranks: Iterable[int]) -> None:
        """Record ranks (current ``state.rank`` values) that leave the job."""
        lines = "".join(f"{int(rank)}\n" for rank in ranks)
        if lines:
            self.append(keys.TERMINATED, lines)

    def terminated_ranks(self) -> list[int]:
        if not self.check([keys.TERMINATED]):
            return []
        return sorted({int(line) for line in _text(self.get(keys.TERMINATED)).split()})

    def set_active_world_size(self, size: int) -> None:
        """Publish the iteration's active world size: a joiner's rank assignment starts from it."""
        self.set(keys.ACTIVE_WORLD_SIZE, str(int(size)))

    def active_world_size(self) -> int | None:
        if not self.check([keys.ACTIVE_WORLD_SIZE]):
            return None
        size = keys.parse_count(_text(self.get(keys.ACTIVE_WORLD_SIZE)))
        return size if size else None

    def termination_result(self) -> str | None:
        """The termination barrier's published result, once it completed."""
        key = keys.barrier_done(TERMINATION_BARRIER)
        return _text(self.get(key)) if self.check([key]) else None

    def set_heal_progress(self, active_rank: int, step: int, fresh: bool) -> None:
        self.set(keys.heal_progress(active_rank), json.dumps({"step": step, "fresh": fresh}))

    def heal_progress(self, active_rank: int) -> object:
        """An active rank's progress record as stored (untrusted: decoded, not checked), None if absent."""
        key = keys.heal_progress(active_rank)
        return json_object(self.get(key)) if self.check([key]) else None

    def mark_any_completed(self) -> None:
        self.set(keys.ANY_COMPLETED, "")

    def any_completed(self) -> bool:
        return self.check([keys.ANY_COMPLETED])

    # ---- identity and liveness ----

    def set_initial_rank(self, rank: int, initial_rank: int) -> None:
        """Publish which initial rank holds ``rank`` in this iteration."""
        self.set(f"{keys.RANK_OF_INITIAL}{initial_rank}", str(rank))

    def rank_of_initial(self, initial_rank: int) -> int | None:
        key = f"{keys.RANK_OF_INITIAL}{initial_rank}"
        return int(_text(self.get(key))) if self.check([key]) else None

    def send_heartbeat(
        self, rank: int, active_at: float | None = None, waiting: bool | None = None, reserve: bool = False
    ) -> None:
        """A heartbeat for initial rank ``rank`` (:class:`~elastic_ft.fault_records.Heartbeat`), sent now."""
        now = time.time()
        text = encode_heartbeat(now, now if active_at is None else active_at, waiting, reserve)
        self.set(f"{keys.HEARTBEAT}{rank}", text)

    def heartbeat(self, rank: int) -> Heartbeat | None:
        """Initial rank ``rank``'s last heartbeat; None without one, or with one that is not well-formed."""
        key = f"{keys.HEARTBEAT}{rank}"
        if not self.check([key]):
            return None
        return parse_heartbeat_record(_text(self.get(key)))

    def _heartbeat(self, rank: int) -> tuple[float, float] | None:
        """(sent at, last active at); None without a heartbeat or with one that is not well-formed."""
        record = self.heartbeat(rank)
        return None if record is None else (record.sent_at, record.active_at)

    def last_heartbeat(self, rank: int) -> float | None:
        record = self._heartbeat(rank)
        return None if record is None else record[0]

    def last_activity(self, rank: int) -> float | None:
        """When (wall clock) initial rank ``rank`` was last active, per its last heartbeat."""
        record = self._heartbeat(rank)
        return None if record is None else record[1]

    # ---- what the node side reads (job-wide view) ----

    def record_wrapped(self, initial_rank: int, pid: int) -> None:
        self.set(f"{keys.WRAPPED}{initial_rank}", json.dumps({"pid": pid}))

    def is_wrapped(self, initial_rank: int) -> bool:
        return self.check([f"{keys.WRAPPED}{initial_rank}"])

    def record_position(self, initial_rank: int, iteration: int, rank: int, world_size: int, active: bool) -> None:
        self.set(
            f"{keys.POSITION}{initial_rank}",
            json.dumps({"iteration": iteration, "rank": rank, "world_size": world_size, "active": active}),
        )

    def position(self, initial_rank: int) -> dict[str, int] | None:
        """The rank's last published position; None if none, or if the record is malformed (untrusted).

        ``active`` is 1 for a rank that runs the function, 0 for a reserve rank.
        """
        key = f"{keys.POSITION}{initial_rank}"
        record = json_object(self.get(key)) if self.check([key]) else None
        fields = ("iteration", "rank", "world_size")
        if record is None or not all(is_count(record.get(name)) for name in fields):
            return None
        active = record.get("active", True)
        if not isinstance(active, bool):
            return None
        return {**{name: record[name] for name in fields}, "active": int(active)}

    # ---- growing the world (job-wide view) ----

    def set_accepts_joiners(self, accepts: bool = True) -> None:
        """Whether the ranks' rank assignment can grow the world (every rank of the world writes the same)."""
        self.set(keys.ACCEPTS_JOINERS, "1" if accepts else "0")

    def accepts_joiners(self) -> bool:
        return self.joiners_accepted() is True

    def joiners_accepted(self) -> bool | None:
        """Whether the world can grow: None until its ranks said (they say so as they enter the Wrapper)."""
        if not self.check([keys.ACCEPTS_JOINERS]):
            return None
        return _text(self.get(keys.ACCEPTS_JOINERS)) == "1"

    def register_joiner(self, initial_rank: int) -> None:
        """A process that is not in the world asks to join it at the next restart."""
        self.append(keys.JOINERS, f"{int(initial_rank)}\n")

    def joiners(self) -> list[int]:
        """Initial ranks that registered, in registration order (a malformed line is skipped)."""
        if not self.check([keys.JOINERS]):
            return []
        seen: dict[int, None] = {}
        for line in _text(self.get(keys.JOINERS)).split():
            rank = keys.parse_count(line)
            if rank is not None:
                seen.setdefault(rank, None)
        return list(seen)

    def claim_admission(self, initial_rank: int, value: str) -> str:
        """Set ``admitted/<r>`` unless set already (``value``: an iteration, or ``withdrawn``); returns what holds."""
        return _text(self.compare_set(f"{keys.ADMITTED}{initial_rank}", "", value))

    def admission(self, initial_rank: int) -> str | None:
        key = f"{keys.ADMITTED}{initial_rank}"
        return _text(self.get(key)) if self.check([key]) else None

    def record_activation(self, initial_rank: int, iteration: int) -> None:
        """A reserve rank (or a joiner) runs the function from ``iteration`` on."""
        self.append(
            keys.ACTIVATIONS, json.dumps({"initial_rank": int(initial_rank), "iteration": int(iteration)}) + "\n"
        )

    def latest_iteration(self) -> int:
        """The iteration the last restart began (0 before any; a malformed record reads as 0)."""
        if not self.check([keys.LATEST_ITERATION]):
            return 0
        return keys.parse_count(_text(self.get(keys.LATEST_ITERATION))) or 0

    def mark_finished(self) -> None:
        self.set(keys.FINISHED, "1")

    def finished(self) -> bool:
        return self.check([keys.FINISHED])

    def record_left(self, initial_rank: int, kind: str, gave_up: bool, message: str = "", fatal: bool = False) -> None:
        """How the rank left the Wrapper; ``fatal``: it gave up on the job for good (a fault repeats: the node side
        must not restart the workers)."""
        record = {"kind": kind, "gave_up": gave_up, "message": message[:500], "fatal": fatal}
        self.set(f"{keys.LEFT}{initial_rank}", json.dumps(record))

    def left(self, initial_rank: int) -> dict[str, object] | None:
        """How the rank left the Wrapper; None if it did not. A malformed record still says it left."""
        key = f"{keys.LEFT}{initial_rank}"
        if not self.check([key]):
            return None
        return json_object(self.get(key)) or {"kind": "malformed"}


class PrefixStore(dist.PrefixStore, StoreMixin):
    """A namespaced view of another store, with the coordination protocol.

    ``iteration``: the restart iteration whose keys the view holds (``None``
    for the job-wide view).
    """

    iteration: int | None = None

    def __init__(self, prefix: str, store: dist.Store) -> None:
        super().__init__(prefix, store)
        #: torch's view keeps its prefix to itself; the barriers need it to count arrivals in the base store.
        self.key_prefix = prefix


def counting_store(view: object) -> tuple[Any, str] | None:
    """The store under ``view`` if it counts a barrier's arrivals in one request (an etcd store's
    ``arrive_once``), and the key prefix of the view; None for any other store (its ``add`` counts).

    A counter that every rank reads, changes and writes back costs each rank
    retries that grow with the number arriving at once; one transaction per
    arrival does not.
    """
    if callable(getattr(view, "arrive_once", None)):
        return view, ""  # the etcd store itself
    prefix = getattr(view, "key_prefix", None)
    if prefix is None or not isinstance(view, dist.PrefixStore):
        return None
    base = view.underlying_store
    if not callable(getattr(base, "arrive_once", None)):
        return None
    return base, f"{prefix}/"


def job_store(base: dist.Store) -> PrefixStore:
    """The view holding the job-wide keys (initial and exit barriers)."""
    return PrefixStore(keys.WRAPPER_JOB, base)


def iteration_store(base: dist.Store, iteration: int) -> PrefixStore:
    """The view holding the keys of one restart iteration."""
    view = PrefixStore(keys.wrapper_iteration(iteration), base)
    view.iteration = iteration
    return view


_JOINED_MAX = 4096  # joiners one restart admits: far beyond any respawn budget


@dataclass(frozen=True)
class TerminationResult:
    """The termination barrier's result: what every rank's next rank assignment starts from.

    ``world_size``: the iteration's world size; ``terminated``: its ranks
    that left; ``joined``: initial ranks of the processes admitted into the
    next iteration, which take ranks ``world_size, world_size + 1, ...`` in
    this order before the rank assignment renumbers everyone; ``history``:
    the job's faults so far as the give-up rule counts them
    (:func:`~elastic_ft.fault_records.next_history`).
    """

    world_size: int
    terminated: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    history: FaultHistory = FaultHistory()  # noqa: RUF009 - frozen: one shared instance is safe

    def to_json(self) -> str:
        return json.dumps(
            {
                "world_size": self.world_size,
                "terminated": self.terminated,
                "joined": self.joined,
                "history": self.history.to_dict(),
            }
        )

    @classmethod
    def from_json(cls, payload: str | bytes | None, world_size: int | None) -> TerminationResult:
        """Decode a payload read from the store (untrusted).

        Raises:
            ValueError: the payload is not a termination result of a world of
                ``world_size`` ranks (``None``: of any size, for a joiner).
        """
        record = json_object(payload or b"")
        terminated = record.get("terminated") if record else None
        joined = record.get("joined") if record else None
        size = record.get("world_size") if record else None
        history = FaultHistory.from_dict(record.get("history", {"repeats": 0, "stalled": 0})) if record else None
        if (
            record is None
            or not is_count(size)
            or size < 1
            or (world_size is not None and size != world_size)
            or not isinstance(terminated, list)
            or not all(is_count(r) and r < size for r in terminated)
            or not isinstance(joined, list)
            or len(joined) > _JOINED_MAX
            or len(set(joined)) != len(joined)
            or not all(is_count(r) for r in joined)
            or history is None
        ):
            raise ValueError(
                f"malformed termination result {payload!r:.200} for a world of {world_size or 'any number of'} "
                'ranks; expected {"world_size": N, "terminated": [ranks below N], "joined": [distinct initial ranks], '
                '"history": {"signature": text or null, "repeats": n, "stalled": n}}'
            )
        return cls(size, tuple(sorted(set(terminated))), tuple(joined), history)


def previous_history(base: dist.Store, iteration: int) -> FaultHistory:
    """The fault history published by the termination barrier of ``iteration - 1`` (empty for the first, or when
    that result is unreadable: the store is untrusted, and forgetting counts only delays a give-up)."""
    if iteration == 0:
        return FaultHistory()
    payload = iteration_store(base, iteration - 1).termination_result()
    try:
        return TerminationResult.from_json(payload, None).history
    except ValueError as error:
        log.warning("iteration %d: the previous termination result is unreadable; fault counts restart: %s",
                    iteration, error)  # fmt: skip
        return FaultHistory()


#: A joiner is admitted only if its monitor process reported it active this recently (seconds): a
#: stopped or hung joiner admitted would hold the next iteration barrier until its timeout.
JOINER_ACTIVITY_LIMIT = 10.0


def joiner_ready(job: PrefixStore, initial_rank: int, now: float | None = None) -> bool:
    """The joiner's heartbeat says its process was active within :data:`JOINER_ACTIVITY_LIMIT`."""
    active_at = job.last_activity(initial_rank)
    return active_at is not None and (time.time() if now is None else now) - active_at < JOINER_ACTIVITY_LIMIT


def admit_joiners(job: PrefixStore, iteration: int) -> list[int]:
    """Admit, into ``iteration``, every registered joiner that is ready and was not admitted or withdrawn
    before (the last arriver at the previous iteration's termination barrier calls this: once per restart).
    One not ready yet (no heartbeat so far, or inactive: stopped, hung) waits for a later restart."""
    if not job.accepts_joiners():
        return []
    value, now = str(iteration), time.time()
    admitted = []
    for rank in job.joiners()[:_JOINED_MAX]:
        if job.admission(rank) is not None:
            continue
        if not joiner_ready(job, rank, now):
            active_at = job.last_activity(rank)
            since = "never" if active_at is None else f"{now - active_at:.1f} s ago"
            log.info("joiner %d is not admitted into iteration %d: last reported active %s", rank, iteration, since)
            continue
        if job.claim_admission(rank, value) == value:
            admitted.append(rank)
    return admitted


def admitted_joiners(job: PrefixStore, iteration: int) -> list[int]:
    """The joiners already admitted into ``iteration``, in the order :func:`admit_joiners` admits them."""
    if not job.accepts_joiners():
        return []
    return [rank for rank in job.joiners()[:_JOINED_MAX] if job.admission(rank) == str(iteration)]


def report_rank_gone(
    store: PrefixStore, rank: int, world_size: int, kind: str, message: str, *, interrupt: bool = True
) -> None:
    """Record ``rank`` of an iteration as gone and arrive at its barriers in its place.

    A reserve rank (``interrupt=False``) leaves without interrupting the
    iteration: the active ranks go on, it also arrives at the completion
    barrier in its place, and the next restart drops it.
    """
    if interrupt:
        store.record_interruption(rank, kind, message)
    store.record_terminated([rank])
    store.arrive_and_wait(ITERATION_BARRIER, [rank], world_size, NO_WAIT)
    store.arrive_and_wait(TERMINATION_BARRIER, [rank], world_size, NO_WAIT)
    if not interrupt:
        store.arrive_and_wait(COMPLETION_BARRIER, [rank], world_size, NO_WAIT)


def report_process_gone(base: dist.Store, initial_rank: int, initial_world_size: int, kind: str, message: str) -> bool:
    """Report, from outside, that the process of ``initial_rank`` died inside the Wrapper.

    Uses the position the process published last, so the other ranks restart
    without it at once. Idempotent (barrier arrivals are per rank), so the
    process's own monitor process may report it too. Returns False when
    there is nothing to report: the process never entered the Wrapper, or
    left it already.
    """
    job = job_store(base)
    if not job.is_wrapped(initial_rank) or job.left(initial_rank) is not None:
        return False
    position = job.position(initial_rank)
    if position is None and initial_rank >= initial_world_size:
        # A joiner that was never admitted: withdraw it, so no restart admits a dead process.
        job.claim_admission(initial_rank, WITHDRAWN)
    if position is not None:
        iteration = iteration_store(base, position["iteration"])
        if iteration.outcome() != COMPLETED:
            report_rank_gone(
                iteration,
                position["rank"],
                position["world_size"],
                kind,
                message,
                interrupt=bool(position["active"]),
            )
    if initial_rank < initial_world_size:  # joiners are not counted by the exit barrier
        job.arrive_and_wait(EXIT_BARRIER, [initial_rank], initial_world_size, NO_WAIT)
    return True


def report_node_gone(base: dist.Store, initial_ranks: Sequence[int], initial_world_size: int, message: str) -> list[int]:
    """Report, from outside, that a node died with the processes of ``initial_ranks``; returns those reported.

    Its joiners that hold no place yet are withdrawn first: reporting an
    active rank may complete the restart whose last arriver admits joiners,
    and a dead process admitted would hold the next iteration's barrier.
    """
    job = job_store(base)
    ranks = sorted(initial_ranks, key=lambda rank: job.position(rank) is not None)
    return [rank for rank in ranks if report_process_gone(base, rank, initial_world_size, "node_died", message)]


#: The keywords of :class:`TCPStore` that say where it listens and who hosts it. Under ``ftrun`` the round's etcd
#: store takes the TCPStore's place, so they have nothing left to configure.
TCPSTORE_PLACEMENT = frozenset(
    {"host_name", "port", "world_size", "is_master", "host_rank", "wait_for_workers", "multi_tenant",
     "master_listen_fd", "use_libuv"}
)  # fmt: skip


def default_store(**kwargs: Any) -> dist.Store:
    """The Wrapper's default ``store_factory``.

    Under ``ftrun`` (a :class:`~elastic_ft.handoff.StoreHandoff` in the
    environment), the etcd store of the current rendezvous round, which no
    rank hosts: the job survives the loss of any process, and the agent
    reads the Wrapper's records there. ``timeout`` applies; the keywords that
    place a TCPStore (``port``, ``host_name``, ...: NVIDIA's examples pass
    ``store_kwargs={'port': MASTER_PORT + 1}``) are accepted and ignored, with
    one log line. Otherwise a :class:`TCPStore` hosted by initial rank 0, with
    ``kwargs``.
    """
    handoff = StoreHandoff.from_env(os.environ)
    if handoff is not None:
        unknown = set(kwargs) - TCPSTORE_PLACEMENT - {"timeout"}
        if unknown:
            raise TypeError(
                f"default_store() got unexpected keyword(s) {sorted(unknown)}; expected timeout or TCPStore's "
                f"{sorted(TCPSTORE_PLACEMENT)}"
            )
        ignored = sorted(set(kwargs) & TCPSTORE_PLACEMENT)
        if ignored:
            log.info(
                "store_kwargs %s place a TCPStore; under ftrun the Wrapper uses the round's etcd store instead (no "
                "rank hosts it, and the agent reads the Wrapper's records there)",
                {name: kwargs[name] for name in ignored},
            )
        from elastic_ft.etcd.client import EtcdClient
        from elastic_ft.etcd.store import EtcdStore

        client = EtcdClient(
            handoff.endpoints,
            connect_timeout=handoff.connect_timeout,
            request_timeout=handoff.request_timeout,
            tls=handoff.tls,
            credentials=handoff.credentials,
        )
        return EtcdStore(client, handoff.prefix, kwargs.get("timeout") or datetime.timedelta(seconds=handoff.timeout))
    return TCPStore(**kwargs)


_hosting_forbidden = False


def forbid_hosting() -> None:
    """Make :class:`TCPStore` connect as a client only: for processes that must not host it."""
    global _hosting_forbidden
    _hosting_forbidden = True


class TCPStore(dist.TCPStore, StoreMixin):
    """The default ``store_factory``: a TCPStore hosted by the process of initial rank ``host_rank``.

    Args:
        host_name: host of the store; default ``MASTER_ADDR``.
        port: port of the store; default ``MASTER_PORT + 1``, leaving
            ``MASTER_PORT`` to the wrapped function's own
            ``init_process_group``.
        world_size: the number of processes that connect, or ``None``
            (unknown: the host does not wait for them).
        timeout: timeout of the store's own blocking operations.
        wait_for_workers: with ``world_size``, the host waits in the
            constructor until every process connected.
        multi_tenant: share one server among the stores of a process on the
            same port.
        use_libuv: use TCPStore's libuv server.
        host_rank: the initial ``RANK`` whose process hosts the store.
    """

    #: The initial rank that hosts the store by default.
    TCP_STORE_HOST_RANK = 0

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        use_libuv: bool = True,
        host_rank: int = TCP_STORE_HOST_RANK,
    ) -> None:
        self.host_rank = host_rank
        hosts = int(os.environ["RANK"]) == host_rank and not _hosting_forbidden
        super().__init__(
            host_name if host_name is not None else os.environ["MASTER_ADDR"],
            port if port is not None else int(os.environ["MASTER_PORT"]) + 1,
            world_size,
            hosts,
            timeout,
            wait_for_workers=wait_for_workers,
            multi_tenant=multi_tenant,
            use_libuv=use_libuv,
        )

    @property
    def critical_ranks(self) -> tuple[int, ...]:
        return (self.host_rank,)


class FileStore(dist.FileStore, StoreMixin):
    """A ``store_factory`` for ranks of one host, or hosts sharing a file system: a ``torch.distributed.FileStore``.

    Args:
        file_name: the store's file, the same path on every rank.
        world_size: the number of processes that use it; ``-1``: unknown.
    """

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        super().__init__(file_name, world_size)


__all__ = [
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "FileStore",
    "PrefixStore",
    "StoreMixin",
    "TCPStore",
    "default_store",
]
