"""Test ranks forked from one process that imported torch once, instead of each importing it again.

A Wrapper test job's ranks are plain ``python worker.py`` processes
(``job.py``). Each spent about 2 s of CPU importing torch, elastic-ft and
``torch._dynamo`` before its first step, for about 80 ranks in the suite. This module's
server imports them once per pytest process and forks each rank from that
state; the rank then runs its script as ``python script.py`` would: as
``__main__``, with its own argv, environment, working directory and output
file, and exits with the script's status (an uncaught exception's traceback
on stderr and 1, ``sys.exit``'s code, or the signal that killed it). It
forks before any thread of its own exists: the server starts none, and
serves on one socket, polling the children's pidfds for their exits.

Only the test harness forks this way. The launchers start workers as
torchrun does, and the tests of ``ftrun`` and torchrun exercise that.

Run as a script, this file is the server: ``python forkserver.py FD MODULE...``.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

#: The largest request: a rank's argv and whole environment, as JSON.
_MESSAGE_BYTES = 1 << 20


@dataclass
class _Request:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    output: int


class ForkServer:
    """The pytest side: starts the server, has it fork ranks, learns their exit statuses."""

    def __init__(self, preload: list[str], ready_timeout: float = 60.0) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = ours
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno()), *preload],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # a rank's stdout is block-buffered, as under a pipe
        )
        theirs.close()
        self._exits: dict[int, int] = {}
        reply = self._receive(ready_timeout)
        if reply.get("ready") is not True:
            self.close()
            raise RuntimeError(f"the fork server did not start: {reply}")

    def start(self, argv: list[str], env: dict[str, str], cwd: str, output: int) -> int:
        """Fork a rank running ``argv`` (a script and its arguments) with its stdout and stderr on ``output``
        (a file descriptor, which the caller still closes); returns its PID."""
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        socket.send_fds(self._socket, [request], [output])
        while True:
            reply = self._receive(30.0)
            if "started" in reply:
                return int(reply["started"])

    def wait(self, pid: int, timeout: float) -> int | None:
        """``pid``'s exit status (negative: the signal that killed it), or None if it still runs after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while pid not in self._exits:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                self._receive(remaining)
            except TimeoutError:
                return None
        return self._exits[pid]

    def kill(self, pid: int) -> None:
        """SIGKILL a rank the server forked and has not reaped yet (by its pidfd: never a reused PID)."""
        self._socket.send(json.dumps({"kill": pid}).encode())

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        self._socket.close()  # the server exits at the end of its socket
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _receive(self, timeout: float) -> dict[str, Any]:
        readable, _, _ = select.select([self._socket], [], [], timeout)
        if not readable:
            raise TimeoutError(f"the fork server (pid {self.process.pid}) answered nothing in {timeout:g} s")
        message = self._socket.recv(_MESSAGE_BYTES)
        if not message:
            raise RuntimeError(f"the fork server exited with {self.process.wait()}")
        reply: dict[str, Any] = json.loads(message)
        if "exited" in reply:
            self._exits[int(reply["exited"])] = int(reply["returncode"])
        return reply


def _serve(control: socket.socket) -> _Request:
    """The server's loop; returns only in a forked child, with what that child must run."""
    children: dict[int, int] = {}  # pidfd -> pid
    poller = select.poll()
    poller.register(control, select.POLLIN)
    control.send(json.dumps({"ready": True}).encode())
    while True:
        for fd, _ in poller.poll():
            if fd in children:
                pid = children.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                control.send(json.dumps({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)}).encode())
                continue
            message, fds, _, _ = socket.recv_fds(control, _MESSAGE_BYTES, 1)
            if not message:
                sys.exit(0)  # pytest closed its end: it is done, or gone
            request = json.loads(message)
            if "kill" in request:
                for pidfd, pid in children.items():
                    if pid == request["kill"]:
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                control.close()
                for pidfd in children:
                    os.close(pidfd)
                return _Request(request["argv"], request["env"], request["cwd"], fds[0])
            os.close(fds[0])
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            poller.register(pidfd, select.POLLIN)
            control.send(json.dumps({"started": pid}).encode())


def _become(request: _Request) -> None:
    """Turn this forked child into ``python script args...`` run with the request's environment."""
    os.dup2(request.output, 1)
    os.dup2(request.output, 2)
    os.close(request.output)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    sys.argv = list(request.argv)
    sys.path[0] = os.path.dirname(os.path.abspath(request.argv[0]))
    runpy.run_path(request.argv[0], run_name="__main__")


if __name__ == "__main__":
    import importlib

    for module in sys.argv[2:]:
        importlib.import_module(module)
    _become(_serve(socket.socket(fileno=int(sys.argv[1]))))
