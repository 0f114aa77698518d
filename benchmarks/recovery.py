"""Recovery of real training, every fault kind: elastic-ft vs torchrun's full restart vs NVIDIA's in-process Wrapper.

One run measures, side by side, the same script (``examples/train_ftrun.py``:
DDP, ``torch.optim.AdamW``, a ``DataLoader`` with ``DistributedSampler``, an
atomic checkpoint), with default settings everywhere, 4 workers:

* **elastic-ft**: 2 simulated nodes x 2 workers under ``ftrun`` (etcd, the
  Wrapper with its default settings);
* **torchrun**: the same nodes under ``torchrun --max-restarts=3`` (the etcdft
  rendezvous, so only the restart strategy differs), the script without a
  Wrapper: every fault restarts every worker;
* **NVIDIA**: ``nvidia_resiliency_ext==0.4.1``'s ``inprocess.Wrapper`` with its
  default settings on the same training function, 4 independent processes
  (its Wrapper cannot run under torchrun, which kills every worker at a
  fault).

Faults, injected at step ``--fault-step`` on initial rank 1: an exception,
SIGKILL, a hang holding the GIL, a hang releasing it (``time.sleep``), and
SIGSTOP. Recovery time: from the fault to the first completed step of every
rank that goes on. A run that has not recovered after the cap of its system
(``--cap``) is stopped and reported as ``> cap``; it is not repeated, since
nothing in the system could end such a stall earlier (torchrun has no hang
detection; a gloo collective blocked on a peer waits for its 30-minute
default timeout).

The first-time rows (skipped by ``--quick`` and ``--no-first-time``) time
a rank's first iteration, by ``benchmarks/spares.py``'s scenarios with its
defaults: a late hot spare replacing a SIGKILLed node, and a SIGKILLed
worker whose place the node's warm standby takes; their admitting restart
gets a column of the per-phase table.

The steady-state part runs the script with and without the Wrapper, 2
workers each pinned to a CPU, ``--steady-rounds`` rounds in alternating
order, and reports the Wrapper's step-time overhead, by the clock and by CPU
accounting (see :func:`steady_state`).

Prints tables and writes ``benchmarks/results/recovery.json``. The NVIDIA
rows need ``pip install nvidia-resiliency-ext==0.4.1`` (in the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import scratch
from phases import print_phase_table, run_phases

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_ftrun.py"
RESULTS = Path(__file__).resolve().parent / "results" / "recovery.json"
KINDS = ("raise", "sigkill", "hang_gil_held", "hang_gil_released", "sigstop")
SYSTEMS = ("elastic_ft", "torchrun", "nvidia")
CONF = "last_call_timeout=1,lease_ttl=5,join_timeout=120"
#: Each fault kind's goal for elastic-ft: the median recovery under it, and every run under :data:`WORST_GOAL`.
GOALS = {"raise": 0.5, "sigkill": 0.5, "hang_gil_held": 1.0, "hang_gil_released": 1.0, "sigstop": 1.0}
WORST_GOAL = 2.0
#: The first-time rows (``benchmarks/spares.py``'s, run here with its defaults): a rank's first iteration.
FIRST_TIME = {
    "hot_spare_late": "late hot spare: node SIGKILLed -> world of 4 again",
    "at_once": "respawned worker (warm standby): SIGKILL -> world of 4 again",
}


# ---------------------------------------------------------------- one job


def fault_time(workdir: Path) -> float | None:
    """When the script injected its fault (wall time), None without one."""
    events = [json.loads(line) for path in workdir.glob("events-*.jsonl") for line in path.open()]
    return min((e["t"] for e in events if e["event"] == "fault"), default=None)


def recovery_seconds(workdir: Path, until: str = "first_step") -> float | None:
    """Fault -> ``until`` (by default the first step) of the last rank that goes on; None if one never got there.

    ``until="enter"``: the wrapped function entered again, the Wrapper's share of the recovery.
    """
    events = [json.loads(line) for path in workdir.glob("events-*.jsonl") for line in path.open()]
    faults = [e for e in events if e["event"] == "fault"]
    if not faults:
        return None
    fault = faults[0]
    firsts: dict[int, float] = {}
    for event in sorted(events, key=lambda e: e["t"]):
        if event["event"] == until and event["t"] > fault["t"]:
            firsts.setdefault(event["rank"], event["t"])
    survivors = {e["rank"] for e in events if e["event"] == "done"}
    if not survivors or not survivors <= set(firsts):
        return None
    return max(firsts[rank] for rank in survivors) - fault["t"]


def survivors(workdir: Path) -> int:
    """How many ranks finished the job."""
    return len(list(workdir.glob("done-*.json")))


def _script_args(workdir: Path, args: argparse.Namespace, kind: str) -> list[str]:
    return [
        str(SCRIPT),
        "--workdir",
        str(workdir),
        "--steps",
        str(args.steps),
        "--hidden",
        str(args.hidden),
        "--fault",
        kind,
        "--fault-rank",
        "1",
        "--fault-step",
        str(args.fault_step),
    ]


def _wait_all(processes: list[Any], cap: float) -> bool:
    """Wait for every process until ``cap`` seconds; False (after killing them) if the cap was hit."""
    deadline = time.monotonic() + cap
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in processes):
            return True
        time.sleep(0.2)
    return False


def run_nodes(system: str, kind: str, args: argparse.Namespace, etcd: Any) -> dict[str, Any]:
    from elastic_ft.testing.local_cluster import TorchrunNode, ftrun_command, torchrun_command

    workdir = scratch.workdir(f"recovery-{system}-{kind}-")
    script = _script_args(workdir, args, kind) + (["--no-wrapper"] if system == "torchrun" else [])
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    nodes = [
        TorchrunNode(
            tag,
            endpoint=etcd.endpoint,
            run_id=run_id,
            script=script,
            nnodes="2:2",
            nproc_per_node=2,
            rdzv_conf=CONF,
            max_restarts=0 if system == "elastic_ft" else 3,
            log_path=workdir / f"node-{tag}.log",
            extra_env={"OMP_NUM_THREADS": "1"},
            launcher=ftrun_command() if system == "elastic_ft" else torchrun_command(),
        )
        for tag in "AB"
    ]
    try:
        finished = _wait_all([node.process for node in nodes], args.cap)
    finally:
        for node in nodes:
            node.terminate()
    timed = run_phases(run_id, etcd.endpoints, fault_time(workdir)) if system == "elastic_ft" else None
    return {
        "seconds": recovery_seconds(workdir) if finished else None,
        "wrapper_seconds": recovery_seconds(workdir, "enter") if finished and system == "elastic_ft" else None,
        "phases": timed,
        "survivors": survivors(workdir),
        "finished": finished,
        "dir": str(workdir),
    }


def run_nvidia(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from elastic_ft.runtime.net import free_port
    from elastic_ft.testing.ports import port_is_free

    workdir = scratch.workdir(f"recovery-nvidia-{kind}-")
    port = free_port()
    while not port_is_free(port + 1):  # MASTER_PORT for the process groups' store, MASTER_PORT + 1 for NVIDIA's own
        port = free_port()
    env = {
        **os.environ,
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--nvidia-worker", *_script_args(workdir, args, kind)[1:]],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=open(workdir / f"stderr-{rank}.txt", "w"),  # noqa: SIM115 - closed with the process
            start_new_session=True,
        )
        for rank in range(4)
    ]
    try:
        finished = _wait_all(processes, args.cap)
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            process.wait()
    return {"seconds": recovery_seconds(workdir) if finished else None, "finished": finished, "dir": str(workdir)}


def nvidia_worker(argv: list[str]) -> None:
    """One rank: the example's training function under NVIDIA's Wrapper, default settings."""
    from nvidia_resiliency_ext import inprocess

    spec = importlib.util.spec_from_file_location("train_ftrun", SCRIPT)
    example = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(example)  # type: ignore[union-attr]
    args = example.parse_args([*argv, "--reload-checkpoint"])  # NVIDIA's Wrapper heals no state from peers
    os.environ["ELASTIC_FT_INITIAL_RANK"] = os.environ["RANK"]
    state = example.TrainingState(args.hidden, args.samples)

    def train(call_wrapper: inprocess.CallWrapper = None) -> dict:
        return example.train(args, state, call_wrapper)

    train.__annotations__ = {"call_wrapper": inprocess.CallWrapper, "return": dict}  # its Wrapper matches the object
    wrapper = inprocess.Wrapper(store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 1})
    result = wrapper(train)()
    if result is not None:
        example.record(args, "done", step=result["step"], iteration=result["iteration"])


# ---------------------------------------------------------------- steady state


def _monitor_cpu_rate(running: subprocess.Popen[bytes]) -> float:
    """CPU seconds per second of one Wrapper monitor process (named ``eft-monitor``) in the second half of the run.

    The first half holds the monitor's start (its etcd connection), a cost
    paid once per process, not per step.
    """
    hertz = os.sysconf("SC_CLK_TCK")
    samples: dict[int, list[tuple[float, float]]] = {}
    while running.poll() is None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                if (entry / "comm").read_text().strip() == "eft-monitor":
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    cpu = (int(fields[11]) + int(fields[12])) / hertz
                    samples.setdefault(int(entry.name), []).append((time.monotonic(), cpu))
        time.sleep(0.1)
    rates = []
    for series in samples.values():
        (start, cpu_start), (end, cpu_end) = series[len(series) // 2], series[-1]
        if end - start > 1.0:
            rates.append((cpu_end - cpu_start) / (end - start))
    return statistics.mean(rates) if rates else 0.0


def _step_hook_seconds() -> float:
    """Seconds per call of the Wrapper's optimizer-step hook (the adaptive timeouts' step clock), default settings."""
    from elastic_ft.inprocess.hangs.heartbeats import ProgressTimestamps, StepClock
    from elastic_ft.inprocess.hangs.verdicts import AdaptiveTimeouts

    clock = StepClock(ProgressTimestamps(), AdaptiveTimeouts(), 60.0, 90.0)
    calls = 100_000
    start = time.perf_counter()
    for _ in range(calls):
        clock.step()
    return (time.perf_counter() - start) / calls


def steady_state(args: argparse.Namespace) -> dict[str, Any]:
    """Step time with and without the Wrapper, by the clock and by accounting the Wrapper's own work.

    Wall-clock step times on a small shared machine vary by more than the
    overhead to measure, so the Wrapper's costs are also accounted one by
    one: its optimizer-step hook on the main thread (timed in this process),
    the CPU of the rank's other threads beyond a run without the Wrapper
    (its monitor and watchdog threads and their etcd streams), and its monitor
    process in steady state. The background part costs step time only where
    the node has no core to spare for it; here each rank and its monitor
    process share one pinned CPU, the worst case.
    """
    from elastic_ft.testing.local_cluster import ftrun_command

    rounds: list[dict[str, Any]] = []
    for index in range(args.steady_rounds):
        order = ("plain", "wrapper") if index % 2 == 0 else ("wrapper", "plain")
        measured: dict[str, Any] = {}
        for variant in order:
            workdir = scratch.workdir(f"recovery-steady-{variant}-")
            command = [
                *ftrun_command(),
                "--nproc-per-node=2",
                str(SCRIPT),
                "--workdir",
                str(workdir),
                "--steps",
                str(args.steady_steps),
                "--hidden",
                str(args.hidden),
                "--pin-cpu",
                "--checkpoint-every",
                "100000",
            ]
            if variant == "plain":
                command.append("--no-wrapper")
            with subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
            ) as running:
                monitor_rate = _monitor_cpu_rate(running)
                stderr = running.stderr.read() if running.stderr else b""
            if running.returncode != 0:
                raise RuntimeError(f"steady-state run failed ({running.returncode}): {stderr.decode()[-2000:]}")
            results = [json.loads(p.read_text()) for p in workdir.glob("done-*.json")]
            step = statistics.mean(r["step_seconds"] for r in results)
            measured[variant] = {
                "step": step,
                "main_cpu": statistics.mean(r["step_cpu_seconds"]["main"] for r in results),
                "other_threads_cpu": statistics.mean(r["step_cpu_seconds"]["other_threads"] for r in results),
                "monitor_process_cpu": monitor_rate * step,
            }
        rounds.append(measured)
        print(
            f"  steady round {index}: "
            + ", ".join(
                f"{v} {m['step'] * 1e3:.2f} ms (main thread CPU {m['main_cpu'] * 1e3:.2f} ms)"
                for v, m in measured.items()
            ),
            flush=True,
        )

    def median(variant: str, figure: str) -> float:
        return statistics.median(r[variant][figure] for r in rounds)

    def paired(figure: str) -> float:
        return statistics.median(r["wrapper"][figure] / r["plain"][figure] - 1 for r in rounds)

    threads = max(0.0, median("wrapper", "other_threads_cpu") - median("plain", "other_threads_cpu"))
    monitor = median("wrapper", "monitor_process_cpu")
    hook = _step_hook_seconds()
    step = median("plain", "step")
    return {
        "rounds": rounds,
        "plain_median": median("plain", "step"),
        "wrapper_median": median("wrapper", "step"),
        "overhead_paired": paired("step"),
        "overhead_of_medians": median("wrapper", "step") / median("plain", "step") - 1,
        "noise_plain": (min(r["plain"]["step"] for r in rounds), max(r["plain"]["step"] for r in rounds)),
        "accounted": {
            "step_hook": hook / step,
            "rank_threads": threads / step,
            "monitor_process": monitor / step,
            "total": (hook + threads + monitor) / step,
        },
    }


def first_time_runs(etcd: Any) -> dict[str, dict[str, Any]]:
    """One run of each first-time row (:data:`FIRST_TIME`), by ``benchmarks/spares.py`` with its defaults: the
    seconds to the world of 4 again and the phases of the restart that admitted the new ranks."""
    import spares

    options = spares.build_parser().parse_args([])
    late = spares.run_node_kill("hot_spare_late", options, etcd)
    respawned = spares.run_respawn_at_once("at_once", options, etcd)
    return {
        "hot_spare_late": {"seconds": late["seconds"], "phases": late["phases"], "dir": late["dir"]},
        "at_once": {
            "seconds": respawned["full_world_seconds"],
            "phases": respawned["admission_phases"],
            "from_standby": respawned["from_standby"],
            "dir": respawned["dir"],
        },
    }


# ---------------------------------------------------------------- driver


def _cell(values: list[float | None], cap: float) -> str:
    measured = [v for v in values if v is not None]
    if not measured:
        return f"> {cap:.0f} (n={len(values)})"
    median = statistics.median(measured)
    text = f"{median:.3f} ({min(measured):.3f}-{max(measured):.3f})"
    return text + (f", {len(values) - len(measured)} > {cap:.0f}" if len(measured) < len(values) else "")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--nvidia-worker":
        nvidia_worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--fault-step", type=int, default=40)
    parser.add_argument(
        "--hidden", type=int, default=1024, help="model width (1024: about 20 ms steps on the 2-core dev machine)"
    )
    parser.add_argument("--cap", type=float, default=150.0, help="seconds after which a run counts as not recovered")
    parser.add_argument("--steady-rounds", type=int, default=6)
    parser.add_argument("--steady-steps", type=int, default=400)
    parser.add_argument("--only", choices=("recovery", "steady"))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI's mode: elastic-ft alone, one run of each fault, the recovery and per-phase tables (no steady state)",
    )
    parser.add_argument(
        "--no-first-time",
        action="store_true",
        help="skip the first-time rows (a late hot spare's and a respawned worker's first iteration)",
    )
    parser.add_argument("--out", type=Path, help="the JSON file to write (default: benchmarks/results/recovery*.json)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.systems, args.only, args.no_first_time = 1, "elastic_ft", "recovery", True
    kinds = args.kinds.split(",")
    systems = args.systems.split(",")
    if "nvidia" in systems and importlib.util.find_spec("nvidia_resiliency_ext") is None:
        print("nvidia-resiliency-ext is not installed: no NVIDIA rows (pip install nvidia-resiliency-ext==0.4.1)")
        systems.remove("nvidia")
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "args": vars(args),
    }
    if args.only != "steady":
        from elastic_ft.etcd.server import EtcdServer

        latencies: dict[str, dict[str, list[float | None]]] = {s: {k: [] for k in kinds} for s in systems}
        runs: list[dict[str, Any]] = []
        first_time: dict[str, list[dict[str, Any]]] = {row: [] for row in FIRST_TIME}
        with EtcdServer() as etcd:
            for repeat in range(args.repeats):
                for kind in kinds:
                    for system in systems:
                        if repeat > 0 and latencies[system][kind] and latencies[system][kind][0] is None:
                            continue  # capped once: it would be capped again
                        run = run_nvidia(kind, args) if system == "nvidia" else run_nodes(system, kind, args, etcd)
                        latencies[system][kind].append(run["seconds"])
                        runs.append({"system": system, "kind": kind, "repeat": repeat, **run})
                        shown = "capped" if run["seconds"] is None else f"{run['seconds']:.3f} s"
                        print(f"  {system:<10} {kind:<18} repeat {repeat}: {shown}", flush=True)
                if not args.no_first_time and "elastic_ft" in systems:
                    for row, run in first_time_runs(etcd).items():
                        first_time[row].append(run)
                        print(f"  first-time {row:<16} repeat {repeat}: {run['seconds']}", flush=True)
        report["recovery"] = {"latencies": latencies, "runs": runs}
        names = {
            "elastic_ft": "elastic-ft (ftrun)",
            "torchrun": "torchrun full restart",
            "nvidia": "NVIDIA inprocess 0.4.1",
        }
        print(
            f"\nRecovery, fault -> first step of every surviving rank (seconds; median (min-max) of {args.repeats};"
            f" 2 nodes x 2 workers; DDP + AdamW, default settings)"
        )
        print("| fault | " + " | ".join(names[s] for s in systems) + " | goal | vs torchrun | vs NVIDIA |")
        print("| --- | " + " | ".join("---" for _ in systems) + " | --- | --- | --- |")
        for kind in kinds:
            cells = [_cell(latencies[s][kind], args.cap) for s in systems]
            ours = [v for v in latencies.get("elastic_ft", {}).get(kind, []) if v is not None]
            ratios = []
            for other in ("torchrun", "nvidia"):
                theirs = [v for v in latencies.get(other, {}).get(kind, []) if v is not None]
                if not ours or other not in systems:
                    ratios.append("-")
                elif theirs:
                    ratios.append(f"{statistics.median(theirs) / statistics.median(ours):.1f}x")
                else:
                    ratios.append(f"> {args.cap / statistics.median(ours):.0f}x")
            goal = f"< {GOALS[kind]:g}, worst < {WORST_GOAL:g}"
            print(f"| {kind} | " + " | ".join(cells) + f" | {goal} | {ratios[0]} | {ratios[1]} |")
        if "elastic_ft" in systems:
            print(
                "\nelastic-ft: the Wrapper's share (fault -> function entered again on every surviving rank), and"
                " ranks that finished (4 started; the faulty one is lost for SIGKILL, SIGSTOP and GIL-held hangs)"
            )
            print("| fault | Wrapper's share (s) | ranks that finished, per run |")
            print("| --- | --- | --- |")
            for kind in kinds:
                ours = [r for r in runs if r["system"] == "elastic_ft" and r["kind"] == kind]
                shares = [r["wrapper_seconds"] for r in ours]
                print(f"| {kind} | {_cell(shares, args.cap)} | {', '.join(str(r['survivors']) for r in ours)} |")
            if any(first_time.values()):
                print(
                    "\nelastic-ft: a rank's first iteration (seconds; median (min-max); benchmarks/spares.py's rows, "
                    "its defaults: DDP + AdamW built in the wrapped function)"
                )
                print("| first-time rank | seconds | from the warm standby |")
                print("| --- | --- | --- |")
                for row, title in FIRST_TIME.items():
                    done = first_time[row]
                    standby = f"{sum(r['from_standby'] for r in done)} of {len(done)}" if row == "at_once" else "-"
                    print(f"| {title} | {_cell([r['seconds'] for r in done], args.cap)} | {standby} |")
                report["first_time"] = first_time
            report["phases"] = print_phase_table(
                "elastic-ft: where the recovery goes, per phase (ms; the longest across ranks, median of runs; "
                "the first-time columns: the restart that admitted the new ranks)",
                {
                    kind: [r["phases"] for r in runs if r["system"] == "elastic_ft" and r["kind"] == kind]
                    for kind in kinds
                }
                | {f"first-time {row}": [r["phases"] for r in first_time[row]] for row in FIRST_TIME},
            )
    if args.only != "recovery":
        print(f"\nSteady state: 2 workers pinned to a CPU each, {args.steady_steps} steps, {args.steady_rounds} rounds")
        steady = steady_state(args)
        report["steady"] = steady
        low, high = steady["noise_plain"]
        print("| run | median step (ms) | overhead: paired / of medians |")
        print("| --- | --- | --- |")
        print(f"| without Wrapper | {steady['plain_median'] * 1e3:.2f} (rounds: {low * 1e3:.2f}-{high * 1e3:.2f}) | |")
        print(
            f"| elastic_ft.Wrapper, default settings | {steady['wrapper_median'] * 1e3:.2f} | "
            f"{steady['overhead_paired'] * 100:+.1f} % / {steady['overhead_of_medians'] * 100:+.1f} % |"
        )
        accounted = steady["accounted"]
        print("\nThe Wrapper's own work, per step, as a share of the median step without it")
        print("| part | share of a step |")
        print("| --- | --- |")
        for part, name in (
            ("step_hook", "optimizer-step hook (main thread)"),
            ("rank_threads", "its threads in the rank (CPU beyond the run without it)"),
            ("monitor_process", "monitor process, steady state"),
            ("total", "total"),
        ):
            print(f"| {name} | {accounted[part] * 100:.2f} % |")
    path = args.out or (RESULTS if args.only is None else RESULTS.with_name(f"recovery_{args.only}.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    scratch.run_main(main)
