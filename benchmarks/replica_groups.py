"""A fault in one replica group: elastic-ft's replica groups vs TorchFT 0.2.0, the same script, one run.

The script is ``examples/torchft_ddp.py`` (DDP, ``torch.optim.AdamW``, a
``DataLoader`` over TorchFT's ``DistributedSampler``, a ``Manager`` with the
model's and optimizer's state): elastic-ft runs it as it is; TorchFT runs it
with its one import line changed back to ``from torchft import ...`` and a
Lighthouse started with the settings of TorchFT's README
(``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``, its
default 5 s heartbeat timeout). Each replica group is one rank under its own
``torchrun --max-restarts`` (TorchFT's deployment); a step takes at least
``--step-time`` seconds (a stand-in for the accelerator's work).

At step ``--fault-step`` one group's worker raises or is SIGKILLed; its
torchrun restarts it, and it heals and joins again. Per run:

* **pause**: the healthy groups' longest time between two committed steps
  (the fault's cost to them; a step takes ``--step-time``);
* **outage steps**: the steps the healthy groups committed between the fault
  and the failed group's return;
* **together**: seconds from the fault until every group commits together
  again (most of it is the failed process's restart and imports);
* **ready->together**: the same, from the moment the replacement process
  was ready (built, about to take its first step);
* **batch**: the global batch of the steps committed during the outage (groups
  in the quorum x 32), and the full one;
* **healthy restarted**, **steps lost**: processes of healthy groups that were
  replaced, and the committed steps a healthy group lost (it restarted from
  an earlier step).

TorchFT runs in two variants: the script as it is (``torchft``) and with its
gradients averaged by ``manager.allreduce`` instead of TorchFT's DDP
(``torchft-allreduce``), since TorchFT 0.2.0's DDP hook fails the healthy
replicas when a peer dies mid all-reduce (see ``TORCHFT_VARIANTS``).

Prints a table (medians of ``--repeats``) and writes
``benchmarks/results/replica_groups.json``. TorchFT needs ``pip install
torchft==0.2.0`` (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import scratch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchft_ddp.py"
BATCH = 32
LIGHTHOUSE_PORT = 29510


#: The TorchFT variants: the script as it is (TorchFT's ``DistributedDataParallel``), and the same with its
#: gradients averaged by ``manager.allreduce`` after the backward pass: TorchFT 0.2.0's DDP hook asserts on a
#: failed all-reduce (``assert fut._fut`` in ``torchft/ddp.py``), which ends the healthy replicas too.
TORCHFT_VARIANTS = {
    "torchft": [],
    "torchft-allreduce": [
        ("    model = DistributedDataParallel(manager, model)\n", ""),
        (
            "            loss.backward()\n",
            (
                "            loss.backward()\n            for parameter in model.parameters():\n"
                "                manager.allreduce(parameter.grad).wait()\n"
            ),
        ),
    ],
}


def torchft_script(into: Path, system: str) -> Path:
    """The example with TorchFT's import (the one line a TorchFT user would not have changed), and the variant's
    edits."""
    text = EXAMPLE.read_text()
    for old, new in [("from elastic_ft.torchft import", "from torchft import"), *TORCHFT_VARIANTS[system]]:
        if old not in text:
            raise RuntimeError(f"{EXAMPLE} no longer has {old!r}")
        text = text.replace(old, new)
    script = into / f"torchft_ddp_{system}.py"
    script.write_text(text)
    return script


def run_job(system: str, groups: int, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from elastic_ft.etcd.server import EtcdServer

    out = scratch.workdir(f"{system}-{groups}-{kind}-")
    settings = {
        "steps": args.steps,
        "step_sleep": args.step_time,
        "fault": {"replica": groups - 1, "step": args.fault_step, "kind": kind},
        "out": str(out / "record"),
    }
    env = {**os.environ, "NUM_REPLICA_GROUPS": str(groups), "EFT_EXAMPLE": json.dumps(settings)}
    helpers: list[subprocess.Popen[bytes]] = []
    server = None
    if system == "elastic-ft":
        server = EtcdServer().start()
        env.update(ELASTIC_FT_ETCD_ENDPOINTS=server.endpoint, ELASTIC_FT_RUN_ID=f"bench-{uuid.uuid4().hex[:8]}")
        script = EXAMPLE
    else:
        script = torchft_script(out, system)
        lighthouse = shutil.which("torchft_lighthouse")
        if lighthouse is None:
            raise RuntimeError("torchft_lighthouse is not installed (pip install torchft==0.2.0)")
        command = [lighthouse, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
        command += ["--bind", f"[::]:{LIGHTHOUSE_PORT}"]
        with open(out / "lighthouse.log", "w") as log:
            helpers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        env["TORCHFT_LIGHTHOUSE"] = f"http://localhost:{LIGHTHOUSE_PORT}"
        time.sleep(1.0)
    try:
        launchers = []
        for replica in range(groups):
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
            command += ["--max-restarts=3", "--monitor-interval=0.1", str(script)]
            with open(out / f"replica{replica}.log", "w") as log:
                launchers.append(
                    subprocess.Popen(
                        command,
                        env={**env, "REPLICA_GROUP_ID": str(replica)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        codes = []
        for launcher in launchers:
            try:
                codes.append(launcher.wait(timeout=args.cap))
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, 9)
                codes.append(launcher.wait())
    finally:
        for helper in helpers:
            helper.kill()
            helper.wait()
        if server is not None:
            server.stop()
    return measure(out, groups, codes)


def _commits(steps: list[list[Any]]) -> list[tuple[int, float, int]]:
    return [tuple(entry) for i, entry in enumerate(steps) if i == 0 or entry[0] != steps[i - 1][0]]  # type: ignore[misc]


def measure(out: Path, groups: int, codes: list[int]) -> dict[str, Any]:
    """The fault's cost, from every process's record: see the module docstring."""
    records = [
        json.loads(path.read_text()) | {"replica": int(path.name.split(".")[1])}
        for path in out.glob("record.[0-9]*.json")
    ]
    fault_path = out / "record.fault.json"
    row: dict[str, Any] = {"workdir": str(out), "codes": codes}
    if not fault_path.exists() or any(codes):
        return row | {"error": "no fault recorded" if not fault_path.exists() else f"launchers exited {codes}"}
    fault_at = json.loads(fault_path.read_text())["at"]
    faulty = groups - 1
    healthy = [r for r in records if r["replica"] != faulty]
    back = [r for r in records if r["replica"] == faulty]
    pauses, lost, restarted = [], 0, 0
    for replica in {r["replica"] for r in healthy}:
        # A healthy group's process may have been replaced too (TorchFT's DDP): its timeline is every process's.
        mine = [r for r in healthy if r["replica"] == replica]
        restarted += sum(1 for r in mine if r["ready"] > fault_at)
        commits = sorted((t, s) for r in mine for s, t, _ in _commits(r["commits"]))
        times = [fault_at] + [t for t, _ in commits if t > fault_at]
        pauses.append(max((b - a for a, b in itertools.pairwise(times)), default=0.0))
        before = max((s for t, s in commits if t <= fault_at), default=0)
        after = min((s for t, s in commits if t > fault_at), default=before)
        lost = max(lost, before - after + 1)
    # The failed group's replacement: ready when built, about to take its first step. Every group commits
    # together again at the first step after that with every group in the quorum (TorchFT's quorum may still
    # count the dead group for its heartbeat timeout, so a count taken before the replacement was ready is none).
    ready = min((r["ready"] for r in back if r["ready"] > fault_at), default=None)
    together = min(
        (t for r in records for _, t, n in _commits(r["commits"]) if ready is not None and t > ready and n == groups),
        default=None,
    )
    outage_end = together if together is not None else float("inf")
    first_healthy = [r for r in healthy if r["replica"] == min(r["replica"] for r in healthy)]
    outage = [(s, t, n) for r in first_healthy for s, t, n in _commits(r["commits"]) if fault_at < t < outage_end]
    return row | {
        "pause": max(pauses),
        "outage_steps": len(outage),
        "together": None if together is None else together - fault_at,
        "ready_to_together": None if together is None or ready is None else together - ready,
        "outage_batch": sorted({n * BATCH for _, _, n in outage}),
        "healthy_restarted": restarted,
        "steps_lost": lost,
    }


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows if row.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="2,4", help="replica group counts (default 2,4)")
    parser.add_argument("--kinds", default="sigkill,raise")
    parser.add_argument("--systems", default="elastic-ft,torchft,torchft-allreduce")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--fault-step", type=int, default=60)
    parser.add_argument("--cap", type=float, default=240.0, help="seconds a job may take")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "replica_groups.json")
    args = parser.parse_args()
    systems = args.systems.split(",")
    if importlib.util.find_spec("torchft") is None:
        print("torchft is not installed: pip install torchft==0.2.0 (the bench extra); skipping its rows")
        systems = [system for system in systems if system not in TORCHFT_VARIANTS]
    results: dict[str, Any] = {"settings": vars(args) | {"out": str(args.out)}, "rows": []}
    header = (
        f"{'system':<17} {'groups':>6} {'fault':<7} {'pause s':>7} {'vs elastic-ft':>13} {'outage steps':>12} "
        f"{'together s':>10} {'ready->together':>15} {'outage batch':>12} {'full':>4} {'healthy restarted':>17} "
        f"{'steps lost':>10}"
    )
    print(header)
    for groups in [int(g) for g in args.groups.split(",")]:
        for kind in args.kinds.split(","):
            by_system = {}
            for system in systems:
                rows = [run_job(system, groups, kind, args) for _ in range(args.repeats)]
                by_system[system] = rows
                results["rows"].append({"system": system, "groups": groups, "kind": kind, "runs": rows})
            ours = median(by_system.get("elastic-ft", []), "pause")
            for system, rows in by_system.items():
                pause = median(rows, "pause")
                ratio = f"{pause / ours:.1f}x" if ours and pause and system != "elastic-ft" else ""
                batches = sorted({b for row in rows for b in row.get("outage_batch", [])})
                errors = [row["error"] for row in rows if "error" in row]
                print(
                    f"{system:<17} {groups:>6} {kind:<7} {_cell(pause):>7} {ratio:>13} "
                    f"{_cell(median(rows, 'outage_steps'), 0):>12} {_cell(median(rows, 'together')):>10} "
                    f"{_cell(median(rows, 'ready_to_together')):>15} {','.join(map(str, batches)) or '-':>12} "
                    f"{groups * BATCH:>4} {_cell(median(rows, 'healthy_restarted'), 0):>17} "
                    f"{_cell(median(rows, 'steps_lost'), 0):>10}" + (f"  errors: {errors}" if errors else "")
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    scratch.run_main(main)
