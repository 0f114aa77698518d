"""The job-wide records of the coordination protocol: what each process is doing, keyed by initial rank.

``wrapped/<r>`` once a process entered the Wrapper, ``position/<r>``
(iteration, rank, world size) at the start of each iteration, ``left/<r>``
(how it left: completed, gave up, or left the job alone), its heartbeats,
and the joiners: processes started into a running world, admitted by a
restart (``admitted/<r>``, set once). The Wrapper writes them; ``ftrun``'s
agent reads them to tell a fault the Wrapper absorbs from one it cannot,
and reports a dead process without waiting for a heartbeat timeout
(:mod:`elastic_ft.coordination.reports`).
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.barriers import (
    Barriers,
    KeyedPrefixStore,
    append,
    as_text,
    log,
    read_existing,
    read_one,
    write_latest,
)
from elastic_ft.coordination.fault_records import (
    Heartbeat,
    PeerLook,
    encode_heartbeat,
    encode_peer_look,
    parse_heartbeat_record,
    parse_peer_look,
)
from elastic_ft.coordination.termination import JOINED_MAX
from elastic_ft.untrusted import is_count, json_object

#: A joiner's admission when it died before any restart admitted it.
WITHDRAWN = "withdrawn"


@dataclass(frozen=True)
class PeerRecords:
    """Peers' records as one read found them: who left, and the others' heartbeats and positions."""

    left: set[int]
    heartbeats: dict[int, Heartbeat]
    positions: dict[int, dict[str, int]]


class LivenessRecords:
    """The ranks' heartbeats and the hang judge's look, on the job-wide ``store``: what the monitor processes write
    and read every second, a few requests however many ranks."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def send_heartbeat(
        self,
        rank: int,
        active_at: float | None = None,
        waiting: bool | None = None,
        reserve: bool = False,
        next_in: float | None = None,
        ring: int | None = None,
        notice: bool = False,
    ) -> tuple[bool, Heartbeat | None] | None:
        """A heartbeat for initial rank ``rank`` (:class:`~elastic_ft.coordination.fault_records.Heartbeat`), sent now; the
        next one is due ``next_in`` seconds later (None: no promise), or sooner as a stall notice (``notice``).

        ``ring``: the same request also reads what a monitor's ring check needs of initial rank ``ring``, and
        returns it: whether that rank left (arrived at the exit barrier), and its last well-formed heartbeat (one
        request a second for a monitor's heartbeat and its check; through the node relay, the host's periodic
        read of the moment)."""
        now = time.time()
        due = None if next_in is None else now + next_in
        text = encode_heartbeat(now, now if active_at is None else active_at, waiting, reserve, due, notice)
        if ring is None:
            write_latest(self.store, f"{keys.HEARTBEAT}{rank}", text)
            return None
        left, beat = keys.barrier_arrived(keys.EXIT_BARRIER, ring), f"{keys.HEARTBEAT}{ring}"
        return _ring_record(write_latest(self.store, f"{keys.HEARTBEAT}{rank}", text, [left, beat]), left, beat)

    def heartbeat(self, rank: int) -> Heartbeat | None:
        """Initial rank ``rank``'s last heartbeat; None without one, or with one that is not well-formed."""
        found = read_one(self.store, f"{keys.HEARTBEAT}{rank}")
        return None if found is None else parse_heartbeat_record(as_text(found))

    def _heartbeat(self, rank: int) -> tuple[float, float] | None:
        """(sent at, last active at); None without a heartbeat or with one that is not well-formed."""
        record = self.heartbeat(rank)
        return None if record is None else (record.sent_at, record.active_at)

    def last_activity(self, rank: int) -> float | None:
        """When (wall clock) initial rank ``rank`` was last active, per its last heartbeat."""
        record = self._heartbeat(rank)
        return None if record is None else record[1]

    def heartbeats(self, ranks: Sequence[int]) -> dict[int, Heartbeat]:
        """The last heartbeats of those of initial ranks ``ranks`` that sent a well-formed one."""
        found = by_rank(self.store, keys.HEARTBEAT, ranks)
        parsed = {rank: parse_heartbeat_record(as_text(value)) for rank, value in found.items()}
        return {rank: heartbeat for rank, heartbeat in parsed.items() if heartbeat is not None}

    def peer_records(self, ranks: Sequence[int]) -> PeerRecords:
        """What a monitor's look at its peers needs of initial ranks ``ranks``, in one read (batched: one request
        per 128 keys; through the node relay, one read for the host's monitors looking at the same moment): who
        left (arrived at the exit barrier), and the others' well-formed heartbeats and positions."""
        names = {
            **{keys.barrier_arrived(keys.EXIT_BARRIER, rank): ("left", rank) for rank in ranks},
            **{f"{keys.HEARTBEAT}{rank}": ("heartbeat", rank) for rank in ranks},
            **{f"{keys.POSITION}{rank}": ("position", rank) for rank in ranks},
        }
        found: dict[str, dict[int, bytes]] = {"left": {}, "heartbeat": {}, "position": {}}
        for key, value in read_existing(self.store, list(names), periodic=True).items():
            kind, rank = names[key]
            found[kind][rank] = value
        left = set(found["left"])
        beats = {rank: parse_heartbeat_record(as_text(value)) for rank, value in found["heartbeat"].items()}
        places = {rank: _parse_position(value) for rank, value in found["position"].items()}
        return PeerRecords(
            left,
            {rank: beat for rank, beat in beats.items() if beat is not None and rank not in left},
            {rank: place for rank, place in places.items() if place is not None and rank not in left},
        )

    # ---- the hang judge's look (what a stalled rank reads instead of every peer) ----

    def publish_peer_look(self, look: PeerLook) -> None:
        """The judge's look, replacing the last (one request; through the node relay, with the host's beats)."""
        write_latest(self.store, keys.PEER_LOOK, encode_peer_look(look))

    def peer_look(self, judge: int | None) -> tuple[PeerLook | None, Heartbeat | None]:
        """The judge's last look (None: none, or not well-formed), and initial rank ``judge``'s last heartbeat
        (None when ``judge`` is None, or without a well-formed one): one read, gathered with the host's."""
        names = [keys.PEER_LOOK] + ([] if judge is None else [f"{keys.HEARTBEAT}{judge}"])
        found = read_existing(self.store, names, periodic=True)
        look = found.get(keys.PEER_LOOK)
        beat = None if judge is None else found.get(names[1])
        return (
            None if look is None else parse_peer_look(as_text(look)),
            None if beat is None else parse_heartbeat_record(as_text(beat)),
        )


def by_rank(store: dist.Store, prefix: str, ranks: Sequence[int]) -> dict[int, bytes]:
    """The values of keys ``<prefix><r>`` of ``store`` for those of ``ranks`` that have one, in one read."""
    names = {f"{prefix}{rank}": rank for rank in ranks}
    return {names[key]: value for key, value in read_existing(store, list(names)).items()}


class JobRecords:
    """The job-wide records, on ``store`` (the job's view of the Wrapper's store), and the job's barriers."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.barriers = Barriers(store)
        self.liveness = LivenessRecords(store)

    def arrive_and_wait(
        self, name: str, ranks: Iterable[int], world_size: int, timeout: datetime.timedelta
    ) -> str | None:
        """Arrive at the job's barrier ``name`` (:meth:`Barriers.arrive_and_wait`)."""
        return self.barriers.arrive_and_wait(name, ranks, world_size, timeout)

    def record_latest_iteration(self, iteration: int) -> None:
        """The iteration the last restart began (the termination barrier's last arriver writes it)."""
        self.store.set(keys.LATEST_ITERATION, str(int(iteration)))

    # ---- what the node side reads (job-wide view) ----

    def record_wrapped(self, initial_rank: int, pid: int) -> None:
        self.store.set(f"{keys.WRAPPED}{initial_rank}", json.dumps({"pid": pid}))

    def is_wrapped(self, initial_rank: int) -> bool:
        return read_one(self.store, f"{keys.WRAPPED}{initial_rank}") is not None

    def record_position(self, initial_rank: int, iteration: int, rank: int, world_size: int, active: bool) -> None:
        self.store.set(
            f"{keys.POSITION}{initial_rank}",
            json.dumps({"iteration": iteration, "rank": rank, "world_size": world_size, "active": active}),
        )

    def position(self, initial_rank: int) -> dict[str, int] | None:
        """The rank's last published position; None if none, or if the record is malformed (untrusted).

        ``active`` is 1 for a rank that runs the function, 0 for a reserve rank.
        """
        found = read_one(self.store, f"{keys.POSITION}{initial_rank}")
        return None if found is None else _parse_position(found)

    # ---- many ranks at once (a monitor's look at its peers: a few requests, however many ranks) ----

    def positions(self, ranks: Sequence[int]) -> dict[int, dict[str, int]]:
        """The last published positions of those of ``ranks`` that published a well-formed one."""
        parsed = {rank: _parse_position(value) for rank, value in by_rank(self.store, keys.POSITION, ranks).items()}
        return {rank: position for rank, position in parsed.items() if position is not None}

    def arrivals(self, name: str, ranks: Sequence[int]) -> set[int]:
        """Those of ``ranks`` that arrived at barrier ``name``."""
        names = {keys.barrier_arrived(name, rank): rank for rank in ranks}
        return {names[key] for key in read_existing(self.store, list(names))}

    def admissions(self, ranks: Sequence[int]) -> dict[int, str]:
        """The admissions (``admitted/<r>``) of those of joiners ``ranks`` that hold one."""
        return {rank: as_text(value) for rank, value in by_rank(self.store, keys.ADMITTED, ranks).items()}

    # ---- growing the world (job-wide view) ----

    def set_accepts_joiners(self, accepts: bool = True) -> None:
        """Whether the ranks' rank assignment can grow the world (every rank of the world writes the same)."""
        self.store.set(keys.ACCEPTS_JOINERS, "1" if accepts else "0")

    def accepts_joiners(self) -> bool:
        return self.joiners_accepted() is True

    def joiners_accepted(self) -> bool | None:
        """Whether the world can grow: None until its ranks said (they say so as they enter the Wrapper)."""
        found = read_one(self.store, keys.ACCEPTS_JOINERS)
        return None if found is None else as_text(found) == "1"

    def register_joiner(self, initial_rank: int) -> None:
        """A process that is not in the world asks to join it at the next restart."""
        append(self.store, keys.JOINERS, f"{int(initial_rank)}\n")

    def joiners(self) -> list[int]:
        """Initial ranks that registered, in registration order (a malformed line is skipped)."""
        seen: dict[int, None] = {}
        for line in as_text(read_one(self.store, keys.JOINERS) or b"").split():
            rank = keys.parse_count(line)
            if rank is not None:
                seen.setdefault(rank, None)
        return list(seen)

    def claim_admission(self, initial_rank: int, value: str) -> str:
        """Set ``admitted/<r>`` unless set already (``value``: an iteration, or ``withdrawn``); returns what holds."""
        return as_text(self.store.compare_set(f"{keys.ADMITTED}{initial_rank}", "", value))

    def admission(self, initial_rank: int) -> str | None:
        found = read_one(self.store, f"{keys.ADMITTED}{initial_rank}")
        return None if found is None else as_text(found)

    def record_activation(self, initial_rank: int, iteration: int) -> None:
        """A reserve rank (or a joiner) runs the function from ``iteration`` on."""
        append(
            self.store,
            keys.ACTIVATIONS,
            json.dumps({"initial_rank": int(initial_rank), "iteration": int(iteration)}) + "\n",
        )

    def latest_iteration(self) -> int:
        """The iteration the last restart began (0 before any; a malformed record reads as 0)."""
        found = read_one(self.store, keys.LATEST_ITERATION)
        return 0 if found is None else keys.parse_count(as_text(found)) or 0

    def mark_finished(self) -> None:
        self.store.set(keys.FINISHED, "1")

    def finished(self) -> bool:
        return read_one(self.store, keys.FINISHED) is not None

    def record_left(self, initial_rank: int, kind: str, gave_up: bool, message: str = "", fatal: bool = False) -> None:
        """How the rank left the Wrapper; ``fatal``: it gave up on the job for good (a fault repeats: the node side
        must not restart the workers)."""
        record = {"kind": kind, "gave_up": gave_up, "message": message[:500], "fatal": fatal}
        self.store.set(f"{keys.LEFT}{initial_rank}", json.dumps(record))

    def left(self, initial_rank: int) -> dict[str, object] | None:
        """How the rank left the Wrapper; None if it did not. A malformed record still says it left."""
        found = read_one(self.store, f"{keys.LEFT}{initial_rank}")
        return None if found is None else json_object(found) or {"kind": "malformed"}


class JobView(JobRecords):
    """The job-wide view of the Wrapper's store (its keys under ``keys.WRAPPER_JOB``)."""

    def __init__(self, prefix: str, base: dist.Store) -> None:
        super().__init__(KeyedPrefixStore(prefix, base))
        self.base = base
        self.key_prefix = prefix


def job_store(base: dist.Store) -> JobView:
    """The view holding the job-wide keys (initial and exit barriers, the records above)."""
    return JobView(keys.WRAPPER_JOB, base)


#: A joiner is admitted only if its monitor process reported it active this recently (seconds): a
#: stopped or hung joiner admitted would hold the next iteration barrier until its timeout.
JOINER_ACTIVITY_LIMIT = 10.0


def joiner_ready(job: JobView, initial_rank: int, now: float | None = None) -> bool:
    """The joiner's heartbeat says its process was active within :data:`JOINER_ACTIVITY_LIMIT`."""
    return _active_recently(job.liveness.last_activity(initial_rank), time.time() if now is None else now)


def _active_recently(active_at: float | None, now: float) -> bool:
    return active_at is not None and now - active_at < JOINER_ACTIVITY_LIMIT


def admit_joiners(job: JobView, iteration: int) -> list[int]:
    """Admit, into ``iteration``, every registered joiner that is ready and was not admitted or withdrawn
    before (the last arriver at the previous iteration's termination barrier calls this: once per restart).
    One not ready yet (no heartbeat so far, or inactive: stopped, hung) waits for a later restart."""
    if not job.accepts_joiners():
        return []
    value, now = str(iteration), time.time()
    admitted = []
    joiners = job.joiners()[:JOINED_MAX]
    held = job.admissions(joiners)  # a few requests for all of them: this runs in every restart
    waiting = [rank for rank in joiners if rank not in held]
    heartbeats = job.liveness.heartbeats(waiting)
    for rank in waiting:
        active_at = heartbeats[rank].active_at if rank in heartbeats else None
        if not _active_recently(active_at, now):
            since = "never" if active_at is None else f"{now - active_at:.1f} s ago"
            log.info("joiner %d is not admitted into iteration %d: last reported active %s", rank, iteration, since)
            continue
        if job.claim_admission(rank, value) == value:
            admitted.append(rank)
    return admitted


def joined_ranks(job: JobView) -> list[int]:
    """The joiners admitted into any iteration so far (members of the world since, unless they left)."""
    joiners = job.joiners()[:JOINED_MAX]
    admissions = job.admissions(joiners)
    return [rank for rank in joiners if keys.parse_count(admissions.get(rank, "")) is not None]


def _parse_position(value: bytes) -> dict[str, int] | None:
    record = json_object(value)
    fields = ("iteration", "rank", "world_size")
    if record is None or not all(is_count(record.get(name)) for name in fields):
        return None
    active = record.get("active", True)
    if not isinstance(active, bool):
        return None
    return {**{name: record[name] for name in fields}, "active": int(active)}


def admitted_joiners(job: JobView, iteration: int) -> list[int]:
    """The joiners already admitted into ``iteration``, in the order :func:`admit_joiners` admits them."""
    if not job.accepts_joiners():
        return []
    joiners = job.joiners()[:JOINED_MAX]
    admissions = job.admissions(joiners)
    return [rank for rank in joiners if admissions.get(rank) == str(iteration)]


def _ring_record(found: dict[str, bytes], left: str, beat: str) -> tuple[bool, Heartbeat | None]:
    """Whether a rank left, and its last well-formed heartbeat, from the values read of its two keys."""
    return left in found, parse_heartbeat_record(as_text(found[beat])) if beat in found else None
