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

import dataclasses
import datetime
import functools
import gc
import inspect
import json
import os
import pathlib
import re
import threading
import time
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

from elastic_ft import inprocess_logging
from elastic_ft.abort import AbortTorchDistributed
from elastic_ft.compose import Compose
from elastic_ft.exception import (
    BarrierOverflow,
    BarrierTimeout,
    HealthCheckError,
    InternalError,
    RankShouldRestart,
    RestartAbort,
)
from elastic_ft.monitor_process import MonitorConfig, MonitorProcess
from elastic_ft.monitor_thread import MonitorThread
from elastic_ft.progress_watchdog import ProgressTimestamps, ProgressWatchdog
from elastic_ft.rank_assignment import ActivateAllRanks, RankAssignmentCtx, RankAssignmentTimeout, ShiftRanks
from elastic_ft.state import Mode, State
from elastic_ft.store import (
    COMPLETED,
    COMPLETION_BARRIER,
    EXIT_BARRIER,
    INITIAL_BARRIER,
    ITERATION_BARRIER,
    TERMINATION_BARRIER,
    PrefixStore,
    default_store,
    iteration_store,
    job_store,
    poll,
)

log = inprocess_logging.get_logger("wrapper")

F = TypeVar("F", bound=Callable[..., Any])
StateHook = Callable[[State], Any]

_NO_WAIT = datetime.timedelta(0)

#: Exceptions with which the in-process layer gives up on the whole job (every
#: rank gets them alike, or the protocol itself broke), as opposed to a rank
#: leaving alone (failed health check or finalize, discarded by the rank
#: assignment) while the others go on. The node side escalates on these.
GIVE_UP_ERRORS: tuple[type[BaseException], ...] = (
    RestartAbort,
    BarrierTimeout,
    BarrierOverflow,
    InternalError,
    RankAssignmentTimeout,
)


def _seconds(value: datetime.timedelta) -> float:
    return value.total_seconds()


#: The Wrapper's durations (``datetime.timedelta``), all positive but these two.
TIMEOUT_ARGUMENTS = (
    "monitor_thread_interval",
    "monitor_process_interval",
    "progress_watchdog_interval",
    "heartbeat_interval",
    "heartbeat_timeout",
    "soft_timeout",
    "hard_timeout",
    "barrier_timeout",
    "completion_timeout",
    "last_call_wait",
    "termination_grace_time",
)
MAY_BE_ZERO = ("last_call_wait", "termination_grace_time")
#: Pairs (smaller, larger) of durations that must be strictly ordered.
TIMEOUT_ORDER = (
    ("soft_timeout", "hard_timeout"),
    ("hard_timeout", "barrier_timeout"),
    ("heartbeat_interval", "heartbeat_timeout"),
    ("heartbeat_timeout", "barrier_timeout"),
    ("monitor_process_interval", "heartbeat_timeout"),
    ("monitor_process_interval", "soft_timeout"),
    ("monitor_thread_interval", "soft_timeout"),
    ("progress_watchdog_interval", "soft_timeout"),
)


def validate_arguments(arguments: dict[str, Any]) -> None:
    """Check the Wrapper's arguments and the relations between its timeouts.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a value out of range, or timeouts in the wrong order,
            naming the arguments involved.
    """
    for name in TIMEOUT_ARGUMENTS:
        value = arguments[name]
        if not isinstance(value, datetime.timedelta):
            raise TypeError(f"Wrapper {name} must be a datetime.timedelta, got {value!r}")
        may_be_zero = name in MAY_BE_ZERO
        if value < _NO_WAIT or (value == _NO_WAIT and not may_be_zero):
            raise ValueError(f"Wrapper {name} must be {'>= 0' if may_be_zero else 'positive'}, got {value}")
    for name in ("store_factory", "rank_assignment"):
        if not callable(arguments[name]):
            raise TypeError(f"Wrapper {name} must be callable, got {arguments[name]!r}")
    for name in ("initialize", "abort", "finalize", "health_check"):
        if arguments[name] is not None and not callable(arguments[name]):
            raise TypeError(f"Wrapper {name} must be callable or None, got {arguments[name]!r}")
    if arguments["store_kwargs"] is not None and not isinstance(arguments["store_kwargs"], dict):
        raise TypeError(f"Wrapper store_kwargs must be a dict or None, got {arguments['store_kwargs']!r}")
    if not isinstance(arguments["enabled"], bool):
        raise TypeError(f"Wrapper enabled must be a bool, got {arguments['enabled']!r}")
    logfile = arguments["monitor_process_logfile"]
    if logfile is not None:
        if not isinstance(logfile, str) or not pathlib.Path(logfile).is_absolute():
            raise ValueError(f"Wrapper monitor_process_logfile must be an absolute path, got {logfile!r}")
        try:
            logfile.format(rank=0)
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                f"Wrapper monitor_process_logfile may only contain the {{rank}} placeholder, got {logfile!r}"
            ) from error
    for smaller, larger in TIMEOUT_ORDER:
        if not arguments[smaller] < arguments[larger]:
            raise ValueError(
                f"Wrapper needs {smaller} < {larger}, got {smaller}={arguments[smaller]} and {larger}={arguments[larger]}"
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
            The default, :func:`elastic_ft.store.default_store`, is the etcd
            store of the rendezvous round under ``ftrun``, else a TCPStore
            hosted by initial rank 0.
        store_kwargs: keyword arguments of ``store_factory``.
        initialize: run at the start of every iteration (:mod:`elastic_ft.initialize`).
        abort: unblocks the main thread on a fault (:mod:`elastic_ft.abort`).
        finalize: cleans up after a fault (:mod:`elastic_ft.finalize`).
        health_check: local health check (:mod:`elastic_ft.health_check`).
        rank_assignment: renumbers ranks and picks the active ones after a
            fault; default ``Compose(ActivateAllRanks(), ShiftRanks())``.
        monitor_thread_interval: how often the monitor thread polls the store.
        monitor_process_interval: how often the monitor process checks the
            rank's process and progress.
        progress_watchdog_interval: how often the automatic heartbeat is taken.
        heartbeat_interval: how often the monitor process heartbeats into the store.
        heartbeat_timeout: silence after which a rank is reported unresponsive.
        soft_timeout: no progress for this long restarts every rank.
        hard_timeout: no progress for this long terminates the rank's process.
        barrier_timeout: timeout of the initial, iteration and termination barriers.
        completion_timeout: how long ranks that finished wait for the others.
        last_call_wait: how long to wait for concurrent faults before restarting.
        termination_grace_time: time between SIGTERM and SIGKILL at a hard timeout.
        monitor_process_logfile: absolute path of the monitor process's log;
            may contain ``{rank}`` (the initial rank); no log when ``None``.
        enabled: when false, ``Wrapper(...)(fn)`` returns ``fn`` itself.
    """

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
        monitor_thread_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        monitor_process_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        progress_watchdog_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        heartbeat_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        heartbeat_timeout: datetime.timedelta = datetime.timedelta(seconds=30),
        soft_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        hard_timeout: datetime.timedelta = datetime.timedelta(seconds=90),
        barrier_timeout: datetime.timedelta = datetime.timedelta(seconds=120),
        completion_timeout: datetime.timedelta = datetime.timedelta(seconds=120),
        last_call_wait: datetime.timedelta = datetime.timedelta(seconds=1),
        termination_grace_time: datetime.timedelta = datetime.timedelta(seconds=5),
        monitor_process_logfile: str | None = None,
        enabled: bool = True,
    ) -> None:
        arguments = dict(locals())
        del arguments["self"]
        for name, value in _job_config_defaults().items():
            if arguments[name] is _SIGNATURE_DEFAULTS[name]:
                arguments[name] = value
        if arguments["abort"] is None:
            arguments["abort"] = AbortTorchDistributed()
        if arguments["rank_assignment"] is None:
            arguments["rank_assignment"] = Compose(ActivateAllRanks(), ShiftRanks())
        validate_arguments(arguments)
        arguments["store_kwargs"] = dict(arguments["store_kwargs"] or {})
        for name, value in arguments.items():
            setattr(self, name, value)

    def __call__(self, fn: F) -> F:
        if not self.enabled:
            return fn

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with CallWrapper(self) as call_wrapper:
                return call_wrapper(fn, args, kwargs)

        return typing.cast(F, wrapped)


_SIGNATURE_DEFAULTS = {name: p.default for name, p in inspect.signature(Wrapper.__init__).parameters.items()}

#: Set by ``ftrun`` for its workers: the job config (JSON), whose ``wrapper``
#: timeouts and ``rank_assignment`` policy become the Wrapper's defaults.
JOB_CONFIG_ENV = "ELASTIC_FT_JOB_CONFIG"


def _job_config_defaults() -> dict[str, Any]:
    """Defaults from the job config ``ftrun`` passed down; arguments given in code take precedence."""
    text = os.environ.get(JOB_CONFIG_ENV)
    if not text:
        return {}
    from elastic_ft.launcher.job_config import JobConfigError, parse_job_config

    try:
        config = parse_job_config(json.loads(text))
    except (ValueError, JobConfigError) as error:
        raise ValueError(f"{JOB_CONFIG_ENV} holds an invalid job config: {error}") from error
    defaults: dict[str, Any] = {name: datetime.timedelta(seconds=value) for name, value in config.wrapper.items()}
    if config.tree or config.max_active_world_size is not None or config.active_world_size_divisible_by != 1:
        defaults["rank_assignment"] = config.rank_assignment()
    return defaults


class _RankLeaves(BaseException):
    """Internal: this rank leaves the job; ``error`` is what the Wrapper raises to the caller."""

    def __init__(self, error: BaseException, kind: str) -> None:
        super().__init__(kind)
        self.error = error
        self.kind = kind


def _is_call_wrapper_annotation(annotation: Any) -> bool:
    if annotation is CallWrapper:
        return True
    if isinstance(annotation, str):
        # An annotation that could not be resolved (say, CallWrapper imported inside a function).
        words = set(re.findall(r"[A-Za-z_.]+", annotation))
        return bool(words & {"CallWrapper", "elastic_ft.wrapper.CallWrapper"}) and words <= {
            "CallWrapper",
            "elastic_ft.wrapper.CallWrapper",
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


def _export_distributed_env(state: State) -> None:
    """Expose the active rank and world size as the usual ``RANK`` and ``WORLD_SIZE``."""
    if state.mode is Mode.ACTIVE:
        os.environ["RANK"] = str(state.active_rank)
        os.environ["WORLD_SIZE"] = str(state.active_world_size)


class CallWrapper:
    """The restart machinery of one call of a wrapped function.

    The wrapped function receives it in any parameter annotated
    ``CallWrapper`` or ``CallWrapper | None``, to use :meth:`atomic` and
    :meth:`ping` and to read :attr:`iteration` and :attr:`state`.
    """

    def __init__(self, wrapper: Wrapper) -> None:
        inprocess_logging.configure()
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("enter the Wrapper before torch.distributed.init_process_group, not after")
        self.wrapper = wrapper
        self.state = State(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        #: The exception that interrupted the last iteration on this rank, if it was local.
        self.fn_exception: BaseException | None = None
        self.atomic_lock = threading.RLock()
        self._timestamps = ProgressTimestamps()
        # Forked first, while this process has no other thread.
        self._monitor_process = MonitorProcess(
            MonitorConfig(
                initial_rank=self.state.rank or 0,
                initial_world_size=self.state.world_size,
                interval=_seconds(wrapper.monitor_process_interval),
                heartbeat_interval=_seconds(wrapper.heartbeat_interval),
                heartbeat_timeout=_seconds(wrapper.heartbeat_timeout),
                soft_timeout=_seconds(wrapper.soft_timeout),
                hard_timeout=_seconds(wrapper.hard_timeout),
                termination_grace_time=_seconds(wrapper.termination_grace_time),
                logfile=wrapper.monitor_process_logfile,
                log_level=log.getEffectiveLevel(),
            ),
            self._timestamps,
            wrapper.store_factory,
            wrapper.store_kwargs,
        )
        self._watchdog = ProgressWatchdog(self._timestamps, _seconds(wrapper.progress_watchdog_interval))
        self._job_store: PrefixStore | None = None
        try:
            self.base_store = wrapper.store_factory(**wrapper.store_kwargs)
            self._job_store = job_store(self.base_store)
            self._job_store.record_wrapped(self.state.rank or 0, os.getpid())
            self._job_store.arrive_and_wait(
                INITIAL_BARRIER, [self.state.rank or 0], self.state.world_size, wrapper.barrier_timeout
            )
            self._monitor_process.store_ready()
            self._watchdog.start()
            # Everything that exists now (imports, the store's client, the caller's
            # set-up) outlives every iteration: move it out of the collector's way, so
            # the full collection after a fault scans only what iterations created.
            gc.freeze()
        except BaseException:
            self._monitor_process.stop()
            raise

    @property
    def job_store(self) -> PrefixStore:
        if self._job_store is None:
            raise InternalError("the Wrapper's store is not set up")
        return self._job_store

    @property
    def iteration(self) -> int:
        """Index of the current restart iteration (0 for the first call)."""
        return self.state.iteration

    def ping(self) -> None:
        """Report progress by hand.

        After the first ping of an iteration the rank must keep pinging
        within ``soft_timeout`` (and ``hard_timeout``), which catches
        livelocks. A ping also counts as automatic progress, so a helper
        thread may keep a main thread that is busy in one long C call alive.
        """
        self._watchdog.ping()

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """A block the restart never interrupts, and that never starts while a restart is under way.

        The lock is shared with the monitor thread's termination procedure.
        Waiting for it is done in short steps, so that a restart already
        under way can still interrupt the waiting thread.
        """
        while not self.atomic_lock.acquire(timeout=0.001):
            pass
        try:
            yield
        finally:
            self.atomic_lock.release()

    def __enter__(self) -> CallWrapper:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, error: BaseException | None, *_: object) -> None:
        try:
            if self._job_store is not None:
                gave_up = isinstance(error, GIVE_UP_ERRORS)
                kind = "completed" if error is None else type(error).__name__
                self._job_store.record_left(
                    self.state.initial_rank or 0, kind, gave_up, "" if error is None else repr(error)
                )
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Leave the job: the store's hosts wait until every rank has left it."""
        try:
            if self._job_store is not None:
                initial_rank = self.state.initial_rank or 0
                hosts_store = initial_rank in getattr(self.base_store, "critical_ranks", ())
                self._job_store.arrive_and_wait(
                    EXIT_BARRIER,
                    [initial_rank],
                    self.state.initial_world_size or 1,
                    datetime.timedelta.max if hosts_store else _NO_WAIT,
                )
        finally:
            gc.unfreeze()
            self._watchdog.shutdown()
            self._monitor_process.stop()

    # ---- the restart loop ----

    def __call__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        wrapper = self.wrapper
        kwargs = dict(kwargs)
        bound = inspect.signature(fn).bind_partial(*args, **kwargs)
        for name in _call_wrapper_parameters(fn):
            if bound.arguments.get(name) is None:
                bound.arguments[name] = self
        args, kwargs = bound.args, bound.kwargs
        store = iteration_store(self.base_store, 0)
        state = wrapper.rank_assignment(RankAssignmentCtx(self.state, store, set())).state
        while True:
            self.state = state
            store = iteration_store(self.base_store, state.iteration)
            store.set_initial_rank(state.rank or 0, state.initial_rank or 0)
            self.job_store.record_position(state.initial_rank or 0, state.iteration, state.rank or 0, state.world_size)
            self._watchdog.reset()
            self._monitor_process.start_iteration(state.iteration, state.rank or 0, state.world_size)
            _export_distributed_env(state)
            store.arrive_and_wait(ITERATION_BARRIER, [state.rank or 0], state.world_size, wrapper.barrier_timeout)
            log.debug("rank %s: iteration %d starts as %s", state.rank, state.iteration, state.mode.name)
            completed, result = self._run_iteration(fn, args, kwargs, store, state)
            if completed:
                log.debug("rank %s: iteration %d completed", state.rank, state.iteration)
                return result
            state = self._prepare_restart(store, state)

    def _run_iteration(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], store: PrefixStore, state: State
    ) -> tuple[bool, Any]:
        """One iteration; returns ``(True, result)`` on completion, ``(False, None)`` to restart."""
        wrapper = self.wrapper
        rank = state.rank or 0
        monitor = MonitorThread(
            store,
            state,
            wrapper.abort,
            _seconds(wrapper.monitor_thread_interval),
            _seconds(wrapper.last_call_wait),
            self.atomic_lock,
        )
        try:
            try:
                monitor.start()
                if wrapper.initialize is not None:
                    wrapper.initialize(state)
                self._check_health(state)
                result = None
                if state.mode is Mode.ACTIVE:
                    result = fn(*args, **kwargs)
                    store.mark_any_completed()
                else:
                    poll(store.any_completed, None, interval_max=_seconds(wrapper.progress_watchdog_interval) / 4)
                outcome = store.arrive_and_wait(
                    COMPLETION_BARRIER,
                    [rank],
                    state.world_size,
                    wrapper.completion_timeout,
                )
                if outcome == COMPLETED:
                    monitor.stop()
                    return True, result
                raise InternalError("the iteration was interrupted while this rank waited to complete")
            except Exception as error:  # noqa: BLE001 - any failure of the iteration restarts it
                # Without its traceback: the frames it holds would keep the failed
                # iteration's process group, and so its connections, alive.
                self.fn_exception = error.with_traceback(None)
                log.error("rank %s: iteration %d failed: %r", rank, state.iteration, error)
                store.record_interruption(rank, type(error).__name__, repr(error))
                self._await_restart(monitor)
        except RankShouldRestart:
            monitor.acknowledge()
            log.info("rank %s: iteration %d interrupted, restarting", rank, state.iteration)
            return False, None
        except BaseException as error:  # noqa: BLE001 - any other exit makes this rank leave, then re-raises
            monitor.stop()
            leaving = error if isinstance(error, _RankLeaves) else _RankLeaves(error, type(error).__name__)
            self._leave(store, state, leaving)
            raise leaving.error from None
        raise InternalError("unreachable")

    def _await_restart(self, monitor: MonitorThread) -> None:
        """Wait in Python code for the monitor thread's RankShouldRestart."""
        monitor.wake()
        wrapper = self.wrapper
        patience = _seconds(wrapper.last_call_wait) + 3 * _seconds(wrapper.monitor_thread_interval) + 30.0
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline or monitor.restart_started.is_set():
            time.sleep(0.001)
        raise InternalError(f"the monitor thread did not start a restart within {patience:g} s")

    def _check_health(self, state: State) -> None:
        if self.wrapper.health_check is None:
            return
        try:
            self.wrapper.health_check(state)
        except Exception as error:
            health_error = HealthCheckError(f"rank {state.rank} failed its health check: {error!r}")
            health_error.__cause__ = error
            raise _RankLeaves(health_error, "health_check") from error

    def _leave(self, store: PrefixStore, state: State, leaving: _RankLeaves) -> None:
        """Record this rank as gone from the iteration, so the others restart without it."""
        rank = state.rank or 0
        log.error("rank %s leaves the job in iteration %d: %r", rank, state.iteration, leaving.error)
        try:
            store.record_interruption(rank, leaving.kind, repr(leaving.error))
            store.record_terminated([rank])
            store.arrive_and_wait(ITERATION_BARRIER, [rank], state.world_size, _NO_WAIT)
            store.arrive_and_wait(TERMINATION_BARRIER, [rank], state.world_size, _NO_WAIT)
        finally:
            self._abort(state)

    def _abort(self, state: State) -> None:
        if self.wrapper.abort is None:
            return
        try:
            self.wrapper.abort(state)
        except Exception:
            log.exception("rank %s: abort failed", state.rank)

    def _prepare_restart(self, store: PrefixStore, state: State) -> State:
        """After an interruption: abort, finalize, health check, termination barrier, rank assignment."""
        wrapper = self.wrapper
        rank = state.rank or 0
        self._abort(state)
        # Free what the unwound function left in reference cycles, above all its process
        # groups: a group's connections close only when it is freed, and peers blocked in
        # a collective with this rank unblock only then.
        gc.collect()
        try:
            try:
                if wrapper.finalize is not None:
                    wrapper.finalize(state)
            except Exception as error:
                raise _RankLeaves(error, "finalize") from error
            self._check_health(state)
        except _RankLeaves as leaving:
            self._leave(store, state, leaving)
            raise leaving.error from None
        payload = store.arrive_and_wait(
            TERMINATION_BARRIER,
            [rank],
            state.world_size,
            wrapper.barrier_timeout,
        )
        terminated = set(json.loads(payload or "[]"))
        if terminated:
            log.info("rank %s: ranks %s left the job in iteration %d", rank, sorted(terminated), state.iteration)
        next_state = dataclasses.replace(state, iteration=state.iteration + 1)
        return wrapper.rank_assignment(RankAssignmentCtx(next_state, store, terminated)).state
