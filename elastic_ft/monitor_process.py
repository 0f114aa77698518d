"""The monitor process: a per-rank guardian that outlives the rank's main process.

The Wrapper forks it at entry, before any thread or process group exists.
It runs in its own session, with its standard streams on ``/dev/null`` and
its log only in ``monitor_process_logfile``, and talks to the job only
through its own connection to the store. It

* heartbeats the rank into the store and watches the heartbeats of the other
  ranks (:mod:`elastic_ft.sibling_monitor`), reporting silent ones;
* reports the rank as terminated when its main process dies, arriving at
  the barriers on its behalf so that the other ranks restart without it;
* enforces the progress timeouts from the heartbeats in shared memory
  (:mod:`elastic_ft.progress_watchdog`): after ``soft_timeout`` it records an
  interruption (every rank restarts); after ``hard_timeout`` it reports the
  rank terminated and stops the process with SIGCONT+SIGTERM, then after
  ``termination_grace_time`` SIGCONT+SIGTERM+SIGKILL.

The main process drives it with JSON lines on a pipe: ``store_ready``,
``iteration`` (number, rank, world size) and ``stop``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from elastic_ft import store as store_module
from elastic_ft.inprocess_logging import get_logger, log_to_file
from elastic_ft.progress_watchdog import ProgressTimestamps
from elastic_ft.sibling_monitor import ring_successor, silent_ranks
from elastic_ft.store import (
    COMPLETED,
    EXIT_BARRIER,
    PrefixStore,
    iteration_store,
    job_store,
    report_process_gone,
    report_rank_gone,
)

log = get_logger("monitor_process")

_NO_WAIT = datetime.timedelta(0)


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
    logfile: str | None
    log_level: int


def process_is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    except PermissionError:
        return True
    return state not in ("Z", "X")


def terminate_process(pid: int, grace_time: float) -> None:
    """SIGCONT+SIGTERM; if still alive after ``grace_time``, SIGCONT+SIGTERM+SIGKILL."""
    for signals in ((signal.SIGCONT, signal.SIGTERM), (signal.SIGCONT, signal.SIGTERM, signal.SIGKILL)):
        for sig in signals:
            log.info("sending %s to %d", sig.name, pid)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
        if store_module.poll(lambda: not process_is_alive(pid), grace_time, interval_max=0.01):
            return
    store_module.poll(lambda: not process_is_alive(pid), None, interval_max=0.01)


class MonitorProcess:
    """Handle, in the main process, on the forked monitor process.

    Args:
        config: see :class:`MonitorConfig`.
        timestamps: the progress heartbeats shared with the main process.
        store_factory: builds the monitor's own store connection.
        store_kwargs: keyword arguments of ``store_factory``.
    """

    def __init__(
        self,
        config: MonitorConfig,
        timestamps: ProgressTimestamps,
        store_factory: Callable[..., dist.Store],
        store_kwargs: dict[str, Any],
    ) -> None:
        target_pid = os.getpid()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _detach(keep=read_end)
                _Monitor(config, timestamps, store_factory, store_kwargs, target_pid, read_end).run()
            except BaseException:
                log.exception("monitor process failed")
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)
        os.close(read_end)
        self.pid = pid
        self._pipe = os.fdopen(write_end, "w", buffering=1)

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._pipe.write(json.dumps(message) + "\n")
        except (BrokenPipeError, ValueError):
            log.warning("monitor process %d is gone; message %s dropped", self.pid, message)

    def store_ready(self) -> None:
        """The store exists (its host is up): the monitor may connect."""
        self._send({"type": "store_ready"})

    def start_iteration(self, iteration: int, rank: int, world_size: int) -> None:
        self._send({"type": "iteration", "iteration": iteration, "rank": rank, "world_size": world_size})

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the monitor to exit and reap it."""
        self._send({"type": "stop"})
        self._pipe.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if pid:
                return
            time.sleep(0.005)
        log.warning("monitor process %d did not exit in %g s", self.pid, timeout)


def _detach(keep: int) -> None:
    """Leave the parent's session and drop every inherited descriptor but ``keep``."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclasses.dataclass
class _Iteration:
    number: int
    rank: int
    world_size: int
    store: PrefixStore
    soft_timeout_reported: bool = False


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
    ) -> None:
        self.config = config
        self.timestamps = timestamps
        self.store_factory = store_factory
        self.store_kwargs = store_kwargs
        self.target_pid = target_pid
        self.pipe = pipe
        self.buffer = b""
        self.pipe_open = True
        self.base_store: dist.Store | None = None
        self.iteration: _Iteration | None = None
        self.reported_silent: set[int] = set()

    def run(self) -> None:
        config = self.config
        logfile = config.logfile.format(rank=config.initial_rank) if config.logfile else None
        log_to_file(logfile, config.log_level)
        log.info("monitoring pid %d as initial rank %d", self.target_pid, config.initial_rank)
        while True:
            messages = self._receive(config.interval)
            if any(message["type"] == "stop" for message in messages):
                return
            if any(message["type"] == "store_ready" for message in messages):
                break
            if not process_is_alive(self.target_pid):
                log.info("target died before the store was ready")
                return
        store_module.forbid_hosting()
        self.base_store = self.store_factory(**self.store_kwargs)
        job = job_store(self.base_store)
        watching_since = time.time()
        next_heartbeat = 0.0
        while True:
            for message in self._receive(config.interval):
                if message["type"] == "stop":
                    log.info("stopped by the main process")
                    return
                if message["type"] == "iteration":
                    number = message["iteration"]
                    self.iteration = _Iteration(
                        number,
                        message["rank"],
                        message["world_size"],
                        iteration_store(self.base_store, number),
                    )
                    log.info("iteration %d: rank %d of %d", number, message["rank"], message["world_size"])
            if not process_is_alive(self.target_pid):
                self._report_terminated("terminated", f"process {self.target_pid} died")
                return
            now = time.time()
            if now >= next_heartbeat:
                job.send_heartbeat(config.initial_rank)
                next_heartbeat = now + config.heartbeat_interval
                self._check_heartbeats(job, now, watching_since)
            if self.iteration is not None and self._enforce_timeouts():
                return

    def _receive(self, timeout: float) -> list[dict[str, Any]]:
        if not self.pipe_open:
            time.sleep(timeout)
            return []
        readable, _, _ = select.select([self.pipe], [], [], timeout)
        if not readable:
            return []
        chunk = os.read(self.pipe, 65536)
        if not chunk:
            self.pipe_open = False
            return []
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def _enforce_timeouts(self) -> bool:
        """Apply the soft and hard timeouts; True once the target was terminated."""
        iteration = self.iteration
        assert iteration is not None
        age = self.timestamps.age()
        if age > self.config.soft_timeout and not iteration.soft_timeout_reported:
            iteration.soft_timeout_reported = True
            log.warning("soft timeout: no progress for %.2f s", age)
            iteration.store.record_interruption(iteration.rank, "soft_timeout", f"no progress for {age:.2f} s")
        if age > self.config.hard_timeout:
            log.warning("hard timeout: no progress for %.2f s, terminating %d", age, self.target_pid)
            self._report_terminated("hard_timeout", f"no progress for {age:.2f} s")
            terminate_process(self.target_pid, self.config.termination_grace_time)
            log.info("target %d terminated", self.target_pid)
            return True
        return False

    def _report_terminated(self, kind: str, message: str) -> None:
        """Record this rank as gone and arrive at the barriers in its place."""
        log.warning("rank leaves the job: %s (%s)", kind, message)
        assert self.base_store is not None
        # The same report ftrun's agent makes from outside (idempotent if both do).
        report_process_gone(self.base_store, self.config.initial_rank, self.config.initial_world_size, kind, message)

    def _check_heartbeats(self, job: PrefixStore, now: float, watching_since: float) -> None:
        config = self.config
        skip = self.reported_silent | {config.initial_rank}
        successor = ring_successor(config.initial_rank, config.initial_world_size, skip)
        if successor is None or job.has_arrived(EXIT_BARRIER, successor):
            return
        if not silent_ranks({successor: job.last_heartbeat(successor)}, now, watching_since, config.heartbeat_timeout):
            return
        others = [rank for rank in range(config.initial_world_size) if rank not in skip]
        heartbeats = {rank: job.last_heartbeat(rank) for rank in others if not job.has_arrived(EXIT_BARRIER, rank)}
        for initial_rank in silent_ranks(heartbeats, now, watching_since, config.heartbeat_timeout):
            self.reported_silent.add(initial_rank)
            log.warning("initial rank %d sent no heartbeat for %g s", initial_rank, config.heartbeat_timeout)
            iteration = self.iteration
            if iteration is not None and iteration.store.outcome() != COMPLETED:
                rank = iteration.store.rank_of_initial(initial_rank)
                if rank is not None:
                    report_rank_gone(iteration.store, rank, iteration.world_size, "unresponsive", "heartbeat timeout")
            job.arrive_and_wait(EXIT_BARRIER, [initial_rank], config.initial_world_size, _NO_WAIT)
