"""Run ``examples/torchft_ddp.py`` as a replicated job: one ``torchrun`` per replica group, as with TorchFT, or
one ``ftrun --replica-groups`` node per group.

Each group's launcher restarts its own workers after a fault (``--max-restarts``); the other groups'
processes run on. Every worker process writes a record when it finishes (its commits and final weights):
a group whose process was replaced leaves one record per process that finished.
"""

from __future__ import annotations

import contextlib
import importlib.util
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

from elastic_ft.testing.local_cluster import descendants, ftrun_command

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
    run_id: str

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
    *,
    launcher: str = "torchrun",
    nproc: int = 1,
    script: Path = EXAMPLE,
) -> ReplicatedJob:
    """Run ``groups`` replica groups of ``nproc`` ranks each until they all exit; ``meanwhile()`` runs once they
    started. ``launcher``: ``torchrun`` (``--standalone``, one each, told its id, as TorchFT's README runs
    them), ``etcdft`` (the same with a rendezvous of its own in etcd: ``--rdzv-backend=etcdft``), or ``ftrun``
    (``ftrun --replica-groups --nnodes=<groups>`` per group, which takes its group's id itself: the log of node
    ``i`` is ``replica<i>.log`` whatever id it took)."""
    if launcher not in ("torchrun", "etcdft", "ftrun"):
        raise ValueError(f"launcher is torchrun, etcdft or ftrun, got {launcher!r}")
    ftrun = launcher == "ftrun"
    out.mkdir(parents=True, exist_ok=True)
    run_id = f"replicas-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "EFT_EXAMPLE": json.dumps({**settings, "out": str(out / "record")})}
    if not ftrun:
        env.update({"ELASTIC_FT_ETCD_ENDPOINTS": endpoint, "ELASTIC_FT_RUN_ID": run_id})
        env["NUM_REPLICA_GROUPS"] = str(groups)
    processes = []
    for replica in range(groups):
        log = (out / f"replica{replica}.log").open("w")
        if ftrun:
            command = [*ftrun_command(), "--replica-groups", f"--nnodes={groups}", f"--rdzv-endpoint={endpoint}"]
            command += [f"--rdzv-id={run_id}"]
        elif launcher == "etcdft":
            command = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=etcdft", "--nnodes=1"]
            command += [f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}-group{replica}"]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={nproc}", "--max-restarts=3", "--monitor-interval=0.1", str(script)]
        process = subprocess.Popen(
            command,
            env=env if ftrun else {**env, "REPLICA_GROUP_ID": str(replica)},
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
    return ReplicatedJob(codes, records, logs, run_id)


def await_full_quorum(out: Path, groups: int, timeout: float = 120.0) -> None:
    """Return once every replica group has committed a step in a quorum of all ``groups``, as its processes'
    step logs (``<out>/record.<replica>.<pid>.steps.jsonl``) say: the job is up and trains together.

    Raises:
        TimeoutError: not within ``timeout`` seconds (the groups' logs are in ``out``).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        together = set()
        for path in out.glob("record.[0-9]*.steps.jsonl"):
            entries = [json.loads(line) for line in path.read_text().splitlines()[1:] if line.endswith("}")]
            if any(e["after"] == e["before"] + 1 and e["participants"] == groups for e in entries):
                together.add(int(path.name.split(".")[1]))
        if len(together) == groups:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the {groups} replica groups committed no step together within {timeout:.0f} s ({out})")


def _example() -> Any:
    """``examples/torchft_ddp.py`` as a module (its model, data and settings)."""
    spec = importlib.util.spec_from_file_location("torchft_ddp_example", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay_committed_steps(out: Path, groups: int, steps: int) -> list[list[float]]:
    """The model one process reaches by applying every committed step as the replica groups of its quorum
    computed it (each group's batch, the gradients averaged, AdamW), from the weights the first quorum started
    from: what the run must end with if no step was committed by some groups and not others, or lost.

    Raises:
        AssertionError: a step no group committed, or groups that disagree on how many took part in one.
    """
    import torch
    from torch import nn

    from elastic_ft.torchft import DistributedSampler

    example = _example()
    dataset = example.make_dataset()
    orders = {
        replica: list(DistributedSampler(dataset, replica, groups, group_rank=0, num_replicas=1))
        for replica in range(groups)
    }
    contributions: dict[int, list[tuple[int, int, int]]] = {}
    starts = []
    for path in out.glob("record.[0-9]*.steps.jsonl"):
        replica = int(path.name.split(".")[1])
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        entries = lines[1:]
        if entries and entries[0]["before"] == 0:
            starts.append(lines[0]["start"])
        for entry in entries:
            if entry["after"] == entry["before"] + 1:
                contributions.setdefault(entry["before"], []).append((replica, entry["batch"], entry["participants"]))
    assert starts and all(start == starts[0] for start in starts), "the processes at step 0 started apart"
    model = example.make_model()
    with torch.no_grad():
        for parameter, values in zip(model.parameters(), starts[0], strict=True):
            parameter.copy_(torch.tensor(values).reshape(parameter.shape))
    optimizer = torch.optim.AdamW(model.parameters(), lr=example.LEARNING_RATE)
    size = example.BATCH_SIZE
    for step in range(steps):
        found = sorted(contributions.get(step, []))
        assert found and all(n == len(found) for _, _, n in found), f"step {step} committed by {found}"
        total: list[torch.Tensor] | None = None
        for replica, batch, _ in found:
            order = orders[replica]
            start = (batch % -(-len(order) // size)) * size
            inputs, labels = dataset[order[start : start + size]]
            model.zero_grad()
            nn.functional.mse_loss(model(inputs), labels).backward()
            grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        for parameter, grad in zip(model.parameters(), total or [], strict=True):
            parameter.grad = grad / len(found)
        optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]
