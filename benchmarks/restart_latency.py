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
* nvidia-resiliency-ext: its ``inprocess.Wrapper`` with the same faults and
  similar intervals, when that package imports (optional peer);
* steady state: step time of the same function with and without the
  Wrapper, no faults, alternating runs.

Prints a table and writes ``benchmarks/results/restart_latency.json``.
Run ``python benchmarks/restart_latency.py``; the same file is the worker
(``--worker MODE``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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
        faulty = int(os.environ["INITIAL_RANK"]) == 1 and iteration < args.faults
        started = time.perf_counter()
        for step in range(args.steps):
            if faulty and step == args.fault_step:
                _event(out, event="fault", iteration=iteration)
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
        return (time.perf_counter() - started) / max(args.steps - 1, 1)
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
    if args.worker == "torchrun":
        os.environ["INITIAL_RANK"] = os.environ["RANK"]
        iteration = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        step_time = train(iteration, out, args)
    elif args.worker == "plain":
        os.environ["INITIAL_RANK"] = os.environ["RANK"]
        step_time = train(0, out, args, _pg_store(int(os.environ["MASTER_PORT"])))
    elif args.worker == "elastic_ft":
        from elastic_ft.initialize import RetryController
        from elastic_ft.wrapper import CallWrapper, Wrapper

        os.environ["INITIAL_RANK"] = os.environ["RANK"]
        store = _pg_store(int(os.environ["MASTER_PORT"]))

        def wrapped(call_wrapper: CallWrapper | None = None) -> float:
            assert call_wrapper is not None
            return train(call_wrapper.iteration, out, args, store)

        retry = RetryController(max_iterations=args.faults + 2)  # a broken run fails instead of looping
        step_time = Wrapper(initialize=retry, **_timedeltas(WRAPPER_SETTINGS))(wrapped)()
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
    ]


def _run_ranks(mode: str, args: argparse.Namespace, faults: int, steps: int, *, strict: bool = True) -> Path:
    """Run the ranks as independent processes (what in-process restart needs).

    With ``strict`` any non-zero exit is an error; otherwise the exit codes
    are written to ``exit_codes.json`` and the timing events decide.
    """
    out = Path(tempfile.mkdtemp(prefix=f"restart-latency-{mode}-"))
    port = _free_port_pair()
    env = {
        **os.environ,
        "WORLD_SIZE": str(args.world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    processes = [
        subprocess.Popen(
            [sys.executable, *_worker_command(mode, out, args, faults, steps)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=open(out / f"stderr{rank}.txt", "w"),  # noqa: SIM115 - closed with the process
        )
        for rank in range(args.world_size)
    ]
    codes = [process.wait(timeout=600) for process in processes]
    (out / "exit_codes.json").write_text(json.dumps(codes))
    if strict and any(codes):
        raise RuntimeError(f"{mode} ranks exited with {codes}; see {out}")
    return out


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


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "samples": values,
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
    print(f"in-process (elastic_ft.Wrapper), {args.faults} faults ...", flush=True)
    results["elastic_ft"] = _summary(_latencies(_run_ranks("elastic_ft", args, args.faults, args.steps), args.faults))
    print(f"full restart (torchrun --max-restarts={args.faults}) ...", flush=True)
    results["torchrun"] = _summary(_latencies(_run_torchrun(args), args.faults))
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
    print("steady state, with and without the Wrapper ...", flush=True)
    plain: list[float] = []
    wrapped: list[float] = []
    for _ in range(args.steady_runs):
        plain.append(statistics.median(_step_times(_run_ranks("plain", args, 0, args.steady_steps))))
        wrapped.append(statistics.median(_step_times(_run_ranks("elastic_ft", args, 0, args.steady_steps))))
    results["steady_state"] = {
        "steps_per_run": args.steady_steps,
        "plain_step_s": _summary(plain),
        "wrapped_step_s": _summary(wrapped),
        "overhead_percent": 100 * (statistics.median(wrapped) / statistics.median(plain) - 1),
    }
    results["speedup"] = results["torchrun"]["median"] / results["elastic_ft"]["median"]
    return results


def format_table(results: dict[str, Any]) -> str:
    def row(name: str, entry: dict[str, Any]) -> str:
        if "median" not in entry:
            return f"| {name} | {next(iter(entry.values()))[:60]} | | |"
        return f"| {name} | {entry['median']:.3f} | {entry['min']:.3f} | {entry['max']:.3f} |"

    steady = results["steady_state"]
    lines = [
        (
            f"Restart latency, fault -> first step of every rank ({results['world_size']} ranks, "
            f"{results['faults']} faults, seconds)"
        ),
        "| restart | median | min | max |",
        "| --- | --- | --- | --- |",
        row("in-process, elastic_ft.Wrapper", results["elastic_ft"]),
        row("full restart, torchrun --max-restarts", results["torchrun"]),
        row("in-process, nvidia-resiliency-ext Wrapper", results["nvidia_resiliency_ext"]),
        f"speed-up of in-process over full restart: {results['speedup']:.1f}x",
        "",
        f"Steady state, median step time over {len(steady['plain_step_s']['samples'])} alternating runs",
        "| run | step (ms) |",
        "| --- | --- |",
        f"| without Wrapper | {1000 * steady['plain_step_s']['median']:.2f} |",
        f"| with elastic_ft.Wrapper | {1000 * steady['wrapped_step_s']['median']:.2f} |",
        f"overhead: {steady['overhead_percent']:+.1f} %",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--fault-step", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--steady-runs", type=int, default=3)
    parser.add_argument("--steady-steps", type=int, default=300)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    results = run_benchmark(args)
    table = format_table(results)
    results["table"] = table
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
