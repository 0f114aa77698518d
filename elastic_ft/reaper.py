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
(:meth:`Reaper.remove_on_exit`). It runs in its own session, ignoring the
terminal's signals, so a Ctrl-C that kills the launcher does not kill it
first. A normal exit ends it the same way: by then torch has stopped the
workers, and anything they left behind goes too.

Linux only (``/proc``, pidfds).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

#: The environment variable that marks the processes a launcher started: ``<launcher pid>:<random>``.
REAPER_ENV = "ELASTIC_FT_REAPER"
#: How long the reaper keeps sweeping for processes forked while it killed the others.
_SWEEP_SECONDS = 2.0


class Reaper:
    """The launcher's handle on its reaper process."""

    def __init__(self, process: subprocess.Popen[bytes], token: str) -> None:
        self.process = process
        self.token = token

    def remove_on_exit(self, path: str | os.PathLike[str]) -> None:
        """Have the reaper remove ``path`` (a directory or a file) once the launcher is gone: an embedded etcd's
        data, the node's shared-memory board."""
        if self.process.stdin is None:
            return
        line = f"rmtree {os.fspath(path)}\n".encode()
        with contextlib.suppress(BrokenPipeError, OSError):
            self.process.stdin.write(line)
            self.process.stdin.flush()


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
        [sys.executable, "-m", "elastic_ft.reaper", str(os.getpid()), token],
        stdin=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )
    _reaper = Reaper(process, token)
    return _reaper


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
        time.sleep(0.05)


def _watch(launcher: int, token: str) -> None:
    """The reaper's life: wait for the launcher to die, then kill what it started and remove its directories."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    directories: list[str] = []
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
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            command, _, argument = line.decode(errors="replace").partition(" ")
            if command == "rmtree" and argument:
                directories.append(argument)
    kill_marked(token)
    for path in directories:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def main(argv: list[str]) -> None:
    if len(argv) != 2 or not argv[0].isdigit():
        raise SystemExit("usage: python -m elastic_ft.reaper LAUNCHER_PID TOKEN")
    with contextlib.suppress(OSError), Path("/proc/self/comm").open("w") as comm:
        comm.write("eft-reaper")
    _watch(int(argv[0]), argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
