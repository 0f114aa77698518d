"""One call of a wrapped function: :class:`CallWrapper`, the restart loop across iterations.

One call goes through these steps (seed pseudocode order)::

    store = store_factory(**store_kwargs)       # + monitor process, watchdog
    initial barrier; rank assignment
    loop:
        iteration barrier; initialize; health check
        active ranks: fn(*args, **kwargs)        spares: wait for completion
        completion barrier                       -> return
      on a fault anywhere:
        unwind (restart.iteration): release, abort (once); RankShouldRestart raised in the main thread
        finalize; health check; termination barrier; rank assignment

Every iteration keeps its keys under its own store prefix, and exactly one
outcome, ``completed`` or ``interrupted``, is ever decided per iteration
(``compare_set``), so ranks cannot disagree on whether to restart. What one
iteration has is an :class:`~elastic_ft.inprocess.restart.iteration.Iteration`;
what this module keeps is what outlives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import inspect
import os
import re
import sys
import threading
import typing
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from elastic_ft.coordination.barriers import NO_WAIT, await_key
from elastic_ft.coordination.iteration import (
    COMPLETED,
    IterationView,
    TerminationResult,
    iteration_store,
)
from elastic_ft.coordination.job import JobView, job_store
from elastic_ft.handoff import WorkerHandoff
from elastic_ft.inprocess.delivery.connections import (
    socket_inodes,
)
from elastic_ft.inprocess.delivery.process_groups import ProcessGroupKeeper
from elastic_ft.inprocess.exception import (
    BarrierOverflow,
    BarrierTimeout,
    HealingError,
    InternalError,
    RankAssignmentTimeout,
    RankShouldRestart,
    RestartAbort,
    RestartLimitError,
)
from elastic_ft.inprocess.hangs.heartbeats import HeartbeatWatchdog, ProgressTimestamps, StepClock
from elastic_ft.inprocess.hangs.monitor import MonitorConfig, MonitorProcess
from elastic_ft.inprocess.healing.heal import heal
from elastic_ft.inprocess.rank_assignment.base import RankAssignmentCtx, admits_new_ranks
from elastic_ft.inprocess.rank_assignment.replicas import ReplicaMesh
from elastic_ft.inprocess.restart.bounds import leaving_bound, restart_bound
from elastic_ft.inprocess.restart.events import close_events, install_rank_events
from elastic_ft.inprocess.restart.growth import next_iteration_state
from elastic_ft.inprocess.restart.hooks import ProcessHooks, RankHooks, _RankLeaves
from elastic_ft.inprocess.restart.iteration import Iteration, IterationParts, begin_iteration
from elastic_ft.inprocess.restart.joining import Joining, Withdrawn
from elastic_ft.inprocess.restart.logs import configure_logging, get_logger, release_logging
from elastic_ft.inprocess.restart.phases import RecoveryClock
from elastic_ft.inprocess.restart.process_group_stores import GroupStores
from elastic_ft.inprocess.restart.report import RestartReporter
from elastic_ft.inprocess.restart.warmup import warm_up
from elastic_ft.inprocess.state import Mode, State
from elastic_ft.inprocess.steps.gate import StepGate, note_collective_wait
from elastic_ft.inprocess.store import close_store
from elastic_ft.keys import (
    ANY_COMPLETED,
    COMPLETION_BARRIER,
    EXIT_BARRIER,
    ITERATION_BARRIER,
    TERMINATION_BARRIER,
)
from elastic_ft.observability import sink as event_sink
from elastic_ft.observability.log_format import set_where
from elastic_ft.runtime.local_board import LocalBoard, at_barrier
from elastic_ft.runtime.torch_compat import check_torch, forget_mesh_caches
from elastic_ft.untrusted import MalformedRecord

if TYPE_CHECKING:
    from elastic_ft.inprocess.wrapper import Wrapper

log = get_logger("wrapper")

# Reference cycles. An exception's traceback holds the frames it passed through, some of them this module's
# methods with ``self``: anything of those frames that names the exception again (a local, an attribute, a
# ``__context__``) makes a cycle that keeps the CallWrapper, and its store with its listening socket, alive
# until a garbage collection. So the code below drops such names as soon as it is done with them ("a cycle").

#: A planned restart's lead: the time, beyond two monitor-thread intervals, every rank gets to learn of it
#: before the step boundary; and how much longer the monitor thread waits for that boundary. A rank that
#: learns of it after the boundary runs into the next step's collective, which the others, waiting at the
#: boundary, never join: its restart strands it in gloo and its monitor process replaces it. On a loaded
#: host a monitor thread learned of a plan more than 0.2 s late; the lead costs the joiner its wait alone
#: (the others train meanwhile).
_PLANNED_LEAD = 0.5
_PLANNED_GRACE = 1.0

#: Exceptions with which the in-process layer gives up on the whole job (every
#: rank gets them alike, or the protocol itself broke, or a rank's state may be
#: half loaded from a peer), as opposed to a rank leaving alone (failed health
#: check or finalize, discarded by the rank assignment) while the others go
#: on. The node side escalates on these.
GIVE_UP_ERRORS: tuple[type[BaseException], ...] = (
    RestartAbort,
    HealingError,
    BarrierTimeout,
    BarrierOverflow,
    InternalError,
    RankAssignmentTimeout,
)


def _termination_result(payload: str | bytes | None, world_size: int) -> TerminationResult:
    """The termination barrier's payload, decoded.

    A malformed payload (the store is untrusted) names no rank: the next
    iteration barrier then times out on any rank that did leave, a bounded
    failure, rather than the Wrapper crashing on every rank.
    """
    try:
        return TerminationResult.from_json(payload, world_size)
    except MalformedRecord as error:
        log.warning("ignoring a malformed termination-barrier payload: %s", error)
        return TerminationResult(world_size)


def _secs(value: datetime.timedelta) -> float:
    return value.total_seconds()


def _bind_call_wrapper(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], call_wrapper: CallWrapper
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments, with ``call_wrapper`` passed for each parameter annotated ``CallWrapper``."""
    bound = inspect.signature(fn).bind_partial(*args, **dict(kwargs))
    for name in _call_wrapper_parameters(fn):
        if bound.arguments.get(name) is None:
            bound.arguments[name] = call_wrapper
    return bound.args, bound.kwargs


def _assigned(wrapper: Wrapper, ctx: RankAssignmentCtx) -> State:
    """The rank assignment, then the deprecated ``rank_filter`` when one was given."""
    state = wrapper.rank_assignment(ctx).state
    if wrapper.rank_filter is not None:
        state = wrapper.rank_filter(state)
        if not isinstance(state, State):
            raise TypeError(f"Wrapper rank_filter must return a State, got {state!r}")
    if state.active_world_size == 0:
        # Every rank computes the same assignment, so every rank stops here alike;
        # otherwise all of them would wait as spares for a completion that never comes.
        raise RestartAbort(
            f"the rank assignment left no active rank in iteration {state.iteration} "
            f"(world size {state.world_size}): nothing can run the function"
        )
    return state


def _heal(
    wrapper: Wrapper,
    store: IterationView,
    state: State,
    step: int,
    fresh: bool,
    groups: ProcessGroupKeeper,
    shard: tuple[int, int] | None,
    mesh: ReplicaMesh | None,
) -> tuple[int, bool]:
    """Peer state healing, on an active rank after a restart (:mod:`elastic_ft.inprocess.healing.heal`): the rank's
    step after it, and whether it holds the world's state (else it loads the user's checkpoint)."""
    if wrapper.state_dict is None or wrapper.load_state_dict is None or not state.iteration:
        return step, not fresh and (mesh is None or shard == mesh.shard)
    try:
        result = heal(
            store,
            state.active_rank or 0,
            state.active_world_size or state.world_size,
            state.iteration,
            step,
            fresh,
            wrapper.state_dict,
            wrapper.load_state_dict,
            wrapper.barrier_timeout,
            groups,
            shard=shard,
            shards=mesh.shape[1] if mesh is not None else None,
        )
    except HealingError as error:
        raise _RankLeaves(error, "healing") from error
    if result.role == "received":
        event_sink.emit(
            "healed",
            rank=state.initial_rank,
            iteration=state.iteration,
            step=result.step,
            previous_step=step,
            nbytes=result.nbytes,
            seconds=round(result.seconds, 4),
        )
    return result.step, result.holds_state


def _progress_sample(call_wrapper: CallWrapper) -> dict[str, Any] | None:
    """The ``progress`` event's fields: this rank's optimizer steps, while it is an active rank."""
    state = call_wrapper.state
    if state.mode is not Mode.ACTIVE:
        return None
    return {"rank": state.initial_rank, "iteration": state.iteration, "step": call_wrapper.step}


def _state_from_env() -> tuple[State, bool]:
    """The process's state before its first iteration, from torchrun's variables, and whether it joins a world
    that is already running (``ftrun`` respawned it)."""
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"a function wrapped by elastic_ft.Wrapper runs under a launcher, which sets RANK and WORLD_SIZE; "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Run it with "
            "`ftrun --nproc-per-node=N script.py` (or torchrun, or srun with them set)"
        )
    worker = WorkerHandoff.from_env(os.environ)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    joining = worker is not None and worker.joining
    if joining and rank < world_size:
        raise ValueError(
            f"a joining process needs an initial RANK outside the running world, got RANK={rank} "
            f"with WORLD_SIZE={world_size}"
        )
    return (State(None, world_size, initial_rank=rank) if joining else State(rank, world_size)), joining


def _monitor_config(wrapper: Wrapper, state: State) -> MonitorConfig:
    """What the rank's monitor process needs of the Wrapper's settings, in seconds."""
    return MonitorConfig(
        initial_rank=state.initial_rank or 0,
        initial_world_size=state.world_size,
        interval=_secs(wrapper.monitor_process_interval),
        heartbeat_interval=_secs(wrapper.heartbeat_interval),
        heartbeat_timeout=_secs(wrapper.heartbeat_timeout),
        soft_timeout=_secs(wrapper.soft_timeout),
        hard_timeout=_secs(wrapper.hard_timeout),
        termination_grace_time=_secs(wrapper.termination_grace_time),
        gil_held_limit=max(1.0, 10 * _secs(wrapper.progress_watchdog_interval)),
        logfile=wrapper.monitor_process_logfile,
        pidfile=wrapper.monitor_process_pidfile,
        log_level=log.getEffectiveLevel(),
    )


def _iteration_parts(
    wrapper: Wrapper,
    hooks: RankHooks,
    gate: StepGate,
    watchdog: HeartbeatWatchdog,
    process_hooks: ProcessHooks,
    timestamps: ProgressTimestamps,
) -> IterationParts:
    """What the call's iterations are built with (once its process-wide hooks are installed)."""
    return IterationParts(
        hooks,
        gate,
        watchdog,
        process_hooks.interrupt,
        timestamps.set_restart_pending,
        _secs(wrapper.monitor_thread_interval),
        _secs(wrapper.last_call_wait),
        gate.planned_lead + _PLANNED_GRACE,
        wrapper.barrier_timeout,
    )


def _agents_board(local_rank: int) -> LocalBoard | None:
    """The board this node's agent shares with its workers (under ftrun); None for a process it did not start
    (a test, a hand-made launch)."""
    board = LocalBoard.from_env()
    if board is not None and not 0 <= local_rank < board.ranks:
        return None
    return board


def _is_call_wrapper_annotation(annotation: Any) -> bool:
    if annotation is CallWrapper:
        return True
    if isinstance(annotation, str):
        # An annotation that could not be resolved (say, CallWrapper imported inside a function).
        words = set(re.findall(r"[A-Za-z_.]+", annotation))
        names = {"CallWrapper", "elastic_ft.CallWrapper", "elastic_ft.inprocess.CallWrapper", f"{__name__}.CallWrapper"}
        return bool(words & names) and words <= names | {
            "None",
            "Optional",
            "typing.Optional",
        }
    return CallWrapper in typing.get_args(annotation) and type(None) in typing.get_args(annotation)


def _call_wrapper_parameters(fn: Callable[..., Any]) -> list[str]:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to the raw ones
        hints = getattr(fn, "__annotations__", {})
    return [name for name, annotation in hints.items() if name != "return" and _is_call_wrapper_annotation(annotation)]


class CallWrapper:
    """The restart machinery of one call of a wrapped function.

    The wrapped function receives it in any parameter annotated
    ``CallWrapper`` or ``CallWrapper | None``, to use :meth:`atomic` and
    :meth:`ping` and to read :attr:`iteration`, :attr:`state` and
    :attr:`step` (the optimizer steps this rank's state has taken, which
    peer state healing compares across ranks).
    """

    def __init__(self, wrapper: Wrapper) -> None:
        check_torch()
        if dist.is_available() and dist.is_initialized():
            raise ValueError(
                "the Wrapper needs not torch.distributed.is_initialized(): enter the Wrapper before "
                "torch.distributed.init_process_group, not after"
            )
        with contextlib.ExitStack() as undo:  # a set-up that fails undoes what it did, latest first
            #: The log handler (and level) this call installed, undone when it ends (None: one was there already).
            self._logging = configure_logging()
            undo.callback(release_logging, self._logging)
            self._start(wrapper, undo)
            undo.pop_all()

    def _start(self, wrapper: Wrapper, undo: contextlib.ExitStack) -> None:
        """Everything the call sets up: its state, monitors, store and hooks (undone by :meth:`shutdown`; by
        ``undo`` if the set-up fails)."""
        self.wrapper = wrapper
        #: The process joins a world that is already running (``ftrun`` respawned it).
        self.state, self.joining = _state_from_env()
        set_where(f"rank {self.state.initial_rank}")
        #: The iteration under way, or the last one (None before the first).
        self._iteration: Iteration | None = None
        self._excepthook = sys.excepthook
        #: The rank holds no state of the world yet: it has not run the function as an active rank, nor been healed.
        self._fresh = True
        #: The shard of a sharded model this rank's state holds (``State.held_shard``), None if none.
        self._held_shard: tuple[int, int] | None = None
        #: Whether this rank holds the world's state as the function starts: False at the first iteration, for a
        #: rank no peer could heal, or one that never trained; the function then loads the user's checkpoint.
        self.holds_state = False
        self._timestamps = ProgressTimestamps(_secs(wrapper.soft_timeout), _secs(wrapper.hard_timeout))
        self._steps = StepClock(
            self._timestamps, wrapper.adaptive_timeouts, _secs(wrapper.soft_timeout), _secs(wrapper.hard_timeout)
        )
        # Forked first, while this process has no other thread.
        self._monitor_process = MonitorProcess(
            _monitor_config(wrapper, self.state), self._timestamps, wrapper.store_factory, wrapper.store_kwargs
        )
        undo.callback(self._monitor_process.stop)
        self._reporter = RestartReporter(wrapper.max_identical_faults, wrapper.max_restarts_without_progress)
        self._groups = ProcessGroupKeeper()
        #: The rank's side of a restart: its connections released, the user's hooks.
        self._hooks = RankHooks(
            self._groups, wrapper.abort, wrapper.restart_health_check, wrapper.completion, wrapper.terminate
        )
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        #: Shared with this node's agent (under ftrun): the node's fence, and this rank's stalls.
        self._board = _agents_board(self._local_rank)
        self._watchdog = HeartbeatWatchdog(
            self._timestamps,
            _secs(wrapper.progress_watchdog_interval),
            self._groups.observe,
            note_collective_wait(self._board, self._local_rank),
        )
        self._job_store: JobView | None = None
        #: The moments of the restart under way on this rank, until its first step (``recovery_phases``).
        self._recovery = RecoveryClock()
        #: Optimizer steps, atomic sections, the fence and the planned restart's step boundary.
        self._gate = StepGate(
            self.state,
            self._steps,
            self._watchdog.ping,
            self._recovery,
            self._board,
            _PLANNED_LEAD + 2 * _secs(wrapper.monitor_thread_interval),
            wrapper.min_progress_steps,
        )
        self._process_hooks = ProcessHooks(self._gate)
        self._connect(wrapper, undo)
        undo.callback(self._process_hooks.remove)  # each of the hooks, as far as it got
        # What exists now (the store's connections above all) is the process's own; what the
        # wrapped function connects later is released at a restart (elastic_ft.inprocess.delivery.connections).
        self._hooks.socket_baseline = socket_inodes()
        self._process_hooks.install(wrapper.interrupt_signal, self._hooks.socket_baseline)
        self._watchdog.start()
        self._iteration_parts = _iteration_parts(
            wrapper, self._hooks, self._gate, self._watchdog, self._process_hooks, self._timestamps
        )
        # Everything that exists now (imports, the store's client, the caller's
        # set-up) outlives every iteration: move it out of the collector's way, so
        # the full collection after a fault scans only what iterations created.
        gc.freeze()

    def _connect(self, wrapper: Wrapper, undo: contextlib.ExitStack) -> None:
        """The call's store and what hangs off it (its events, the job's records), then the world entered."""
        self.base_store = wrapper.store_factory(**wrapper.store_kwargs)
        #: The stores this call hands out for process groups (``process_group_store``), by iteration.
        self._group_stores = GroupStores(self.base_store)
        #: The sink of this rank's events this call installed (None: none, or one was there already).
        self._events = install_rank_events(self.base_store, functools.partial(_progress_sample, self))
        undo.callback(close_events, self._events)
        self._job_store = job_store(self.base_store)
        self._job_store.record_wrapped(self.state.initial_rank or 0, os.getpid())
        self._joining = Joining(
            self._job_store,
            self.base_store,
            self._board,
            self._local_rank,
            self._monitor_process,
            self._recovery,
            wrapper.barrier_timeout,
            wrapper.heartbeat_timeout,
        )
        self._joining.enter_world(
            self.state,
            self.joining,
            admits_new_ranks(wrapper.rank_assignment),
            wrapper.barrier_timeout,
            functools.partial(warm_up, wrapper.warmup, "it waited to register as a joiner"),
        )

    @property
    def job_store(self) -> JobView:
        if self._job_store is None:
            raise InternalError("the Wrapper's store is not set up")
        return self._job_store

    @property
    def iteration(self) -> int:
        """Index of the current restart iteration (0 for the first call)."""
        return self.state.iteration

    @property
    def mesh(self) -> ReplicaMesh | None:
        """This iteration's mesh of a sharded model (``ShardedReplicas``): its shape, and this rank's coordinates
        in it; None for a reserve rank, or a model replicated whole."""
        return self._iteration.mesh if self._iteration is not None else None

    @property
    def fn_exception(self) -> BaseException | None:
        """The exception that interrupted the last iteration on this rank, if it was local (no traceback)."""
        return self._iteration.exception if self._iteration is not None else None

    def process_group_store(self, name: str = "pg") -> dist.Store:
        """The store this iteration's process group is bootstrapped from:
        ``init_process_group(backend, store=call_wrapper.process_group_store(), rank=..., world_size=...)``.

        A prefix of the Wrapper's store of its own per iteration
        (``<name>/<iteration>``), so no group meets a failed iteration's
        ranks. Over the round's etcd store (under ``ftrun``) it is a
        :class:`~elastic_ft.etcd.group_store.GroupStore`: the keys gloo and
        NCCL publish are written once, so every rank reads them from one
        watch, and forming a group of N ranks costs each rank three etcd
        requests instead of 2N. It stays open for the iteration (NCCL may
        read it after the group is built) and is closed at the next restart.
        """
        return self._group_stores.for_iteration(self.state.iteration, name)

    def ping(self) -> None:
        """Report progress by hand: a step, for loops without a ``torch.optim`` optimizer.

        After the first ping of an iteration the rank must keep pinging
        within the soft (and hard) timeout, which catches livelocks. A ping
        also counts as automatic progress, so a helper thread may keep a
        main thread that is busy in one long C call alive. Pings, like
        optimizer steps, time the steps the adaptive timeouts follow.
        """
        self._gate.ping()

    def long_section(self) -> contextlib.AbstractContextManager[None]:
        """A stretch that may take much longer than a step (a checkpoint, an evaluation).

        Inside it the configured ``soft_timeout`` and ``hard_timeout`` apply
        instead of the adaptive ones, and its duration is not taken for a
        step time. ``atomic()`` is a long section too.
        """
        return self._gate.long_section()

    def disable_hang_protection(self) -> contextlib.AbstractContextManager[None]:
        """A section during which this rank's hang timeouts are off (NVIDIA 0.6's name): no stall inside it
        restarts or kills the rank, however long. The other ranks' timeouts still run, so a section every rank
        enters (a collective checkpoint) is the one to mark; a section only some ranks enter is better a
        :meth:`long_section`. A fault (an exception, a dead process) still restarts as usual."""
        return self._gate.unprotected()

    def atomic(self) -> contextlib.AbstractContextManager[None]:
        """A block the restart never interrupts, and that never starts while a restart is under way.

        The lock is shared with the monitor thread's termination procedure.
        Waiting for it is done in short steps, so that a restart already
        under way can still interrupt the waiting thread. The block is a
        :meth:`long_section`: typically a checkpoint.
        """
        return self._gate.atomic()

    @property
    def step(self) -> int:
        """Optimizer steps this rank's state has taken (set to the sender's when it is healed)."""
        return self._gate.step

    @step.setter
    def step(self, value: int) -> None:
        self._gate.step = value

    @property
    def atomic_lock(self) -> threading.RLock:
        """Held for optimizer steps and atomic sections; the monitor thread's restart takes it too."""
        return self._gate.atomic_lock

    def __enter__(self) -> CallWrapper:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, error: BaseException | None, *_: object) -> None:
        try:
            if self._job_store is not None:
                gave_up = isinstance(error, GIVE_UP_ERRORS)
                kind = "completed" if error is None else type(error).__name__
                if error is None:
                    event_sink.emit(
                        "completed", rank=self.state.initial_rank, iteration=self.state.iteration, step=self.step
                    )
                fatal = isinstance(error, RestartLimitError) and error.fatal
                with leaving_bound(self.wrapper.barrier_timeout, self.state.rank, "its exit record"):
                    self._job_store.record_left(
                        self.state.initial_rank or 0, kind, gave_up, "" if error is None else repr(error), fatal=fatal
                    )
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Leave the job: the store's hosts wait until every rank has left it."""
        try:
            initial_rank = self.state.initial_rank or 0
            # Joiners are not counted by the exit barrier: it is the initial world's.
            if self._job_store is not None and initial_rank < (self.state.initial_world_size or 1):
                hosts_store = initial_rank in getattr(self.base_store, "critical_ranks", ())
                with leaving_bound(self.wrapper.barrier_timeout, self.state.rank, "its arrival at the exit barrier"):
                    self._job_store.arrive_and_wait(
                        EXIT_BARRIER,
                        [initial_rank],
                        self.state.initial_world_size or 1,
                        datetime.timedelta.max if hosts_store else NO_WAIT,
                    )
        finally:
            gc.unfreeze()
            self._group_stores.close()
            self._groups.keep_until_exit()
            self._process_hooks.remove()
            self._watchdog.shutdown()
            self._monitor_process.stop()
            close_events(self._events)
            release_logging(self._logging)
            # The last iteration's monitor thread and fault chain frames of this object: a cycle.
            self._iteration = None
            close_store(self.base_store)

    # ---- the restart loop ----

    def __call__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = _bind_call_wrapper(fn, args, kwargs, self)
        if self.joining:
            state = self._await_admission()
        else:
            state = _assigned(
                self.wrapper, RankAssignmentCtx(self.state, iteration_store(self.base_store, 0).store, set())
            )
        while state is not None:
            iteration = self._begin_iteration(state)
            completed, result = self._run_iteration(fn, args, kwargs, iteration)
            if completed:
                log.debug("rank %s: iteration %d completed", state.rank, state.iteration)
                self._hooks.run_completion(state)
                return result
            next_state = self._prepare_restart(iteration)
            # None: counted out while it lived, it joins the running world again.
            state = next_state if next_state is not None else self._rejoin(state)
        return None

    def _begin_iteration(self, state: State) -> Iteration:
        """Take ``state``'s place: publish it, reset the monitors, and meet the others at the iteration barrier."""
        was_reserve = self.joining or self.state.mode is Mode.INACTIVE
        active = state.mode is Mode.ACTIVE
        if active and was_reserve and state.iteration:
            self.job_store.record_activation(state.initial_rank or 0, state.iteration)
            event_sink.emit("spare_activated", rank=state.initial_rank, iteration=state.iteration, joined=self.joining)
        self.joining = False  # a member of the world from now on
        self.state = state
        iteration = self._iteration = begin_iteration(state, self.base_store, self._iteration_parts)
        store = iteration.store
        with restart_bound(self.wrapper.barrier_timeout):
            store.set_initial_rank(state.rank or 0, state.initial_rank or 0)
            store.set_active_world_size(state.active_world_size or state.world_size)
            self.job_store.record_position(
                state.initial_rank or 0, state.iteration, state.rank or 0, state.world_size, active
            )
        event_sink.emit(
            "iteration_started",
            rank=state.initial_rank,
            iteration=state.iteration,
            iteration_rank=state.rank,
            world_size=state.world_size,
            active=active,
            active_world_size=state.active_world_size or state.world_size,
            step=self.step,
        )
        self._watchdog.reset()
        # torch's init_process_group wraps sys.excepthook to prefix "[rank<r>]: " on every call: one
        # prefix per iteration, not one more per restart.
        sys.excepthook = self._excepthook
        self._steps.start_iteration(active)
        self._monitor_process.start_iteration(state.iteration, state.rank or 0, state.world_size, active)
        state.set_distributed_vars()
        with at_barrier(self._board, self._local_rank):
            store.arrive_and_wait(ITERATION_BARRIER, [state.rank or 0], state.world_size, self.wrapper.barrier_timeout)
        self._recovery.mark("started")
        log.debug("rank %s: iteration %d starts as %s", state.rank, state.iteration, state.mode.name)
        return iteration

    def _run_iteration(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], iteration: Iteration
    ) -> tuple[bool, Any]:
        """One iteration; returns ``(True, result)`` on completion, ``(False, None)`` to restart."""
        monitor = iteration.monitor
        try:
            try:
                monitor.start()
                return self._complete(fn, args, kwargs, iteration)
            except Exception as error:  # noqa: BLE001 - any failure of the iteration restarts it
                iteration.unwind()
                iteration.record_failure(error, self.step)
                iteration.keep(error)
                del error  # a cycle
                iteration.await_restart()
        except RankShouldRestart as restart:
            iteration.unwind()
            if not monitor.restart_started.is_set():
                iteration.record_asked_restart(restart, self.step)
                iteration.keep(restart)
                with suppress(RankShouldRestart):
                    iteration.await_restart()
            monitor.acknowledge()
            self._recovery.start(monitor.restart_started_at)
            self._recovery.mark("unwound")
            log.debug("rank %s: iteration %d interrupted, restarting", iteration.state.rank, iteration.state.iteration)
            return False, None
        except BaseException as error:  # noqa: BLE001 - any other exit makes this rank leave, then re-raises
            iteration.unwind()
            monitor.stop()
            leaving = error if isinstance(error, _RankLeaves) else _RankLeaves(error, type(error).__name__)
            iteration.leave(leaving, self.step)
            reason = leaving.release()
            try:
                raise reason from None
            finally:
                # The raised exception's traceback holds this frame: a local naming it would make a cycle.
                del reason, leaving
        raise InternalError("unreachable")

    def _complete(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], iteration: Iteration
    ) -> tuple[bool, Any]:
        """Run the iteration to its completion barrier: ``(True, result)`` when every rank completed; a restart
        (``RankShouldRestart``) or the function's exception otherwise."""
        wrapper, state, store = self.wrapper, iteration.state, iteration.store
        rank = state.rank or 0
        if wrapper.initialize is not None:
            wrapper.initialize(state)
        # A rank unhealthy before the function is a fault of this iteration, as in NVIDIA's Wrapper: the
        # ranks restart, and the check after finalize decides whether it leaves (_prepare_restart).
        self._hooks.check_health(state, leave=False)
        self._recovery.mark("checked")
        result = None
        if state.mode is Mode.ACTIVE:
            self.step, self.holds_state = _heal(
                self.wrapper, store, state, self.step, self._fresh, self._groups, self._held_shard, iteration.mesh
            )
            self._recovery.mark("healed")
            self._fresh = False
            if iteration.mesh is not None:
                self._held_shard = iteration.mesh.shard  # healed, held already, or loaded by the function
            result = fn(*args, **kwargs)
            self._watchdog.reset()  # the Wrapper's code runs now: pings stop by design (RankHooks)
            store.mark_any_completed()
        elif state.mode is Mode.INACTIVE:
            # Atomic: a restart that activates this rank waits for the warm-up's end (an import interrupted
            # half-way leaves its module broken), and the work is done when the rank's function needs it.
            with self._gate.atomic():
                warm_up(wrapper.warmup, "it waited in reserve")
            interval = _secs(wrapper.progress_watchdog_interval) / 4
            await_key(store.store, ANY_COMPLETED, store.any_completed, poll_interval=interval)
        else:
            raise InternalError(
                f"the rank assignment left rank {rank} in mode {state.mode.name}; expected ACTIVE or "
                "INACTIVE (compose an activation such as ActivateAllRanks() into it)"
            )
        outcome = store.arrive_and_wait(COMPLETION_BARRIER, [rank], state.world_size, wrapper.completion_timeout)
        if outcome == COMPLETED:
            iteration.monitor.stop()
            self._groups.forget()
            self.job_store.mark_finished()  # joiners still waiting leave
            return True, result
        # Interrupted while this rank waited to complete (a hung rank came back, and the job ran to
        # its end before the restart landed): no fault of this rank's, so none is recorded (it was
        # reported on every rank as an InternalError); the restart under way takes it as the others.
        log.info("rank %s: iteration %d was interrupted as it completed", rank, state.iteration)
        iteration.unwind()
        iteration.await_restart()

    def _prepare_restart(self, iteration: Iteration) -> State | None:
        """After an interruption (unwound): finalize, health check, termination barrier, rank assignment.

        Returns None when the others counted this rank out while it lived
        (its node cut off) and it may join the world again (:meth:`_rejoin`).
        """
        wrapper, store, state = self.wrapper, iteration.store, iteration.state
        rank = state.rank or 0
        # DTensor's caches would answer the next iteration's meshes with this one's, and their dead groups.
        forget_mesh_caches()
        # Free what the unwound function left in reference cycles (its frames, DDP's reducer), then
        # the process groups retired one restart ago, which nothing else can hold by now.
        gc.collect()
        self._groups.release()
        self._group_stores.close(before=state.iteration + 1)
        self._recovery.mark("released")
        try:
            try:
                if wrapper.finalize is not None:
                    wrapper.finalize(state)
            except Exception as error:
                raise _RankLeaves(error, "finalize") from error
            self._hooks.check_health(state)
        except _RankLeaves as leaving:
            iteration.leave(leaving, self.step)
            raise leaving.release() from None
        self._recovery.mark("finalized")
        with at_barrier(self._board, self._local_rank):
            payload = store.arrive_and_wait(TERMINATION_BARRIER, [rank], state.world_size, wrapper.barrier_timeout)
        self._recovery.mark("terminated")
        result = _termination_result(payload, state.world_size)
        cause_traceback = self._reporter.report(store, state, result)
        self._reporter.check_limits(store, state, result, cause_traceback, self.step)
        if result.terminated:
            log.info("rank %s: ranks %s left the job in iteration %d", rank, list(result.terminated), state.iteration)
        if result.joined:
            log.info("rank %s: initial ranks %s join in iteration %d", rank, list(result.joined), state.iteration + 1)
        if rank in result.terminated and self._joining.may_rejoin():
            return None
        next_state = dataclasses.replace(next_iteration_state(state, result), held_shard=self._held_shard)
        assigned = _assigned(self.wrapper, RankAssignmentCtx(next_state, store.store, set(result.terminated)))
        self._recovery.mark("assigned")
        return assigned

    def _rejoin(self, state: State) -> State | None:
        """The others counted this rank out while it lived: it joins the running world again in this process,
        under a new initial rank, as a respawned process would, and is healed from a peer
        (:meth:`Joining.take_new_initial_rank`). None when the job finished first."""
        self._take_new_initial_rank(state)
        return self._await_admission()

    def _take_new_initial_rank(self, state: State) -> None:
        """Become a joiner under a new initial rank (:meth:`Joining.take_new_initial_rank`), registered."""
        new = self._joining.take_new_initial_rank(state)
        world = state.initial_world_size or state.world_size
        set_where(f"rank {new}")
        self.state = State(None, world, initial_rank=new, initial_world_size=world)
        self.joining, self._fresh, self._held_shard = True, True, None
        self._joining.register_when_reported_active(new)

    def _await_admission(self) -> State | None:
        """A joiner: wait until a restart admits this process, then take its place; None if the job finished.

        Withdrawn while it waited (its node counted out, as a node cut off
        from its peers is again and again), it joins again under a new
        initial rank: the process lives, and the job loses nothing by it.
        """
        while isinstance(
            admission := self._joining.await_admission(
                self.state.initial_rank or 0, self.state.initial_world_size or 1
            ),
            Withdrawn,
        ):
            self._take_new_initial_rank(self.state)
        if admission is None:
            log.info(
                "initial rank %s: the job finished before a restart admitted this process", self.state.initial_rank
            )
            return None
        assigned = _assigned(
            self.wrapper, RankAssignmentCtx(admission.state, admission.previous.store, set(admission.terminated))
        )
        self._recovery.mark("assigned")
        return assigned
