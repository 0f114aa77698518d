"""A warm standby process: a dead worker's place taken by a process that has started already.

A respawned worker pays an interpreter start, ``import torch``, the
elastic-ft imports and torch's lazy first-use imports (``torch._dynamo``,
built by the first optimizer) before it can join: 3 to 4 s on two cores,
while the job trains one rank short. ``ftrun`` keeps one process per node
that has done all of that and waits, without a rank, for a place
(:mod:`elastic_ft.inprocess.restart.standby`, named by
:data:`elastic_ft.handoff.STANDBY_PROCESS_MODULE`: the node side imports nothing of the worker side). When a worker dies the
agent sends the standby the dead worker's command line, environment and
log files on its stdin, and the standby runs the training script in its
own interpreter, as ``python script.py`` would: only the script's own
start-up and the admission remain.

This module holds the agent's side: which worker commands a standby can
run (:func:`standby_plan`, pure), :class:`Standby`, one process's life
(start, readiness, hand-over, stop), and :class:`StandbyKeeper`, when a
node has one (the next starts once the node has been quiet; a crash loop
turns it off). The agent ticks the keeper from its loop and takes the
standby when a worker dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from elastic_ft.handoff import STANDBY_PROCESS_MODULE, STANDBY_READY, STANDBY_STATUS_FD_ENV

#: Python options that take no value, as a worker's command line may carry them (torchrun passes ``-u``).
_FLAGS = frozenset({"-u", "-B", "-O", "-OO", "-s", "-S", "-E", "-I", "-b", "-bb", "-q", "-v", "-d", "-P", "-R"})
#: Python options followed by a value.
_FLAGS_WITH_VALUE = frozenset({"-W", "-X"})
#: How long a standby gets to exit on SIGTERM before SIGKILL.
STOP_GRACE = 5.0
#: How long the node's workers run undisturbed (since their start, or the last hand-over) before a standby
#: starts: its imports take a core for 4 to 10 s, which a starting or recovering job needs more (on a
#: saturated host, a training rank starved by them long enough reads as hung).
STANDBY_DELAY = 30.0
#: Standbys that end in a row before they are warm: then the node keeps none (something in them is broken).
STANDBY_FAILURES = 3
#: The hand-over pipe's capacity asked for: the whole message fits, so the agent's write never waits for a
#: standby still warming up (Linux's default limit for an unprivileged process, /proc/sys/fs/pipe-max-size).
HAND_OVER_PIPE = 1 << 20

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StandbyPlan:
    """How a standby runs a worker's command: the interpreter and its options (the standby starts with the
    same), then a script path or a module, with its arguments."""

    interpreter: str
    options: tuple[str, ...]
    script: str | None
    module: str | None
    arguments: tuple[str, ...]

    def start_command(self) -> list[str]:
        return [self.interpreter, *self.options, "-m", STANDBY_PROCESS_MODULE]


def standby_plan(entrypoint: str, args: Sequence[object], python: str = sys.executable) -> StandbyPlan | str:
    """The plan for a worker started as ``entrypoint *args``, or why a standby cannot run it.

    A standby is a Python interpreter (``python``, the agent's own) that
    imported torch: it can run what ``python [options] script.py ...`` or
    ``python [options] -m module ...`` runs, not a binary
    (``--no-python``) nor ``-c`` code.
    """
    if os.path.realpath(entrypoint) != os.path.realpath(python):
        return f"the workers run {entrypoint!r}, not this Python ({python})"
    words = [str(arg) for arg in args]
    options: list[str] = []
    index = 0
    while index < len(words) and words[index].startswith("-") and words[index] != "-m":
        word = words[index]
        if word in _FLAGS:
            options.append(word)
            index += 1
        elif word in _FLAGS_WITH_VALUE and index + 1 < len(words):
            options += words[index : index + 2]
            index += 2
        else:
            return f"the workers' Python option {word!r} is not one a standby can take"
    if index < len(words) and words[index] == "-m":
        if index + 1 >= len(words):
            return "the workers' command has -m without a module"
        return StandbyPlan(python, tuple(options), None, words[index + 1], tuple(words[index + 2 :]))
    if index >= len(words):
        return "the workers' command names no script"
    return StandbyPlan(python, tuple(options), words[index], None, tuple(words[index + 1 :]))


class Standby:
    """One standby process: started warming up, ready once it says so on its status pipe, then handed a place
    (:meth:`hand_over`) or stopped (:meth:`stop`).

    It runs in a session of its own, as torch's workers do, so that a
    worker's stop (``killpg``) reaches its data loader processes too; it
    inherits the agent's environment, and with it the reaper's token.
    """

    def __init__(self, plan: StandbyPlan, env: Mapping[str, str]) -> None:
        self.plan = plan
        self._env = dict(env)
        self.process: subprocess.Popen[bytes] | None = None
        self._status: int | None = None  # the read end of the status pipe
        self._pid = 0
        self._pipe_capacity = 0
        self.ready = False

    def start(self) -> int:
        """Start the process; returns its pid."""
        status_read, status_write = os.pipe()
        env = {**self._env, STANDBY_STATUS_FD_ENV: str(status_write)}
        try:
            self.process = subprocess.Popen(
                self.plan.start_command(),
                env=env,
                stdin=subprocess.PIPE,
                pass_fds=(status_write,),
                start_new_session=True,
            )
        except BaseException:
            os.close(status_read)
            raise
        finally:
            os.close(status_write)
        os.set_blocking(status_read, False)
        self._status = status_read
        hand_over_pipe = self.process.stdin.fileno() if self.process.stdin is not None else -1
        with contextlib.suppress(OSError):  # a smaller pipe only limits the message's size
            fcntl.fcntl(hand_over_pipe, fcntl.F_SETPIPE_SZ, HAND_OVER_PIPE)
        with contextlib.suppress(OSError):
            self._pipe_capacity = fcntl.fcntl(hand_over_pipe, fcntl.F_GETPIPE_SZ)
        self._pid = self.process.pid
        return self._pid

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else self._pid

    def exitcode(self) -> int | None:
        """The process's exit code once it ended, else None (it runs, or was never started)."""
        return None if self.process is None else self.process.poll()

    def poll_ready(self) -> bool:
        """Whether the process said it is warm (read without blocking)."""
        if not self.ready and self._status is not None:
            with contextlib.suppress(BlockingIOError):
                self.ready = STANDBY_READY in os.read(self._status, 64)
        return self.ready

    def hand_over(self, env: Mapping[str, str], stdout: str, stderr: str) -> subprocess.Popen[bytes] | None:
        """Give the process a worker's place: it runs the plan's script with ``env`` (the whole environment)
        and its output in ``stdout``/``stderr`` (files; empty: the agent's own). Returns the process, now the
        worker's; None if it was gone, or the message would not fit its pipe (the caller then starts a worker the
        usual way: the agent never waits for a standby)."""
        process = self.process
        if process is None or process.poll() is not None or process.stdin is None:
            return None
        message = {
            "env": dict(env),
            "script": self.plan.script,
            "module": self.plan.module,
            "arguments": list(self.plan.arguments),
            "stdout": stdout,
            "stderr": stderr,
        }
        data = json.dumps(message).encode() + b"\n"
        if len(data) > self._pipe_capacity:
            log.warning(
                "the worker's hand-over (%d bytes, its environment above all) does not fit the standby's pipe "
                "(%d bytes): a new process takes the place",
                len(data),
                self._pipe_capacity,
            )
            return None
        lift_priority(process.pid)
        try:
            process.stdin.write(data)
            process.stdin.close()
        except (BrokenPipeError, OSError):
            return None
        self._close_status()
        self.process = None
        return process

    def stop(self) -> None:
        """SIGTERM the process's session, SIGKILL if it lingers; idempotent."""
        process, self.process = self.process, None
        self._close_status()
        if process is None:
            return
        stop_session(process, STOP_GRACE)
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()

    def _close_status(self) -> None:
        if self._status is not None:
            os.close(self._status)
            self._status = None


def lift_priority(pid: int) -> None:
    """Give a waiting standby the usual CPU priority before its hand-over, from outside: its session's autogroup
    back to nice 0 and every thread to ``SCHED_OTHER``, so that it wakes to read the hand-over as a worker
    would, not when a core is idle. Best effort (the standby does the same itself once awake): the process may
    be gone, or its owner's ``RLIMIT_NICE`` may not let it leave ``SCHED_IDLE``."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as autogroup:
        autogroup.write("0")
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setscheduler(int(name), os.SCHED_OTHER, os.sched_param(0))


def stop_session(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the session ``process`` leads (a worker's, with its data loader processes), SIGKILL it if the
    process is still there ``grace`` seconds later; returns once it exited."""
    for death_signal in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, death_signal)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
            return


class HandedOverWorker:
    """A standby process watched as a worker: what torch's process context reads of a worker's handler (its
    ``proc``, and ``close`` to stop it: a signal to its session, as torch's own handler sends)."""

    def __init__(self, process: subprocess.Popen[bytes], local_rank: int) -> None:
        self.proc = process
        self.local_rank_id = local_rank

    def close(self, death_sig: signal.Signals | None = None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)


class StandbyKeeper:
    """Whether and when a node keeps its warm standby; the agent calls :meth:`tick` from its loop.

    ``plan_and_env`` gives the plan (or why there can be none) and the
    environment to start one with, asked when the first is due: the
    workers' command is known once they run. A standby starts
    ``delay`` seconds after the node was last busy (:meth:`hold`: the
    workers' start, a hand-over); one that ends while it waits is
    replaced after the same delay, and ``failures`` of them in a row that
    end before they are warm turn the keeper off (logged, with the reason
    kept in :attr:`off`).
    """

    def __init__(
        self,
        plan_and_env: Callable[[], tuple[StandbyPlan | str, Mapping[str, str]]],
        delay: float = STANDBY_DELAY,
        failures: int = STANDBY_FAILURES,
        clock: Callable[[], float] = time.monotonic,
        off: str | None = None,
    ) -> None:
        self._plan_and_env = plan_and_env
        self._delay, self._failures_limit, self._clock = delay, failures, clock
        #: Why the node keeps no standby (None: it keeps one).
        self.off = off
        self.standby: Standby | None = None
        self._due = clock() + delay
        self._failures = 0

    def hold(self) -> None:
        """The node is busy: no standby starts before ``delay`` seconds from now."""
        self._due = self._clock() + self._delay

    def tick(self) -> None:
        """Note the standby's readiness or its end; start the next one when due."""
        if self.off is not None:
            return
        standby = self.standby
        if standby is not None:
            self._watch(standby)
            return
        if self._clock() < self._due:
            return
        plan, env = self._plan_and_env()
        if isinstance(plan, str):
            self.off = plan
            log.info("no warm standby on this node: %s", plan)
            return
        self.standby = Standby(plan, env)
        log.info("warm standby starting (pid %d)", self.standby.start())

    def _watch(self, standby: Standby) -> None:
        exitcode = standby.exitcode()
        if exitcode is None:
            if not standby.ready and standby.poll_ready():
                self._failures = 0
                log.info("warm standby ready (pid %d)", standby.pid)
            return
        self.standby = None
        standby.stop()
        self._failures += 0 if standby.ready else 1
        how = f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"
        if self._failures >= self._failures_limit:
            self.off = f"{self._failures} standbys in a row ended before they were warm (the last with {how})"
            log.warning("no warm standby on this node from now on: %s", self.off)
            return
        log.warning(
            "the warm standby (pid %d) ended with %s before it was used; another starts in %g s",
            standby.pid,
            how,
            self._delay,
        )
        self.hold()

    def take(self) -> Standby | None:
        """The standby, for a hand-over, if it is warm; None otherwise. Either way a worker starts now, from the
        standby or as a new process importing torch: the next standby starts once the node was quiet again, not
        beside it.

        A standby still warming is stopped, not handed the place: it warms at idle CPU priority, and on a busy
        host the rest of its imports could wait for an idle core far longer than a new process takes to start.
        """
        standby, self.standby = self.standby, None
        self.hold()
        if standby is not None and not standby.poll_ready():
            log.info("the warm standby (pid %d) is not warm yet: a new process takes the place", standby.pid)
            standby.stop()
            return None
        return standby

    def stop(self) -> None:
        standby, self.standby = self.standby, None
        if standby is not None:
            standby.stop()
