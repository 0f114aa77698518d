"""The records of one restart iteration: its outcome, its faults, who left, and what its barriers decide.

Each iteration's keys live under their own prefix (``keys.wrapper_iteration``),
so that they never collide with the previous iteration's. The termination
barrier's result (:class:`TerminationResult`) is what every rank's next
rank assignment starts from.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.barriers import (
    NO_WAIT,
    Barriers,
    KeyWatch,
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
from elastic_ft.coordination.job import JOINED_MAX, admit_joiners, admitted_joiners, job_store
from elastic_ft.keys import COMPLETION_BARRIER, HEAL_BARRIER, ITERATION_BARRIER, TERMINATION_BARRIER
from elastic_ft.runtime.waits import poll
from elastic_ft.untrusted import MalformedRecord, SkipLog, is_count, json_object

_SKIPPED = SkipLog(log)

#: The per-iteration outcome: exactly one of these wins the ``compare_set``.
COMPLETED = "completed"
INTERRUPTED = "interrupted"
#: A restart nothing forces (admitting joiners): it waits for a step boundary (:data:`keys.RESTART_STEP`),
#: and either final outcome above replaces it.
PLANNED = "planned"


class IterationRecords(Barriers):
    """One iteration's records and what its barriers publish, on top of a store's primitive operations.

    ``iteration``: the restart iteration whose keys the view holds (``None``
    on a store used without views, as NVIDIA's API allows).
    """

    iteration: int | None = None

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
            return json.dumps(self.heal_progresses(world_size))
        if name == TERMINATION_BARRIER:
            iteration = self.iteration
            if iteration is None:
                return TerminationResult(world_size, tuple(self.terminated_ranks())).to_json()
            base = cast(dist.PrefixStore, self).underlying_store  # every view is a PrefixStore
            job = job_store(base)
            joined = admit_joiners(job, iteration + 1) if admit else admitted_joiners(job, iteration + 1)
            job.set(keys.LATEST_ITERATION, str(iteration + 1))
            records, _ = parse_interruptions(as_text(read_one(self, keys.INTERRUPTIONS) or b""))
            history = next_history(previous_history(base, iteration), records, self.progressed())
            return TerminationResult(world_size, tuple(self.terminated_ranks()), tuple(joined), history).to_json()
        return ""

    def gone_ranks(self) -> list[int]:
        return self.terminated_ranks()

    def record_lost(self, initial_rank: int) -> None:
        """A process expected in this iteration died before it took its place here (it arrived nowhere in it)."""
        self.append(keys.LOST_RANKS, f"{int(initial_rank)}\n")

    def _terminated_after_the_decision(self) -> list[int]:
        """Ranks of the previous iteration terminated after its termination barrier's result was published."""
        number = self.iteration
        if not number:
            return []
        previous = iteration_store(cast(dist.Store, underlying(self)), number - 1)
        payload = previous.termination_result()
        if payload is None:
            return []
        try:
            decided = set(TerminationResult.from_json(payload, None).terminated)
        except MalformedRecord:
            return []  # the barrier's timeout still bounds the wait
        return sorted(set(previous.terminated_ranks()) - decided)

    def lost_ranks(self) -> list[int]:
        """Initial ranks of the processes recorded lost before they took their place in this iteration."""
        lines = as_text(read_one(self, keys.LOST_RANKS) or b"").split()
        return sorted({n for line in lines if (n := keys.parse_count(line)) is not None})

    def stand_in_for_lost(self, name: str, world_size: int) -> bool:
        """At the iteration barrier: once every rank arrived but as many as are known lost, those missing are
        the lost processes' places; report them gone (interrupting the iteration, so that the next restart
        goes on without them) instead of waiting out the barrier timeout.

        Lost: joiners admitted to this iteration that died before taking
        their place (:meth:`record_lost`), and ranks of the previous
        iteration that died after its restart had decided this iteration's
        world with them in (terminated there, but not in its published
        result). Their places come from a rank assignment they never ran, so
        they are known only this way: by elimination, once every live rank
        arrived (each records its position before it arrives, and one dead
        with a position here is reported at that place).
        """
        if name != ITERATION_BARRIER:
            return False
        lost = len(self.lost_ranks()) + len(self._terminated_after_the_decision())
        if not lost:
            return False
        arrived = read_existing(self, [keys.barrier_arrived(name, rank) for rank in range(world_size)])
        missing = [rank for rank in range(world_size) if keys.barrier_arrived(name, rank) not in arrived]
        if not missing or len(missing) > lost:
            return False
        message = f"{lost} process(es) expected in this iteration died before taking their place"
        log.warning("%s: ranks %s never arrived: %s; restarting without them", name, missing, message)
        for rank in missing:
            report_rank_gone(cast(IterationView, self), rank, world_size, "node_died", message)
        return False  # the last stand-in's arrival publishes the result, which the watch brings

    # ---- the iteration's outcome and the fault records ----

    def decide_outcome(self, outcome: str) -> str:
        """Propose the iteration's outcome; returns the one that won (the first final one proposed: a
        :data:`PLANNED` restart gives way to either final outcome)."""
        held = as_text(self.compare_set(keys.OUTCOME, "", outcome))
        if held == PLANNED and outcome != PLANNED:
            held = as_text(self.compare_set(keys.OUTCOME, PLANNED, outcome))
        return held

    def request_restart(self, rank: int, kind: str, message: str = "") -> str:
        """Ask for a :data:`PLANNED` restart on ``rank``'s behalf (recorded like an interruption, which it
        becomes at the next step boundary); returns the outcome that holds."""
        self.append(keys.INTERRUPTIONS, encode_interruption(rank, kind, message, time.time()))
        return self.decide_outcome(PLANNED)

    def restart_step(self, proposed: int) -> int:
        """The planned restart's step boundary: the first proposed (a malformed record reads as 0: at once)."""
        held = as_text(self.compare_set(keys.RESTART_STEP, "", str(int(proposed))))
        return keys.parse_count(held) or 0

    def outcome(self) -> str | None:
        found = read_one(self, keys.OUTCOME)
        return None if found is None else as_text(found)

    def watch_outcome(self) -> KeyWatch | None:
        """A watch for the iteration's outcome, for :meth:`wait_for_outcome` to wait on for the whole iteration;
        None on a store that cannot watch (the caller stops it: ``stop()``).

        One watch per iteration (on an etcd store; through the node's relay, one per host) rather than a new
        one every wait: the monitor thread waits for the outcome all the time the rank trains, and a watch
        created and cancelled every second cost each rank about five etcd requests a second.
        """
        counting = counting_store(self)
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
        if getattr(underlying(self), "waits_without_polling", False):
            try:
                self.wait([keys.OUTCOME], datetime.timedelta(seconds=timeout))
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
        self.append(keys.INTERRUPTIONS, line)
        return self.decide_outcome(INTERRUPTED)

    def mark_progressed(self) -> None:
        """A rank made a step in this iteration (the give-up rule counts iterations without one)."""
        self.set(keys.PROGRESSED, "1")

    def progressed(self) -> bool:
        return read_one(self, keys.PROGRESSED) is not None

    def interruptions(self) -> list[Interruption]:
        """The iteration's well-formed interruption records (a malformed line is logged and skipped)."""
        found = read_one(self, keys.INTERRUPTIONS)
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
            self.append(keys.TERMINATED, lines)

    def terminated_ranks(self) -> list[int]:
        return sorted({int(line) for line in as_text(read_one(self, keys.TERMINATED) or b"").split()})

    def set_active_world_size(self, size: int) -> None:
        """Publish the iteration's active world size: a joiner's rank assignment starts from it."""
        self.set(keys.ACTIVE_WORLD_SIZE, str(int(size)))

    def active_world_size(self) -> int | None:
        found = read_one(self, keys.ACTIVE_WORLD_SIZE)
        size = None if found is None else keys.parse_count(as_text(found))
        return size if size else None

    def termination_result(self) -> str | None:
        """The termination barrier's published result, once it completed."""
        found = read_one(self, keys.barrier_done(TERMINATION_BARRIER))
        return None if found is None else as_text(found)

    def set_heal_progress(self, active_rank: int, step: int, fresh: bool, shard: tuple[int, int] | None = None) -> None:
        """Record an active rank's progress: its step, whether it holds no state, and the shard it holds."""
        record: dict[str, object] = {"step": step, "fresh": fresh}
        if shard is not None:
            record["shard"] = list(shard)
        self.set(keys.heal_progress(active_rank), json.dumps(record))

    def heal_progresses(self, active_world_size: int) -> list[object]:
        """Every active rank's progress record, in rank order (see :meth:`heal_progress`), in one read (batched:
        one request per 128 ranks on an etcd store); a rank arrived for by another, dead before it recorded,
        has None."""
        names = [keys.heal_progress(rank) for rank in range(active_world_size)]
        found = read_existing(self, names)
        return [json_object(found[name]) if name in found else None for name in names]

    def heal_progress(self, active_rank: int) -> object:
        """An active rank's progress record as stored (untrusted: decoded, not checked), None if absent."""
        found = read_one(self, keys.heal_progress(active_rank))
        return None if found is None else json_object(found)

    def mark_any_completed(self) -> None:
        self.set(keys.ANY_COMPLETED, "")

    def any_completed(self) -> bool:
        return read_one(self, keys.ANY_COMPLETED) is not None

    # ---- identity ----

    def set_initial_rank(self, rank: int, initial_rank: int) -> None:
        """Publish which initial rank holds ``rank`` in this iteration."""
        self.set(f"{keys.RANK_OF_INITIAL}{initial_rank}", str(rank))

    def rank_of_initial(self, initial_rank: int) -> int | None:
        found = read_one(self, f"{keys.RANK_OF_INITIAL}{initial_rank}")
        return None if found is None else int(as_text(found))


class IterationView(dist.PrefixStore, IterationRecords):
    """The view of one restart iteration's keys."""

    def __init__(self, prefix: str, store: dist.Store, iteration: int) -> None:
        super().__init__(prefix, store)
        #: torch's view keeps its prefix to itself; the barriers need it to count arrivals in the base store.
        self.key_prefix = prefix
        self.iteration = iteration


def iteration_store(base: dist.Store, iteration: int) -> IterationView:
    """The view holding the keys of one restart iteration."""
    return IterationView(keys.wrapper_iteration(iteration), base, iteration)


@dataclass(frozen=True)
class TerminationResult:
    """The termination barrier's result: what every rank's next rank assignment starts from.

    ``world_size``: the iteration's world size; ``terminated``: its ranks
    that left; ``joined``: initial ranks of the processes admitted into the
    next iteration, which take ranks ``world_size, world_size + 1, ...`` in
    this order before the rank assignment renumbers everyone; ``history``:
    the job's faults so far as the give-up rule counts them
    (:func:`~elastic_ft.coordination.fault_records.next_history`).
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
            MalformedRecord: the payload is not a termination result of a world
                of ``world_size`` ranks (``None``: of any size, for a joiner).
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
            or len(joined) > JOINED_MAX
            or len(set(joined)) != len(joined)
            or not all(is_count(r) for r in joined)
            or history is None
        ):
            raise MalformedRecord(
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
    except MalformedRecord as error:
        log.warning(
            "iteration %d: the previous termination result is unreadable; fault counts restart: %s", iteration, error
        )
        return FaultHistory()


def report_rank_gone(
    store: IterationView, rank: int, world_size: int, kind: str, message: str, *, interrupt: bool = True
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
