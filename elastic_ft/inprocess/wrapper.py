"""The public Wrapper: ``Wrapper(...)(train)`` adds in-process restart to a training function.

``Wrapper(...)(train)`` returns a function that runs ``train`` on every rank
and, when any rank fails, unwinds it on every rank and calls it again in the
same processes, without the ranks that died or turned unhealthy. A restart
costs a few store round trips and the function's own re-initialisation,
instead of new processes, imports and a rendezvous.

This module holds what a user sees: the arguments, their defaults and the
device checks chained to the health check. The restart machinery is the
engine's (:mod:`elastic_ft.inprocess.restart.call`, one call;
:mod:`elastic_ft.inprocess.restart.iteration`, one iteration); NVIDIA's
module name for it, ``inprocess.wrap``, is this module object, so that
patching the chained checks there (NVIDIA's tests do) changes what the
Wrapper builds.
"""

from __future__ import annotations

import datetime
import functools
import os
import signal
import typing
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from elastic_ft.etcd import accounting
from elastic_ft.handoff import WorkerHandoff
from elastic_ft.inprocess.abort import AbortTorchDistributed
from elastic_ft.inprocess.compose import Compose
from elastic_ft.inprocess.exception import release_frames
from elastic_ft.inprocess.hangs.verdicts import AdaptiveTimeouts
from elastic_ft.inprocess.health_check import ChainedGPUHealthCheck, ChainedNicHealthCheck, ChainedNVLHealthCheck
from elastic_ft.inprocess.rank_assignment.base import RankAssignmentCtx
from elastic_ft.inprocess.rank_assignment.policies import ActivateAllRanks, MaxActiveWorldSize, ShiftRanks
from elastic_ft.inprocess.rank_assignment.segments import SegmentSpares
from elastic_ft.inprocess.restart.arguments import (
    DEFAULT_DURATIONS,
    DEFAULT_LIMITS,
    DEFAULT_MIN_PROGRESS_STEPS,
    apply_job_config_defaults,
    validate_arguments,
)
from elastic_ft.inprocess.restart.call import CallWrapper
from elastic_ft.inprocess.restart.warmup import import_lazy_modules
from elastic_ft.inprocess.state import State
from elastic_ft.inprocess.store import default_store

__all__ = ["CallWrapper", "Wrapper", "chain_health_checks", "default_rank_assignment"]

F = TypeVar("F", bound=Callable[..., Any])
StateHook = Callable[[State], Any]


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
            elastic_ft.shared_utils.wait_daemon PIDFILE`` keeps the step until the
            monitors have recorded the ranks' ends (NVIDIA's 0.6 argument).
        enabled: when false, ``Wrapper(...)(fn)`` returns ``fn`` itself.
        adaptive_timeouts: how the soft and hard timeouts follow the job's
            step times (:class:`~elastic_ft.inprocess.hangs.verdicts.AdaptiveTimeouts`);
            ``None`` keeps them at ``soft_timeout`` and ``hard_timeout``.
        interrupt_signal: the signal that breaks the main thread out of a
            blocking call at a restart (its handler passes the signal on to
            the previous handler otherwise); ``None`` relies on the
            asynchronous exception alone, which waits for the call to return.
        state_dict: returns the training state that is identical on every
            data-parallel replica (model, optimizer, step, RNG, data position),
            kept by the caller outside the wrapped function; given with
            ``load_state_dict``, it turns on peer state healing
            (:mod:`elastic_ft.inprocess.healing.heal`): at the start of every
            iteration after a restart, active ranks behind the others (new,
            respawned, activated, or interrupted before their last optimizer
            step) receive the state of an up-to-date rank before the function
            is called. Named as TorchFT's ``Manager`` names them. It is called
            on every active rank that holds state at each restart (to read
            where its DTensors place it), so it must not communicate.
        load_state_dict: puts a received state back (``load_state_dict(state)``);
            tensors arrive on the CPU, a DTensor as its local shard (a plain
            tensor: copy it into the DTensor's ``to_local()``). A state of
            DTensors is healed by their mesh and placements: a rank receives
            only the shard its coordinate needs, and the next iteration is
            taken to build a mesh of the same shape over its active ranks.
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
            iteration while the others wait for it (:mod:`elastic_ft.inprocess.restart.warmup`).
            The default, :func:`~elastic_ft.inprocess.restart.warmup.import_lazy_modules`,
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
