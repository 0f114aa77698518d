"""The records of one restart iteration: its outcome, its faults, who left, and what its barriers decide.

Each iteration's keys live under their own prefix (``keys.wrapper_iteration``),
so that they never collide with the previous iteration's. The termination
barrier's result (:class:`~elastic_ft.coordination.termination.TerminationResult`)
is what every rank's next rank assignment starts from.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterable
from typing import cast

import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.barriers import (
    NO_WAIT,
    Barriers,
    KeyedPrefixStore,
    KeyWatch,
    append,
    as_text,
    counting_store,
    log,
    read_existing,
    read_one,
    underlying,
)
from elastic_ft.coordination.fault_records import (
    FaultHistory,
    Interruption,
    encode_interruption,
    next_history,
    parse_interruptions,
)
from elastic_ft.coordination.job import admit_joiners, admitted_joiners, job_store
from elastic_ft.coordination.termination import TerminationResult
from elastic_ft.keys import COMPLETION_BARRIER, HEAL_BARRIER, ITERATION_BARRIER, TERMINATION_BARRIER
from elastic_ft.runtime.waits import poll
from elastic_ft.untrusted import MalformedRecord, SkipLog, json_object

_SKIPPED = SkipLog(log)

#: The per-iteration outcome: exactly one of these wins the ``compare_set``.
COMPLETED = "completed"
INTERRUPTED = "interrupted"
#: A restart nothing forces (admitting joiners): it waits for a step boundary (:data:`keys.RESTART_STEP`),
#: and either final outcome above replaces it.
PLANNED = "planned"


class IterationRules:
    """What one iteration's barriers decide (:class:`~elastic_ft.coordination.barriers.BarrierRules`): the
    outcome, the termination result, and the ranks lost before they arrived."""

    def __init__(self, records: IterationRecords) -> None:
        self.records = records

    def barrier_result(self, name: str, world_size: int, *, admit: bool) -> str:
        """What the last rank arriving at barrier ``name`` publishes.

        The completion barrier decides the iteration's outcome (completed,
        unless an interruption came first); the termination barrier freezes
        what the next rank assignment gets (:class:`TerminationResult`): the
        terminated ranks, and the joiners admitted into the next iteration
        (with ``admit=False``, only those admitted already: a rank that
        publishes in place of a lost last arriver admits no one new, so
        that no admission it makes can miss the result that holds).
        """
        records = self.records
        if name == COMPLETION_BARRIER:
            return records.decide_outcome(COMPLETED)
        if name == HEAL_BARRIER:
            return json.dumps(records.heal_progresses(world_size))
        if name == TERMINATION_BARRIER:
            iteration = records.iteration
            if iteration is None:
                return TerminationResult(world_size, tuple(records.terminated_ranks())).to_json()
            base = records.base
            job = job_store(base)
            joined = admit_joiners(job, iteration + 1) if admit else admitted_joiners(job, iteration + 1)
            job.record_latest_iteration(iteration + 1)
            interruptions, _ = parse_interruptions(as_text(read_one(records.store, keys.INTERRUPTIONS) or b""))
            history = next_history(previous_history(base, iteration), interruptions, records.progressed())
            return TerminationResult(world_size, tuple(records.terminated_ranks()), tuple(joined), history).to_json()
        return ""

    def gone_ranks(self) -> list[int]:
        return self.records.terminated_ranks()

    def _terminated_after_the_decision(self) -> list[int]:
        """Ranks of the previous iteration terminated after its termination barrier's result was published."""
        number = self.records.iteration
        if not number:
            return []
        previous = iteration_store(self.records.base, number - 1)
        payload = previous.termination_result()
        if payload is None:
            return []
        try:
            decided = set(TerminationResult.from_json(payload, None).terminated)
        except MalformedRecord:
            return []  # the barrier's timeout still bounds the wait
        return sorted(set(previous.terminated_ranks()) - decided)

    def stand_in_for_lost(self, name: str, world_size: int) -> bool:
        """At the iteration barrier: once every rank arrived but as many as are known lost, those missing are
        the lost processes' places; report them gone (interrupting the iteration, so that the next restart
        goes on without them) instead of waiting out the barrier timeout.

        Lost: joiners admitted to this iteration that died before taking
        their place (``IterationRecords.record_lost``), and ranks of the previous
        iteration that died after its restart had decided this iteration's
        world with them in (terminated there, but not in its published
        result). Their places come from a rank assignment they never ran, so
        they are known only this way: by elimination, once every live rank
        arrived (each records its position before it arrives, and one dead
        with a position here is reported at that place).
        """
        if name != ITERATION_BARRIER:
            return False
        lost = len(self.records.lost_ranks()) + len(self._terminated_after_the_decision())
        if not lost:
            return False
        arrived = read_existing(self.records.store, [keys.barrier_arrived(name, rank) for rank in range(world_size)])
        missing = [rank for rank in range(world_size) if keys.barrier_arrived(name, rank) not in arrived]
        if not missing or len(missing) > lost:
            return False
        message = f"{lost} process(es) expected in this iteration died before taking their place"
        log.warning("%s: ranks %s never arrived: %s; restarting without them", name, missing, message)
        for rank in missing:
            report_rank_gone(self.records, rank, world_size, "node_died", message)
        return False  # the last stand-in's arrival publishes the result, which the watch brings


class IterationRecords:
    """One iteration's records, on ``store`` (a view of the iteration's keys, or a store used without views, as
    NVIDIA's API allows: then ``iteration`` is None), and its barriers (:class:`IterationRules`).

    ``base``: the store below the view, where the job-wide and the other iterations' records are.
    """

    def __init__(self, store: dist.Store, iteration: int | None, base: dist.Store | None = None) -> None:
        self.store = store
        self.iteration = iteration
        self.base: dist.Store = base if base is not None else cast(dist.Store, underlying(store))

    @property
    def barriers(self) -> Barriers:
        """The iteration's barriers, deciding by :class:`IterationRules`; made for each use, since kept here they
        would name these records back: a cycle that keeps the store until a garbage collection."""
        return Barriers(self.store, IterationRules(self))

    def arrive_and_wait(
        self, name: str, ranks: Iterable[int], world_size: int, timeout: datetime.timedelta
    ) -> str | None:
        """Arrive at the iteration's barrier ``name`` (:meth:`Barriers.arrive_and_wait`)."""
        return self.barriers.arrive_and_wait(name, ranks, world_size, timeout)

    def record_lost(self, initial_rank: int) -> None:
        """A process expected in this iteration died before it took its place here (it arrived nowhere in it)."""
        append(self.store, keys.LOST_RANKS, f"{int(initial_rank)}\n")

    def lost_ranks(self) -> list[int]:
        """Initial ranks of the processes recorded lost before they took their place in this iteration."""
        lines = as_text(read_one(self.store, keys.LOST_RANKS) or b"").split()
        return sorted({n for line in lines if (n := keys.parse_count(line)) is not None})

    # ---- the iteration's outcome and the fault records ----

    def decide_outcome(self, outcome: str) -> str:
        """Propose the iteration's outcome; returns the one that won (the first final one proposed: a
        :data:`PLANNED` restart gives way to either final outcome)."""
        held = as_text(self.store.compare_set(keys.OUTCOME, "", outcome))
        if held == PLANNED and outcome != PLANNED:
            held = as_text(self.store.compare_set(keys.OUTCOME, PLANNED, outcome))
        return held

    def request_restart(self, rank: int, kind: str, message: str = "") -> str:
        """Ask for a :data:`PLANNED` restart on ``rank``'s behalf (recorded like an interruption, which it
        becomes at the next step boundary); returns the outcome that holds."""
        append(self.store, keys.INTERRUPTIONS, encode_interruption(rank, kind, message, time.time()))
        return self.decide_outcome(PLANNED)

    def restart_step(self, proposed: int) -> int:
        """The planned restart's step boundary: the first proposed (a malformed record reads as 0: at once)."""
        held = as_text(self.store.compare_set(keys.RESTART_STEP, "", str(int(proposed))))
        return keys.parse_count(held) or 0

    def outcome(self) -> str | None:
        found = read_one(self.store, keys.OUTCOME)
        return None if found is None else as_text(found)

    def watch_outcome(self) -> KeyWatch | None:
        """A watch for the iteration's outcome, for :meth:`wait_for_outcome` to wait on for the whole iteration;
        None on a store that cannot watch (the caller stops it: ``stop()``).

        One watch per iteration (on an etcd store; through the node's relay, one per host) rather than a new
        one every wait: the monitor thread waits for the outcome all the time the rank trains, and a watch
        created and cancelled every second cost each rank about five etcd requests a second.
        """
        counting = counting_store(self.store)
        return None if counting is None else counting[0].watch_for(counting[1] + keys.OUTCOME)

    def wait_for_outcome(self, timeout: float, poll_interval: float, watch: KeyWatch | None = None) -> str | None:
        """The iteration's outcome once decided, or None after ``timeout`` seconds.

        On ``watch`` (:meth:`watch_outcome`) when given and not broken: no
        request until it sees the key (or may have missed it: one read), and
        none for a final outcome it saw.
        Otherwise event-driven on a store that waits without polling (a
        watch for this wait alone), and elsewhere polled every
        ``poll_interval``, since a TCPStore client holds its connection for
        the whole of a ``wait``.
        """
        if watch is not None and not watch.broken:
            if watch.value is None and not watch.must_read():
                watch.appeared.wait(timeout)
                if watch.value is None and not watch.broken and not watch.must_read():
                    return None
            seen = None if watch.value is None else as_text(watch.value)
            if seen is not None and seen != PLANNED:
                return seen  # final: it never changes, so every rank of a restart is spared a read
            return self.outcome()
        if getattr(underlying(self.store), "waits_without_polling", False):
            try:
                self.store.wait([keys.OUTCOME], datetime.timedelta(seconds=timeout))
            except dist.DistStoreError:
                return None
            return self.outcome()
        poll(lambda: self.outcome() is not None, timeout, interval_max=poll_interval, interval_first=poll_interval)
        return self.outcome()

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
        its traceback (:class:`~elastic_ft.coordination.fault_records.Interruption`).
        """
        line = encode_interruption(rank, kind, message, time.time(), step=step, origin=origin, traceback=traceback)
        append(self.store, keys.INTERRUPTIONS, line)
        return self.decide_outcome(INTERRUPTED)

    def mark_progressed(self) -> None:
        """A rank made a step in this iteration (the give-up rule counts iterations without one)."""
        self.store.set(keys.PROGRESSED, "1")

    def progressed(self) -> bool:
        return read_one(self.store, keys.PROGRESSED) is not None

    def interruptions(self) -> list[Interruption]:
        """The iteration's well-formed interruption records (a malformed line is logged and skipped)."""
        found = read_one(self.store, keys.INTERRUPTIONS)
        if found is None:
            return []
        records, malformed = parse_interruptions(as_text(found))
        for line in malformed:
            _SKIPPED.skip(MalformedRecord(f"{line:.200}", keys.INTERRUPTIONS), "an interruption record")
        return records

    def record_terminated(self, ranks: Iterable[int]) -> None:
        """Record ranks (current ``state.rank`` values) that leave the job."""
        lines = "".join(f"{int(rank)}\n" for rank in ranks)
        if lines:
            append(self.store, keys.TERMINATED, lines)

    def terminated_ranks(self) -> list[int]:
        return sorted({int(line) for line in as_text(read_one(self.store, keys.TERMINATED) or b"").split()})

    def set_active_world_size(self, size: int) -> None:
        """Publish the iteration's active world size: a joiner's rank assignment starts from it."""
        self.store.set(keys.ACTIVE_WORLD_SIZE, str(int(size)))

    def active_world_size(self) -> int | None:
        found = read_one(self.store, keys.ACTIVE_WORLD_SIZE)
        size = None if found is None else keys.parse_count(as_text(found))
        return size if size else None

    def termination_result(self) -> str | None:
        """The termination barrier's published result, once it completed."""
        found = read_one(self.store, keys.barrier_done(TERMINATION_BARRIER))
        return None if found is None else as_text(found)

    def set_heal_progress(
        self,
        active_rank: int,
        step: int,
        fresh: bool,
        shard: tuple[int, int] | None = None,
        layout: dict[str, object] | None = None,
    ) -> None:
        """Record an active rank's progress: its step, whether it holds no state, the shard it holds, and where its
        state's DTensors place it (a ``ShardLayout``'s JSON)."""
        record: dict[str, object] = {"step": step, "fresh": fresh}
        if shard is not None:
            record["shard"] = list(shard)
        if layout is not None:
            record["layout"] = layout
        self.store.set(keys.heal_progress(active_rank), json.dumps(record))

    def heal_progresses(self, active_world_size: int) -> list[object]:
        """Every active rank's progress record, in rank order , in one read (batched:
        one request per 128 ranks on an etcd store); a rank arrived for by another, dead before it recorded,
        has None."""
        names = [keys.heal_progress(rank) for rank in range(active_world_size)]
        found = read_existing(self.store, names)
        return [json_object(found[name]) if name in found else None for name in names]

    def mark_any_completed(self) -> None:
        self.store.set(keys.ANY_COMPLETED, "")

    def any_completed(self) -> bool:
        return read_one(self.store, keys.ANY_COMPLETED) is not None

    # ---- identity ----

    def set_initial_rank(self, rank: int, initial_rank: int) -> None:
        """Publish which initial rank holds ``rank`` in this iteration."""
        self.store.set(f"{keys.RANK_OF_INITIAL}{initial_rank}", str(rank))

    def rank_of_initial(self, initial_rank: int) -> int | None:
        found = read_one(self.store, f"{keys.RANK_OF_INITIAL}{initial_rank}")
        return None if found is None else int(as_text(found))


class IterationView(IterationRecords):
    """The view of one restart iteration's keys (under ``keys.wrapper_iteration``), on the Wrapper's store."""

    def __init__(self, prefix: str, base: dist.Store, iteration: int) -> None:
        super().__init__(KeyedPrefixStore(prefix, base), iteration, base)
        self.key_prefix = prefix


def iteration_store(base: dist.Store, iteration: int) -> IterationView:
    """The view holding the keys of one restart iteration."""
    return IterationView(keys.wrapper_iteration(iteration), base, iteration)


def previous_history(base: dist.Store, iteration: int) -> FaultHistory:
    """The fault history published by the termination barrier of ``iteration - 1`` (empty for the first, or when
    that result is unreadable: the store is untrusted, and forgetting counts only delays a give-up)."""
    if iteration == 0:
        return FaultHistory()
    payload = iteration_store(base, iteration - 1).termination_result()
    try:
        return TerminationResult.from_json(payload, None).history
    except MalformedRecord as error:
        log.warning(
            "iteration %d: the previous termination result is unreadable; fault counts restart: %s", iteration, error
        )
        return FaultHistory()


def report_rank_gone(
    store: IterationRecords, rank: int, world_size: int, kind: str, message: str, *, interrupt: bool = True
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
