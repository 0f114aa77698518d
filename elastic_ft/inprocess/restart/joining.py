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
from elastic_ft.coordination.iteration import IterationView, iteration_store
from elastic_ft.coordination.job import JOINER_ACTIVITY_LIMIT, WITHDRAWN, JobView
from elastic_ft.coordination.termination import TerminationResult
from elastic_ft.inprocess.exception import BarrierTimeout, InternalError
from elastic_ft.inprocess.hangs.monitor import MonitorProcess
from elastic_ft.inprocess.restart.bounds import restart_bound, unless_unreachable
from elastic_ft.inprocess.restart.growth import joiner_state
from elastic_ft.inprocess.restart.logs import get_logger
from elastic_ft.inprocess.restart.phases import RecoveryClock
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
    ) -> None:
        self._job = job
        self._base_store = base_store
        self._board = board
        self._local_rank = local_rank
        self._monitor_process = monitor_process
        self._recovery = recovery
        self._barrier_timeout = barrier_timeout
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
        admitted with it.
        """
        job = self._job
        log.info("initial rank %d waits for a restart to join the running world", initial_rank)
        admitted: list[str] = []

        def admitted_or_finished() -> bool:
            admission = job.admission(initial_rank)
            if admission is not None:
                admitted.append(admission)
            return admission is not None or job.finished()

        # For as long as the job runs, etcd away included; on a watch of its admission where the store has one.
        await_key(
            job.store, f"{ADMITTED}{initial_rank}", unless_unreachable(admitted_or_finished), poll_interval=JOIN_POLL
        )
        if not admitted:
            return None
        admission = admitted[0]
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
