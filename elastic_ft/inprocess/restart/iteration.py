"""One restart iteration on a rank: what it has, and the one unwind of the fault that ends it.

``CallWrapper`` keeps what lives across iterations (the store, the monitors,
the step count, the hooks); an :class:`Iteration` holds what one iteration
has: its number and world (``state``), its store view, its mesh, its
monitor thread, the delivery of its restart and the exception that ended
it on this rank. It is made at the iteration's barrier and dropped when
the next one begins.

A fault reaches the main thread in one of four ways: the function raised;
the monitor thread delivered ``RankShouldRestart``; the iteration was
interrupted as this rank completed it; or the rank leaves the job. Each
way calls :meth:`Iteration.unwind`, which does the same steps in the same
order, once: the main thread is taken out of the optimizer steps, the
monitor thread delivers nothing more, the heartbeats stop, the connections
are released (again, if the monitor thread released them first: the
function may have connected more since) and ``abort`` runs, and the process
groups the function left are destroyed. Two of those steps, releasing the iteration's connections and
the user's ``abort``, the monitor thread may have run already, as it
started the restart (they are what unblocks a main thread stuck in a
collective): :class:`Unwinding` runs them once per iteration, by whichever
thread comes first, so a user's ``abort`` runs once per restart per rank,
as NVIDIA's does.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from elastic_ft.coordination.fault_records import PEER_LOST, fault_kind
from elastic_ft.coordination.iteration import IterationView, iteration_store, report_rank_gone
from elastic_ft.inprocess.delivery.interrupt import InterruptSignal
from elastic_ft.inprocess.delivery.watcher import MonitorThread
from elastic_ft.inprocess.exception import InternalError, RankShouldRestart, RestartDelivery, exception_chain
from elastic_ft.inprocess.hangs.heartbeats import HeartbeatWatchdog
from elastic_ft.inprocess.rank_assignment.replicas import ReplicaMesh, state_mesh
from elastic_ft.inprocess.restart.bounds import restart_bound
from elastic_ft.inprocess.restart.hooks import RankHooks, _RankLeaves
from elastic_ft.inprocess.restart.logs import get_logger
from elastic_ft.inprocess.state import State
from elastic_ft.inprocess.steps.gate import StepGate
from elastic_ft.observability import sink as event_sink
from elastic_ft.runtime.waits import poll

log = get_logger("wrapper")


class Unwinding:
    """The main thread's side of one iteration, as its monitor thread sees it
    (:class:`~elastic_ft.inprocess.delivery.watcher.MainThreadSide`): the release of the failed iteration's
    connections, then the user's ``abort``, run once by whichever thread comes first; the lock a restart takes,
    the iteration's delivery and the interrupt signal; and the monitor process's note that a restart is pending.

    The second caller of :meth:`release_and_abort` waits for the first to
    finish, then returns: the main thread never goes on to ``finalize`` while
    the monitor thread is still inside ``abort``.
    """

    def __init__(self, state: State, parts: IterationParts, delivery: RestartDelivery) -> None:
        self._hooks = parts.hooks
        self._state = state
        self._pending = parts.pending
        self.atomic_lock = parts.gate.atomic_lock
        self.delivery = delivery
        self.interrupt = parts.interrupt
        self._lock = threading.Lock()
        self.done = False

    def release_and_abort(self) -> None:
        with self._lock:
            if self.done:
                return
            self.done = True
            self._hooks.abort(self._state)

    def release_everything(self) -> int:
        return self._hooks.release_connections(self._state, everything=True)

    def release_again(self) -> None:
        """Release what the function connected since the first release (the Wrapper's own step: no ``abort``)."""
        try:
            self._hooks.release_connections(self._state)
        except Exception:
            log.exception("rank %s: releasing connections failed", self._state.rank)

    def connections_open(self) -> int | None:
        return self._hooks.connections_open()

    def restart_pending(self, pending: bool) -> None:
        self._pending(pending)

    def unregister_groups(self) -> None:
        """Destroy the process groups the unwound function left registered (main thread only, once it unwound)."""
        try:
            self._hooks.groups.unregister()
        except Exception:
            log.exception("rank %s: destroying the process groups failed", self._state.rank)


@dataclasses.dataclass(frozen=True)
class IterationParts:
    """What every iteration of a call is built with: the call's parts an iteration acts on, and the Wrapper's
    durations (seconds) its monitor thread and its unwind follow."""

    hooks: RankHooks
    gate: StepGate
    watchdog: HeartbeatWatchdog
    #: The interrupt signal installed for the call (None: none).
    interrupt: InterruptSignal | None
    #: Told when a restart is being delivered, and when the main thread took it (the monitor process's timestamps).
    pending: Callable[[bool], None]
    monitor_interval: float
    last_call_wait: float
    #: How long a planned restart waits for the main thread's step boundary.
    planned_bound: float
    #: The restart's barrier timeout: how long the store writes of an unwind wait for an unreachable etcd.
    bound: datetime.timedelta

    @property
    def patience(self) -> float:
        """How long an unwound main thread waits for its monitor thread to start the restart."""
        return self.last_call_wait + 3 * self.monitor_interval + 30.0


def begin_iteration(state: State, base: dist.Store, parts: IterationParts) -> Iteration:
    """``state``'s iteration on the Wrapper's store ``base``, with its monitor thread (not started), known to the
    step gate."""
    store = iteration_store(base, state.iteration)
    delivery = RestartDelivery()
    unwinding = Unwinding(state, parts, delivery)
    monitor = MonitorThread(
        store, state, unwinding, parts.monitor_interval, parts.last_call_wait, planned_bound=parts.planned_bound
    )
    parts.gate.begin_iteration(state, store, monitor.restart_planned)
    return Iteration(state, store, state_mesh(state), unwinding, delivery, monitor, parts)


@dataclasses.dataclass(eq=False)
class Iteration:
    """One restart iteration on this rank (see the module docstring).

    ``exception`` is the fault that ended the iteration on this rank, if it
    was local, kept without its traceback: the frames would keep the failed
    iteration's process groups, and their connections, alive.
    """

    state: State
    store: IterationView
    mesh: ReplicaMesh | None
    unwinding: Unwinding
    delivery: RestartDelivery
    monitor: MonitorThread
    parts: IterationParts
    exception: BaseException | None = None
    _unwound: bool = False

    def unwind(self) -> None:
        """The main thread left the wrapped function: take it out of the steps, deliver nothing more to it,
        stop its pings, then release the iteration's connections and run ``abort`` (unless the monitor thread
        did). Once per iteration, whichever way the fault arrived."""
        if self._unwound:
            return
        self._unwound = True
        self.parts.gate.leave_steps()  # an optimizer step that raised holds the monitor thread's lock
        # From here the main thread runs the Wrapper's own code (store writes over gRPC): no asynchronous
        # restart exception may land in it.
        self.monitor.hold()
        self.parts.watchdog.reset()  # pings stop by design while the Wrapper's code runs (RankHooks)
        # The iteration is lost: its connections are cut here, before the frames a traceback holds (and their
        # process groups) can be freed; and again if the monitor thread cut them first, since the function may
        # have connected more (a group it was building) before the restart reached it.
        self.unwinding.release_and_abort()
        self.unwinding.release_again()
        # Whichever thread ran ``abort``, the function has unwound now: what it left registered goes.
        self.unwinding.unregister_groups()

    def keep(self, error: BaseException) -> None:
        """Keep ``error`` as the iteration's fault on this rank, without traceback (once its origin is recorded:
        the give-up rule compares origins): ``state.fn_exception`` for ``finalize``, the health check and
        ``terminate``.

        The exceptions chained to it lose theirs too: a traceback holds the frames it passed through, whose
        ``f_back`` chain reaches this iteration's own frames, which name the iteration: a cycle that would keep
        the call's store, and its listening socket, alive until a garbage collection.
        """
        for chained in exception_chain(error):
            chained.__traceback__ = None
        self.exception = error
        self.state = dataclasses.replace(self.state, fn_exception=error)

    def record_failure(self, error: Exception, step: int) -> None:
        """The function's exception: logged on this rank, emitted, and recorded as the iteration's fault, but for
        a broken connection once a restart is under way, which is that restart's consequence."""
        state = self.state
        origin, text = exception_origin(error)
        # One line per rank; the text once per restart, by the rank that reports it (RestartReporter.report).
        kind = fault_kind(error)
        log.info("rank %s: iteration %d failed with %s (%s)", state.rank, state.iteration, kind, type(error).__name__)
        event_sink.emit(
            "fault_detected",
            rank=state.initial_rank,
            iteration=state.iteration,
            kind=kind,
            exception=type(error).__name__,
            message=str(error),
            step=step,
            origin=origin,
        )
        if kind == PEER_LOST and self.monitor.restart_started.is_set():
            return
        with restart_bound(self.parts.bound):  # etcd away: waited for, within the restart's barrier timeout
            self.store.record_interruption(state.rank or 0, kind, repr(error), step=step, origin=origin, traceback=text)

    def record_asked_restart(self, restart: RankShouldRestart, step: int) -> None:
        """The function raised ``RankShouldRestart`` itself (NVIDIA's explicit restart): a fault of this rank.
        No restart was under way, so none would come: it is recorded, as an exception is, to start one."""
        state = self.state
        origin, text = exception_origin(restart)
        log.info("rank %s: the function asked for a restart in iteration %d", state.rank, state.iteration)
        with restart_bound(self.parts.bound):
            self.store.record_interruption(
                state.rank or 0,
                "RankShouldRestart",
                "the function raised RankShouldRestart",
                step=step,
                origin=origin,
                traceback=text,
            )

    def await_restart(self) -> NoReturn:
        """Wait for the monitor thread to start the restart (the fault recorded here reaches it), then raise it.

        The monitor thread delivers nothing to a main thread that unwound
        (see :meth:`MonitorThread.hold`): it raises the restart itself.
        """
        patience = self.parts.patience
        if poll(self.monitor.restart_started.is_set, patience, interval_max=0.001):
            raise RankShouldRestart()
        raise InternalError(f"the monitor thread did not start a restart within {patience:g} s")

    def leave(self, leaving: _RankLeaves, step: int) -> None:
        """Record this rank as gone from the iteration, so the others restart without it; then its ``terminate``."""
        state = self.state
        rank = state.rank or 0
        log.error("rank %s leaves the job in iteration %d: %r", rank, state.iteration, leaving.error)
        event_sink.emit(
            "gave_up",
            rank=state.initial_rank,
            iteration=state.iteration,
            kind=leaving.kind,
            message=repr(leaving.error),
            step=step,
        )
        try:
            with restart_bound(self.parts.bound):
                report_rank_gone(self.store, rank, state.world_size, leaving.kind, repr(leaving.error))
        finally:
            self.unwinding.release_and_abort()
            self.parts.hooks.terminate(state, leaving.error)


def exception_origin(error: BaseException) -> tuple[str | None, str]:
    """Where ``error`` was raised (``file:line in function``, its innermost frame) and its formatted traceback.

    The origin is what makes two exceptions the same fault for the give-up
    rule; the traceback is what the restart report shows, once.
    """
    frames = traceback.extract_tb(error.__traceback__)
    origin = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None
    return origin, "".join(traceback.format_exception(error)).rstrip()
