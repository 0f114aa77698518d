"""Restart latency: in-process restart with elastic_ft.Wrapper vs a full torchrun restart.

One run measures, side by side, on this machine:

* in-process: ``--world-size`` ranks (independent processes) train a small
  MLP with gloo under ``elastic_ft.wrapper.Wrapper``; rank 1 raises at step
  ``--fault-step`` of each of the first ``--faults`` iterations. Latency of a
  fault: from the moment rank 1 raises to the moment the last active rank
  completes its first training step of the next iteration;
* full restart: the same training function run by ``torchrun
  --max-restarts`` with the same faults; torchrun kills and restarts every
  worker (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, c10d rendezvous,
  standalone), so the latency includes process start, imports, rendezvous;
* ftrun: the same training under ``ftrun`` on one host (embedded etcd), the
  Wrapper with its default store (the round's etcd store, which the process
  groups bootstrap from too); one worker raises, or is SIGKILLed (the others
  go on without it, the agent reporting it at once);
* nvidia-resiliency-ext: its ``inprocess.Wrapper`` with the same faults and
  similar intervals, when that package imports (optional peer);
* steady state: step time of the same function without the Wrapper, with
  the Wrapper's default settings, and with the fast settings of the latency
  runs; no faults. The three run in turn, ``--steady-runs`` rounds, each
  round in a rotated order; the overhead is the median over rounds of the
  ratio to the plain run of the same round (pairing cancels slow drifts of
  a shared machine), also given as the ratio of the medians. Step times on a
  small shared machine vary by tens of percent from run to run, more than
  the overhead, so the benchmark also measures the overhead directly: the
  CPU time of the Wrapper's threads and monitor process per second of
  training (``/proc``), as a share of one core. ``--steady-world-size`` defaults to the number of CPUs
  (at most ``--world-size``), and each rank is pinned to its own CPU (its
  monitor process shares it): more busy ranks than cores, or ranks moved
  between cores, measures the scheduler, not the Wrapper.

``--only latency`` or ``--only steady`` runs one part.

Prints a table and writes ``benchmarks/results/restart_latency.json`` (``restart_latency_<part>.json``
with ``--only``).
Run ``python benchmarks/restart_latency.py``; the same file is the worker
(``--worker MODE``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "restart_latency.json"
HIDDEN = 512
BATCH = 64

# Wrapper settings of the in-process runs: the monitor thread polls the store every
# 50 ms (about 1 % of a core per rank) and waits 20 ms for concurrent faults;
# timeouts stay generous.
WRAPPER_SETTINGS = {
    "monitor_thread_interval": 0.05,
    "last_call_wait": 0.02,
    "monitor_process_interval": 0.1,
    "progress_watchdog_interval": 0.1,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 20.0,
    "soft_timeout": 30.0,
    "hard_timeout": 60.0,
    "barrier_timeout": 120.0,
    "completion_timeout": 120.0,
}


# ---------------------------------------------------------------- worker side


def _event(out: Path, **record: Any) -> None:
    with open(out / f"events{os.environ['INITIAL_RANK']}.jsonl", "a") as file:
        file.write(json.dumps({**record, "t": time.time()}) + "\n")


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(stat_path: str) -> float:
    """utime + stime of a /proc stat file, in seconds (0 once the task is gone)."""
    try:
        with open(stat_path) as file:
            fields = file.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def wrapper_cpu_seconds() -> float:
    """CPU time used so far by the Wrapper's machinery in this rank: its threads and its monitor process."""
    import threading

    threads = [t.native_id for t in threading.enumerate() if t.name.startswith("elastic_ft") and t.native_id]
    total = sum(_cpu_seconds(f"/proc/self/task/{tid}/stat") for tid in threads)
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as file:
            total += sum(_cpu_seconds(f"/proc/{child}/stat") for child in file.read().split())
    return total


def train(iteration: int, out: Path, args: argparse.Namespace, store: Any = None) -> float:
    """Train the MLP for ``args.steps`` steps (manual SGD, gradients all-reduced); returns the mean step time."""
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=30)
    if store is None:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    else:
        pg_store = dist.PrefixStore(f"pg/{iteration}", store)
        dist.init_process_group("gloo", store=pg_store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN))
        parameters = list(model.parameters())
        generator = torch.Generator().manual_seed(rank)
        # raise: initial rank 1 raises in each faulty iteration; sigkill: initial rank
        # i + 1 is SIGKILLed in iteration i (a killed rank does not come back).
        victim = iteration + 1 if args.fault_kind == "sigkill" else 1
        faulty = int(os.environ["INITIAL_RANK"]) == victim and iteration < args.faults
        started = time.perf_counter()
        for step in range(args.steps):
            if faulty and step == args.fault_step:
                _event(out, event="fault", iteration=iteration)
                if args.fault_kind == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"benchmark fault in iteration {iteration}")
            inputs = torch.randn(BATCH, HIDDEN, generator=generator)
            loss = model(inputs).square().mean()
            model.zero_grad(set_to_none=False)
            loss.backward()
            flat = torch.cat([parameter.grad.reshape(-1) for parameter in parameters])
            dist.all_reduce(flat)
            offset = 0
            with torch.no_grad():
                for parameter in parameters:
                    count = parameter.numel()
                    parameter -= 0.01 / world_size * flat[offset : offset + count].view_as(parameter)
                    offset += count
            if step == 0:
                _event(out, event="first_step", iteration=iteration)
                started = time.perf_counter()
                wrapper_cpu = wrapper_cpu_seconds()
        elapsed = time.perf_counter() - started
        if args.worker.startswith("elastic_ft"):
            _event(out, event="wrapper_cpu", seconds=wrapper_cpu_seconds() - wrapper_cpu, elapsed=elapsed)
        return elapsed / max(args.steps - 1, 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _pg_store(port: int) -> Any:
    import torch.distributed as dist

    is_host = int(os.environ["RANK"]) == 0
    return dist.TCPStore("127.0.0.1", port, None, is_host, datetime.timedelta(seconds=60), wait_for_workers=False)


def _timedeltas(names: dict[str, float]) -> dict[str, datetime.timedelta]:
    return {name: datetime.timedelta(seconds=value) for name, value in names.items()}


def run_worker(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if "BENCH_CPU" in os.environ:
        os.sched_setaffinity(0, {int(os.environ["BENCH_CPU"])})  # inherited by the monitor process
    if args.worker == "torchrun":
        os.environ["INITIAL_RANK"] = os.environ["RANK"]
        iteration = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        step_time = train(iteration, out, args)
    elif args.worker == "plain":
        os.environ["INITIAL_RANK"] = os.environ["RANK"]
        step_time = train(0, out, args, _pg_store(int(os.environ["MASTER_PORT"])))
    elif args.worker in ("elastic_ft", "elastic_ft_defaults"):
        from elastic_ft.initialize import RetryController
        from elastic_ft.wrapper import CallWrapper, Wrapper

        os.environ["INITIAL_RANK"] = os.environ["RANK"]
        store = _pg_store(int(os.environ["MASTER_PORT"]))

        def wrapped(call_wrapper: CallWrapper | None = None) -> float:
            assert call_wrapper is not None
            return train(call_wrapper.iteration, out, args, store)

        retry = RetryController(max_iterations=args.faults + 2)  # a broken run fails instead of looping
        settings = _timedeltas(WRAPPER_SETTINGS) if args.worker == "elastic_ft" else {}
        step_time = Wrapper(initialize=retry, **settings)(wrapped)()
    elif args.worker == "ftrun":
        from elastic_ft.initialize import RetryController
        from elastic_ft.wrapper import CallWrapper, Wrapper

        os.environ["INITIAL_RANK"] = os.environ["RANK"]

        def ftrun_wrapped(call_wrapper: CallWrapper | None = None) -> float:
            assert call_wrapper is not None
            # The process groups bootstrap from the Wrapper's store: under ftrun, etcd.
            return train(call_wrapper.iteration, out, args, call_wrapper.base_store)

        retry = RetryController(max_iterations=args.faults + 2)
        step_time = Wrapper(initialize=retry, **_timedeltas(WRAPPER_SETTINGS))(ftrun_wrapped)()
    elif args.worker == "nvidia":
        from nvidia_resiliency_ext import inprocess

        os.environ["INITIAL_RANK"] = os.environ["RANK"]
        store = _pg_store(int(os.environ["MASTER_PORT"]))

        def nv_wrapped(call_wrapper: inprocess.CallWrapper = None) -> float:
            return train(call_wrapper.iteration, out, args, store)

        # Its Wrapper matches the annotation object itself, not this module's postponed string.
        nv_wrapped.__annotations__ = {"call_wrapper": inprocess.CallWrapper, "return": float}

        nv_settings = {**WRAPPER_SETTINGS, "heartbeat_interval": 0.5}
        step_time = inprocess.Wrapper(
            store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 1},
            health_check=None,
            initialize=inprocess.initialize.RetryController(max_iterations=args.faults + 2),
            **_timedeltas(nv_settings),
        )(nv_wrapped)()
    else:
        raise ValueError(args.worker)
    if step_time is not None:
        _event(out, event="step_time", seconds=step_time)


# ---------------------------------------------------------------- driver side


def _free_port_pair() -> int:
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def _worker_command(mode: str, out: Path, args: argparse.Namespace, faults: int, steps: int) -> list[str]:
    return [
        __file__,
        "--worker",
        mode,
        "--out",
        str(out),
        "--faults",
        str(faults),
        "--fault-step",
        str(args.fault_step),
        "--steps",
        str(steps),
        "--fault-kind",
        args.fault_kind,
    ]


def _run_ranks(
    mode: str,
    args: argparse.Namespace,
    faults: int,
    steps: int,
    *,
    strict: bool = True,
    world_size: int | None = None,
    pin: bool = False,
) -> Path:
    """Run the ranks as independent processes (what in-process restart needs).

    With ``strict`` any non-zero exit is an error; otherwise the exit codes
    are written to ``exit_codes.json`` and the timing events decide.
    """
    out = Path(tempfile.mkdtemp(prefix=f"restart-latency-{mode}-"))
    port = _free_port_pair()
    world_size = world_size or args.world_size
    env = {
        **os.environ,
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    processes = [
        subprocess.Popen(
            [sys.executable, *_worker_command(mode, out, args, faults, steps)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            | ({"BENCH_CPU": str(sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))])} if pin else {}),
            stdout=subprocess.DEVNULL,
            stderr=open(out / f"stderr{rank}.txt", "w"),  # noqa: SIM115 - closed with the process
        )
        for rank in range(world_size)
    ]
    codes = [process.wait(timeout=600) for process in processes]
    (out / "exit_codes.json").write_text(json.dumps(codes))
    if strict and any(codes):
        raise RuntimeError(f"{mode} ranks exited with {codes}; see {out}")
    return out


def _run_ftrun(args: argparse.Namespace, kind: str) -> list[float]:
    """Latencies of ``kind`` faults under ftrun (one host, embedded etcd), over as many jobs as needed.

    A SIGKILLed rank does not come back, so one job takes at most
    ``--world-size - 2`` kills (two ranks must remain).
    """
    per_job = args.faults if kind == "raise" else max(1, min(args.faults, args.world_size - 2))
    latencies: list[float] = []
    while len(latencies) < args.faults:
        faults = min(per_job, args.faults - len(latencies))
        out = Path(tempfile.mkdtemp(prefix=f"restart-latency-ftrun-{kind}-"))
        command = [
            sys.executable,
            "-m",
            "elastic_ft.launcher.ftrun",
            f"--nproc-per-node={args.world_size}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            *_worker_command(
                "ftrun", out, argparse.Namespace(**{**vars(args), "fault_kind": kind}), faults, args.steps
            ),
        ]
        with open(out / "ftrun.txt", "w") as log:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            code = subprocess.run(command, check=False, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
        if code.returncode:
            raise RuntimeError(f"ftrun exited with {code.returncode}; see {out}")
        latencies += _latencies(out, faults)
    return latencies


def _run_torchrun(args: argparse.Namespace) -> Path:
    out = Path(tempfile.mkdtemp(prefix="restart-latency-torchrun-"))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--rdzv-backend=c10d",
        f"--nproc-per-node={args.world_size}",
        f"--max-restarts={args.faults}",
        "--monitor-interval=0.1",
        *_worker_command("torchrun", out, args, args.faults, args.steps),
    ]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    with open(out / "torchrun.txt", "w") as log:
        code = subprocess.run(
            command, check=False, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900
        ).returncode
    if code:
        raise RuntimeError(f"torchrun exited with {code}; see {out}")
    return out


def _events(out: Path) -> list[dict[str, Any]]:
    events = []
    for path in out.glob("events*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines()]
    return events


def _latencies(out: Path, faults: int) -> list[float]:
    """Per fault: from the fault to the first completed step of the last active rank in the next iteration."""
    events = _events(out)
    latencies = []
    for iteration in range(faults):
        fault = [e["t"] for e in events if e["event"] == "fault" and e["iteration"] == iteration]
        recovered = [e["t"] for e in events if e["event"] == "first_step" and e["iteration"] == iteration + 1]
        latencies.append(max(recovered) - fault[0])
    return latencies


def _step_times(out: Path) -> list[float]:
    return [e["seconds"] for e in _events(out) if e["event"] == "step_time"]


def _wrapper_cpu_share(out: Path) -> float:
    """CPU used by the Wrapper's machinery per second of training, as a fraction of one core (median of ranks)."""
    return statistics.median(e["seconds"] / e["elapsed"] for e in _events(out) if e["event"] == "wrapper_cpu")


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "samples": values,
    }


STEADY_VARIANTS = {
    "plain": "without Wrapper",
    "elastic_ft_defaults": "elastic_ft.Wrapper, default settings",
    "elastic_ft": "elastic_ft.Wrapper, latency-run settings",
}


def _latency_results(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    print(f"in-process (elastic_ft.Wrapper), {args.faults} faults ...", flush=True)
    results["elastic_ft"] = _summary(_latencies(_run_ranks("elastic_ft", args, args.faults, args.steps), args.faults))
    print(f"full restart (torchrun --max-restarts={args.faults}) ...", flush=True)
    results["torchrun"] = _summary(_latencies(_run_torchrun(args), args.faults))
    for kind in ("raise", "sigkill"):
        print(f"ftrun, worker {kind}, {args.faults} faults ...", flush=True)
        results[f"ftrun_{kind}"] = _summary(_run_ftrun(args, kind))
    try:
        import nvidia_resiliency_ext.inprocess  # noqa: F401
    except Exception as error:  # noqa: BLE001 - the peer is optional
        results["nvidia_resiliency_ext"] = {"skipped": repr(error)}
    else:
        print("nvidia-resiliency-ext inprocess.Wrapper ...", flush=True)
        try:
            # Its ranks may exit non-zero at shutdown (a gloo timeout on the way
            # out) after recovering from every fault: the events decide.
            out = _run_ranks("nvidia", args, args.faults, args.steps, strict=False)
            summary = _summary(_latencies(out, args.faults))
            summary["exit_codes"] = json.loads((out / "exit_codes.json").read_text())
            results["nvidia_resiliency_ext"] = summary
        except Exception as error:  # noqa: BLE001 - report the peer's failure, keep our numbers
            results["nvidia_resiliency_ext"] = {"failed": repr(error)}
    results["speedup"] = results["torchrun"]["median"] / results["elastic_ft"]["median"]
    for kind in ("raise", "sigkill"):
        results[f"speedup_ftrun_{kind}"] = results["torchrun"]["median"] / results[f"ftrun_{kind}"]["median"]
    return results


def _steady_results(args: argparse.Namespace) -> dict[str, Any]:
    world_size = args.steady_world_size or min(args.world_size, os.cpu_count() or 1)
    print(f"steady state, {world_size} ranks, {args.steady_runs} rounds of {list(STEADY_VARIANTS)} ...", flush=True)
    samples: dict[str, list[float]] = {variant: [] for variant in STEADY_VARIANTS}
    cpu_share: dict[str, list[float]] = {variant: [] for variant in list(STEADY_VARIANTS)[1:]}
    variants = list(STEADY_VARIANTS)
    for round_index in range(args.steady_runs):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            out = _run_ranks(variant, args, 0, args.steady_steps, world_size=world_size, pin=True)
            samples[variant].append(statistics.median(_step_times(out)))
            if variant in cpu_share:
                cpu_share[variant].append(_wrapper_cpu_share(out))
    overheads = {
        variant: 100 * (statistics.median(w / p for w, p in zip(samples[variant], samples["plain"], strict=True)) - 1)
        for variant in variants[1:]
    }
    return {
        "world_size": world_size,
        "steps_per_run": args.steady_steps,
        "step_s": {variant: _summary(values) for variant, values in samples.items()},
        "overhead_percent": overheads,
        "ratio_of_medians_percent": {
            variant: 100 * (statistics.median(samples[variant]) / statistics.median(samples["plain"]) - 1)
            for variant in variants[1:]
        },
        "wrapper_cpu_percent_of_core": {variant: 100 * statistics.median(v) for variant, v in cpu_share.items()},
    }


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "world_size": args.world_size,
        "faults": args.faults,
        "fault_step": args.fault_step,
        "model": f"MLP {HIDDEN}x{HIDDEN}x{HIDDEN}, batch {BATCH}, manual SGD, gloo",
        "wrapper_settings_s": WRAPPER_SETTINGS,
    }
    if args.only in (None, "latency"):
        results["latency"] = _latency_results(args)
    if args.only in (None, "steady"):
        results["steady_state"] = _steady_results(args)
    return results


def format_table(results: dict[str, Any]) -> str:
    def row(name: str, entry: dict[str, Any]) -> str:
        if "median" not in entry:
            return f"| {name} | {next(iter(entry.values()))[:60]} | | |"
        return f"| {name} | {entry['median']:.3f} | {entry['min']:.3f} | {entry['max']:.3f} |"

    lines: list[str] = []
    latency = results.get("latency")
    if latency:
        lines += [
            (
                f"Restart latency, fault -> first step of every rank ({results['world_size']} ranks, "
                f"{results['faults']} faults, seconds)"
            ),
            "| restart | median | min | max |",
            "| --- | --- | --- | --- |",
            row("in-process, elastic_ft.Wrapper", latency["elastic_ft"]),
            row("full restart, torchrun --max-restarts", latency["torchrun"]),
            row("ftrun, worker exception (in-process, etcd store)", latency["ftrun_raise"]),
            row("ftrun, worker SIGKILL (in-process without it)", latency["ftrun_sigkill"]),
            row("in-process, nvidia-resiliency-ext Wrapper", latency["nvidia_resiliency_ext"]),
            (
                f"speed-up over the full restart: Wrapper {latency['speedup']:.1f}x, ftrun exception "
                f"{latency['speedup_ftrun_raise']:.1f}x, ftrun SIGKILL {latency['speedup_ftrun_sigkill']:.1f}x"
            ),
            "",
        ]
    steady = results.get("steady_state")
    if steady:
        rounds = len(steady["step_s"]["plain"]["samples"])
        lines += [
            f"Steady state, {steady['world_size']} ranks, {rounds} rounds of {steady['steps_per_run']} steps",
            "| run | median step (ms) | min | max | step overhead: paired / of medians | Wrapper CPU (% of a core) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for variant, name in STEADY_VARIANTS.items():
            entry = steady["step_s"][variant]
            cells = [name, f"{1000 * entry['median']:.2f}", f"{1000 * entry['min']:.2f}", f"{1000 * entry['max']:.2f}"]
            if variant == "plain":
                cells += ["", ""]
            else:
                paired, of_medians = steady["overhead_percent"][variant], steady["ratio_of_medians_percent"][variant]
                cells += [
                    f"{paired:+.1f} % / {of_medians:+.1f} %",
                    f"{steady['wrapper_cpu_percent_of_core'][variant]:.2f} %",
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--fault-step", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--steady-runs", type=int, default=5)
    parser.add_argument("--steady-steps", type=int, default=300)
    parser.add_argument("--steady-world-size", type=int, help="default: min(--world-size, CPUs)")
    parser.add_argument("--only", choices=("latency", "steady"), help="run one part of the benchmark")
    parser.add_argument("--fault-kind", choices=("raise", "sigkill"), default="raise", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    results = run_benchmark(args)
    table = format_table(results)
    results["table"] = table
    path = RESULTS if args.only is None else RESULTS.with_name(f"restart_latency_{args.only}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
