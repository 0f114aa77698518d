"""The monitor process: a per-rank guardian that outlives the rank's main process.

The Wrapper forks it at entry, before any thread or process group exists.
It runs in its own session, with its standard streams on ``/dev/null`` and
its log only in ``monitor_process_logfile``, and talks to the job only
through its own connection to the store. It

* heartbeats the rank into the store and watches the heartbeats of the other
  ranks (:mod:`elastic_ft.inprocess.sibling_monitor`), reporting silent ones;
* reports the rank as terminated the moment its main process dies (it waits
  on a ``pidfd``, not a timer), arriving at the barriers on its behalf so
  that the other ranks restart without it;
* judges stalls (:mod:`elastic_ft.inprocess.hangs.verdicts`) from the
  heartbeats and timeouts in shared memory
  (:mod:`elastic_ft.inprocess.hangs.heartbeats`), the rank's CPU use and
  process state, and the other ranks' activity published with their
  heartbeats: a restart records an interruption (every rank restarts); a
  kill reports the rank terminated and stops the process with
  SIGCONT+SIGTERM, then after ``termination_grace_time`` SIGCONT+SIGTERM+SIGKILL.

The main process drives it with JSON lines on a pipe: ``store_ready``,
``iteration`` (number, rank, world size), ``initial_rank`` (the rank joins
the world again under a new one) and ``stop``; and waits on the monitor's
``pidfd`` in turn: a monitor that ends before ``stop`` ends the rank
(:func:`leave_without_hang_protection`), which its launcher replaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from elastic_ft.coordination.barriers import NO_WAIT
from elastic_ft.coordination.fault_records import Heartbeat, PeerLook
from elastic_ft.coordination.iteration import COMPLETED, IterationView, iteration_store, report_rank_gone
from elastic_ft.coordination.job import JobView, job_store, joined_ranks
from elastic_ft.coordination.reports import report_process_gone
from elastic_ft.etcd.accounting import on_behalf_of, set_role
from elastic_ft.etcd.kv import EtcdRequestError
from elastic_ft.etcd.outage import OUTAGES, bounded, patiently
from elastic_ft.inprocess.hangs.heartbeats import ProgressTimestamps
from elastic_ft.inprocess.hangs.resends import ResendProbe
from elastic_ft.inprocess.hangs.verdicts import (
    RankActivity,
    StallAction,
    StalledRank,
    StallVerdict,
    Timeouts,
    hang_culprit,
    heartbeat_period,
    judge_stall,
    notice_pending,
    overdue_for,
    overdue_slack,
    peer_read_period,
    select_evidence,
    stall_notice_after,
)
from elastic_ft.inprocess.restart.events import close_events, install_store_events
from elastic_ft.inprocess.restart.logs import get_logger, log_to_file
from elastic_ft.inprocess.sibling_monitor import ring_successor, silent_ranks
from elastic_ft.inprocess.store import close_store, forbid_hosting
from elastic_ft.keys import EXIT_BARRIER
from elastic_ft.observability.sink import EventSink, emit, installed
from elastic_ft.runtime.reaper import describe_exit, process_is_alive
from elastic_ft.runtime.waits import Backoff, aligned_instant, pause, poll

log = get_logger("monitor_process")


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """What the monitor process needs to know; times in seconds."""

    initial_rank: int
    initial_world_size: int
    interval: float
    heartbeat_interval: float
    heartbeat_timeout: float
    soft_timeout: float
    hard_timeout: float
    termination_grace_time: float
    #: Silence of every Python thread of the rank after which its GIL is held for good.
    gil_held_limit: float
    logfile: str | None
    #: Where the monitor appends its PID when it starts (``Wrapper(monitor_process_pidfile=...)``).
    pidfile: str | None
    log_level: int


#: Makes the rank write every thread's stack to its stderr (``faulthandler``) before it is terminated.
STACK_DUMP_SIGNAL = signal.SIGRTMIN + 1

#: A rank's main thread (with its data loader workers) using more than this share of a core is working.
BUSY_CPU_SHARE = 0.1
#: How often the rank's CPU use (and its resends) are sampled: the end of its work is seen this late at most,
#: which the hang detection adds to the soft timeout. CPU time comes in clock ticks (10 ms), so a window this
#: short still tells 20 ms of work from none.
_CPU_SAMPLE_PERIOD = 0.1
#: A rank that made progress or used CPU this recently is active, whatever its network: the automatic progress
#: heartbeat and the CPU meter each refresh once a period, so a working rank's latest sign is up to two old.
_SEEN_ACTIVE_WITHIN = 2 * _CPU_SAMPLE_PERIOD
_STACK_DUMP_PAUSE = 0.05
#: A ring check rides on the first heartbeat at least this share of a heartbeat interval after the last check:
#: on every heartbeat at the interval, on one in four while a rank without progress heartbeats four times faster.
_CHECK_SPACING = 0.75
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def beat_due(now: float, last: float, next_due: float, period: float, notice_owed: bool = False) -> bool:
    """Whether a heartbeat is due at ``now``: the last one (sent at ``last``) promised ``next_due``, and the period
    may have shortened since (a rank working without progress heartbeats faster); at once when a stall notice is
    owed (``notice_owed``: the last one promised it and the rank has been inactive that long since).

    The earlier instant is the next multiple of the current period after ``last`` (``aligned_instant``), never
    ``last + period``: a beat that was late by over half a period would then stay that far off its host's
    others for good, and the node relay would write the host's heartbeats in two requests a second, not one.
    A wall clock set back past ``last`` makes a beat due at once, not after the jump. Every monitor process of
    the job heartbeats at the same instants, so that the node relay writes its host's heartbeats in one
    transaction (:mod:`elastic_ft.etcd.node_relay`); each heartbeat promises its next instant, so no peer reads
    it as late.
    """
    if notice_owed or now < last or last == -math.inf:
        return True
    return now >= min(next_due, aligned_instant(last, period))


def aligned_check(now: float, period: float) -> float:
    """When the look at the peers after one at ``now`` is due (a hang verdict's): half a period off the
    heartbeats' instants, so that the host's looks read together (one read through the node relay) and read
    the beats just written."""
    return (math.floor(now / period - 0.5) + 1.5) * period


def _stat_fields(pid: int, thread: int | None = None) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` (of one ``thread``'s, ``/proc/<pid>/task/<thread>/stat``) after the
    command name; None once the process is gone."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        with open(path) as stat:
            return stat.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_is_stopped(pid: int) -> bool:
    """True while ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP) or a tracer."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in ("T", "t")


def cpu_seconds(pid: int, exclude: int) -> float:
    """CPU time used by the main thread of ``pid`` and by the children it started (data loader workers), but
    ``exclude``.

    The main thread's, not the process's: the rank's other threads are
    machinery (gloo's transport loop, gRPC, the Wrapper's own threads) whose
    CPU use says nothing of the rank's progress. A gloo loop thread was seen
    spinning at a full core under a rank that waited in DDP's backward, which
    made that rank look busy, and the whole job wait for the configured soft
    timeout (60 s) for a hang elsewhere. A computation in C runs on the main
    thread (and an OpenMP team includes it).
    """
    total = 0.0
    for fields in _work_stats(pid, exclude):
        total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return total


def wants_cpu(pid: int, exclude: int) -> bool:
    """Whether the main thread of ``pid`` or a child it started (but ``exclude``) is running or waiting for a core
    now (state ``R``): working, however little CPU a saturated host gave it. A rank that waits (in a collective,
    a lock, a sleep) sleeps in the kernel instead."""
    return any(fields[0] == "R" for fields in _work_stats(pid, exclude))


def _work_stats(pid: int, exclude: int) -> list[list[str]]:
    """The stat fields of the rank's working threads: its main thread and its children (data loader workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            workers = [int(child) for child in children.read().split() if int(child) != exclude]
    except OSError:
        workers = []
    found = (_stat_fields(pid, thread=pid), *(_stat_fields(worker) for worker in workers))
    return [fields for fields in found if fields is not None]


def terminate_process(pid: int, grace_time: float) -> None:
    """SIGCONT+SIGTERM; if still alive after ``grace_time``, SIGCONT+SIGTERM+SIGKILL."""
    for signals in ((signal.SIGCONT, signal.SIGTERM), (signal.SIGCONT, signal.SIGTERM, signal.SIGKILL)):
        for sig in signals:
            log.info("sending %s to %d", sig.name, pid)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
        if poll(lambda: not process_is_alive(pid), grace_time, interval_max=0.01):
            return
    poll(lambda: not process_is_alive(pid), None, interval_max=0.01)


def after_store_ready(messages: list[dict[str, Any]]) -> tuple[bool, list[dict[str, Any]] | None]:
    """Before the store is ready: (stop requested, the messages that followed ``store_ready``, None if none came).

    The messages after ``store_ready`` in the same read (an ``iteration``,
    when the monitor process woke late) must be kept, or the monitor would
    never learn which iteration its rank is in.
    """
    for index, message in enumerate(messages):
        if message["type"] == "stop":
            return True, None
        if message["type"] == "store_ready":
            return False, messages[index + 1 :]
    return False, None


def _in_iteration(position: dict[str, int] | None, iteration: int) -> bool:
    """Whether a peer whose last published position is ``position`` may be in ``iteration``: not when it last
    started an earlier one (None: it has published none yet, so it cannot be ruled out)."""
    return position is None or position["iteration"] >= iteration


def _append_pid(path: str) -> None:
    """Append this process's PID to ``path``, a line (one write: lines of several monitors never mix)."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as error:
        log.warning("cannot write the monitor process's PID to %s: %s", path, error)
        return
    try:
        os.write(descriptor, f"{os.getpid()}\n".encode())
    finally:
        os.close(descriptor)


def _log_refusal(error: Exception, last: str) -> str:
    """Log an etcd refusal the monitor process retries after, unless it is the one logged last; returns it."""
    if str(error) != last:
        log.warning("etcd refused a request of the monitor process: %s; trying again", error)
    return str(error)


class MonitorProcess:
    """Handle, in the main process, on the forked monitor process.

    A thread of the main process waits on the monitor's ``pidfd``: a monitor that ends before the rank stopped
    it (killed, crashed) would leave the rank without hang protection and without anyone to report its death,
    so ``on_lost`` runs at once (by default, :func:`leave_without_hang_protection`).

    Args:
        config: see :class:`MonitorConfig`.
        timestamps: the progress heartbeats shared with the main process.
        store_factory: builds the monitor's own store connection.
        store_kwargs: keyword arguments of ``store_factory``.
        on_lost: called with the monitor's pid, how it ended and the rank's initial rank, if it ends before
            :meth:`stop`.
    """

    def __init__(
        self,
        config: MonitorConfig,
        timestamps: ProgressTimestamps,
        store_factory: Callable[..., dist.Store],
        store_kwargs: dict[str, Any],
        on_lost: Callable[[int, str, int], None] | None = None,
    ) -> None:
        target_pid = os.getpid()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_stderr = _detach(keep=read_end)
                _Monitor(config, timestamps, store_factory, store_kwargs, target_pid, read_end, rank_stderr).run()
            except BaseException:
                log.exception("monitor process failed")
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)
        os.close(read_end)
        self.pid = pid
        self._pipe = os.fdopen(write_end, "w", buffering=1)
        self._stopping = threading.Event()
        self._initial_rank = config.initial_rank
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # Linux before 5.3: the rank cannot wait on its monitor
            log.debug("no pidfd for monitor process %d: its death goes unwatched", pid)
        else:
            lost = on_lost or leave_without_hang_protection
            threading.Thread(target=self._watch, args=(pidfd, lost), name="eft-monitor-watch", daemon=True).start()

    def _watch(self, pidfd: int, on_lost: Callable[[int, str, int], None]) -> None:
        """Wait for the monitor process to end; unless the rank stopped it, report how it ended to ``on_lost``."""
        try:
            select.select([pidfd], [], [])
        finally:
            os.close(pidfd)
        if self._stopping.is_set():
            return
        try:
            _, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            how = "ended"
        else:
            code = os.waitstatus_to_exitcode(status) if status else 0
            how = describe_exit(code)
        on_lost(self.pid, how, self._initial_rank)

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._pipe.write(json.dumps(message) + "\n")
        except (BrokenPipeError, ValueError):
            log.warning("monitor process %d is gone; message %s dropped", self.pid, message)

    def store_ready(self) -> None:
        """The store exists (its host is up): the monitor may connect."""
        self._send({"type": "store_ready"})

    def take_initial_rank(self, initial_rank: int) -> None:
        """The rank holds a new initial rank from now on: heartbeat and report it under that one."""
        self._initial_rank = initial_rank
        self._send({"type": "initial_rank", "initial_rank": initial_rank})

    def start_iteration(self, iteration: int, rank: int, world_size: int, active: bool = True) -> None:
        self._send(
            {"type": "iteration", "iteration": iteration, "rank": rank, "world_size": world_size, "active": active}
        )

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the monitor to exit and reap it."""
        self._stopping.set()
        self._send({"type": "stop"})
        with contextlib.suppress(OSError):  # the monitor is gone: the buffered message cannot be flushed
            self._pipe.close()
        if not poll(self._reaped, timeout, interval_max=0.005):
            log.warning("monitor process %d did not exit in %g s", self.pid, timeout)

    def _reaped(self) -> bool:
        """Whether the monitor process has exited (and is reaped now)."""
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return True
        return pid != 0


MONITOR_PROCESS_NAME = "eft-monitor"

#: The exit code of a rank whose monitor process ended under it (EX_SOFTWARE): its launcher replaces it (``ftrun``
#: respawns it, and the others restart in-process) or restarts the workers (``torchrun``).
MONITOR_LOST_EXIT_CODE = 70


def leave_without_hang_protection(pid: int, how: str, initial_rank: int) -> None:
    """The monitor process ``pid`` of ``initial_rank`` ended (``how``) before the rank stopped it: end the rank.

    Without its monitor the rank is protected from no hang, and its death would be reported by nobody; a
    replacement gets a monitor of its own. The rank's launcher sees an ordinary death: ``ftrun`` respawns it
    (the other ranks restart in-process), ``torchrun`` restarts the workers.
    """
    log.error(
        "monitor process %d ended (%s): this rank would run on without hang protection; it exits with code %d "
        "so that its launcher replaces it",
        pid,
        how,
        MONITOR_LOST_EXIT_CODE,
    )
    emit("fault_detected", rank=initial_rank, kind="monitor_lost", message=f"monitor process {pid}: {how}")
    close_events(installed(), timeout=2.0)
    logging.shutdown()
    os._exit(MONITOR_LOST_EXIT_CODE)


def _detach(keep: int) -> int:
    """Leave the parent's session, take the name ``eft-monitor`` and drop every inherited descriptor but ``keep``.

    Returns a descriptor of the rank's stderr: the same open file, so a line written there takes the rank's
    own file offset. Opening ``/proc/<rank>/fd/2`` anew would not: in a log file (torchrun's ``--redirects``),
    the rank's next write, its stack dump, landed on that line and erased it. Returns -1 if the rank has no
    stderr (it closed it): the monitor then runs without writing there.
    """
    os.setsid()
    # The name ps and top show, so operators (and benchmarks/recovery.py) can tell it from the rank.
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(MONITOR_PROCESS_NAME)
    try:
        rank_stderr = os.dup(2)
    except OSError:
        rank_stderr = -1
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    low = 3
    for kept in sorted(fd for fd in (keep, rank_stderr) if fd >= 0):
        os.closerange(low, kept)
        low = kept + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return rank_stderr


@dataclasses.dataclass
class _Iteration:
    number: int
    rank: int
    world_size: int
    store: IterationView
    #: When this rank's monitor asked for a restart of the iteration (``time.monotonic()``; None: it did not).
    restart_requested_at: float | None = None
    #: The rank runs the function (False: a reserve rank, which waits).
    active: bool = True
    #: Why the rank, without progress for its soft timeout, is left alone (logged when it changes).
    waits_because: str = ""
    #: The iteration's hang judge (its rank 0) published that it judges (``PeerLook`` without a look).
    announced: bool = False


class _CpuMeter:
    """When the rank last worked (used CPU, or was runnable and waited for a core), sampled every
    ``_CPU_SAMPLE_PERIOD`` (``time.monotonic()``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._sampled_at = time.monotonic()
        self._used = cpu_seconds(pid, os.getpid())
        self.busy_at = self._sampled_at

    def sample(self, now: float) -> None:
        elapsed = now - self._sampled_at
        if elapsed < _CPU_SAMPLE_PERIOD:
            return
        used = cpu_seconds(self.pid, os.getpid())
        # Starved of CPU on a saturated host, a computing rank uses little but stays runnable: still working.
        if (used - self._used) / elapsed > BUSY_CPU_SHARE or wants_cpu(self.pid, os.getpid()):
            self.busy_at = now
        self._used, self._sampled_at = used, now


class _NetworkMeter:
    """When the rank last resent data the network lost (:class:`~elastic_ft.inprocess.hangs.resends.ResendProbe`),
    sampled every ``_CPU_SAMPLE_PERIOD`` while nothing cheaper shows the rank active.

    Resends only matter while the rank neither makes progress nor uses CPU (:attr:`RankActivity.inactive_for` is
    the least of the three), so a rank seen active within ``_SEEN_ACTIVE_WITHIN`` is not sampled: its inactivity
    is then off by that much at most, far below any timeout it is judged by.
    """

    def __init__(self, pid: int) -> None:
        self.probe = ResendProbe(pid)
        self._sampled_at = -math.inf
        self.busy_at = -math.inf

    def sample(self, now: float, otherwise_inactive_for: float) -> None:
        """``otherwise_inactive_for``: since the rank last made progress or used CPU, in seconds."""
        if otherwise_inactive_for < _SEEN_ACTIVE_WITHIN or now - self._sampled_at < _CPU_SAMPLE_PERIOD:
            return
        self._sampled_at = now
        if self.probe.resending(now):
            self.busy_at = now


@dataclasses.dataclass
class _Beats:
    """The monitor's heartbeat schedule: the last heartbeat's time and the next one it promised (the next is sent at
    the shorter of that period and the one the rank's activity asks for now: a rank that starts working without
    progress heartbeats faster at once, and none comes later than promised); whether it promised a stall notice
    (the next then comes as soon as the rank has been inactive for ``stall_notice_after``); when the ring check is
    next due; and the last refusal logged (each new one once)."""

    last: float = -math.inf
    next_due: float = -math.inf
    notice_promised: bool = False
    next_check: float = 0.0
    refused: str = ""


class _Monitor:
    """The loop of the monitor process."""

    def __init__(
        self,
        config: MonitorConfig,
        timestamps: ProgressTimestamps,
        store_factory: Callable[..., dist.Store],
        store_kwargs: dict[str, Any],
        target_pid: int,
        pipe: int,
        rank_stderr: int,
    ) -> None:
        self.config = config
        self.rank_stderr = rank_stderr
        self.timestamps = timestamps
        self.store_factory = store_factory
        self.store_kwargs = store_kwargs
        self.target_pid = target_pid
        self.pipe = pipe
        self.buffer = b""
        self.pipe_open = True
        self.iteration: _Iteration | None = None
        self.reported_silent: set[int] = set()
        self.pidfd = self._open_pidfd(target_pid)
        self.cpu = _CpuMeter(target_pid)
        self.network = _NetworkMeter(target_pid)
        self._peers: tuple[float, float | None] = (-float("inf"), None)  # (read at, inactive for then)
        #: The peer whose heartbeat was overdue at the last read, and by how long then (None: none was).
        self._overdue_peer: tuple[int, float] | None = None
        #: A peer whose stall notice could still come at the last read (None: none could).
        self._unheard_peer: int | None = None
        #: The other active ranks, as their heartbeats last read said.
        self._stalled_peers: list[StalledRank] = []
        #: The initial rank whose heartbeat was the latest active one, as last read.
        self._latest_active_peer: int | None = None
        #: The joiners admitted so far, as read in iteration ``[0]``.
        self._joined: tuple[int, list[int]] | None = None
        #: The initial rank of the hang judge of iteration ``[0]`` (learned from its look; -1: none yet).
        self._judge_rank: tuple[int, int] = (-1, -1)
        self.events: EventSink | None = None

    @staticmethod
    def _open_pidfd(pid: int) -> int | None:
        """A descriptor that becomes readable when ``pid`` exits (Linux 5.3+), else None (polling)."""
        try:
            return os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None

    def run(self) -> None:
        config = self.config
        logfile = config.logfile.format(rank=config.initial_rank) if config.logfile else None
        log_to_file(logfile, config.log_level)
        set_role("monitor process")
        log.info("monitoring target_pid=%d as initial rank %d", self.target_pid, config.initial_rank)
        if config.pidfile:
            _append_pid(config.pidfile.format(rank=config.initial_rank))
        while True:
            stopped, early = after_store_ready(self._receive(config.interval))
            if stopped:
                return
            if early is not None:
                break
            if not process_is_alive(self.target_pid):
                log.info("target died before the store was ready")
                return
        forbid_hosting()
        base_store = self.store_factory(**self.store_kwargs)
        self.events = install_store_events(base_store)
        try:
            self._watch(base_store, early)
        finally:
            close_events(self.events, timeout=2.0)
            close_store(base_store)
            self.network.probe.close()

    def _watch(self, base_store: dist.Store, early: list[dict[str, Any]]) -> None:
        """The monitor's loop once the store is ready, until the rank leaves or the main process stops it."""
        config = self.config
        job = job_store(base_store)
        watching_since = time.time()
        beats = _Beats()
        backoff = Backoff()
        # The first pass waits for no message: the first heartbeat goes out at once (a joiner registers only
        # once its monitor's heartbeat is in the store).
        wait = 0.0
        while True:
            messages, early = [*early, *self._receive(0.0 if early else wait)], []
            wait = config.interval
            taken = self._take(messages, base_store)
            if taken == "stop":
                return
            if taken == "rejoined":
                beats = dataclasses.replace(_Beats(), next_check=beats.next_check, refused=beats.refused)
            if not process_is_alive(self.target_pid):
                self._report_terminated(base_store, "terminated", f"process {self.target_pid} died")
                return
            monotonic_now, now = time.monotonic(), time.time()
            # Read before the rank's progress: an unprotected section it left meanwhile wrote fresh progress.
            unprotected = self.timestamps.unprotected()
            activity = self._activity(monotonic_now)
            timeouts = self._timeouts()
            # etcd away: the rank trains on; its death is still seen (pidfd), and reported once etcd answers.
            look, unreachable = self._beat(job, now, activity, timeouts, beats)
            try:
                # A look waits for etcd a heartbeat interval at most: the loop stays free to see the rank die.
                with bounded(max(1.0, config.heartbeat_interval), "a look of the monitor process"):
                    if look is not None:
                        self._check_ring(job, now, watching_since, *look)
                    iteration = None if unprotected else self.iteration
                    if iteration is not None and self._judge(base_store, job, iteration, activity, timeouts):
                        return
            except ConnectionError:
                unreachable = True
            except EtcdRequestError as error:
                beats.refused = _log_refusal(error, beats.refused)
                unreachable = True
            if unreachable:
                early = self._receive(backoff.next())  # what the main process says meanwhile is handled next
            else:
                backoff.reset()

    def _beat(
        self, job: JobView, now: float, activity: RankActivity, timeouts: Timeouts, beats: _Beats
    ) -> tuple[tuple[int, tuple[bool, Heartbeat | None]] | None, bool]:
        """The heartbeat, when one is due, with the ring check riding on it: the ring's look (its successor and
        what was read of it), and whether etcd was unreachable (or refused)."""
        config = self.config
        period = heartbeat_period(activity, timeouts.soft, config.heartbeat_interval)
        notice_after = stall_notice_after(timeouts.soft)
        stalled = beats.notice_promised and activity.inactive_for >= notice_after
        if not beat_due(now, beats.last, beats.next_due, period, stalled):
            return None, False
        beats.last, beats.next_due = now, aligned_instant(now, period)
        # The ring check rides on a heartbeat, once a heartbeat interval: one request for both.
        successor = self._ring_successor() if now >= beats.next_check and OUTAGES.down_since() is None else None
        reserve = self.iteration is not None and not self.iteration.active
        notice = not reserve and activity.inactive_for < notice_after
        # Unsent (etcd away), a promised notice is still owed: it is sent again at the next pass.
        beats.notice_promised = notice or stalled
        try:
            seen = self._heartbeat(job, now - activity.inactive_for, reserve, beats.next_due - now, successor, notice)
        except ConnectionError:
            return None, True
        except EtcdRequestError as error:  # a refusal ends no watch: the monitor goes on guarding its rank
            beats.refused = _log_refusal(error, beats.refused)
            return None, True
        beats.notice_promised = notice
        if successor is None or seen is None:
            return None, False
        beats.next_check = now + _CHECK_SPACING * config.heartbeat_interval
        return (successor, seen), False

    def _take(self, messages: list[dict[str, Any]], base_store: dist.Store) -> str:
        """Act on the main process's messages: ``"stop"`` when told to stop, ``"rejoined"`` when the rank took a
        new initial rank, else ``""``."""
        taken = ""
        for message in messages:
            if message["type"] == "stop":
                log.info("stopped by the main process")
                return "stop"
            if message["type"] == "iteration":
                number = message["iteration"]
                self.iteration = _Iteration(
                    number,
                    message["rank"],
                    message["world_size"],
                    iteration_store(base_store, number),
                    active=message.get("active", True),
                )
                log.info("iteration %d: rank %d of %d", number, message["rank"], message["world_size"])
            if message["type"] == "initial_rank":
                # The rank was counted out while it lived and joins the world again under a new one.
                self.config = dataclasses.replace(self.config, initial_rank=int(message["initial_rank"]))
                self.iteration, self.reported_silent = None, set()
                taken = "rejoined"
                log.info("the rank joins the running world again as initial rank %d", self.config.initial_rank)
        return taken

    def _heartbeat(
        self, job: JobView, active_at: float, reserve: bool, next_in: float, ring: int | None, notice: bool
    ) -> tuple[bool, Heartbeat | None] | None:
        """One heartbeat, the next due ``next_in`` seconds later (or sooner, a stall notice, if ``notice``), waiting
        at most a heartbeat interval for etcd: the loop must stay free to see the rank die or stall (a heartbeat
        that etcd's absence loses is no fault: the next one follows). ``ring``: the ring successor whose records
        the same request reads (``LivenessRecords.send_heartbeat``), returned."""
        with bounded(self.config.heartbeat_interval, "a heartbeat interval"), on_behalf_of("heartbeat"):
            return job.liveness.send_heartbeat(
                self.config.initial_rank, active_at, self.timestamps.waiting(), reserve, next_in, ring, notice
            )

    def _activity(self, now: float) -> RankActivity:
        """What the monitor sees of the rank at ``now`` (``time.monotonic()``), its meters sampled first."""
        self.cpu.sample(now)
        progress_age = self.timestamps.age()
        self.network.sample(now, min(progress_age, now - self.cpu.busy_at))
        return RankActivity(
            progress_age=progress_age,
            cpu_idle_for=now - self.cpu.busy_at,
            network_idle_for=now - self.network.busy_at,
            stopped=process_is_stopped(self.target_pid),
            threads_silent_for=self.timestamps.threads_silent_for(),
            restart_pending_for=self.timestamps.restart_pending_for(),
        )

    def _timeouts(self) -> Timeouts:
        config = self.config
        soft, hard = self.timestamps.timeouts()
        warming_up = self.timestamps.warming_up()
        if self.timestamps.in_long_section():
            soft, hard, warming_up = config.soft_timeout, config.hard_timeout, False
        return Timeouts(
            soft, hard, config.soft_timeout, config.hard_timeout, self.timestamps.delivery_bound(), warming_up
        )

    def _judge(
        self,
        base_store: dist.Store,
        job: JobView,
        iteration: _Iteration,
        activity: RankActivity,
        timeouts: Timeouts,
    ) -> bool:
        """Act on a stall of the rank (``activity``, sampled outside any unprotected section); True once the rank
        was terminated."""
        if self.timestamps.unprotected():
            return False  # the function turned this rank's hang protection off (disable_hang_protection)
        config = self.config
        peers = None
        requested = iteration.restart_requested_at
        requested_for = None if requested is None else time.monotonic() - requested
        read_period = peer_read_period(timeouts.soft, config.heartbeat_interval)
        judge = iteration.rank == 0 and iteration.active
        # The judge's work for the others never holds this rank's own verdict: etcd away, it is tried again at
        # the next pass, and a stopped or wedged rank is still killed meanwhile.
        if judge and not iteration.announced:
            # The other monitors learn who judges from the look, before the first one: while this rank is active
            # they read its heartbeat, not every peer.
            with contextlib.suppress(ConnectionError, EtcdRequestError):
                job.liveness.publish_peer_look(PeerLook(iteration.number, config.initial_rank))
                iteration.announced = True
        if activity.inactive_for >= timeouts.soft and requested_for is None:
            peers = self._peers_inactive_for(job, read_period, activity)
        elif judge and activity.inactive_for >= timeouts.soft / 2:
            # The judge looks from half its soft timeout on: the others, stalled for theirs, find a fresh look.
            with contextlib.suppress(ConnectionError, EtcdRequestError):
                self._peers_inactive_for(job, read_period, activity)
        overdue = None if peers is None or self._overdue_peer is None else self._overdue_peer[1]
        unheard = peers is not None and self._unheard_peer is not None
        verdict = judge_stall(activity, timeouts, config.gil_held_limit, peers, requested_for, overdue, unheard)
        self._log_wait_reason(iteration, verdict)
        if verdict.action is StallAction.RESTART:
            self._report_hang(job, iteration, activity, verdict.reason)  # etcd away: asked again at the next look
            iteration.restart_requested_at = time.monotonic()
        elif verdict.action is StallAction.KILL:
            kind = "stopped" if activity.stopped else "hard_timeout"
            if activity.restart_pending_for >= timeouts.delivery:
                kind = "restart_blocked"
            self._terminate(base_store, iteration, activity, kind, verdict.reason)
            return True
        return False

    def _log_wait_reason(self, iteration: _Iteration, verdict: StallVerdict) -> None:
        """Log why a rank without progress is not judged hung yet, when that reason changes (and the peer it
        names)."""
        if verdict.waits_because == iteration.waits_because:
            return
        iteration.waits_because = verdict.waits_because
        if not verdict.waits_because:
            return
        peer = ""
        if verdict.waits_because == "peer active":
            peer = f" (initial rank {self._latest_active_peer})"
        elif verdict.waits_because == "peer overdue" and self._overdue_peer is not None:
            peer = f" (initial rank {self._overdue_peer[0]})"
        elif verdict.waits_because == "peer unheard":
            peer = f" (initial rank {self._unheard_peer})"
        log.info("not hung yet: %s%s", verdict.reason, peer)

    def _terminate(
        self, base_store: dist.Store, iteration: _Iteration, activity: RankActivity, kind: str, reason: str
    ) -> None:
        """Terminate the rank: reported, its stacks dumped, SIGTERM then SIGKILL."""
        config = self.config
        log.warning("%s: %s; terminating %d (its stacks go to its stderr)", kind, reason, self.target_pid)
        emit("fault_detected", rank=config.initial_rank, iteration=iteration.number, kind=kind, message=reason)
        # Reported before the dump: the dump's signal ends a blocking call (a sleep, a read) and a stopped
        # rank continues for it. Whatever the rank does in the moments it runs again, it meets the
        # iteration already interrupted and itself counted out: its own arrival cannot complete the
        # restart with it still counted in, only for it to be terminated in the next iteration.
        self._report_terminated(base_store, kind, reason)
        self._dump_stacks(reason)
        if activity.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.target_pid, signal.SIGCONT)  # the dump runs now; SIGTERM comes after it
        pause(_STACK_DUMP_PAUSE)
        terminate_process(self.target_pid, config.termination_grace_time)
        log.info("target %d terminated", self.target_pid)

    def _report_hang(self, job: JobView, iteration: _Iteration, activity: RankActivity, reason: str) -> None:
        """Every rank made no progress for the soft timeout: record the hang, blamed on the rank that stopped first.

        Every stalled rank's monitor process may get here, each with the
        same heartbeats: they name the same culprit, and the restart report
        shows the hang once (:func:`~elastic_ft.inprocess.hangs.verdicts.hang_culprit`).
        """
        config = self.config
        culprit, why = self.culprit(job, activity)
        rank = iteration.rank if culprit.rank == config.initial_rank else None
        if rank is None:
            rank = iteration.store.rank_of_initial(culprit.rank)
        if rank is None:
            me = StalledRank(config.initial_rank, time.time() - activity.inactive_for, self.timestamps.waiting())
            culprit, why, rank = me, "the rank it was blamed on is not in this iteration", iteration.rank
        message = (
            f"rank {rank} (initial rank {culprit.rank}) made no progress for {time.time() - culprit.active_at:.1f} s: "
            f"{why} (seen by initial rank {config.initial_rank}: {reason})"
        )
        iteration.store.record_interruption(rank, "hang", message)
        log.warning("soft timeout: %s", message)
        emit("fault_detected", rank=culprit.rank, iteration=iteration.number, kind="hang", message=message)

    def culprit(self, job: JobView, activity: RankActivity) -> tuple[StalledRank, str]:
        """The rank this monitor blames a hang on, and why: from its rank's ``activity`` and its last look at
        the peers (read again if older than a look's period)."""
        config = self.config
        self._peers_inactive_for(job, peer_read_period(self._timeouts().soft, config.heartbeat_interval), activity)
        me = StalledRank(config.initial_rank, time.time() - activity.inactive_for, self.timestamps.waiting())
        return hang_culprit([me, *self._stalled_peers])

    def _dump_stacks(self, reason: str) -> None:
        """Have the rank write every thread's stack to its stderr, under a line that says whose and why.

        The dump comes from the rank's own signal handler (``faulthandler``),
        which runs even while it holds the GIL; a stopped rank writes it once
        it continues.
        """
        config = self.config
        header = (
            f"\n[elastic_ft monitor process] stacks of initial rank {config.initial_rank} (pid {self.target_pid}), "
            f"about to be terminated: {reason}\n"
        )
        with contextlib.suppress(OSError):
            os.write(self.rank_stderr, header.encode())
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.target_pid, STACK_DUMP_SIGNAL)

    def _candidate_peers(self, job: JobView) -> list[int]:
        """The initial world and the joiners admitted so far (a joiner's initial rank lies past the initial
        world); read once per iteration, as joiners are admitted only at a restart."""
        number = self.iteration.number if self.iteration is not None else -1
        if self._joined is None or self._joined[0] != number:
            self._joined = (number, joined_ranks(job))
        return [*range(self.config.initial_world_size), *self._joined[1]]

    def _peers_inactive_for(self, job: JobView, read_period: float, activity: RankActivity) -> float | None:
        """Seconds since any other rank was last active, from their heartbeats (read once per ``read_period``)."""
        read_at, inactive_for = self._peers
        now = time.time()
        if now - read_at < read_period and now < aligned_check(read_at, read_period):
            return None if inactive_for is None else inactive_for + (now - read_at)
        soft = self._timeouts().soft
        with on_behalf_of("peer look"):
            beats = self._evidence(job, now, soft, read_period, activity)
        latest, latest_rank = None, None
        stalled = []
        overdue: tuple[int, float] | None = None
        unheard: int | None = None
        skip = self.reported_silent | {self.config.initial_rank}
        for rank, heartbeat in beats.items():
            if rank in skip:
                continue
            stalled.append(StalledRank(rank, heartbeat.active_at, heartbeat.waiting))
            if latest is None or heartbeat.active_at > latest:
                latest, latest_rank = heartbeat.active_at, rank
            late = overdue_for(heartbeat.sent_at, heartbeat.active_at, heartbeat.due_at, now, soft)
            if late is not None and (overdue is None or late > overdue[1]):
                overdue = (rank, late)
            if unheard is None and notice_pending(heartbeat, now, soft):
                unheard = rank
        inactive_for = None if latest is None else max(0.0, now - latest)
        self._peers, self._latest_active_peer = (now, inactive_for), latest_rank
        self._stalled_peers, self._overdue_peer, self._unheard_peer = stalled, overdue, unheard
        return inactive_for

    def _evidence(
        self, job: JobView, now: float, soft: float, read_period: float, activity: RankActivity
    ) -> dict[int, Heartbeat]:
        """The peers' heartbeats a look judges by (:func:`_peers_inactive_for`).

        The iteration's rank 0 is the judge: its monitor reads every peer and
        publishes what decides the others' verdicts (``select_evidence``: a
        few heartbeats, its own rank's activity among them). Another monitor
        reads that look and the judge's heartbeat, one small read however
        many ranks: the judge's fresh look; else, while the judge's rank was
        active within ``soft``, that activity alone (a peer active within the
        soft timeout is all a verdict needs to wait); else (no judge, its look
        late: its monitor dead or starved) every peer itself, as the judge does.
        """
        config, iteration = self.config, self.iteration
        number = None if iteration is None else iteration.number
        if iteration is not None and iteration.rank == 0 and iteration.active:
            beats = self._every_peer(job, number)
            active = activity.inactive_for < stall_notice_after(soft)
            mine = Heartbeat(
                now, now - activity.inactive_for, self.timestamps.waiting(), False, now + read_period, active
            )
            evidence = select_evidence({**beats, config.initial_rank: mine}, soft)
            job.liveness.publish_peer_look(PeerLook(iteration.number, config.initial_rank, now, evidence))
            return beats
        if number is not None:
            judge = self._judge_rank[1] if self._judge_rank[0] == number else None
            look, judge_beat = job.liveness.peer_look(judge)
            if look is not None and look.iteration == number:
                if look.read_at is not None and now - look.read_at <= 2 * read_period + overdue_slack(soft):
                    return look.beats
                if judge is None:
                    self._judge_rank = (number, look.judge)
                    _, judge_beat = job.liveness.peer_look(look.judge)
                if judge_beat is not None and not judge_beat.reserve and now - judge_beat.active_at < soft:
                    return {look.judge: judge_beat}
        return self._every_peer(job, number)

    def _every_peer(self, job: JobView, number: int | None) -> dict[int, Heartbeat]:
        """Every other candidate's heartbeat that speaks for this iteration (not a reserve rank's, not one of a
        rank gone before it began), in one batched read: a few requests however many peers (one per peer would
        outgrow the look's bound in a large world, or in a long job whose respawned ranks all stay candidates)."""
        config = self.config
        peers = [r for r in self._candidate_peers(job) if r != config.initial_rank and r not in self.reported_silent]
        records = job.liveness.peer_records(peers)
        beats = {}
        for rank, heartbeat in records.heartbeats.items():
            if heartbeat.reserve:
                continue  # a reserve rank waits by design: its activity says nothing of the iteration's
            if number is not None and not _in_iteration(records.positions.get(rank), number):
                # Gone before this iteration began (a joiner that died: the exit barrier does not count joiners);
                # its last heartbeat, ever more overdue, says nothing of this iteration.
                continue
            beats[rank] = heartbeat
        return beats

    def _receive(self, timeout: float) -> list[dict[str, Any]]:
        """Messages from the main process, waiting up to ``timeout``; returns early when the target exits."""
        watched = ([self.pipe] if self.pipe_open else []) + ([self.pidfd] if self.pidfd is not None else [])
        if not watched:
            pause(timeout)
            return []
        readable, _, _ = select.select(watched, [], [], timeout)
        if self.pipe not in readable or not self.pipe_open:
            return []
        chunk = os.read(self.pipe, 65536)
        if not chunk:
            self.pipe_open = False
            return []
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def _report_terminated(self, base_store: dist.Store, kind: str, message: str) -> None:
        """Record this rank as gone and arrive at the barriers in its place."""
        log.warning("rank leaves the job: %s (%s)", kind, message)
        # The same report ftrun's agent makes from outside (idempotent if both do); made however long etcd is
        # away: a fault during an outage is recovered from once it is back.
        patiently(
            lambda: report_process_gone(
                base_store, self.config.initial_rank, self.config.initial_world_size, kind, message
            ),
            "the report of the rank's end",
        )

    def _ring_successor(self) -> int | None:
        """The initial rank whose heartbeats this monitor checks (the next one in the ring not known silent);
        None for a joiner (the ring is the initial world's) or when no other is left."""
        config = self.config
        if config.initial_rank >= config.initial_world_size:
            return None
        return ring_successor(
            config.initial_rank, config.initial_world_size, self.reported_silent | {config.initial_rank}
        )

    def _check_ring(
        self, job: JobView, now: float, watching_since: float, successor: int, look: tuple[bool, Heartbeat | None]
    ) -> None:
        """The ring check, on what the heartbeat read of ``successor``: whether it left, and its last heartbeat.
        A successor silent for the heartbeat timeout makes this monitor read every rank's heartbeat, and report
        each silent one gone."""
        config = self.config
        skip = self.reported_silent | {config.initial_rank}
        reachable_since = OUTAGES.last_ended_wall
        successor_left, heartbeat = look
        if successor_left:
            return
        beat = {successor: None if heartbeat is None else heartbeat.sent_at}
        if not silent_ranks(beat, now, watching_since, config.heartbeat_timeout, reachable_since):
            return
        others = [rank for rank in range(config.initial_world_size) if rank not in skip]
        left = job.arrivals(EXIT_BARRIER, others)
        sent = job.liveness.heartbeats([rank for rank in others if rank not in left])
        heartbeats = {rank: sent[rank].sent_at if rank in sent else None for rank in others if rank not in left}
        for initial_rank in silent_ranks(heartbeats, now, watching_since, config.heartbeat_timeout, reachable_since):
            self.reported_silent.add(initial_rank)
            log.warning("initial rank %d sent no heartbeat for %g s", initial_rank, config.heartbeat_timeout)
            iteration = self.iteration
            if iteration is not None and iteration.store.outcome() != COMPLETED:
                rank = iteration.store.rank_of_initial(initial_rank)
                if rank is not None:
                    position = job.position(initial_rank)
                    reserve = (
                        position is not None and position["iteration"] == iteration.number and not position["active"]
                    )
                    report_rank_gone(
                        iteration.store,
                        rank,
                        iteration.world_size,
                        "unresponsive",
                        "heartbeat timeout",
                        interrupt=not reserve,
                    )
            job.arrive_and_wait(EXIT_BARRIER, [initial_rank], config.initial_world_size, NO_WAIT)
