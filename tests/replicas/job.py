"""Run ``examples/torchft_ddp.py`` as a replicated job: one ``torchrun`` per replica group, as with TorchFT.

Each group's torchrun restarts its own worker after a fault (``--max-restarts``); the other groups'
processes run on. Every worker process writes a record when it finishes (its commits and final weights):
a group whose process was replaced leaves one record per process that finished.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_ft.testing.local_cluster import descendants

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchft_ddp.py"


@dataclass
class ProcessRecord:
    replica: int
    pid: int
    #: (committed step, wall time, replica groups in the quorum), one per step, committed or not.
    steps: list[tuple[int, float, int]]
    weights: list[list[float]]

    @property
    def commits(self) -> list[tuple[int, float, int]]:
        """The steps that committed: those after which the step count grew."""
        return [entry for i, entry in enumerate(self.steps) if i == 0 or entry[0] != self.steps[i - 1][0]]

    def longest_pause(self, after: float = 0.0) -> float:
        """The longest time between two commits after ``after`` (wall time)."""
        times = [time for _, time, _ in self.commits if time >= after]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


@dataclass
class ReplicatedJob:
    codes: list[int]
    records: list[ProcessRecord]
    logs: list[str]

    def of(self, replica: int) -> list[ProcessRecord]:
        return [record for record in self.records if record.replica == replica]

    def describe(self) -> str:
        return "\n".join(f"--- replica {i} ---\n{log[-4000:]}" for i, log in enumerate(self.logs))


def run_replicated(
    endpoint: str,
    groups: int,
    out: Path,
    settings: dict[str, Any],
    reap: list[int],
    timeout: float = 240,
    meanwhile: Callable[[], None] | None = None,
) -> ReplicatedJob:
    """Run ``groups`` replica groups of one rank each until they all exit; ``meanwhile()`` runs once they started."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "ELASTIC_FT_ETCD_ENDPOINTS": endpoint,
        "ELASTIC_FT_RUN_ID": f"replicas-{uuid.uuid4().hex[:8]}",
        "NUM_REPLICA_GROUPS": str(groups),
        "EFT_EXAMPLE": json.dumps({**settings, "out": str(out / "record")}),
    }
    processes = []
    for replica in range(groups):
        log = (out / f"replica{replica}.log").open("w")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
        command += ["--max-restarts=3", "--monitor-interval=0.1", str(EXAMPLE)]
        process = subprocess.Popen(
            command,
            env={**env, "REPLICA_GROUP_ID": str(replica)},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        reap.append(process.pid)
        processes.append(process)
    deadline = time.monotonic() + timeout
    if meanwhile is not None:
        meanwhile()
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            workers = descendants(process.pid)  # torchrun's workers run in sessions of their own
            os.killpg(process.pid, 9)
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            codes.append(process.wait())
    records = []
    for path in sorted(out.glob("record.[0-9]*.json")):
        document = json.loads(path.read_text())
        replica = int(path.name.split(".")[1])
        steps = [tuple(entry) for entry in document["commits"]]
        records.append(ProcessRecord(replica, document["pid"], steps, document["weights"]))  # type: ignore[arg-type]
    logs = [(out / f"replica{replica}.log").read_text(errors="replace") for replica in range(groups)]
    return ReplicatedJob(codes, records, logs)
