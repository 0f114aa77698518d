"""etcd away: a job trains through its coordination service's outages. ftrun beside torchrun's etcd-v2 and c10d.

Each run trains the reference script (``examples/train_ftrun.py``: DDP,
``torch.optim.AdamW``, a ``DataLoader``, a checkpoint; default Wrapper
settings and default rendezvous settings) on 2 simulated nodes x 2 workers,
takes the coordination service away for ``D`` seconds once every rank
trains, lets the job train on for ``--after`` seconds, and stops it at a
common step. Outage kinds:

* ``freeze``: the one etcd member SIGSTOPped for ``D``, then SIGCONTed;
* ``restart``: the one member SIGKILLed, started again on its data dir and
  ports after ``D``;
* ``quorum``: a 3-member cluster loses its quorum for ``D``: the leader and
  a follower frozen (the case that ends every lease; a quorum lost with
  the leader up keeps them, ``tests/etcd/test_lease_outages.py``);
* ``rolling``: a rolling restart of a 3-member cluster: each member in turn
  SIGKILLed and restarted, ``D`` apart;
* ``fault``: ``freeze``, and a worker raises half-way through it.

Systems:

* ``ftrun``: ``--rdzv-backend=etcdft``, the script under ``elastic_ft.Wrapper``;
* ``torchrun-etcd-v2``: plain ``torchrun --rdzv-backend=etcd-v2`` on the same
  etcd (its v2 API on; its client takes one endpoint, the first member's),
  the script without the Wrapper;
* ``torchrun-c10d``: plain ``torchrun --rdzv-backend=c10d``, the store on node
  A's agent; its outage is that agent (the store's host) frozen for ``D``
  (``freeze`` and ``fault`` only: c10d uses no etcd).

Measured per run: the step rate during the outage against the rate before
it (every rank's steps), in-process restarts, process restarts (worker
processes replaced), the time from the service's return until every rank
has stepped again, the ranks that finished, and the launchers' exit codes.
The table shows medians over ``--repeats``; the JSON, every run.

Prints a table, writes ``benchmarks/results/etcd_outages.json``, and exits 1
if an ftrun run missed a goal: a rank stopped, restarted or failed to
finish without a fault, or (``fault``) it took more than 2 s after etcd's
return to train again.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import signal
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import scratch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_ftrun.py"
RESULTS = Path(__file__).resolve().parent / "results" / "etcd_outages.json"
SYSTEMS = ("ftrun", "torchrun-etcd-v2", "torchrun-c10d")
KINDS = ("freeze", "restart", "quorum", "rolling", "fault")
NOT_APPLICABLE = {("torchrun-c10d", kind) for kind in ("restart", "quorum", "rolling")}
#: A rank that makes no step for this long during the outage counts as stopped.
STOPPED_AFTER = 2.0
#: The goal for a worker's fault during an outage: every rank trains again this soon after etcd's return.
FAULT_GOAL = 2.0


class Run:
    """One job: its launchers, its coordination service, what its workers recorded."""

    def __init__(self, system: str, kind: str, args: argparse.Namespace) -> None:
        self.system, self.kind, self.args = system, kind, args
        self.workdir = scratch.workdir(f"outage-{system}-{kind}-")
        self.run_id = f"outage-{uuid.uuid4().hex[:8]}"
        self.stop_file = self.workdir / "stop"
        self.nodes: list[Any] = []

    def script(self) -> list[str]:
        script = [
            str(SCRIPT),
            "--workdir",
            str(self.workdir),
            "--steps",
            "100000000",
            "--record-steps",
            "--stop-file",
            str(self.stop_file),
            "--step-wait",
            str(self.args.step_wait),
            "--fault-dir",
            str(self.workdir),
        ]
        return script + (["--no-wrapper"] if self.system != "ftrun" else [])

    def start(self, etcd_endpoint: str, c10d_port: int) -> None:
        from elastic_ft.testing.local_cluster import TorchrunNode, ftrun_command

        for index, tag in enumerate("AB"):
            if self.system == "ftrun":
                backend, endpoint, conf, launcher = "etcdft", etcd_endpoint, "", ftrun_command()
            elif self.system == "torchrun-etcd-v2":  # its client takes one endpoint: the first member's
                backend, endpoint, conf, launcher = "etcd-v2", etcd_endpoint.split(",")[0], "", None
            else:
                backend, endpoint, conf, launcher = "c10d", f"127.0.0.1:{c10d_port}", f"is_host={int(index == 0)}", None
            self.nodes.append(
                TorchrunNode(
                    tag,
                    endpoint=endpoint,
                    run_id=self.run_id,
                    script=self.script(),
                    nnodes="2:2",
                    nproc_per_node=2,
                    backend=backend,
                    rdzv_conf=conf,
                    max_restarts=3,
                    log_path=self.workdir / f"node-{tag}.log",
                    extra_env={"OMP_NUM_THREADS": "1"},
                    launcher=launcher,
                )
            )

    def events(self) -> list[dict[str, Any]]:
        found = []
        for path in self.workdir.glob("events-*.jsonl"):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    found.append(json.loads(line))
        return sorted(found, key=lambda e: e["t"])

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == "step"]

    def wait_training(self, ranks: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len({e["rank"] for e in self.steps()}) >= ranks:
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        steps = self.steps()
        last = max((e["step"] for e in steps), default=0)
        (self.workdir / "stop.tmp").write_text(str(last + self.args.steps_after))
        os.replace(self.workdir / "stop.tmp", self.stop_file)


def take_away(run: Run, cluster: Any, duration: float) -> tuple[float, float]:
    """Take the coordination service away as ``run.kind`` says; returns when it went and when it was back."""
    system, kind = run.system, run.kind
    went = time.time()
    if system == "torchrun-c10d":  # the store lives in node A's agent: freeze that process alone
        agent = run.nodes[0].pid
        os.kill(agent, signal.SIGSTOP)
        if kind == "fault":
            time.sleep(duration / 2)
            (run.workdir / "fault-1").write_text("raise")
            time.sleep(duration / 2)
        else:
            time.sleep(duration)
        os.kill(agent, signal.SIGCONT)
        return went, time.time()
    if kind in ("freeze", "fault"):
        cluster.pause_member(0)
        if kind == "fault":
            time.sleep(duration / 2)
            (run.workdir / "fault-1").write_text("raise")
            time.sleep(duration / 2)
        else:
            time.sleep(duration)
        cluster.resume_member(0)
    elif kind == "restart":
        cluster.kill_member(0)
        time.sleep(duration)
        cluster.restart_member(0)
    elif kind == "quorum":
        leader = cluster.leader()
        follower = next(index for index in range(cluster.member_count) if index != leader)
        for index in (leader, follower):
            cluster.pause_member(index)
        time.sleep(duration)
        for index in (leader, follower):
            cluster.resume_member(index)
    elif kind == "rolling":
        for index in range(cluster.member_count):
            cluster.kill_member(index)
            time.sleep(1.0)
            cluster.restart_member(index)
            if index < cluster.member_count - 1:
                time.sleep(duration)
    return went, time.time()


def measure(run: Run, went: float, back: float, normal_from: float) -> dict[str, Any]:
    """What the workers recorded around the outage (see the module docstring)."""
    events = run.events()
    steps = [e for e in events if e["event"] == "step"]
    ranks = sorted({e["rank"] for e in steps if e["t"] < went})
    normal = [e for e in steps if normal_from <= e["t"] < went]
    during = [e for e in steps if went <= e["t"] < back]
    normal_rate = len(normal) / max(went - normal_from, 1e-9)
    during_rate = len(during) / max(back - went, 1e-9)
    stopped = 0
    for rank in ranks:
        times = [went] + [e["t"] for e in during if e["rank"] == rank] + [back]
        if max(b - a for a, b in itertools.pairwise(times)) > STOPPED_AFTER:
            stopped += 1
    first_after = {}
    for e in steps:
        if e["t"] >= back:
            first_after.setdefault(e["rank"], e["t"])
    resumed = [first_after.get(rank) for rank in ranks]
    done = [json.loads(p.read_text()) for p in run.workdir.glob("done-*.json")]
    pids: dict[int, set[int]] = {}
    for e in events:
        if e["event"] == "ready":
            pids.setdefault(e["rank"], set()).add(e["pid"])
    # A worker replaced: a rank with a second process, or a rank that was not there before the outage.
    replaced = sum(len(p) - 1 for p in pids.values()) + len({rank for rank in pids if rank not in ranks})
    return {
        "rate_during": round(during_rate / normal_rate, 3) if normal_rate else None,
        "normal_steps_per_s": round(normal_rate, 2),
        "ranks_stopped": stopped,
        "in_process_restarts": len({e["iteration"] for e in events if e["event"] == "enter"}),
        "processes_replaced": replaced,
        "back_to_normal": None if None in resumed else round(max(t for t in resumed if t is not None) - back, 3),
        "ranks_finished": len(done),
    }


def run_one(system: str, kind: str, duration: float, args: argparse.Namespace) -> dict[str, Any]:
    from elastic_ft.runtime.net import free_port
    from elastic_ft.testing.etcd_cluster import EtcdCluster

    run = Run(system, kind, args)
    row: dict[str, Any] = {"system": system, "kind": kind, "duration": duration, "dir": str(run.workdir)}
    members = 3 if kind in ("quorum", "rolling") else 1
    # Default heartbeat and election timeouts, as a production etcd has them (the tests' servers are faster).
    with EtcdCluster(
        members=members, enable_v2=system == "torchrun-etcd-v2", heartbeat_ms=100, election_ms=1000
    ) as cluster:
        endpoint = ",".join(e.target for e in cluster.endpoints)
        try:
            run.start(endpoint, free_port("127.0.0.1"))
            if not run.wait_training(4, args.start_timeout):
                raise RuntimeError(f"the job did not train within {args.start_timeout:g} s ({run.workdir})")
            normal_from = time.time()
            time.sleep(args.before)
            went, back = take_away(run, cluster, duration)
            row.update(went=went, back=back)
            time.sleep(args.after)
            run.stop()
            deadline = time.monotonic() + args.cap
            while any(node.process.poll() is None for node in run.nodes) and time.monotonic() < deadline:
                time.sleep(0.2)
            row["exit_codes"] = [node.process.poll() for node in run.nodes]
            row.update(measure(run, went, back, normal_from))
        finally:
            for node in run.nodes:
                with contextlib.suppress(Exception):
                    os.kill(node.pid, signal.SIGCONT)
                node.terminate()
    return row


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(values) if values else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for kind in KINDS:
        for duration in sorted({r["duration"] for r in rows if r["kind"] == kind}):
            for system in SYSTEMS:
                mine = [r for r in rows if (r["system"], r["kind"], r["duration"]) == (system, kind, duration)]
                if not mine:
                    continue
                ok = [r for r in mine if "error" not in r]
                entry: dict[str, Any] = {
                    "kind": kind,
                    "duration": duration,
                    "system": system,
                    "runs": len(ok),
                    "errors": [r["error"] for r in mine if "error" in r],
                }
                for key in (
                    "rate_during",
                    "ranks_stopped",
                    "in_process_restarts",
                    "processes_replaced",
                    "back_to_normal",
                    "ranks_finished",
                ):
                    entry[key] = _median(ok, key)
                entry["exit_codes"] = sorted(
                    {code for r in ok for code in r.get("exit_codes", [])}, key=lambda c: (c is None, c)
                )
                table.append(entry)
    return table


def _cell(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.2f}{unit}"
    return f"{value:g}{unit}"


def print_table(table: list[dict[str, Any]]) -> None:
    print(
        "| outage | D (s) | system | runs | step rate during (of normal) | ranks stopped | in-process restarts | "
        "processes replaced | back to normal (s) | ranks finished | exit codes |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for e in table:
        rate = "-" if e["rate_during"] is None else f"{100 * e['rate_during']:.0f} %"
        codes = ",".join("running" if c is None else str(c) for c in e["exit_codes"]) or "-"
        print(
            f"| {e['kind']} | {e['duration']:g} | {e['system']} | {e['runs']} | {rate} | {_cell(e['ranks_stopped'])} | "
            f"{_cell(e['in_process_restarts'])} | {_cell(e['processes_replaced'])} | {_cell(e['back_to_normal'])} | "
            f"{_cell(e['ranks_finished'])} | {codes} |"
        )
        for error in e["errors"]:
            print(f"|  | | error: {error[:200]} | | | | | | | | |")


def goals_missed(rows: list[dict[str, Any]]) -> list[str]:
    """ftrun's goals (the module docstring), run by run."""
    missed = []
    for r in rows:
        if r["system"] != "ftrun":
            continue
        name = f"{r['kind']} {r['duration']:g} s"
        if "error" in r:
            missed.append(f"{name}: {r['error']}")
            continue
        if r["ranks_finished"] != 4 or any(code != 0 for code in r["exit_codes"]):
            missed.append(f"{name}: {r['ranks_finished']} ranks finished, exit codes {r['exit_codes']}")
        if r["kind"] == "fault":
            if r["back_to_normal"] is None or r["back_to_normal"] > FAULT_GOAL:
                missed.append(f"{name}: back to training {r['back_to_normal']} s after etcd's return")
        elif r["ranks_stopped"] or r["in_process_restarts"] or r["processes_replaced"]:
            missed.append(
                f"{name}: {r['ranks_stopped']} rank(s) stopped, {r['in_process_restarts']} in-process "
                f"restart(s), {r['processes_replaced']} process(es) replaced"
            )
    return missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--durations", default="30,60", help="seconds each outage lasts (comma-separated)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=float, default=5.0, help="seconds of training the normal rate is taken on")
    parser.add_argument("--after", type=float, default=15.0, help="seconds of training after the outage")
    parser.add_argument("--steps-after", type=int, default=50, help="steps trained once the driver stops the job")
    parser.add_argument(
        "--step-wait",
        type=float,
        default=0.05,
        help="the script's --step-wait: each step leaves the CPUs idle, as on GPUs",
    )
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--cap", type=float, default=180.0, help="seconds the job may take to stop")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    systems, kinds = args.systems.split(","), args.kinds.split(",")
    for name, chosen, known in (("system", systems, SYSTEMS), ("kind", kinds, KINDS)):
        bad = [c for c in chosen if c not in known]
        if bad:
            parser.error(f"unknown {name} {bad[0]!r}; expected some of {', '.join(known)}")
    try:
        durations = [float(d) for d in args.durations.split(",")]
    except ValueError:
        parser.error(f"--durations must be seconds separated by commas, got {args.durations!r}")
    if not all(0 < d <= 3600 for d in durations):
        parser.error(f"--durations must be seconds in (0, 3600], got {args.durations!r}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if "torchrun-etcd-v2" in systems:
        try:
            import etcd  # noqa: F401 - python-etcd, which torch's etcd-v2 backend needs
        except ImportError:
            parser.error("torchrun-etcd-v2 needs python-etcd: pip install -e .[bench] (or leave it out of --systems)")
    rows = []
    for repeat in range(args.repeats):
        for kind in kinds:
            for duration in durations:
                for system in systems:
                    if (system, kind) in NOT_APPLICABLE:
                        continue
                    started = time.monotonic()
                    try:
                        row = run_one(system, kind, duration, args)
                    except Exception as error:  # noqa: BLE001 - one failed run is reported, the others go on
                        row = {
                            "system": system,
                            "kind": kind,
                            "duration": duration,
                            "error": f"{type(error).__name__}: {error}",
                        }
                    row["repeat"], row["seconds"] = repeat, round(time.monotonic() - started, 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    table = summarize(rows)
    print()
    print_table(table)
    missed = goals_missed(rows)
    for line in missed:
        print(f"goal missed: {line}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "args": {k: str(v) for k, v in vars(args).items()},
                "table": table,
                "runs": rows,
                "goals_missed": missed,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")
    return 1 if missed else 0


if __name__ == "__main__":
    scratch.run_main(main)
