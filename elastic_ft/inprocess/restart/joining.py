"""A process that joins a running world: its registration, its admission by a restart, and a rank's rejoin.

A joiner (``ftrun`` respawned it, a hot spare's node joined the running
round, or a rank counted out while it lived joins again in its own
process) waits outside every barrier until a restart admits it
(:func:`~elastic_ft.coordination.job.admit_joiners`). :class:`Joining` is
the Wrapper's collaborator for that wait; it returns what the call needs
to take its place (:class:`Admission`), and the call runs the same rank
assignment the others do.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Callable

import torch.distributed as dist

from elastic_ft.coordination.barriers import NO_WAIT, await_key
from elastic_ft.coordination.fault_records import NOT_FAULTS
from elastic_ft.coordination.iteration import IterationView, iteration_store
from elastic_ft.coordination.job import JOINER_ACTIVITY_LIMIT, WITHDRAWN, JobView, joined_ranks
from elastic_ft.coordination.termination import TerminationResult
from elastic_ft.etcd.outage import OUTAGES
from elastic_ft.inprocess.exception import BarrierTimeout, InternalError, RestartAbort
from elastic_ft.inprocess.hangs.monitor import MonitorProcess
from elastic_ft.inprocess.restart.bounds import restart_bound, unless_unreachable
from elastic_ft.inprocess.restart.growth import joiner_state
from elastic_ft.inprocess.restart.logs import get_logger
from elastic_ft.inprocess.restart.phases import RecoveryClock
from elastic_ft.inprocess.sibling_monitor import nobody_left
from elastic_ft.inprocess.state import State
from elastic_ft.keys import ADMITTED, EXIT_BARRIER, FTRUN_NEXT_RANK, INITIAL_BARRIER, parse_count
from elastic_ft.observability import sink as event_sink
from elastic_ft.runtime.local_board import LocalBoard
from elastic_ft.runtime.waits import Backoff, pause, poll
from elastic_ft.untrusted import MalformedRecord

log = get_logger("wrapper")

#: How often a joiner looks for its admission (a restart admits it; it then has a barrier timeout to arrive).
JOIN_POLL = 0.05
#: A rank counted out again soon after it rejoined pauses before it registers: its link to its peers may still
#: be down (a host cut off from them, not from etcd), and each admission that fails costs the others a restart.
#: The pauses double from the first up to the cap (with jitter), and start over after a quiet spell this long.
REJOIN_BACKOFF_FIRST, REJOIN_BACKOFF_CAP, REJOIN_QUIET = 0.5, 4.0, 30.0
#: How often a waiting joiner looks whether a member of the world it waits to join is left to admit it (seconds).
WORLD_LOOK_INTERVAL = 2.0


@dataclasses.dataclass(frozen=True)
class Withdrawn:
    """A joiner's admission, withdrawn while its process lived: a report that its node was lost withdrew it
    (:func:`~elastic_ft.coordination.reports.report_node_gone`; its node was counted out while it waited). It
    is no failure of the process, which joins again under a new initial rank, as a rank counted out does."""

    initial_rank: int


@dataclasses.dataclass(frozen=True)
class Admission:
    """A joiner's place: its state in the iteration it was admitted into (before the rank assignment), the view
    of the iteration that admitted it, and the ranks that left there (the rank assignment's inputs)."""

    state: State
    previous: IterationView
    terminated: frozenset[int]


class RunningWorld:
    """A waiting joiner's look at the world it waits to join: is a member left to admit it?

    A restart admits joiners, and only a live member of the world runs one.
    When every member died or stopped at once (a one-node job whose workers
    were all SIGKILLed, a node stopped while the other nodes' ranks died),
    the processes ``ftrun`` respawned would wait for a restart nobody runs.
    Two records say so. Either the last restart ended with every rank of its
    world terminated and none admitted (the dead ranks' monitor processes
    arrived at its barrier in their place); that costs two reads a look.
    Or the running iteration was interrupted by a fault and no restart ended
    it, and every member is gone or silent for the heartbeat timeout
    (:func:`~elastic_ft.inprocess.sibling_monitor.nobody_left`); the members'
    records are read only then.
    """

    def __init__(self, job: JobView, base_store: dist.Store, initial_world_size: int, heartbeat_timeout: float) -> None:
        self._job = job
        self._base_store = base_store
        self._initial_world_size = initial_world_size
        self._heartbeat_timeout = heartbeat_timeout
        self._watching_since = time.time()
        self._next_look = 0.0
        #: The latest iteration known to have begun with ranks in its world (its restart's result says so).
        self._began_with_a_world = 0

    def gone(self) -> str | None:
        """Why no member is left to restart the world (None while one may be); looks once a
        :data:`WORLD_LOOK_INTERVAL` at most."""
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + WORLD_LOOK_INTERVAL
        iteration = self._job.latest_iteration()
        if iteration > 0 and iteration != self._began_with_a_world:
            published = iteration_store(self._base_store, iteration - 1).termination_result()
            emptied = None if published is None else _emptied_world(published)
            if emptied is not None:
                return f"iteration {iteration - 1} ended with {emptied}, and nobody was admitted into iteration {iteration}"
            if published is not None:
                self._began_with_a_world = iteration  # a published result does not change: read once
        view = iteration_store(self._base_store, iteration)
        interruptions = view.interruptions()
        faults = sorted(
            {f"{record.kind} on rank {record.rank}" for record in interruptions if record.kind not in NOT_FAULTS}
        )
        if not faults or view.termination_result() is not None:
            return None
        reason = self._members_gone()
        if reason is None:
            return None
        return (
            f"iteration {iteration} was interrupted ({', '.join(faults)}) and no member of its world is left: {reason}"
        )

    def _members_gone(self) -> str | None:
        """Whether every member of the world left, was terminated, or fell silent (read from their records)."""
        job = self._job
        members = [*range(self._initial_world_size), *joined_ranks(job)]
        gone = job.arrivals(EXIT_BARRIER, range(self._initial_world_size))
        terminated: dict[int, set[int]] = {}
        for rank, position in job.positions([rank for rank in members if rank not in gone]).items():
            if position["iteration"] not in terminated:
                records = iteration_store(self._base_store, position["iteration"])
                terminated[position["iteration"]] = set(records.terminated_ranks())
            if position["rank"] in terminated[position["iteration"]]:
                gone.add(rank)
        beats = job.liveness.heartbeats([rank for rank in members if rank not in gone])
        return nobody_left(
            members,
            gone,
            {rank: beat.sent_at for rank, beat in beats.items()},
            time.time(),
            self._watching_since,
            self._heartbeat_timeout,
            OUTAGES.last_ended_wall,
        )


def _emptied_world(published: str) -> str | None:
    """What an iteration's restart left of its world, by its published result, when it left nothing (every rank
    terminated, no joiner admitted); None when it left ranks, or the result is not well-formed."""
    try:
        result = TerminationResult.from_json(published, None)
    except MalformedRecord:
        return None
    if result.joined or not set(range(result.world_size)) <= set(result.terminated):
        return None
    return f"every rank of its world of {result.world_size} terminated"


class Joining:
    """The joiner side of one call (see the module docstring)."""

    def __init__(
        self,
        job: JobView,
        base_store: dist.Store,
        board: LocalBoard | None,
        local_rank: int,
        monitor_process: MonitorProcess,
        recovery: RecoveryClock,
        barrier_timeout: datetime.timedelta,
        heartbeat_timeout: datetime.timedelta,
    ) -> None:
        self._job = job
        self._base_store = base_store
        self._board = board
        self._local_rank = local_rank
        self._monitor_process = monitor_process
        self._recovery = recovery
        self._barrier_timeout = barrier_timeout
        self._heartbeat_timeout = heartbeat_timeout
        self._rejoin_backoff = Backoff(REJOIN_BACKOFF_FIRST, REJOIN_BACKOFF_CAP)
        self._last_rejoin: float | None = None

    def enter_world(
        self,
        state: State,
        joining: bool,
        accepts_joiners: bool,
        barrier_timeout: datetime.timedelta,
        warm_up: Callable[[], object] = lambda: None,
    ) -> None:
        """Join the running world (register, to be admitted by a restart), or meet the initial world at its
        first barrier; the monitor process starts using the store either way. A joiner calls ``warm_up``
        before it registers: the others train on meanwhile, and admit it once it is ready to train at once."""
        if joining:
            if getattr(self._base_store, "critical_ranks", ()):
                raise RuntimeError("a process can join a running world only through a store no rank hosts")
            self._monitor_process.store_ready()
            warm_up()
            self.register_when_reported_active(state.initial_rank or 0)
            return
        self._job.set_accepts_joiners(accepts_joiners)
        self._job.arrive_and_wait(INITIAL_BARRIER, [state.rank or 0], state.world_size, barrier_timeout)
        self._monitor_process.store_ready()

    def register_when_reported_active(self, initial_rank: int) -> None:
        """Register as a joiner once the monitor process's first heartbeat is in the store.

        A restart admits only joiners their monitor process reports active
        (:func:`~elastic_ft.coordination.job.admit_joiners`), so a registered
        joiner is a ready one. A monitor that does not report within the
        activity limit does not hold the process back: it registers anyway,
        and waits to be reported active before a restart takes it.
        """
        job = self._job
        if not poll(
            unless_unreachable(lambda: job.liveness.last_activity(initial_rank) is not None), JOINER_ACTIVITY_LIMIT
        ):
            log.warning("initial rank %d: no heartbeat from the monitor process yet; registering anyway", initial_rank)
        board = self._board
        if board is not None and not board.may_join():
            # Its node was cut off and counted out: a joiner that cannot reach the others would stall them again.
            log.info("initial rank %d waits until its node reaches the other members again", initial_rank)
            poll(unless_unreachable(lambda: board.may_join() or job.finished()), None, interval_max=JOIN_POLL)

        def register() -> bool:
            job.register_joiner(initial_rank)  # a line written twice counts once (JobRecords.joiners)
            return True

        poll(unless_unreachable(register), None, interval_max=JOIN_POLL)  # etcd away included

    def await_admission(self, initial_rank: int, initial_world_size: int) -> Admission | Withdrawn | None:
        """Wait until a restart admits this process, and return its place; None if the job finished first,
        :class:`Withdrawn` if a report of its node's loss withdrew it first.

        The restart's termination barrier admitted it and published the
        world it grows; this process takes the rank after the others
        admitted with it. With no member of the world left to run that
        restart (:class:`RunningWorld`) it raises :class:`RestartAbort`: the
        in-process layer gives up, and ``ftrun``'s agent restarts the job's
        processes, as torchrun does.
        """
        admission = self._wait_for_admission(initial_rank, initial_world_size)
        if admission is None:
            return None
        if admission == WITHDRAWN and self.may_rejoin():
            log.warning(
                "initial rank %d: its node was reported lost while it waited to join (withdrawn): it lives, so it "
                "joins again",
                initial_rank,
            )
            return Withdrawn(initial_rank)
        self._recovery.start()  # its admission is this process's recovery: timed from here to its first step
        iteration = parse_count(admission)
        if admission == WITHDRAWN or not iteration:
            raise InternalError(f"initial rank {initial_rank} was not admitted: its admission record is {admission!r}")
        previous = iteration_store(self._base_store, iteration - 1)
        with restart_bound(self._barrier_timeout):
            published = poll(
                unless_unreachable(lambda: previous.termination_result() is not None),
                self._barrier_timeout.total_seconds(),
            )
            if not published:
                raise BarrierTimeout(f"the restart admitting initial rank {initial_rank} did not publish its result")
        try:
            result = TerminationResult.from_json(previous.termination_result(), None)
        except MalformedRecord as error:
            raise InternalError(f"initial rank {initial_rank} cannot join: {error}") from None
        try:
            state = joiner_state(
                result,
                initial_rank,
                initial_world_size=initial_world_size,
                active_world_size=previous.active_world_size(),
                iteration=iteration,
            )
        except ValueError as error:
            raise InternalError(f"admitted into iteration {iteration}, but {error}") from None
        log.info(
            "initial rank %d joins iteration %d as rank %s of %d", initial_rank, iteration, state.rank, state.world_size
        )
        return Admission(state, previous, frozenset(result.terminated))

    def _wait_for_admission(self, initial_rank: int, initial_world_size: int) -> str | None:
        """The admission record, once a restart writes it; None if the job finished first. Raises
        :class:`RestartAbort` when no member of the world is left to run that restart (:class:`RunningWorld`)."""
        job = self._job
        log.info("initial rank %d waits for a restart to join the running world", initial_rank)
        admitted: list[str] = []
        world = RunningWorld(job, self._base_store, initial_world_size, self._heartbeat_timeout.total_seconds())
        nobody: list[str] = []

        def admitted_or_finished() -> bool:
            admission = job.admission(initial_rank)
            if admission is not None:
                admitted.append(admission)
                return True
            if job.finished():
                return True
            reason = world.gone()
            if reason is not None:
                nobody.append(reason)
            return reason is not None

        # For as long as the job runs, etcd away included; on a watch of its admission where the store has one.
        await_key(
            job.store, f"{ADMITTED}{initial_rank}", unless_unreachable(admitted_or_finished), poll_interval=JOIN_POLL
        )
        if nobody:
            raise RestartAbort(f"initial rank {initial_rank} cannot join: {nobody[0]}; nothing can admit it")
        return admitted[0] if admitted else None

    def may_rejoin(self) -> bool:
        """Whether a rank counted out while it lived can join the running world again in its own process: its
        agent admits it (under ``ftrun``), through a store no rank hosts, into a world that grows."""
        hosted: tuple[int, ...] = getattr(self._base_store, "critical_ranks", ())
        if self._board is None or hosted:
            return False
        with restart_bound(self._barrier_timeout):
            return self._job.accepts_joiners()

    def take_new_initial_rank(self, state: State) -> int:
        """A rank counted out while it lived (its node was cut off, or its heartbeats went unheard) joins again:
        its new initial rank, above the world's, from the round's counter (the agent's for respawned processes).

        It leaves under its old one (the exit barrier, a ``rejoined`` exit
        record), and tells its agent (the node's board) and its monitor
        process; the caller then registers and awaits its admission.
        """
        old, world = state.initial_rank or 0, state.initial_world_size or state.world_size
        job = self._job
        with restart_bound(self._barrier_timeout):
            new = world + self._base_store.add(FTRUN_NEXT_RANK, 1) - 1
            job.record_wrapped(new, os.getpid())
            job.record_left(old, "rejoined", False, f"counted out while it lived; joins again as initial rank {new}")
            if old < world:
                job.arrive_and_wait(EXIT_BARRIER, [old], world, NO_WAIT)
        if self._board is not None:
            self._board.set_initial_rank(self._local_rank, new)
        self._monitor_process.take_initial_rank(new)
        log.warning(
            "initial rank %d was counted out while it lived (%s): it joins the running world again "
            "in the same process, as initial rank %d",
            old,
            "waiting to join" if old >= world else f"iteration {state.iteration}",
            new,
        )
        event_sink.emit("rejoined", rank=new, iteration=state.iteration, previous_rank=old)
        self._pause_if_rejoined_lately(new)
        return new

    def _pause_if_rejoined_lately(self, initial_rank: int) -> None:
        """Back off before registering when the last rejoin was less than :data:`REJOIN_QUIET` ago."""
        now = time.monotonic()
        if self._last_rejoin is None or now - self._last_rejoin >= REJOIN_QUIET:
            self._rejoin_backoff.reset()
            self._last_rejoin = now
            return
        seconds = self._rejoin_backoff.next()
        log.info(
            "initial rank %d was counted out again %.1f s after it rejoined: it registers in %.1f s",
            initial_rank,
            now - self._last_rejoin,
            seconds,
        )
        pause(seconds)
        self._last_rejoin = time.monotonic()
