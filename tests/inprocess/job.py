"""Start a test job as independent rank processes and collect what each rank reported.

Ranks are plain processes with the standard ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` environment, not torchrun workers: torchrun
would kill every worker when one fails, which is the very situation the
Wrapper must survive. They are forked from a process that imported torch
once (``forkserver.py``); each writes its output to ``output<rank>.log``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from elastic_ft.testing.ports import port_is_free
from tests.inprocess.forkserver import ForkServer

WORKER = Path(__file__).with_name("worker.py")
#: What the fork server imports once, for every rank it forks: what ``worker.py`` imports, and torch._dynamo,
#: which a process imports at its first optimizer (about 1 s of CPU; the server starts no thread with it).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "elastic_ft.inprocess.wrapper",
    "elastic_ft.coordination.iteration",
]
_server: ForkServer | None = None


@dataclasses.dataclass
class RankOutcome:
    """How one rank ended: exit code, its report (if it wrote one) and its output."""

    returncode: int
    report: dict[str, Any] | None
    output: str

    @property
    def result(self) -> dict[str, Any] | None:
        return None if self.report is None else self.report.get("result")

    @property
    def error(self) -> str | None:
        return None if self.report is None else self.report.get("error")


def free_port_pair() -> int:
    """A port P such that P and P + 1 are free (torch's store, the Wrapper's store)."""
    for _ in range(200):
        port = random.randint(20000, 60000)
        if port_is_free(port) and port_is_free(port + 1):
            return port
    raise RuntimeError("no free pair of ports")


def _fork_server() -> ForkServer:
    """This pytest process's fork server (``forkserver.py``), started at the first job."""
    global _server
    if _server is None or not _server.alive():
        _server = ForkServer(PRELOAD)
    return _server


def run_job(scenario: dict[str, Any], world_size: int, out: Path, timeout: float = 90) -> list[RankOutcome]:
    """Run ``world_size`` ranks of ``worker.py`` and wait for all of them."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port_pair()
    server = _fork_server()
    pids, logs = [], []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "EFT_SCENARIO": json.dumps(scenario),
            "EFT_OUT": str(out),
        }
        logs.append(out / f"output{rank}.log")
        with logs[-1].open("wb") as log:
            pids.append(server.start([str(WORKER)], env, os.getcwd(), log.fileno()))
    deadline = time.monotonic() + timeout
    codes = [server.wait(pid, max(deadline - time.monotonic(), 0.1)) for pid in pids]
    killed = [code is None for code in codes]
    for pid, kill in zip(pids, killed, strict=True):
        if kill:
            server.kill(pid)
    codes = [server.wait(pid, 30) if kill else code for pid, code, kill in zip(pids, codes, killed, strict=True)]
    outcomes = []
    for rank, (code, log) in enumerate(zip(codes, logs, strict=True)):
        output = log.read_text(errors="replace") + ("\n<killed by the test: job timeout>" if killed[rank] else "")
        report_path = out / f"rank{rank}.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        outcomes.append(RankOutcome(-9 if code is None else code, report, output))
    return outcomes


def seconds_since_the_first_call(outcomes: list[RankOutcome]) -> float:
    """Seconds from the first call of the wrapped function, on any rank, to now: a job's time without its
    processes' start (importing torch), which a loaded machine stretches by seconds."""
    entered = [o.report["calls"][0]["entered"] for o in outcomes if o.report is not None and o.report["calls"]]
    assert entered, "no rank reported a call"
    return time.time() - min(entered)


def describe(outcomes: list[RankOutcome], out: Path) -> str:
    """Everything about a job, for assertion messages."""
    parts = []
    for rank, outcome in enumerate(outcomes):
        parts.append(f"--- rank {rank}: exit {outcome.returncode}, report {outcome.report}\n{outcome.output[-3000:]}")
        log = out / f"monitor{rank}.log"
        if log.exists():
            parts.append(f"--- monitor {rank} log:\n{log.read_text()[-2000:]}")
    return "\n".join(parts)
