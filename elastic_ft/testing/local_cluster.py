"""Simulate several torchrun nodes on one host, for the demo, tests and benchmarks.

Each :class:`TorchrunNode` is one real ``torchrun`` (or ``ftrun``) process
(one "node") with its own agent and workers, rendezvousing through etcd on
loopback.
:meth:`TorchrunNode.kill` SIGKILLs the agent *and* its workers, like losing
the machine: torchrun's workers live in their own sessions and would survive
their agent otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def torchrun_command() -> list[str]:
    """The ``torchrun`` console script of this Python, else ``-m torch.distributed.run``.

    A ``torchrun`` elsewhere on PATH may belong to another interpreter, which
    would not see this installation of elastic-ft.
    """
    script = Path(sys.executable).with_name("torchrun")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "torch.distributed.run"]


def ftrun_command() -> list[str]:
    """``ftrun`` of this Python (the module, so that no console script is needed)."""
    return [sys.executable, "-m", "elastic_ft.launcher.ftrun"]


def stranded_ranks(log: str) -> set[int]:
    """The initial ranks a job's log says their monitor process terminated because a restart could not reach
    their main thread: gloo's gap (a send being written when its connection failed waits with no socket left to
    cut; docs/inprocess.md, Known limitations), seen on loaded machines when a killed peer was mid-transfer. The
    rank's node respawns it, and the new process joins the running world at the next restart."""
    blocked = r"stacks of initial rank (\d+) \(pid \d+\), about to be terminated: a restart has not reached"
    return {int(rank) for rank in re.findall(blocked, log)}


def python_stacks(pids: Sequence[int]) -> str:
    """Every thread's Python stack in each of ``pids`` (``py-spy dump``), or why it could not be read: what
    tells a hung process from a slow one after the fact."""
    beside = Path(sys.executable).with_name("py-spy")
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        return "(no stacks: py-spy is not installed; pip install py-spy)"
    dumps = []
    for pid in pids:
        try:
            done = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30, check=False
            )
            dumps.append(f"---- process {pid}\n{done.stdout or done.stderr}")
        except subprocess.TimeoutExpired:
            dumps.append(f"---- process {pid}: py-spy took over 30 s")
    return "\n".join(dumps)


class NodeStillRunning(subprocess.TimeoutExpired):
    """A node's launcher outlived a wait; the message holds its log's tail and the stacks of it and its
    workers (read before anything ends them)."""

    def __init__(self, error: subprocess.TimeoutExpired, details: str) -> None:
        super().__init__(error.cmd, error.timeout)
        self.details = details

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.details}"


def descendants(pid: int) -> list[int]:
    """All live descendant PIDs of ``pid`` (Linux /proc)."""
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            stack += children
    return found


class TorchrunNode:
    def __init__(
        self,
        tag: str,
        *,
        endpoint: str,
        run_id: str,
        script: Sequence[str],
        nnodes: str = "1:2",
        nproc_per_node: int = 1,
        backend: str = "etcdft",
        rdzv_conf: str = "",
        max_restarts: int = 3,
        log_path: Path | None = None,
        extra_env: dict[str, str] | None = None,
        launcher: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.tag = tag
        command = [
            *(launcher or torchrun_command()),
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}",
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            "--local-addr=127.0.0.1",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1",
        ]
        if rdzv_conf:
            command.append(f"--rdzv-conf={rdzv_conf}")
        command += [*extra_args, *script]
        env = {**os.environ, "NODE_TAG": tag, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        self.log_path = log_path
        log = open(log_path, "wb") if log_path else None  # noqa: SIM115 - closed below
        try:
            self.process = subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.DEVNULL if log is None else log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if log is not None:
                log.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, timeout: float | None = None) -> int:
        """The launcher's exit code; :class:`NodeStillRunning` (a ``TimeoutExpired``) after ``timeout``."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired as error:
            stacks = python_stacks([self.pid, *descendants(self.pid)])
            raise NodeStillRunning(error, f"{self.log()[-4000:]}\n==== stacks\n{stacks}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def kill(self) -> list[int]:
        """SIGKILL the agent and every process below it; returns the PIDs killed."""
        victims = [self.pid, *descendants(self.pid)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        return victims

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.kill()
