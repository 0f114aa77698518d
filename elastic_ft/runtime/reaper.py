"""No orphans: when a launcher dies, even by SIGKILL, every process it started dies within moments.

torch starts each worker in a session of its own, the Wrapper's monitor
process leaves the worker's session, and ``ftrun``'s embedded etcd runs in
its own: a SIGKILLed ``ftrun`` or torchrun agent would leave all of them
running, still restarting and burning CPU, and the embedded etcd's data
directory on disk. ``PR_SET_PDEATHSIG`` covers none of them (it fires on the
death of the parent *thread*, and only for direct children).

So the launcher starts a small helper process, the reaper
(:func:`ensure_reaper`), and marks its own environment with a token that
every process it starts inherits, whatever its session: workers, their
data loader workers, monitor processes, etcd. The reaper waits on a pidfd
of the launcher (and on its pipe, closed by the kernel when the launcher
dies); when the launcher is gone it SIGKILLs every process whose initial
environment carries the token, then removes the directories it was told to
(:meth:`Reaper.remove_on_exit`) and runs the commands it was given
(:meth:`Reaper.run_on_exit`). It runs in its own session, ignoring the
terminal's signals, so a Ctrl-C that kills the launcher does not kill it
first. A normal exit ends it the same way: by then torch has stopped the
workers, and anything they left behind goes too.

Test drivers use the same helper (pytest's processes, the benchmarks): the
etcd servers and the network test beds they start go with them, even when
a timeout SIGKILLs them. :class:`~elastic_ft.etcd.server.EtcdServer` and
:class:`~elastic_ft.testing.netns.TestBed` hand their clean-up to this
process's reaper, if it has one (:func:`current_reaper`), and take it back
(:meth:`Reaper.forget`) once they cleaned up themselves.

Linux only (``/proc``, pidfds).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from elastic_ft.runtime.waits import pause, poll

#: The environment variable that marks the processes a launcher started: ``<launcher pid>:<random>``.
REAPER_ENV = "ELASTIC_FT_REAPER"
#: How long the reaper keeps sweeping for processes forked while it killed the others.
_SWEEP_SECONDS = 2.0
#: The pause between two sweeps.
_SWEEP_PAUSE = 0.05
#: How long the reaper waits for the processes it killed to be gone before it removes their directories.
_GONE_WITHIN = 10.0
#: How long the reaper lets each command of :meth:`Reaper.run_on_exit` run.
_COMMAND_SECONDS = 10.0


class Reaper:
    """The launcher's handle on its reaper process."""

    def __init__(self, process: subprocess.Popen[bytes], token: str) -> None:
        self.process = process
        self.token = token

    def remove_on_exit(self, path: str | os.PathLike[str]) -> None:
        """Have the reaper remove ``path`` (a directory or a file) once the launcher is gone: an embedded etcd's
        data, the node's shared-memory board."""
        self._tell(_removal(path))

    def run_on_exit(self, argv: Sequence[str]) -> None:
        """Have the reaper run ``argv`` once the launcher is gone and its processes are killed (a test bed's
        ``ip netns del``); in the order given, each for at most :data:`_COMMAND_SECONDS`."""
        self._tell(_command(argv))

    def forget(self, *, path: str | os.PathLike[str] | None = None, argv: Sequence[str] | None = None) -> None:
        """Take back a :meth:`remove_on_exit` or :meth:`run_on_exit`: the caller cleaned up itself, and the
        name may be reused by the time the launcher exits."""
        if path is not None:
            self._tell(f"forget {_removal(path)}")
        if argv is not None:
            self._tell(f"forget {_command(argv)}")

    def _tell(self, line: str) -> None:
        if "\n" in line:
            raise ValueError(f"the reaper takes a task per line, and {line!r} holds a newline")
        if self.process.stdin is None:
            return
        with contextlib.suppress(BrokenPipeError, OSError):
            self.process.stdin.write(f"{line}\n".encode())
            self.process.stdin.flush()


def _removal(path: str | os.PathLike[str]) -> str:
    return f"rmtree {os.fspath(path)}"


def _command(argv: Sequence[str]) -> str:
    return f"run {json.dumps(list(argv))}"


_reaper: Reaper | None = None


def ensure_reaper() -> Reaper | None:
    """Start this process's reaper, once; None where it cannot run (not Linux).

    Sets :data:`REAPER_ENV` in ``os.environ`` before anything else is
    started, so every later child inherits it. A token inherited from a
    parent launcher is replaced: each launcher reaps its own processes.
    """
    global _reaper
    if _reaper is not None and _reaper.process.poll() is None:
        return _reaper
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return None
    token = f"{os.getpid()}:{uuid.uuid4().hex}"
    os.environ[REAPER_ENV] = token
    process = subprocess.Popen(
        [sys.executable, "-m", "elastic_ft.runtime.reaper", str(os.getpid()), token],
        stdin=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )
    _reaper = Reaper(process, token)
    return _reaper


def current_reaper() -> Reaper | None:
    """This process's reaper if it started one (:func:`ensure_reaper`) and it runs; None otherwise."""
    if _reaper is not None and _reaper.process.poll() is None:
        return _reaper
    return None


def _processes_with(token: str) -> Iterator[int]:
    """PIDs whose initial environment holds ``REAPER_ENV=token`` (this process excepted)."""
    entry = f"{REAPER_ENV}={token}".encode()
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                if entry in environ.read().split(b"\0"):
                    yield int(name)
        except OSError:  # gone, or not ours
            continue


def process_is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped (a zombie has stopped writing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def describe_exit(code: int) -> str:
    """How a process ended, from its exit status as ``subprocess`` and ``os.waitstatus_to_exitcode`` give it
    (negative: the signal that killed it): ``exit code 1``, ``signal SIGKILL``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def kill_marked(token: str, sweep: float = _SWEEP_SECONDS) -> list[int]:
    """SIGKILL every process marked with ``token``, sweeping again for ``sweep`` seconds (forks during the
    first pass); returns the PIDs signalled."""
    killed: list[int] = []
    deadline = time.monotonic() + sweep
    while True:
        found = [pid for pid in _processes_with(token) if pid not in killed]
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed += found
        if not found or time.monotonic() >= deadline:
            return killed
        pause(_SWEEP_PAUSE)


def _watch(launcher: int, token: str) -> None:
    """The reaper's life: wait for the launcher to die, then kill what it started and clean up after it."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    tasks: list[str] = []  # "rmtree PATH" and "run JSON" lines, in the order given
    try:
        pidfd: int | None = os.pidfd_open(launcher)
    except OSError:  # already gone
        pidfd = None
    stdin = sys.stdin.fileno()
    buffer = b""
    while pidfd is not None:
        readable, _, _ = select.select([pidfd, stdin], [], [])
        if pidfd in readable:
            break
        chunk = os.read(stdin, 4096)
        if not chunk:
            break  # the launcher's end closed: it exited
        buffer = _take_tasks(buffer + chunk, tasks)
    _take_pending_tasks(stdin, buffer, tasks)
    killed = kill_marked(token)
    # A SIGKILLed process finishes the system call it is in: an etcd member may still create a file in the
    # directory being removed, which then stays. Its directories go once it is gone.
    poll(lambda: not any(process_is_alive(pid) for pid in killed), _GONE_WITHIN, interval_max=0.05)
    for task in tasks:
        command, _, argument = task.partition(" ")
        if command == "run":
            _run_command(argument)
        elif os.path.isdir(argument):
            shutil.rmtree(argument, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(argument)


def _take_pending_tasks(stdin: int, buffer: bytes, tasks: list[str]) -> None:
    """Add the tasks a dead launcher left in the pipe: a busy host may run the reaper only after the launcher
    died, even before it could open the launcher's pidfd. Never blocks: a process the launcher forked may still
    hold the pipe's other end."""
    with contextlib.suppress(BlockingIOError, OSError):
        os.set_blocking(stdin, False)
        while chunk := os.read(stdin, 4096):
            buffer = _take_tasks(buffer + chunk, tasks)


def _take_tasks(buffer: bytes, tasks: list[str]) -> bytes:
    """Add the whole lines of ``buffer`` to ``tasks`` (a ``forget`` line takes one back); returns the rest."""
    *lines, rest = buffer.split(b"\n")
    for line in lines:
        task = line.decode(errors="replace")
        if task.startswith("forget "):
            with contextlib.suppress(ValueError):
                tasks.remove(task.removeprefix("forget "))
        elif task.startswith(("rmtree ", "run ")):
            tasks.append(task)
    return rest


def _run_command(encoded: str) -> None:
    try:
        argv = json.loads(encoded)
    except ValueError:
        return
    if not isinstance(argv, list) or not argv or not all(isinstance(part, str) for part in argv):
        return
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=_COMMAND_SECONDS,
            check=False,
        )


def main(argv: list[str]) -> None:
    if len(argv) != 2 or not argv[0].isdigit():
        raise SystemExit("usage: python -m elastic_ft.runtime.reaper LAUNCHER_PID TOKEN")
    with contextlib.suppress(OSError), Path("/proc/self/comm").open("w") as comm:
        comm.write("eft-reaper")
    _watch(int(argv[0]), argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
