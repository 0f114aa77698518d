"""What a real job costs etcd, per node: steady training and one in-process restart, by workers per node.

Two ``ftrun`` nodes on this host train ``examples/train_ftrun.py`` (DDP, AdamW,
a DataLoader, checkpoints, default Wrapper settings; ``--step-wait 0.05``: a
step leaves the CPU idle as a step on an accelerator does) against one etcd;
initial rank 1 raises once. For 1, 4 and 8 workers per node, with the node
relay (``ftrun --node-relay``) and without it (``ftrun``'s default), in one run.

etcd's own ``/metrics`` is sampled every 0.1 s: every gRPC message the
server received (``grpc_server_msg_received_total``: unary requests, and
the watch and keep-alive streams' messages). From the script's step events:

* **steady**: the requests a second over a window of training with no
  fault (from step 20 to ten steps before the fault), per node;
* **restart**: the requests from the fault to the last rank's first step
  after it, less the steady rate over that time, per node.

Where the steady requests come from: every process of the job counts the
requests its etcd clients send by role (agent, rank, monitor process) and
source (heartbeat with its ring check, peer look, a thread's name: ``etcd-session``
is a lease's keep-alives, ``elastic_ft-events`` the event log,
``elastic_ft-monitor-thread`` a rank's outcome watch, ``MainThread`` of the
agent its loop; :mod:`elastic_ft.etcd.accounting`), written every 0.25 s
(``ELASTIC_FT_ETCD_ACCOUNTS``). The same windows' client-side counts, per
node, make the third table (steady) and the fifth (one restart); they count
requests and stream messages sent, as etcd's own counter does.

Prints a table, writes ``benchmarks/results/worker_requests.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import scratch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_ftrun.py"
CONF = "last_call_timeout=1,lease_ttl=5,join_timeout=120"
_RECEIVED = re.compile(r"^grpc_server_msg_received_total\{([^}]*)\} ([0-9.e+]+)$")
_METHOD = re.compile(r'grpc_method="([^"]+)"')


def received(endpoint: Any) -> dict[str, float]:
    """etcd's received gRPC messages so far, by method (Range, Txn, Put, Watch, LeaseKeepAlive, ...)."""
    by_method: dict[str, float] = {}
    with urllib.request.urlopen(f"http://{endpoint.host}:{endpoint.port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            match = _RECEIVED.match(line)
            if match:
                method = _METHOD.search(match.group(1))
                name = method.group(1) if method else "other"
                by_method[name] = by_method.get(name, 0.0) + float(match.group(2))
    return by_method


class Sampler:
    """etcd's received messages, sampled every ``period`` seconds from a thread: (wall time, total) pairs."""

    def __init__(self, endpoint: Any, period: float = 0.1) -> None:
        self.endpoint, self.period = endpoint, period
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), received(self.endpoint)))
            self._stop.wait(self.period)

    def at(self, when: float, method: str | None = None) -> float:
        """The messages received by ``when`` (of one method, or all), interpolated between the samples around it."""

        def count(sample: tuple[float, dict[str, float]]) -> float:
            return sum(sample[1].values()) if method is None else sample[1].get(method, 0.0)

        before = max((s for s in self.samples if s[0] <= when), default=self.samples[0], key=lambda s: s[0])
        after = min((s for s in self.samples if s[0] >= when), default=self.samples[-1], key=lambda s: s[0])
        if after[0] == before[0]:
            return count(before)
        return count(before) + (count(after) - count(before)) * (when - before[0]) / (after[0] - before[0])

    def methods(self) -> list[str]:
        return sorted({name for _, sample in self.samples for name in sample})


_NUMBERED = re.compile(r"-\d+$")


def accounts_at(directory: Path, when: float) -> dict[str, float]:
    """The job's client-side request counts by ``role: source/kind`` at ``when``: each process's last record
    before it (a process's records carry running totals; a process started later counts from zero)."""
    latest: dict[int, dict[str, Any]] = {}
    for path in directory.glob("*.jsonl"):
        for line in path.open():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by the process's end
            if record["t"] <= when and record["t"] >= latest.get(record["pid"], {"t": -1.0})["t"]:
                latest[record["pid"]] = record
    summed: dict[str, float] = {}
    for record in latest.values():
        for name, count in record["counts"].items():
            source, kind = name.rsplit("/", 1)
            key = f"{record['role']}: {_NUMBERED.sub('', source)}/{kind}"
            summed[key] = summed.get(key, 0.0) + count
    return summed


def run_job(etcd: Any, workers: int, relay: bool, args: argparse.Namespace) -> dict[str, Any]:
    from elastic_ft.etcd.accounting import ACCOUNTS_DIR_ENV
    from elastic_ft.testing.local_cluster import TorchrunNode, ftrun_command

    workdir = scratch.workdir(f"requests-{workers}-{'relay' if relay else 'direct'}-")
    accounts = workdir / "accounts"
    accounts.mkdir()
    script = [
        str(SCRIPT),
        "--workdir",
        str(workdir),
        "--steps",
        str(args.steps),
        "--step-wait",
        "0.05",
        "--fault",
        "raise",
        "--fault-rank",
        "1",
        "--fault-step",
        str(args.fault_step),
        "--record-steps",
    ]
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    with Sampler(etcd.endpoints[0]) as sampler:
        nodes = [
            TorchrunNode(
                tag,
                endpoint=etcd.endpoint,
                run_id=run_id,
                script=script,
                nnodes="2:2",
                nproc_per_node=workers,
                rdzv_conf=CONF,
                max_restarts=0,
                log_path=workdir / f"node-{tag}.log",
                extra_env={"OMP_NUM_THREADS": "1", ACCOUNTS_DIR_ENV: str(accounts)},
                launcher=ftrun_command(),
                extra_args=("--node-relay",) if relay else (),
            )
            for tag in "AB"
        ]
        try:
            deadline = time.monotonic() + args.cap
            while time.monotonic() < deadline and any(node.process.poll() is None for node in nodes):
                time.sleep(0.2)
            codes = [node.process.poll() for node in nodes]
        finally:
            for node in nodes:
                node.terminate()
    events = [json.loads(line) for path in workdir.glob("events-*.jsonl") for line in path.open()]
    fault = min((e["t"] for e in events if e["event"] == "fault"), default=None)
    if codes != [0, 0] or fault is None:
        raise RuntimeError(f"{workers} workers per node, relay={relay}: exits {codes}, fault at {fault}; see {workdir}")
    steps = [e for e in events if e["event"] == "step"]

    def when_all_reached(step: int, after: float = 0.0) -> float:
        return max(
            min(e["t"] for e in steps if e["rank"] == rank and e["step"] >= step and e["t"] > after)
            for rank in {e["rank"] for e in steps}
        )

    start, end = when_all_reached(20), fault - 10 * 0.05 * 2
    end = max(end, when_all_reached(args.fault_step - 10))
    steady = (sampler.at(end) - sampler.at(start)) / (end - start) / 2
    steady_by_method = {
        method: (sampler.at(end, method) - sampler.at(start, method)) / (end - start) / 2
        for method in sampler.methods()
    }
    opened, closed = accounts_at(accounts, start), accounts_at(accounts, end)
    steady_by_source = {name: (count - opened.get(name, 0.0)) / (end - start) / 2 for name, count in closed.items()}
    firsts: dict[int, float] = {}
    for event in sorted(events, key=lambda e: e["t"]):
        if event["event"] == "first_step" and event["t"] > fault:
            firsts.setdefault(event["rank"], event["t"])
    back = max(firsts.values())
    restart = (sampler.at(back) - sampler.at(fault) - steady * 2 * (back - fault)) / 2
    restart_by_method = {
        method: (sampler.at(back, method) - sampler.at(fault, method)) / 2 - steady_by_method[method] * (back - fault)
        for method in sampler.methods()
    }
    at_fault, at_back = accounts_at(accounts, fault), accounts_at(accounts, back)
    restart_by_source = {
        name: (count - at_fault.get(name, 0.0)) / 2 - steady_by_source.get(name, 0.0) * (back - fault)
        for name, count in at_back.items()
    }
    return {
        "workers_per_node": workers,
        "relay": relay,
        "ranks": 2 * workers,
        "steady_requests_per_second_per_node": steady,
        "steady_window_s": end - start,
        "steady_by_method": {name: rate for name, rate in steady_by_method.items() if rate >= 0.05},
        "steady_by_source": {name: rate for name, rate in steady_by_source.items() if rate >= 0.05},
        "restart_requests_per_node": restart,
        "restart_by_method": {name: count for name, count in restart_by_method.items() if abs(count) >= 0.5},
        "restart_by_source": {name: count for name, count in restart_by_source.items() if count >= 0.5},
        "restart_seconds": back - fault,
        "dir": str(workdir),
    }


def _print_breakdowns(
    rows: list[dict[str, Any]], part: str, title: str, method_format: str, source_format: str
) -> None:
    """``part``'s (``steady`` or ``restart``) requests of each row, by gRPC method, then by role and source."""
    print(f"\n{title} by gRPC method:")
    for row in rows:
        methods = ", ".join(
            f"{name} {value:{method_format}}" for name, value in sorted(row[f"{part}_by_method"].items())
        )
        print(f"- {row['workers_per_node']} per node, {'node relay' if row['relay'] else 'per rank'}: {methods}")
    print(f"\n{title} by role and source (the clients' own counts):")
    for row in rows:
        print(f"- {row['workers_per_node']} per node, {'node relay' if row['relay'] else 'per rank'}:")
        for name, value in sorted(row[f"{part}_by_source"].items(), key=lambda item: -item[1]):
            print(f"  - {name}: {value:{source_format}}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,4,8", help="workers per node")
    parser.add_argument("--steps", type=int, default=140)
    parser.add_argument("--fault-step", type=int, default=90)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cap", type=float, default=300.0, help="seconds one job may take")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "worker_requests.json"
    )
    args = parser.parse_args()
    from elastic_ft.etcd.server import EtcdServer

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    with EtcdServer() as etcd:
        for workers in [int(w) for w in args.workers.split(",") if w]:
            for relay in (True, False):
                runs = [run_job(etcd, workers, relay, args) for _ in range(args.repeats)]
                row = dict(runs[0])
                for key in ("steady_requests_per_second_per_node", "restart_requests_per_node", "restart_seconds"):
                    row[key] = statistics.median(run[key] for run in runs)
                rows.append(row)
                print(
                    f"{workers} workers/node, relay={relay}: {row['steady_requests_per_second_per_node']:.1f}/s, "
                    f"restart {row['restart_requests_per_node']:.0f}",
                    flush=True,
                )
    print(
        f"\netcd requests per node (2 ftrun nodes, median of {args.repeats}; `python benchmarks/worker_requests.py`):"
    )
    print(
        "| workers per node | ranks | path | steady: requests/s per node | per rank | "
        "one restart: requests per node | per rank | restart s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        workers = row["workers_per_node"]
        print(
            f"| {workers} | {row['ranks']} | {'node relay' if row['relay'] else 'per rank'} | "
            f"{row['steady_requests_per_second_per_node']:.1f} | {row['steady_requests_per_second_per_node'] / workers:.1f} | "
            f"{row['restart_requests_per_node']:.0f} | {row['restart_requests_per_node'] / workers:.0f} | "
            f"{row['restart_seconds']:.2f} |"
        )
    _print_breakdowns(rows, "steady", "Steady training, etcd requests a second per node", ".1f", ".2f")
    _print_breakdowns(rows, "restart", "One restart, etcd requests per node", ".0f", ".0f")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": os.uname().nodename, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    scratch.run_main(main)
