"""In-process restart: :class:`Wrapper` and the per-call :class:`CallWrapper`.

``Wrapper(...)(train)`` returns a function that runs ``train`` on every rank
and, when any rank fails, unwinds it on every rank and calls it again in the
same processes, without the ranks that died or turned unhealthy. A restart
costs a few store round trips and the function's own re-initialisation,
instead of new processes, imports and a rendezvous.

One call goes through these steps (seed pseudocode order)::

    store = store_factory(**store_kwargs)       # + monitor process, watchdog
    initial barrier; rank assignment
    loop:
        iteration barrier; initialize; health check
        active ranks: fn(*args, **kwargs)        spares: wait for completion
        completion barrier                       -> return
      on a fault anywhere:
        abort (monitor thread); RankShouldRestart raised in the main thread
        finalize; health check; termination barrier; rank assignment

Every iteration keeps its keys under its own store prefix, and exactly one
outcome, ``completed`` or ``interrupted``, is ever decided per iteration
(``compare_set``), so ranks cannot disagree on whether to restart.
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
import signal
import sys
import threading
import traceback
import typing
import warnings
from collections.abc import Callable
from contextlib import suppress
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist

from elastic_ft.coordination.barriers import NO_WAIT, await_key
from elastic_ft.coordination.fault_records import (
    PEER_LOST,
    fault_kind,
)
from elastic_ft.coordination.iteration import (
    COMPLETED,
    IterationView,
    TerminationResult,
    iteration_store,
    report_rank_gone,
)
from elastic_ft.coordination.job import JobView, job_store
from elastic_ft.etcd import accounting
from elastic_ft.handoff import WorkerHandoff
from elastic_ft.inprocess.abort import AbortTorchDistributed
from elastic_ft.inprocess.arguments import (
    DEFAULT_DURATIONS,
    DEFAULT_LIMITS,
    DEFAULT_MIN_PROGRESS_STEPS,
    apply_job_config_defaults,
    validate_arguments,
)
from elastic_ft.inprocess.bounds import leaving_bound, restart_bound
from elastic_ft.inprocess.compose import Compose
from elastic_ft.inprocess.exception import (
    BarrierOverflow,
    BarrierTimeout,
    HealingError,
    InternalError,
    RankAssignmentTimeout,
    RankShouldRestart,
    RestartAbort,
    RestartLimitError,
    release_frames,
)
from elastic_ft.inprocess.group_stores import GroupStores
from elastic_ft.inprocess.growth import next_iteration_state
from elastic_ft.inprocess.hang_detection import AdaptiveTimeouts
from elastic_ft.inprocess.healing import heal
from elastic_ft.inprocess.health_check import ChainedGPUHealthCheck, ChainedNicHealthCheck, ChainedNVLHealthCheck
from elastic_ft.inprocess.joining import Joining
from elastic_ft.inprocess.logs import configure_logging, get_logger, release_logging
from elastic_ft.inprocess.monitor_process import MonitorConfig, MonitorProcess
from elastic_ft.inprocess.monitor_thread import MonitorThread
from elastic_ft.inprocess.process_groups import ProcessGroupKeeper
from elastic_ft.inprocess.progress_watchdog import HeartbeatWatchdog, ProgressTimestamps, StepClock
from elastic_ft.inprocess.rank_assignment.base import RankAssignmentCtx, admits_new_ranks
from elastic_ft.inprocess.rank_assignment.policies import ActivateAllRanks, MaxActiveWorldSize, ShiftRanks
from elastic_ft.inprocess.rank_assignment.replicas import ReplicaMesh, state_mesh
from elastic_ft.inprocess.rank_assignment.segments import SegmentSpares
from elastic_ft.inprocess.rank_hooks import ProcessHooks, RankHooks, _RankLeaves
from elastic_ft.inprocess.recovery_phases import RecoveryClock
from elastic_ft.inprocess.restart_report import RestartReporter
from elastic_ft.inprocess.sockets import (
    socket_inodes,
)
from elastic_ft.inprocess.state import Mode, State
from elastic_ft.inprocess.steps import StepGate, note_collective_wait
from elastic_ft.inprocess.store import default_store
from elastic_ft.inprocess.warmup import import_lazy_modules, warm_up
from elastic_ft.inprocess.worker_events import close_events, install_rank_events
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
from elastic_ft.runtime.waits import poll
from elastic_ft.untrusted import MalformedRecord

log = get_logger("wrapper")

# Reference cycles. An exception's traceback holds the frames it passed through, some of them this module's
# methods with ``self``: anything of those frames that names the exception again (a local, an attribute, a
# ``__context__``) makes a cycle that keeps the CallWrapper, and its store with its listening socket, alive
# until a garbage collection. So the code below drops such names as soon as it is done with them ("a cycle").

#: A planned restart's lead: the time, beyond two monitor-thread intervals, every rank gets to learn of it
#: before the step boundary; and how much longer the monitor thread waits for that boundary.
_PLANNED_LEAD = 0.1
_PLANNED_GRACE = 1.0

F = TypeVar("F", bound=Callable[..., Any])
StateHook = Callable[[State], Any]

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


class Wrapper:
    """Adds in-process restart to a distributed training function.

    Use as a decorator (``@Wrapper(...)``) or call it on a function. Under
    ``ftrun`` with a job config, the config's ``wrapper`` timeouts and
    ``rank_assignment`` replace the defaults of the arguments not given. The
    wrapped function returns the function's result on the active ranks and
    ``None`` on spares, once every rank has completed in the same iteration.
    On a rank that leaves the job (terminated, unhealthy, discarded), it
    raises the reason there.

    Args:
        store_factory: builds the coordination store, ``store_factory(**store_kwargs)``;
            called by the main process and by the monitor process of every rank.
            The default, :func:`elastic_ft.inprocess.store.default_store`, is the etcd
            store of the rendezvous round under ``ftrun``, else a TCPStore
            hosted by initial rank 0.
        store_kwargs: keyword arguments of ``store_factory``.
        initialize: run at the start of every iteration (:mod:`elastic_ft.inprocess.initialize`).
        abort: unblocks the main thread on a fault (:mod:`elastic_ft.inprocess.abort`).
        finalize: cleans up after a fault (:mod:`elastic_ft.inprocess.finalize`).
        health_check: local health check (:mod:`elastic_ft.inprocess.health_check`). The
            Wrapper runs ``restart_health_check``: these checks, then (first)
            the chained NIC, NVLink and GPU checks when ``LOCAL_RANK`` is set.
        rank_assignment: renumbers ranks and picks the active ones after a
            fault; default ``Compose(ActivateAllRanks(), ShiftRanks())``.
        monitor_thread_interval: how often the monitor thread polls a store
            that cannot watch (an etcd store is watched: no polling).
        monitor_process_interval: how often the monitor process checks the
            rank's progress (its death it learns at once).
        progress_watchdog_interval: how often the automatic heartbeat is taken.
        heartbeat_interval: how often the monitor process heartbeats into the store.
        heartbeat_timeout: silence after which a rank is reported unresponsive.
        soft_timeout: no progress for this long restarts every rank; the
            ceiling of the adaptive soft timeout.
        hard_timeout: no progress for this long terminates the rank's process;
            the ceiling of the adaptive hard timeout.
        barrier_timeout: timeout of the initial, iteration and termination barriers.
        completion_timeout: how long ranks that finished wait for the others.
        last_call_wait: how long to wait for concurrent faults before restarting.
        termination_grace_time: time between SIGTERM and SIGKILL at a hard timeout.
        monitor_process_logfile: absolute path of the monitor process's log;
            may contain ``{rank}`` (the initial rank); no log when ``None``.
        monitor_process_pidfile: absolute path of a file the monitor process
            appends its PID to, a line, when it starts; may contain ``{rank}``.
            Under Slurm, ``srun --kill-on-bad-exit=0 ...; python -m
            elastic_ft.runtime.wait_daemon PIDFILE`` keeps the step until the
            monitors have recorded the ranks' ends (NVIDIA's 0.6 argument).
        enabled: when false, ``Wrapper(...)(fn)`` returns ``fn`` itself.
        adaptive_timeouts: how the soft and hard timeouts follow the job's
            step times (:class:`~elastic_ft.inprocess.hang_detection.AdaptiveTimeouts`);
            ``None`` keeps them at ``soft_timeout`` and ``hard_timeout``.
        interrupt_signal: the signal that breaks the main thread out of a
            blocking call at a restart (its handler passes the signal on to
            the previous handler otherwise); ``None`` relies on the
            asynchronous exception alone, which waits for the call to return.
        state_dict: returns the training state that is identical on every
            data-parallel replica (model, optimizer, step, RNG, data position),
            kept by the caller outside the wrapped function; given with
            ``load_state_dict``, it turns on peer state healing
            (:mod:`elastic_ft.inprocess.healing`): at the start of every
            iteration after a restart, active ranks behind the others (new,
            respawned, activated, or interrupted before their last optimizer
            step) receive the state of an up-to-date rank before the function
            is called. Named as TorchFT's ``Manager`` names them.
        load_state_dict: puts a received state back (``load_state_dict(state)``);
            tensors arrive on the CPU.
        completion: run on every rank once the Wrapper completed, with the
            final state (:mod:`elastic_ft.inprocess.completion`); what it
            raises is logged, not raised.
        terminate: run on a rank that leaves the job (terminated, unhealthy,
            discarded, given up), with its last state, before the Wrapper
            raises the reason (:mod:`elastic_ft.inprocess.terminate`).
        rank_filter: deprecated (as in NVIDIA's package): a callable on
            :class:`State` applied after ``rank_assignment``, such as
            :mod:`elastic_ft.inprocess.rank_filter`'s filters; put filters in
            ``rank_assignment`` instead.
        max_identical_faults: the Wrapper stops the job once this many
            iterations in a row ended on the same exception (its type, the
            line that raised it, and the step) with no progress in between:
            a bug that raises on every call. Every rank raises
            :class:`~elastic_ft.inprocess.exception.RestartLimitError`, the
            restart report shows the traceback, and ``ftrun`` does not
            restart the workers. ``None``: no limit.
        max_restarts_without_progress: the Wrapper gives up (``RestartLimitError``,
            which ``ftrun`` may escalate to a process restart) once this
            many iterations in a row ended on a fault without progress:
            fewer than ``min_progress_steps`` steps (optimizer steps or
            :meth:`CallWrapper.ping` calls) on active rank 0. Its message
            names the last fault. ``None``: no limit.
        min_progress_steps: the steps an iteration must make to count as
            progress (``ft_launcher``'s ``--ft-min-progress-iterations``);
            1, any step, by default.
        warmup: called once per process while it waits before it trains for
            the first time (a joiner before it registers for admission, a
            reserve rank while it waits in reserve), before any process group
            exists, to do what torch would otherwise do in the rank's first
            iteration while the others wait for it (:mod:`elastic_ft.inprocess.warmup`).
            The default, :func:`~elastic_ft.inprocess.warmup.import_lazy_modules`,
            imports what a script's first optimizer and checkpoint read import
            (``torch._dynamo`` first: 1.5 to 2 s); a callable of your own
            replaces it (call the default from it to keep both); ``None``: no
            warm-up. What it raises is logged, not raised.
    """

    # Set from the arguments of __init__, once the job config's defaults are applied and checked.
    store_factory: Callable[..., dist.Store]
    store_kwargs: dict[str, Any]
    initialize: StateHook | None
    abort: StateHook
    finalize: StateHook | None
    health_check: StateHook | None
    #: What the Wrapper runs as the health check: ``health_check``'s parts, then the chained device checks.
    restart_health_check: StateHook | None
    rank_assignment: Callable[[RankAssignmentCtx], RankAssignmentCtx]
    monitor_thread_interval: datetime.timedelta
    monitor_process_interval: datetime.timedelta
    progress_watchdog_interval: datetime.timedelta
    heartbeat_interval: datetime.timedelta
    heartbeat_timeout: datetime.timedelta
    soft_timeout: datetime.timedelta
    hard_timeout: datetime.timedelta
    barrier_timeout: datetime.timedelta
    completion_timeout: datetime.timedelta
    last_call_wait: datetime.timedelta
    termination_grace_time: datetime.timedelta
    monitor_process_logfile: str | None
    monitor_process_pidfile: str | None
    enabled: bool
    adaptive_timeouts: AdaptiveTimeouts | None
    interrupt_signal: signal.Signals | None
    state_dict: Callable[[], Any] | None
    load_state_dict: Callable[[Any], Any] | None
    completion: StateHook | None
    terminate: StateHook | None
    rank_filter: StateHook | None
    max_identical_faults: int | None
    max_restarts_without_progress: int | None
    min_progress_steps: int
    warmup: Callable[[], Any] | None

    def __init__(
        self,
        *,
        store_factory: Callable[..., dist.Store] = default_store,
        store_kwargs: dict[str, Any] | None = None,
        initialize: StateHook | None = None,
        abort: StateHook | None = None,
        finalize: StateHook | None = None,
        health_check: StateHook | None = None,
        rank_assignment: Callable[[RankAssignmentCtx], RankAssignmentCtx] | None = None,
        monitor_thread_interval: datetime.timedelta = DEFAULT_DURATIONS["monitor_thread_interval"],
        monitor_process_interval: datetime.timedelta = DEFAULT_DURATIONS["monitor_process_interval"],
        progress_watchdog_interval: datetime.timedelta = DEFAULT_DURATIONS["progress_watchdog_interval"],
        heartbeat_interval: datetime.timedelta = DEFAULT_DURATIONS["heartbeat_interval"],
        heartbeat_timeout: datetime.timedelta = DEFAULT_DURATIONS["heartbeat_timeout"],
        soft_timeout: datetime.timedelta = DEFAULT_DURATIONS["soft_timeout"],
        hard_timeout: datetime.timedelta = DEFAULT_DURATIONS["hard_timeout"],
        barrier_timeout: datetime.timedelta = DEFAULT_DURATIONS["barrier_timeout"],
        completion_timeout: datetime.timedelta = DEFAULT_DURATIONS["completion_timeout"],
        last_call_wait: datetime.timedelta = DEFAULT_DURATIONS["last_call_wait"],
        termination_grace_time: datetime.timedelta = DEFAULT_DURATIONS["termination_grace_time"],
        monitor_process_logfile: str | None = None,
        monitor_process_pidfile: str | None = None,
        enabled: bool = True,
        adaptive_timeouts: AdaptiveTimeouts | None = AdaptiveTimeouts(),  # noqa: B008 - immutable
        interrupt_signal: signal.Signals | None = signal.SIGUSR2,
        state_dict: Callable[[], Any] | None = None,
        load_state_dict: Callable[[Any], Any] | None = None,
        completion: StateHook | None = None,
        terminate: StateHook | None = None,
        rank_filter: StateHook | None = None,
        max_identical_faults: int | None = DEFAULT_LIMITS["max_identical_faults"],
        max_restarts_without_progress: int | None = DEFAULT_LIMITS["max_restarts_without_progress"],
        min_progress_steps: int = DEFAULT_MIN_PROGRESS_STEPS,
        warmup: Callable[[], Any] | None = import_lazy_modules,
    ) -> None:
        arguments = dict(locals())
        del arguments["self"]
        if rank_filter is not None:
            warnings.warn(
                "Wrapper rank_filter is deprecated: compose the filters into rank_assignment "
                "(for example Compose(MaxActiveWorldSize(n), ShiftRanks()))",
                DeprecationWarning,
                stacklevel=2,
            )
        apply_job_config_defaults(arguments)
        if arguments["abort"] is None:
            arguments["abort"] = AbortTorchDistributed()
        if arguments["rank_assignment"] is None:
            arguments["rank_assignment"] = default_rank_assignment()
        validate_arguments(arguments)
        arguments["store_kwargs"] = dict(arguments["store_kwargs"] or {})
        arguments["restart_health_check"] = chain_health_checks(arguments["health_check"], os.environ)
        for name, value in arguments.items():
            setattr(self, name, value)

    def __call__(self, fn: F) -> F:
        if not self.enabled:
            return fn

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return _call(self, fn, args, kwargs)
            except BaseException as error:
                release_frames(error)  # a caller keeping the error keeps no store, thread or state of the call
                raise

        return typing.cast(F, wrapped)


def _call(wrapper: Wrapper, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One call of a wrapped function, from its set-up to its shutdown."""
    accounting.set_role("rank")
    with CallWrapper(wrapper) as call_wrapper:
        return call_wrapper(fn, args, kwargs)


def chain_health_checks(health_check: StateHook | None, environ: typing.Mapping[str, str]) -> StateHook | None:
    """``health_check``'s parts, then NIC, NVLink and GPU checks of ``LOCAL_RANK``'s device, when it is set.

    :class:`Compose` runs its parts last to first, so the device checks run
    first: NIC, NVLink, GPU, then the user's. The chained classes are looked
    up in this module when the Wrapper is built, so that code replacing
    NVIDIA's names in ``inprocess.wrap`` (its tests do) replaces them here.
    """
    checks: list[StateHook] = []
    if isinstance(health_check, Compose):
        checks.extend(health_check.parts)
    elif health_check is not None:
        checks.append(health_check)
    local_rank = environ.get("LOCAL_RANK")
    if local_rank is not None:
        try:
            index = int(local_rank)
        except ValueError:
            raise ValueError(f"LOCAL_RANK must be an integer, got {local_rank!r}") from None
        checks += [
            ChainedGPUHealthCheck(device_index=index),
            ChainedNVLHealthCheck(device_index=index),
            ChainedNicHealthCheck(device_index=index),
        ]
    return Compose(*checks) if checks else None


def default_rank_assignment() -> Compose | SegmentSpares:
    """``ShiftRanks``, then the active ranks: all of them, or under ``ftrun`` the round's active world size;
    under ``ftrun --segment-size``, :class:`SegmentSpares`.

    ``ftrun``'s agent hands its workers the number of ranks the round's
    active nodes hold (:class:`~elastic_ft.handoff.WorkerHandoff`); the hot
    spare nodes' ranks above it wait as reserve ranks, and replace ranks
    that fail, keeping the active world size while reserve ranks last.
    """
    worker = WorkerHandoff.from_env(os.environ)
    if worker is not None and worker.segment is not None and worker.segment_ranks is not None:
        return SegmentSpares(worker.active_world_size, worker.segment, worker.segment_ranks)
    if worker is not None and worker.active_world_size is not None:
        return Compose(MaxActiveWorldSize(worker.active_world_size), ShiftRanks())
    return Compose(ActivateAllRanks(), ShiftRanks())


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


def await_restart(monitor: MonitorThread, wrapper: Wrapper) -> NoReturn:
    """Wait for the monitor thread to start the restart (the fault recorded here reaches it), then restart.

    The monitor thread delivers nothing to a held main thread (see
    :meth:`MonitorThread.hold`): once the restart started (connections
    released, ``abort`` called), the main thread raises it itself.
    """
    patience = _secs(wrapper.last_call_wait) + 3 * _secs(wrapper.monitor_thread_interval) + 30.0
    if poll(monitor.restart_started.is_set, patience, interval_max=0.001):
        raise RankShouldRestart()
    raise InternalError(f"the monitor thread did not start a restart within {patience:g} s")


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


def _record_failure(
    error: Exception, store: IterationView, state: State, step: int, bound: datetime.timedelta, restarting: bool
) -> None:
    """The function's exception: logged on this rank, emitted, and recorded as the iteration's fault, but for a
    broken connection once a restart is under way (``restarting``), which is that restart's consequence."""
    rank = state.rank or 0
    origin, text = exception_origin(error)
    # One line per rank; the text once per restart, by the rank that reports it (RestartReporter.report).
    kind = fault_kind(error)
    log.info("rank %s: iteration %d failed with %s (%s)", rank, state.iteration, kind, type(error).__name__)
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
    if kind == PEER_LOST and restarting:
        return
    with restart_bound(bound):  # etcd away: waited for, within the restart's barrier timeout
        store.record_interruption(rank, kind, repr(error), step=step, origin=origin, traceback=text)


def _record_asked_restart(
    restart: RankShouldRestart, store: IterationView, state: State, step: int, bound: datetime.timedelta
) -> None:
    """The function raised ``RankShouldRestart`` itself (NVIDIA's explicit restart): a fault of this rank.
    No restart was under way, so none would come: it is recorded, as an exception is, to start one."""
    origin, text = exception_origin(restart)
    log.info("rank %s: the function asked for a restart in iteration %d", state.rank, state.iteration)
    with restart_bound(bound):
        store.record_interruption(
            state.rank or 0,
            "RankShouldRestart",
            "the function raised RankShouldRestart",
            step=step,
            origin=origin,
            traceback=text,
        )


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
    """Peer state healing, on an active rank after a restart (:mod:`elastic_ft.inprocess.healing`): the rank's
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


def _leave(
    store: IterationView, state: State, leaving: _RankLeaves, step: int, hooks: RankHooks, bound: datetime.timedelta
) -> None:
    """Record this rank as gone from the iteration, so the others restart without it."""
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
        with restart_bound(bound):
            report_rank_gone(store, rank, state.world_size, leaving.kind, repr(leaving.error))
    finally:
        hooks.abort(state)
        hooks.terminate(state, leaving.error)


def _progress_sample(call_wrapper: CallWrapper) -> dict[str, Any] | None:
    """The ``progress`` event's fields: this rank's optimizer steps, while it is an active rank."""
    state = call_wrapper.state
    if state.mode is not Mode.ACTIVE:
        return None
    return {"rank": state.initial_rank, "iteration": state.iteration, "step": call_wrapper.step}


def _state_from_env() -> tuple[State, bool]:
    """The process's state before its first iteration, from torchrun's variables, and whether it joins a world
    that is already running (``ftrun`` respawned it)."""
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


def _agents_board(local_rank: int) -> LocalBoard | None:
    """The board this node's agent shares with its workers (under ftrun); None for a process it did not start
    (a test, a hand-made launch)."""
    board = LocalBoard.from_env()
    if board is not None and not 0 <= local_rank < board.ranks:
        return None
    return board


def exception_origin(error: BaseException) -> tuple[str | None, str]:
    """Where ``error`` was raised (``file:line in function``, its innermost frame) and its formatted traceback.

    The origin is what makes two exceptions the same fault for the give-up
    rule; the traceback is what the restart report shows, once.
    """
    frames = traceback.extract_tb(error.__traceback__)
    origin = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None
    return origin, "".join(traceback.format_exception(error)).rstrip()


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
        #: The exception that interrupted the last iteration on this rank, if it was local.
        self.fn_exception: BaseException | None = None
        self._excepthook = sys.excepthook
        #: The rank holds no state of the world yet: it has not run the function as an active rank, nor been healed.
        self._fresh = True
        #: This iteration's mesh of a sharded model (``ShardedReplicas``): its shape, and this rank's coordinates
        #: in it; None for a reserve rank, or a model replicated whole.
        self.mesh: ReplicaMesh | None = None
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
        #: The current iteration's monitor thread.
        self._monitor: MonitorThread | None = None
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
        # wrapped function connects later is released at a restart (elastic_ft.inprocess.sockets).
        self._hooks.socket_baseline = socket_inodes()
        self._process_hooks.install(wrapper.interrupt_signal, self._hooks.socket_baseline)
        self._watchdog.start()
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
            # The last monitor thread holds this object's bound method, and the last fault's traceback chain
            # frames of this object: a cycle.
            self._monitor = None
            self.fn_exception = None

    # ---- the restart loop ----

    def __call__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = _bind_call_wrapper(fn, args, kwargs, self)
        if self.joining:
            state = self._await_admission()
        else:
            state = _assigned(self.wrapper, RankAssignmentCtx(self.state, iteration_store(self.base_store, 0), set()))
        while state is not None:
            store = self._begin_iteration(state)
            completed, result = self._run_iteration(fn, args, kwargs, store, state)
            if completed:
                log.debug("rank %s: iteration %d completed", state.rank, state.iteration)
                self._hooks.run_completion(state)
                return result
            state = self._next_state(store, state)
        return None

    def _next_state(self, store: IterationView, state: State) -> State | None:
        """After an iteration that did not complete: the next one's state (None: the job finished before this
        rank, counted out while it lived, could join it again)."""
        next_state = self._prepare_restart(store, state)
        if next_state is not None:
            return next_state
        return self._rejoin(state)  # counted out while it lived: it joins the running world again

    def _begin_iteration(self, state: State) -> IterationView:
        """Take ``state``'s place: publish it, reset the monitors, and meet the others at the iteration barrier."""
        was_reserve = self.joining or self.state.mode is Mode.INACTIVE
        active = state.mode is Mode.ACTIVE
        if active and was_reserve and state.iteration:
            self.job_store.record_activation(state.initial_rank or 0, state.iteration)
            event_sink.emit("spare_activated", rank=state.initial_rank, iteration=state.iteration, joined=self.joining)
        self.joining = False  # a member of the world from now on
        self.state = state
        self.mesh = state_mesh(state)
        store = iteration_store(self.base_store, state.iteration)
        self._gate.begin_iteration(state, store)
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
        self.fn_exception = None
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
        return store

    def _run_iteration(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], store: IterationView, state: State
    ) -> tuple[bool, Any]:
        """One iteration; returns ``(True, result)`` on completion, ``(False, None)`` to restart."""
        monitor = self._watch_iteration(store, state)
        try:
            try:
                monitor.start()
                return self._complete(fn, args, kwargs, store, state, monitor)
            except Exception as error:  # noqa: BLE001 - any failure of the iteration restarts it
                self._gate.leave_steps()  # an optimizer step that raised holds the monitor thread's lock
                # From here the main thread runs the Wrapper's own code (store writes over gRPC):
                # no asynchronous restart exception may land in it.
                monitor.hold()
                self._watchdog.reset()  # the Wrapper's code runs now: pings stop by design (RankHooks)
                # The iteration is lost: cut its connections first, here, before the frames the
                # traceback holds (and their process groups) can be freed.
                self._hooks.abort(state)
                restarting = monitor.restart_started.is_set()
                _record_failure(error, store, state, self.step, self.wrapper.barrier_timeout, restarting)
                # Without its traceback (once its origin is recorded: the give-up rule compares them): the
                # frames it holds would keep the failed iteration's process group, and its connections, alive.
                self.fn_exception = error.with_traceback(None)
                del error
                await_restart(monitor, self.wrapper)
        except RankShouldRestart as restart:
            self._watchdog.reset()  # the Wrapper's code runs now: pings stop by design (RankHooks)
            self._gate.leave_steps()
            if not monitor.restart_started.is_set():
                monitor.hold()
                self._hooks.abort(state)
                _record_asked_restart(restart, store, state, self.step, self.wrapper.barrier_timeout)
                self.fn_exception = restart.with_traceback(None)  # recorded with its origin first
                with suppress(RankShouldRestart):
                    await_restart(monitor, self.wrapper)
            monitor.acknowledge()
            self._recovery.start(monitor.restart_started_at)
            self._recovery.mark("unwound")
            log.debug("rank %s: iteration %d interrupted, restarting", state.rank, state.iteration)
            return False, None
        except BaseException as error:  # noqa: BLE001 - any other exit makes this rank leave, then re-raises
            self._gate.leave_steps()
            monitor.stop()
            leaving = error if isinstance(error, _RankLeaves) else _RankLeaves(error, type(error).__name__)
            _leave(store, state, leaving, self.step, self._hooks, self.wrapper.barrier_timeout)
            reason = leaving.release()
            try:
                raise reason from None
            finally:
                # The raised exception's traceback holds this frame: a local naming it would make a cycle.
                del reason, leaving
        raise InternalError("unreachable")

    def _watch_iteration(self, store: IterationView, state: State) -> MonitorThread:
        """The iteration's monitor thread (not started), known to the step gate."""
        wrapper = self.wrapper
        monitor = MonitorThread(
            store,
            state,
            wrapper.abort,
            functools.partial(self._hooks.release_connections, state),
            _secs(wrapper.monitor_thread_interval),
            _secs(wrapper.last_call_wait),
            self.atomic_lock,
            self._process_hooks.interrupt,
            self._timestamps.set_restart_pending,
            planned_bound=self._gate.planned_lead + _PLANNED_GRACE,
            connections_open=self._hooks.connections_open,
        )
        self._monitor = monitor
        self._gate.watched_by(monitor)
        return monitor

    def _complete(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        store: IterationView,
        state: State,
        monitor: MonitorThread,
    ) -> tuple[bool, Any]:
        """Run the iteration to its completion barrier: ``(True, result)`` when every rank completed; a restart
        (``RankShouldRestart``) or the function's exception otherwise."""
        wrapper = self.wrapper
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
                self.wrapper, store, state, self.step, self._fresh, self._groups, self._held_shard, self.mesh
            )
            self._recovery.mark("healed")
            self._fresh = False
            if self.mesh is not None:
                self._held_shard = self.mesh.shard  # healed, held already, or loaded by the function
            result = fn(*args, **kwargs)
            self._watchdog.reset()  # the Wrapper's code runs now: pings stop by design (RankHooks)
            store.mark_any_completed()
        elif state.mode is Mode.INACTIVE:
            # Atomic: a restart that activates this rank waits for the warm-up's end (an import interrupted
            # half-way leaves its module broken), and the work is done when the rank's function needs it.
            with self._gate.atomic():
                warm_up(wrapper.warmup, "it waited in reserve")
            interval = _secs(wrapper.progress_watchdog_interval) / 4
            await_key(store, ANY_COMPLETED, store.any_completed, poll_interval=interval)
        else:
            raise InternalError(
                f"the rank assignment left rank {rank} in mode {state.mode.name}; expected ACTIVE or "
                "INACTIVE (compose an activation such as ActivateAllRanks() into it)"
            )
        outcome = store.arrive_and_wait(COMPLETION_BARRIER, [rank], state.world_size, wrapper.completion_timeout)
        if outcome == COMPLETED:
            monitor.stop()
            self._groups.forget()
            self.job_store.mark_finished()  # joiners still waiting leave
            return True, result
        # Interrupted while this rank waited to complete (a hung rank came back, and the job ran to
        # its end before the restart landed): no fault of this rank's, so none is recorded (it was
        # reported on every rank as an InternalError); the restart under way takes it as the others.
        log.info("rank %s: iteration %d was interrupted as it completed", rank, state.iteration)
        monitor.hold()
        self._hooks.abort(state)
        await_restart(monitor, wrapper)

    def _prepare_restart(self, store: IterationView, state: State) -> State | None:
        """After an interruption: abort, finalize, health check, termination barrier, rank assignment.

        Returns None when the others counted this rank out while it lived
        (its node cut off) and it may join the world again (:meth:`_rejoin`).
        """
        wrapper = self.wrapper
        rank = state.rank or 0
        state = dataclasses.replace(state, fn_exception=self.fn_exception)
        self._hooks.abort(state)
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
            _leave(store, state, leaving, self.step, self._hooks, self.wrapper.barrier_timeout)
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
        assigned = _assigned(self.wrapper, RankAssignmentCtx(next_state, store, set(result.terminated)))
        self._recovery.mark("assigned")
        return assigned

    def _rejoin(self, state: State) -> State | None:
        """The others counted this rank out while it lived: it joins the running world again in this process,
        under a new initial rank, as a respawned process would, and is healed from a peer
        (:meth:`Joining.take_new_initial_rank`). None when the job finished first."""
        new = self._joining.take_new_initial_rank(state)
        world = state.initial_world_size or state.world_size
        set_where(f"rank {new}")
        self.state = State(None, world, initial_rank=new, initial_world_size=world)
        self.joining, self._fresh, self._held_shard = True, True, None
        self._joining.register_when_reported_active(new)
        return self._await_admission()

    def _await_admission(self) -> State | None:
        """A joiner: wait until a restart admits this process, then take its place; None if the job finished."""
        admission = self._joining.await_admission(self.state.initial_rank or 0, self.state.initial_world_size or 1)
        if admission is None:
            log.info(
                "initial rank %s: the job finished before a restart admitted this process", self.state.initial_rank
            )
            return None
        assigned = _assigned(
            self.wrapper, RankAssignmentCtx(admission.state, admission.previous, set(admission.terminated))
        )
        self._recovery.mark("assigned")
        return assigned
