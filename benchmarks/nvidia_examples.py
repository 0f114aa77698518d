"""NVIDIA's inprocess examples (v0.4.1) under ``ftrun``, with only the import swapped, under real faults.

NVIDIA's ``examples/inprocess/basic_example.py`` and ``optimal_example.py``
are taken from a clone of NVIDIA/nvidia-resiliency-ext at tag v0.4.1
(``git archive``), and their import is swapped
(``nvidia_resiliency_ext.inprocess`` -> ``elastic_ft.inprocess``); nothing
else changes: they run on the CPU with gloo by default. Each run starts
``ftrun --nproc-per-node=3 --max-restarts=0`` (one host, an embedded etcd)
and, once the job has written its first checkpoint, injects one fault:

* ``sigkill``: a worker (local rank 1) SIGKILLed from outside;
* ``hang``: a worker (local rank 1) SIGSTOPped from outside: it hangs;
* ``exception``: the examples' own fault injection (``--fault-prob``), a
  ``RuntimeError`` raised at random iterations of random ranks (about six
  per run).

Local rank 1, not 0: ``optimal_example.py`` keeps one TCPStore of its own
for the whole job, hosted by rank 0, which no restart can replace.

A run passes when ``ftrun`` exits 0 without escalating (no process-level
restart: every fault absorbed in-process) and the Wrapper restarted in
process at least once. Prints a table (passes per example and fault, the
median seconds from the fault to the next iteration's start as the
Wrapper's log shows it) and writes JSON.

Not run by CI (it needs NVIDIA's repository);
``python benchmarks/nvidia_examples.py NVIDIA_REPO --runs 10``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import scratch

EXAMPLES = ("basic_example", "optimal_example")
FAULTS = ("sigkill", "hang", "exception")
RESULTS = Path(__file__).resolve().parent / "results" / "nvidia_examples.json"
FTRUN = [sys.executable, "-m", "elastic_ft.launcher.ftrun"]
NPROC = 3
EXPECTED_EXCEPTIONS = 6
# The Wrapper's restart report, in elastic-ft's log format or, as here, the example's own (the Wrapper's
# handler takes the formatter of the application's): "W1126 21:32:50.655 ..." or "2026-11-26 21:32:50,655 | ...".
RESTART = re.compile(
    r"^(?:W\d{4} |\d{4}-\d\d-\d\d )(\d\d):(\d\d):(\d\d[.,]\d+) .*\biteration (\d+) restarts", re.MULTILINE
)


def extract(repo: Path, into: Path) -> dict[str, Path]:
    """NVIDIA's examples at v0.4.1, their import swapped."""
    git_dir = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--absolute-git-dir"], check=True, capture_output=True, text=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", f"--git-dir={git_dir}", "archive", "v0.4.1", "examples/inprocess"], check=True, capture_output=True
    ).stdout
    path = into / "nvidia.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    scripts = {}
    for name in EXAMPLES:
        script = into / "examples" / "inprocess" / f"{name}.py"
        text = script.read_text()
        swapped = text.replace(
            "import nvidia_resiliency_ext.inprocess as inprocess", "import elastic_ft.inprocess as inprocess"
        )
        if swapped == text:
            raise RuntimeError(f"{script}: NVIDIA's import line was not found")
        script.write_text(swapped)
        scripts[name] = script
    return scripts


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(p) for p in file.read().split()]
    except OSError:
        return []


def _local_worker(ftrun: int, script: Path, local_rank: int) -> int | None:
    """The pid of the agent's worker with ``LOCAL_RANK=local_rank`` running ``script``."""
    for pid in _children(ftrun):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(script).encode() in cmdline and f"LOCAL_RANK={local_rank}".encode() in environ:
            return pid
    return None


def _restart_times(log: str) -> list[float]:
    """Seconds of the day at which the Wrapper's reporting rank logged each in-process restart."""
    return [int(h) * 3600 + int(m) * 60 + float(s.replace(",", ".")) for h, m, s, _ in RESTART.findall(log)]


def run_once(script: Path, fault: str, workdir: Path, timeout: float, iterations: int) -> dict[str, Any]:
    checkpoints = workdir / "checkpoints"
    checkpoints.mkdir(parents=True)
    # About EXPECTED_EXCEPTIONS faults per run: the examples draw one per rank and iteration.
    prob = f"{EXPECTED_EXCEPTIONS / (NPROC * iterations):.6f}" if fault == "exception" else "0"
    command = [
        *FTRUN,
        f"--nproc-per-node={NPROC}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        str(script),
        "--total-iterations",
        str(iterations),
        "--chkpt-interval",
        "100",
        "--log-interval",
        "1000",
        "--path",
        str(checkpoints),
        "--fault-prob",
        prob,
    ]
    log_path = workdir / "ftrun.log"
    started = time.monotonic()
    injected_at = None
    with log_path.open("w") as log:
        ftrun = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = started + timeout
        while ftrun.poll() is None and time.monotonic() < deadline:
            if injected_at is None and fault != "exception" and (checkpoints / "checkpoint.pt").exists():
                pid = _local_worker(ftrun.pid, script, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
                    injected_at = time.time()
            time.sleep(0.05)
        if ftrun.poll() is None:
            os.killpg(ftrun.pid, signal.SIGKILL)
            ftrun.wait()
            code: int | None = None
        else:
            code = ftrun.returncode
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(ftrun.pid, signal.SIGKILL)
    text = log_path.read_text(errors="replace")
    restarts = _restart_times(text)
    escalated = "escalating to a process-level restart" in text or "no restarts are left" in text
    resume = None
    if injected_at is not None and restarts:
        local = time.localtime(injected_at)
        injected = local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + injected_at % 1
        later = [t - injected for t in restarts if t >= injected - 0.5]
        resume = round(min(later), 3) if later else None
    passed = code == 0 and not escalated and bool(restarts) and (fault == "exception" or injected_at is not None)
    return {
        "exit": code,
        "escalated": escalated,
        "in_process_restarts": len(restarts),
        "restart_after": resume,
        "seconds": round(time.monotonic() - started, 1),
        "passed": passed,
        "log_tail": "" if passed else text[-3000:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo", type=Path, help="a clone of NVIDIA/nvidia-resiliency-ext with the v0.4.1 tag")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take")
    parser.add_argument(
        "--iterations",
        type=int,
        default=4000,
        help="the examples' --total-iterations (a respawned worker needs a few seconds to rejoin)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    work = scratch.workdir("nvidia-examples-")
    scripts = extract(args.repo, work)
    runs: list[dict[str, Any]] = []
    for name in args.examples.split(","):
        for fault in args.faults.split(","):
            for index in range(args.runs):
                result = run_once(scripts[name], fault, work / f"{name}-{fault}-{index}", args.timeout, args.iterations)
                runs.append({"example": name, "fault": fault, "run": index, **result})
                print(
                    f"  {name:<16} {fault:<10} run {index}: "
                    + (
                        "pass" if result["passed"] else f"FAIL (exit {result['exit']}, escalated {result['escalated']})"
                    ),
                    flush=True,
                )
    print(
        "\n| example | fault | passed | in-process restarts (median) | Wrapper restart after the fault, median | "
        "run time, median |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    table = []
    for name in args.examples.split(","):
        for fault in args.faults.split(","):
            mine = [r for r in runs if r["example"] == name and r["fault"] == fault]
            delays = [r["restart_after"] for r in mine if r["restart_after"] is not None]
            row = {
                "example": name,
                "fault": fault,
                "passed": sum(r["passed"] for r in mine),
                "runs": len(mine),
                "restarts": statistics.median(r["in_process_restarts"] for r in mine),
                "restart_after": statistics.median(delays) if delays else None,
                "seconds": statistics.median(r["seconds"] for r in mine),
            }
            table.append(row)
            after = "-" if row["restart_after"] is None else f"{row['restart_after']:.2f} s"
            print(
                f"| {name} | {fault} | {row['passed']} of {row['runs']} | {row['restarts']:g} | {after} | "
                f"{row['seconds']:.1f} s |"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"table": table, "runs": runs}, indent=2))
    print(f"\nwrote {args.out}")
    sys.exit(0 if all(r["passed"] for r in runs) else 1)


if __name__ == "__main__":
    scratch.run_main(main)
