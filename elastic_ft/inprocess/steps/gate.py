"""A rank's optimizer steps and atomic sections: what may happen at a step boundary, and what a step records.

:class:`StepGate` is the Wrapper's collaborator for everything between two
optimizer steps. Through global ``torch.optim`` hooks it makes each step
atomic (no restart lands inside one, so no rank's state is half stepped),
lets no step commit while the node's fence is down, lands a planned restart
at the step boundary the ranks agreed on, counts the step, times it for the
adaptive timeouts, and records the iteration's first progress and the end
of a recovery. ``atomic()`` and ``ping()`` are the same gate for code the
user marks. The decisions are :mod:`elastic_ft.inprocess.steps.decisions`'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from elastic_ft.coordination.iteration import INTERRUPTED, IterationView
from elastic_ft.etcd.outage import OUTAGES, bounded
from elastic_ft.inprocess.exception import Fenced, InternalError
from elastic_ft.inprocess.hangs.heartbeats import StepClock
from elastic_ft.inprocess.restart.logs import get_logger
from elastic_ft.inprocess.restart.phases import RecoveryClock
from elastic_ft.inprocess.state import State
from elastic_ft.inprocess.steps.decisions import Fence, fence_verdict, planned_restart_step, training_step
from elastic_ft.observability import sink as event_sink
from elastic_ft.runtime.local_board import LocalBoard
from elastic_ft.runtime.waits import poll

log = get_logger("wrapper")

#: How long a rank at the boundary waits for its monitor thread to deliver the restart (far beyond need).
PLANNED_DELIVERY = 30.0
#: The slices a rank waits in for a restart to be delivered: an asynchronous exception lands at a slice's end.
_DELIVERY_SLICE = 0.002
#: How often a fenced rank looks at its node's board.
_FENCE_POLL = 0.01
#: How long an optimizer step may wait for the iteration's progress record: longer, and the step would wait
#: on etcd (the record is tried again at the next step).
_PROGRESS_WRITE_BOUND = 1.0
#: The slices ``atomic_lock`` is waited for in: a restart under way interrupts the waiting thread between two.
_LOCK_SLICE = 0.001


class StepGate:
    """The step boundary of one call of a wrapped function (see the module docstring).

    ``planned_lead`` is how long every rank's monitor thread may take to
    learn of a planned restart. The gate holds nothing of the call's
    ``CallWrapper`` (a reference back would keep it alive past its end):
    each iteration hands it its state, store and monitor thread.
    """

    def __init__(
        self,
        state: State,
        steps: StepClock,
        ping_watchdog: Callable[[], None],
        recovery: RecoveryClock,
        board: LocalBoard | None,
        planned_lead: float,
        min_progress_steps: int = 1,
    ) -> None:
        #: Shared with the monitor thread's restart: held for optimizer steps and atomic sections.
        self.atomic_lock = threading.RLock()
        #: Optimizer steps this rank's state has taken (set to the sender's when it is healed).
        self.step = 0
        #: Whether this process took an optimizer step yet (its first one is an event: the end of its start-up).
        self._stepped = False
        self.planned_lead = planned_lead
        #: Steps an iteration makes before its progress is recorded (the Wrapper's ``min_progress_steps``).
        self.min_progress_steps = min_progress_steps
        self._state = state
        self._steps = steps
        self._ping_watchdog = ping_watchdog
        self._recovery = recovery
        self._board = board
        self._hooks: list[Any] = []
        #: Levels of ``atomic_lock`` the main thread holds for optimizer steps under way.
        self._lock_depth = 0
        #: Whether each optimizer step under way counts as a training step (``steps.decisions.training_step``).
        self._counted: list[bool] = []
        # The current iteration's: its state, its store view, whether its progress is recorded, the generation of
        # the node's lease it began under, whether its monitor thread plans a restart, and that restart's step
        # boundary once agreed.
        self._store: IterationView | None = None
        self._progress_marked = False
        self._steps_this_iteration = 0
        self._fence_generation = 0
        self._restart_planned: threading.Event | None = None
        self._restart_step: int | None = None

    # ---- the call and its iterations ----

    def install(self) -> None:
        """Hook every ``torch.optim`` optimizer's steps (until :meth:`remove`)."""
        self._hooks = [
            register_optimizer_step_pre_hook(self._enter_step),
            register_optimizer_step_post_hook(self._on_step),
        ]

    def remove(self) -> None:
        """Unhook the optimizers, and forget the last iteration."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._store, self._restart_planned = None, None

    def begin_iteration(self, state: State, store: IterationView, restart_planned: threading.Event) -> None:
        """An iteration starts: its progress is not recorded yet, it runs under the node's lease of now, and a
        restart its monitor thread plans (``restart_planned``) lands at a step boundary agreed anew."""
        self._state, self._store, self._progress_marked = state, store, False
        self._steps_this_iteration = 0
        self._fence_generation = self._board.generation() if self._board is not None else 0
        self._restart_planned, self._restart_step = restart_planned, None

    # ---- optimizer steps ----

    def _enter_step(self, optimizer: Any, *_: object) -> None:
        """An optimizer step is atomic: no restart interrupts it, so no rank's state is ever half stepped.

        The optimizer's own pre and post hooks run inside too (a position
        counter kept in a post hook moves with the parameters). A restart
        under way first interrupts this wait, as in :meth:`atomic`. No step
        commits while the node's fence is down (:meth:`await_fence`). A
        planned restart lands here (:meth:`_reach_step_boundary`).
        """
        counted, why = training_step(bool(optimizer.state), optimizer.param_groups)
        if counted:
            self._reach_step_boundary()
            self.await_fence("an optimizer step")
        else:
            log.debug("rank %s: an optimizer step not counted: %s", self._state.rank, why)
        while not self.atomic_lock.acquire(timeout=_LOCK_SLICE):
            pass
        self._lock_depth += 1
        self._counted.append(counted)

    def _on_step(self, *_: object) -> None:
        if not (self._counted.pop() if self._counted else True):
            self.leave_steps(1)
            return
        self.step += 1
        self._steps.step()
        try:
            self._mark_progress()
            state = self._state
            if self._recovery.open:
                timed = self._recovery.finish()
                event_sink.emit(
                    "recovery_phases",
                    rank=state.initial_rank,
                    iteration=state.iteration,
                    step=self.step,
                    **(timed or {}),
                )
            elif not self._stepped:
                event_sink.emit("first_step", rank=state.initial_rank, iteration=state.iteration, step=self.step)
            self._stepped = True
        finally:
            self.leave_steps(1)

    def leave_steps(self, levels: int | None = None) -> None:
        """Release ``levels`` optimizer-step holds of ``atomic_lock`` (all: a step that raised left them)."""
        count = self._lock_depth if levels is None else min(levels, self._lock_depth)
        if levels is None:
            self._counted.clear()
        for _ in range(count):
            self._lock_depth -= 1
            self.atomic_lock.release()

    def _reach_step_boundary(self) -> None:
        """A planned restart (admitting joiners) lands between two optimizer steps, with no collective in flight.

        Interrupting a rank inside a collective (DDP's all-reduce in
        ``backward``) can strand its work in gloo: the rank then waits for
        its restart to be delivered until the monitor process kills it. So
        the first active rank to see the plan proposes a step boundary far
        enough ahead for every rank to learn of it (``restart_step`` keeps
        the first proposal), and each rank, reaching it, turns the plan into
        an interruption and waits here for its restart. A rank that never
        reaches it is interrupted as usual after the monitor thread's bound.
        """
        planned, store = self._restart_planned, self._store
        if planned is None or store is None or not planned.is_set():
            return
        done = self._steps.steps_in_iteration
        if self._restart_step is None:
            proposal = planned_restart_step(done, self._steps.typical_step(), self.planned_lead)
            self._restart_step = store.restart_step(proposal)
        if done < self._restart_step:
            return
        rank = self._state.rank
        log.debug("rank %s: the planned restart's step boundary (%d steps)", rank, done)
        store.decide_outcome(INTERRUPTED)
        # The monitor thread delivers the restart into this wait: short slices, so an asynchronous exception lands
        # within one.
        poll(lambda: False, PLANNED_DELIVERY, interval_max=_DELIVERY_SLICE)
        raise InternalError(f"a planned restart did not reach rank {rank} within {PLANNED_DELIVERY:g} s")

    def await_fence(self, what: str) -> None:
        """Let ``what`` begin only under the lease this iteration began under, proven alive (``local_board``).

        While the node cannot prove its lease alive, the others may be
        counting it out: the rank waits (a restart under way ends the wait).
        Once the node holds a new lease, they may have done so: the rank
        raises :class:`Fenced`, and the restart that follows takes it into
        the membership the job has now, or discards it. An etcd outage
        shorter than a whole TTL never gets here.
        """
        board = self._board
        if board is None:
            return

        def verdict() -> tuple[Fence, str]:
            return fence_verdict(board.fence_valid(), board.generation(), self._fence_generation)

        state = self._state
        decided, why = verdict()
        if decided is Fence.WAIT:
            log.warning("rank %s: %s waits: %s (fenced for %.1f s)", state.rank, what, why, -board.fence_left())
            event_sink.emit("fenced", rank=state.initial_rank, iteration=state.iteration, what=what)
            # No deadline: the agent's fence keeper ends a lapse (the lease proven again, or a new generation), and
            # a restart under way ends the wait.
            poll(lambda: verdict()[0] is not Fence.WAIT, None, _FENCE_POLL)
            decided, why = verdict()
            if decided is Fence.GO:
                log.warning("rank %s: its node proved its lease again; %s goes on", state.rank, what)
        if decided is Fence.FENCED:
            raise Fenced(f"rank {state.rank}: {why}, before {what}")

    def _mark_progress(self) -> None:
        """A step of active rank 0: once the iteration made ``min_progress_steps``, record that it progressed (once).

        The give-up rule counts iterations that end on a fault without
        progress. Called with ``atomic_lock`` held, so no restart lands
        inside the store write; a failed write only delays a give-up.
        """
        store, state = self._store, self._state
        if store is None or self._progress_marked or state.active_rank != 0:
            return
        self._steps_this_iteration += 1
        if self._steps_this_iteration < self.min_progress_steps or OUTAGES.down_since() is not None:
            return  # etcd away: the next step tries again once it answers, and no step waits for it
        try:
            with bounded(_PROGRESS_WRITE_BOUND, "the progress record's bound"):
                store.mark_progressed()
        except ConnectionError:
            return  # the next step tries again
        except Exception as error:  # noqa: BLE001 - training goes on; the rule then counts one restart too many
            log.warning("rank %s: could not record the iteration's progress: %s", state.rank, error)
        self._progress_marked = True

    # ---- what the user marks ----

    def ping(self) -> None:
        """A step reported by hand (see :meth:`elastic_ft.inprocess.restart.call.CallWrapper.ping`)."""
        self._ping_watchdog()
        self._steps.step()
        if not self._progress_marked and self._state.active_rank == 0:
            if threading.current_thread() is threading.main_thread():
                with self.lock_held():  # no restart lands inside the store write
                    self._mark_progress()
            else:
                self._mark_progress()

    @contextmanager
    def long_section(self) -> Iterator[None]:
        """Configured timeouts inside, and no step time taken (see ``CallWrapper.long_section``)."""
        self._steps.enter_long_section()
        try:
            yield
        finally:
            self._steps.exit_long_section()

    @contextmanager
    def unprotected(self) -> Iterator[None]:
        """No hang timeout inside, and no step time taken (see ``CallWrapper.disable_hang_protection``)."""
        self._steps.enter_long_section(unprotected=True)
        try:
            yield
        finally:
            self._steps.exit_long_section(unprotected=True)

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """No restart interrupts the block, nor does it start under a fence or a restart under way."""
        self.await_fence("an atomic section")
        with self.lock_held(), self.long_section():
            yield

    @contextmanager
    def lock_held(self) -> Iterator[None]:
        """Hold ``atomic_lock``, waiting in short slices that a restart under way can interrupt."""
        while not self.atomic_lock.acquire(timeout=_LOCK_SLICE):
            pass
        try:
            yield
        finally:
            self.atomic_lock.release()


def note_collective_wait(board: LocalBoard | None, local_rank: int) -> Callable[[bool], None] | None:
    """What the progress watchdog calls when the main thread starts (or stops) waiting for other ranks in C code:
    the node's board records it, for its agent's probes (None without a board)."""
    if board is None:
        return None

    def note(waiting: bool) -> None:
        board.set_in_collective(local_rank, time.monotonic() if waiting else None)

    return note
