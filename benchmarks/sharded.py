"""Recovery of sharded training (FSDP2 on an HSDP mesh, DCP checkpoints): elastic-ft vs torchrun's full restart.

One run measures, side by side, the same script (``examples/train_fsdp.py``:
FSDP2 per block and on the root, a 2 x 2 HSDP mesh, AdamW, a DataLoader, a
DCP checkpoint every 8 steps), 4 workers on one node, default settings:

* **elastic-ft**: ``ftrun`` and ``Wrapper(rank_assignment=ShardedReplicas(2))``
  with peer healing: a lost rank takes its replica group out (1 x 2), its
  respawned process brings it back, each new rank healed with its own shard;
* **torchrun**: ``torchrun --max-restarts=3``, the script without a Wrapper:
  every fault restarts every worker, which resume from the last checkpoint.

Faults on rank 3 at step ``--fault-step``: an exception, SIGKILL, a hang
releasing the GIL, a hang holding it. Per run:

* ``resume``: from the fault to the first step after it completed by every
  rank that goes on (elastic-ft: the survivors, on 1 x 2 if one was lost);
* ``full``: elastic-ft, a rank lost: from the respawned process's readiness
  (its script started) to the first step every rank of the 2 x 2 world
  completed again;
* the checkpoint reads and the steps trained twice.

A run not recovered after ``--cap`` seconds is stopped and reported as
``> cap`` (torchrun has no hang detection). Steps idle ``--step-wait``
seconds (an accelerator's share of a step), which leaves a respawned
process time to start on a loaded machine. Prints a table and writes
``benchmarks/results/sharded.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import scratch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_fsdp.py"
RESULTS = Path(__file__).resolve().parent / "results" / "sharded.json"
KINDS = ("exception", "sigkill", "hang_gil_released", "hang_gil_held")
SYSTEMS = ("elastic_ft", "torchrun")


def events(work: Path, kind: str | None = None) -> list[dict[str, Any]]:
    found = []
    for path in work.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                continue  # a line being written
    return sorted((e for e in found if kind is None or e["event"] == kind), key=lambda e: e["t"])


def first_steps_after(work: Path, iteration: int, since: float) -> dict[int, float]:
    """Every rank's first step of ``iteration`` (or later) completed after ``since``: time by initial rank."""
    firsts: dict[int, float] = {}
    for event in events(work, "step"):
        if event["iteration"] >= iteration and event["t"] > since:
            firsts.setdefault(event["rank"], event["t"])
    return firsts


def steps_redone(work: Path) -> int:
    seen: dict[int, set[int]] = {}
    for event in events(work, "step"):
        seen.setdefault(event["step"], set()).add(event["iteration"])
    return sum(len(iterations) - 1 for iterations in seen.values())


def command(system: str, work: Path, args: argparse.Namespace, kind: str, endpoint: str) -> list[str]:
    script = [
        str(SCRIPT),
        "--workdir",
        str(work),
        "--steps",
        str(args.max_steps),
        "--step-wait",
        str(args.step_wait),
        "--stop-file",
        str(work / "stop"),
        "--fault",
        kind,
        "--fault-step",
        str(args.fault_step),
    ]
    # Both on the same etcd and rendezvous: only the restart strategy differs.
    launcher = (
        ["elastic_ft.launcher.ftrun"] if system == "elastic_ft" else ["torch.distributed.run", "--max-restarts=3"]
    )
    rendezvous = [
        "--nnodes=1:1",
        "--nproc-per-node=4",
        "--rdzv-backend=etcdft",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={work.name}",
        "--monitor-interval=0.1",
    ]
    return [sys.executable, "-m", *launcher, *rendezvous, *script, *(["--no-wrapper"] if system == "torchrun" else [])]


def stop_at(work: Path, step: int) -> None:
    (work / "stop.tmp").write_text(str(step))
    (work / "stop.tmp").replace(work / "stop")


def run_one(system: str, kind: str, args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    work = scratch.workdir(f"sharded-{system}-{kind}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"}
    with (work / "launcher.log").open("wb") as log:
        launcher = subprocess.Popen(
            command(system, work, args, kind, endpoint),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    row: dict[str, Any] = {"system": system, "kind": kind, "resume_s": None, "full_s": None}
    deadline: float | None = None
    try:
        while launcher.poll() is None:
            time.sleep(0.2)
            faults = events(work, "fault")
            if not faults:
                continue
            fault = faults[0]["t"]
            deadline = deadline or time.monotonic() + args.cap
            if time.monotonic() > deadline:
                row["capped"] = True
                break
            if (work / "stop").exists():
                continue
            starts = [e for e in events(work, "start") if e["t"] > fault]
            # The run ends 20 steps after what it waits for: the restart, and a lost rank's respawned process.
            respawned = [e for e in starts if e["rank"] >= 4 and e["mesh"] == [2, 2]]
            shrunk = system == "elastic_ft" and any(e["mesh"] == [1, 2] for e in starts)
            if starts and (respawned or not shrunk):
                stop_at(work, max(e["step"] for e in starts) + 20)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    faults = events(work, "fault")
    if not faults or row.get("capped"):
        return row | {"exit": launcher.returncode, "work": str(work)}
    fault = faults[0]["t"]
    starts = [e for e in events(work, "start") if e["t"] > fault]
    going_on = {e["rank"] for e in starts if e["iteration"] == min(s["iteration"] for s in starts)} if starts else set()
    resumed = first_steps_after(work, 1, fault)
    if going_on and going_on <= set(resumed):
        row["resume_s"] = max(resumed[rank] for rank in going_on) - fault
        row["mesh_after"] = next(e["mesh"] for e in starts)
    ready = [e["t"] for e in events(work, "ready") if e["rank"] >= 4]
    full = [e for e in starts if e["mesh"] == [2, 2] and ready and e["t"] > ready[0]]
    if full:
        back = first_steps_after(work, max(e["iteration"] for e in full), ready[0])
        if len(back) == 4:
            row["full_s"] = max(back.values()) - ready[0]
    row["checkpoint_reads"] = len(events(work, "checkpoint_read"))
    row["steps_redone"] = steps_redone(work)
    row["exit"] = launcher.returncode
    return row


def cell(values: list[float | None], cap: float) -> str:
    if not values:
        return ""
    if any(v is None for v in values):
        return f"> {cap:g}"
    return f"{statistics.median(v for v in values if v is not None):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--fault-step", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--step-wait", type=float, default=0.05)
    parser.add_argument("--cap", type=float, default=90.0, help="seconds after the fault a run may take")
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    from elastic_ft.etcd.server import EtcdServer

    rows = []
    with EtcdServer() as etcd:
        for _ in range(repeats):
            for kind in args.kinds.split(","):
                for system in args.systems.split(","):
                    row = run_one(system, kind, args, etcd.endpoint)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print(
        f"\nSharded recovery (FSDP2, HSDP 2 x 2 on one node, fault on rank 3 at step {args.fault_step}; "
        f"median of {repeats}; seconds)"
    )
    print(
        "| fault | system | resume | mesh after | world back at 2 x 2 after ready | checkpoint reads | steps redone |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for system in args.systems.split(","):
            mine = [r for r in rows if r["kind"] == kind and r["system"] == system]
            full = [r["full_s"] for r in mine if r.get("mesh_after") == [1, 2]]
            meshes = sorted({str(r.get("mesh_after")) for r in mine})
            reads = sorted({r.get("checkpoint_reads") for r in mine}, key=str)
            redone = sorted({r.get("steps_redone") for r in mine}, key=str)
            print(
                f"| {kind} | {system} | {cell([r['resume_s'] for r in mine], args.cap)} | {', '.join(meshes)} | "
                f"{cell(full, args.cap) if full else '-'} | {reads} | {redone} |"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    scratch.run_main(main)
