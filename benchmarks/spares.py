"""Hot spares: a node killed mid-training, full world size again: elastic-ft's hot spares vs ftrun's cold spare vs torchrun.

One run measures, side by side, the same script (``examples/train_ftrun.py``:
DDP, ``torch.optim.AdamW``, a ``DataLoader`` with ``DistributedSampler``, an
atomic checkpoint, the Wrapper with default settings), 2 active nodes x 2
workers and 1 spare node, all simulated on this host, one etcd:

* **hot spare** (``ftrun --spare-nodes=1``): the spare node is a member of
  the round; its workers start, initialise and wait as reserve ranks, and
  replace the killed node's ranks in the next in-process iteration;
* **late hot spare** (``hot_spare_late``, the usual case: spares start after
  the job): the spare node starts once the job trains, joins the running
  round, and its workers register as joiners (initialised, in reserve)
  before the kill; the restart that follows the kill admits them;
* **cold spare** (``ftrun`` without ``--spare-nodes``, what ftrun did before
  hot spares): the spare waits outside the round; the survivors shrink
  in-process, then follow into a process restart that admits the spare;
* **torchrun**: ``torchrun`` (etcdft rendezvous, ``--max-restarts=3``), the
  script without a Wrapper, the spare waiting outside the round: every
  worker restarts. (``--nnodes=2:3`` would make torchrun admit the third
  node as an active one, world size 6, not as a spare; ``--nnodes=2:2`` with
  a third node waiting is torchrun's spare.)

The fault: SIGKILL of the whole node holding initial ranks 2 and 3 (agent,
workers, monitors), once every rank trains. The measure: from the kill to
the first step of the last of 4 ranks in a world of 4 again. Also counted:
worker processes started after the kill on the surviving nodes (0 is the
goal: nothing restarted). A dead node is known dead when its rendezvous
lease expires: the rows run with ``--lease-ttl`` (default 1 s), and the
``hot_spare_lease10`` row with the rendezvous's default of 10 s, to show
what detection costs.

The script builds its optimizer in the wrapped function (``--lazy-optimizer``,
``--eager-optimizer`` to build it before the Wrapper), so a rank's first
optimizer, and with it ``torch._dynamo``'s import, falls in its first
iteration unless the Wrapper's warm-up did it while the rank waited:
``hot_spare_late_no_warmup`` is the late hot spare with ``Wrapper(warmup=None)``.

The respawn part: 2 nodes x 2 workers (ftrun defaults); worker rank 1 is
SIGKILLed; measured: from the kill to the respawned process registering as a
ready joiner (it is then an initialised reserve), and, after a second fault
the benchmark triggers once it is ready (an exception on rank 0), from that
fault to the respawned rank's first step as an active rank, with the world
back at 4; and with ``respawn.rejoin: at_once`` (the node asks for the
restart that admits the new process as soon as it is ready), from the kill
to the first step at world size 4 again, with no second fault: ``at_once``
kills the worker once its node's warm standby is ready (ftrun's default: the
standby takes its place), ``at_once_no_standby`` under ``ftrun
--no-warm-standby`` (a new process), both at least ``--standby-wait``
seconds after the job trains.

Prints tables and writes ``benchmarks/results/spares.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import scratch
from phases import print_phase_table, run_phases

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_ftrun.py"
RESULTS = Path(__file__).resolve().parent / "results" / "spares.json"
CONF = "last_call_timeout=1,join_timeout=120,lease_ttl={lease_ttl}"
SYSTEMS = ("hot_spare", "hot_spare_late", "hot_spare_late_no_warmup", "cold_spare", "torchrun", "hot_spare_lease10")
#: The respawn rows: ``respawn.rejoin: at_once``, with the node's warm standby (ftrun's default) and without.
AT_ONCE = ("at_once", "at_once_no_standby")
#: A respawned worker makes the world whole again within this (median), with a warm standby.
RESPAWN_GOAL_SECONDS = 1.5
#: The extra row: hot spares at the rendezvous's default lease_ttl (10 s), the time a dead node takes to be known dead.
DEFAULT_LEASE_TTL = 10
GOAL_SECONDS = 2.0
#: A late hot spare restores the world size within these (median, worst run).
LATE_GOAL_SECONDS = (1.0, 1.5)


def _events(workdir: Path) -> list[dict[str, Any]]:
    events = []
    for path in workdir.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e["t"])


def full_world_seconds(workdir: Path, since: float, world_size: int = 4) -> float | None:
    """From ``since`` to the first step of the last of ``world_size`` ranks in a world of that size; None if never."""
    firsts: dict[int, float] = {}
    for event in _events(workdir):
        if event["event"] == "first_step" and event["t"] > since and event.get("world_size") == world_size:
            firsts.setdefault(event["rank"], event["t"])
    if len(firsts) < world_size:
        return None
    return sorted(firsts.values())[world_size - 1] - since


def admission_stall(workdir: Path) -> float | None:
    """The survivors' longest pause in stepping across the restart that admitted the respawned process: from
    their last step at world size 3 to their first at 4 again; None if that restart never came."""
    steps = [e for e in _events(workdir) if e["event"] == "step" and e["rank"] < 4]
    pauses = []
    for rank in {e["rank"] for e in steps if e["world_size"] == 3}:
        shrunk = [e["t"] for e in steps if e["rank"] == rank and e["world_size"] == 3]
        after = [e["t"] for e in steps if e["rank"] == rank and e["world_size"] == 4 and e["t"] > max(shrunk)]
        if not after:
            return None
        pauses.append(min(after) - max(shrunk))
    return max(pauses, default=None)


def processes_started_after(workdir: Path, since: float, surviving_ranks: set[int]) -> int:
    """Worker processes of the surviving nodes that started (their first event) after ``since``."""
    first_seen: dict[int, tuple[float, int]] = {}
    for event in _events(workdir):
        first_seen.setdefault(event["pid"], (event["t"], event["rank"]))
    return sum(1 for t, rank in first_seen.values() if t > since and rank in surviving_ranks)


def _script(workdir: Path, args: argparse.Namespace, wrapper: bool, extra: list[str] | None = None) -> list[str]:
    command = [str(SCRIPT), "--workdir", str(workdir), "--steps", str(args.steps), "--hidden", str(args.hidden)]
    lazy = [] if args.eager_optimizer else ["--lazy-optimizer"]
    return command + lazy + ([] if wrapper else ["--no-wrapper"]) + (extra or [])


def _node(
    tag: str,
    workdir: Path,
    etcd: Any,
    run_id: str,
    script: list[str],
    launcher: list[str],
    lease_ttl: int,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Any:
    from elastic_ft.testing.local_cluster import TorchrunNode

    return TorchrunNode(
        tag,
        endpoint=etcd.endpoint,
        run_id=run_id,
        script=script,
        nnodes="2:2",
        nproc_per_node=2,
        rdzv_conf=CONF.format(lease_ttl=lease_ttl),
        max_restarts=3,
        log_path=workdir / f"node-{tag}.log",
        extra_env={"OMP_NUM_THREADS": "1", **(env or {})},
        launcher=launcher,
        extra_args=extra,
    )


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:g} s")
        time.sleep(0.05)


def _node_of_rank(workdir: Path, nodes: list[Any], rank: int) -> Any:
    from elastic_ft.testing.local_cluster import descendants

    pid = next(e["pid"] for e in _events(workdir) if e["rank"] == rank)
    return next(node for node in nodes if pid in descendants(node.pid))


def _joined(etcd: Any, run_id: str) -> int:
    """How many processes registered as joiners of the running world (initialised, in reserve)."""
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.keys import RunKeys
    from elastic_ft.launcher.status import collect_status

    client = EtcdClient(etcd.endpoints)
    try:
        return len(collect_status(client, RunKeys("/elastic_ft", run_id)).get("joined") or [])
    finally:
        client.close()


def run_node_kill(system: str, args: argparse.Namespace, etcd: Any) -> dict[str, Any]:
    from elastic_ft.testing.local_cluster import ftrun_command, torchrun_command

    workdir = scratch.workdir(f"spares-{system}-")
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    launcher = torchrun_command() if system == "torchrun" else ftrun_command()
    script = _script(
        workdir, args, wrapper=system != "torchrun", extra=["--no-warmup"] if "no_warmup" in system else []
    )
    hot = system.startswith("hot_spare")
    extra = ("--spare-nodes=1",) if hot else ()
    lease_ttl = DEFAULT_LEASE_TTL if system == "hot_spare_lease10" else args.lease_ttl
    nodes = [_node(tag, workdir, etcd, run_id, script, launcher, lease_ttl, extra) for tag in "AB"]
    try:
        training = lambda: len({e["rank"] for e in _events(workdir) if e["event"] == "first_step"}) >= 4
        if system.startswith("hot_spare_late"):  # joins the running round; its workers register as joiners
            _wait(training, args.cap, "training")
            nodes.append(_node("C", workdir, etcd, run_id, script, launcher, lease_ttl, extra))
            _wait(lambda: _joined(etcd, run_id) >= 2, args.cap, "the late spare's workers to register")
        elif hot:
            nodes.append(_node("C", workdir, etcd, run_id, script, launcher, lease_ttl, extra))
        else:
            _wait(training, args.cap, "training")
            nodes.append(_node("C", workdir, etcd, run_id, script, launcher, lease_ttl, extra))  # waits outside
        _wait(training, args.cap, "training")
        time.sleep(args.train_before_kill)
        victim = _node_of_rank(workdir, nodes, 2)
        survivors = [node for node in nodes if node is not victim]
        killed_at = time.time()
        victim.kill()
        finished = True
        deadline = time.monotonic() + args.cap
        while any(node.process.poll() is None for node in survivors):
            if time.monotonic() > deadline:
                finished = False
                break
            time.sleep(0.2)
        statuses = [node.process.poll() for node in survivors]
    finally:
        for node in nodes:
            node.terminate()
    surviving_ranks = {e["rank"] for e in _events(workdir) if e["t"] < killed_at} - {2, 3}
    return {
        "seconds": full_world_seconds(workdir, killed_at) if finished else None,
        "processes_restarted": processes_started_after(workdir, killed_at, surviving_ranks),
        "phases": run_phases(run_id, etcd.endpoints, killed_at) if system != "torchrun" else None,
        "finished": finished and statuses == [0, 0],
        "dir": str(workdir),
    }


def run_respawn_at_once(variant: str, args: argparse.Namespace, etcd: Any) -> dict[str, Any]:
    """``respawn.rejoin: at_once``: from a worker's SIGKILL to the first step at world size 4 again, no second fault.

    The kill comes once the job trains and, with the warm standby (``at_once``), once the victim's node says its
    standby is ready; ``at_once_no_standby`` runs ``ftrun --no-warm-standby``, killed after as long a wait.
    """
    import os
    import signal

    from elastic_ft.testing.local_cluster import ftrun_command

    workdir = scratch.workdir(f"spares-{variant}-")
    config = workdir / "job.yaml"
    config.write_text("respawn: {rejoin: at_once}\n")
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    stop = workdir / "stop"
    args_steps = argparse.Namespace(**{**vars(args), "steps": 10**9})
    script = _script(workdir, args_steps, wrapper=True, extra=["--record-steps", "--stop-file", str(stop)])
    flags = (f"--job-config={config}",) + (("--no-warm-standby",) if variant == "at_once_no_standby" else ())
    info = {"LOGLEVEL": "INFO"}  # the agent says when its standby is ready
    nodes = [_node(tag, workdir, etcd, run_id, script, ftrun_command(), args.lease_ttl, flags, info) for tag in "AB"]
    try:
        _wait(
            lambda: len({e["rank"] for e in _events(workdir) if e["event"] == "first_step"}) >= 4, args.cap, "training"
        )
        victim = _node_of_rank(workdir, nodes, 1)
        began = time.monotonic()
        if variant == "at_once":
            _wait(lambda: "warm standby ready" in victim.log(), args.cap, "the warm standby")
        time.sleep(max(0.0, args.standby_wait - (time.monotonic() - began)))
        pid = next(e["pid"] for e in _events(workdir) if e["rank"] == 1 and e["event"] == "start")
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: full_world_seconds(workdir, killed_at) is not None, args.cap, "the world of 4 again")
        last = max(e.get("step", 0) for e in _events(workdir))
        stop.with_suffix(".tmp").write_text(str(last + 100))
        stop.with_suffix(".tmp").replace(stop)
        _wait(lambda: all(node.process.poll() is not None for node in nodes), args.cap, "the job to finish")
        statuses = [node.process.poll() for node in nodes]
    finally:
        for node in nodes:
            node.terminate()
    respawned = [e for e in _events(workdir) if e["event"] == "start" and e["rank"] == 4]
    return {
        "full_world_seconds": full_world_seconds(workdir, killed_at),
        "admission_stall_seconds": admission_stall(workdir),
        "admission_phases": run_phases(run_id, etcd.endpoints, None, last=True),
        "from_standby": bool(respawned) and "(initial rank 4, the node's warm standby)" in victim.log(),
        "finished": statuses == [0, 0],
        "dir": str(workdir),
    }


def run_respawn(args: argparse.Namespace, etcd: Any) -> dict[str, Any]:
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.keys import JOINERS, WRAPPER_JOB, RunKeys
    from elastic_ft.testing.local_cluster import ftrun_command

    workdir = scratch.workdir("spares-respawn-")
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    trigger = workdir / "second-fault"
    extra = [
        "--fault",
        "sigkill",
        "--fault-rank",
        "1",
        "--fault-step",
        str(args.fault_step),
        "--fault-file",
        str(trigger),
        "--fault-file-rank",
        "0",
    ]
    script = _script(workdir, args, wrapper=True, extra=extra)
    nodes = [_node(tag, workdir, etcd, run_id, script, ftrun_command(), args.lease_ttl) for tag in "AB"]
    joiners_key = f"{RunKeys('/elastic_ft', run_id).round_store(0)}{WRAPPER_JOB}/{JOINERS}"
    client = EtcdClient(etcd.endpoints)
    try:
        _wait(lambda: any(e["event"] == "fault" for e in _events(workdir)), args.cap, "the first fault")
        killed_at = next(e["t"] for e in _events(workdir) if e["event"] == "fault")
        _wait(lambda: client.get(joiners_key)[0] is not None, args.cap, "the respawned worker to register")
        ready_at = time.time()
        trigger.touch()
        _wait(lambda: sum(e["event"] == "fault" for e in _events(workdir)) >= 2, args.cap, "the second fault")
        second_at = [e["t"] for e in _events(workdir) if e["event"] == "fault"][1]
        _wait(lambda: all(node.process.poll() is not None for node in nodes), args.cap, "the job to finish")
        statuses = [node.process.poll() for node in nodes]
    finally:
        client.close()
        for node in nodes:
            node.terminate()
    joiner_steps = [e for e in _events(workdir) if e["event"] == "first_step" and e["rank"] == 4 and e["t"] > second_at]
    return {
        "ready_seconds": ready_at - killed_at,
        "active_seconds": joiner_steps[0]["t"] - second_at if joiner_steps else None,
        "full_world_seconds": full_world_seconds(workdir, second_at),
        "finished": statuses == [0, 0],
        "dir": str(workdir),
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if len(present) == len(values) and present else None


def _fmt(value: float | None) -> str:
    return "never" if value is None else f"{value:.3f}"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (``benchmarks/recovery.py`` runs two of its rows with their defaults)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000, help="long enough that training outlives the recovery")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--fault-step", type=int, default=40)
    parser.add_argument("--train-before-kill", type=float, default=2.0, help="seconds of training before the kill")
    parser.add_argument("--cap", type=float, default=150.0, help="seconds after which a run counts as failed")
    parser.add_argument(
        "--lease-ttl", type=int, default=1, help="the rendezvous lease TTL: a dead node is known dead this long after"
    )
    parser.add_argument(
        "--only",
        choices=(*SYSTEMS, "respawn", *AT_ONCE),
        action="append",
        help="run only this row; repeat the flag for several (--only hot_spare --only torchrun)",
    )
    parser.add_argument(
        "--eager-optimizer",
        action="store_true",
        help="build the optimizer before the Wrapper (default: in the wrapped function, --lazy-optimizer)",
    )
    parser.add_argument(
        "--standby-wait",
        type=float,
        default=20.0,
        help="the respawn rows kill a worker at least this long after the job trains (and after the standby is ready)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    from elastic_ft.etcd.server import EtcdServer

    selected = args.only or [*SYSTEMS, "respawn", *AT_ONCE]
    results: dict[str, Any] = {
        "machine": {
            "cpus": __import__("os").cpu_count(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        },
        "args": {k: str(v) for k, v in vars(args).items()},
        "node_kill": {},
        "respawn": [],
        **{variant: [] for variant in AT_ONCE},
    }
    with EtcdServer() as etcd:
        for repeat in range(args.repeats):
            for system in SYSTEMS:
                if system in selected:
                    run = run_node_kill(system, args, etcd)
                    results["node_kill"].setdefault(system, []).append(run)
                    print(f"[{repeat + 1}/{args.repeats}] {system}: {run}", file=sys.stderr, flush=True)
            if "respawn" in selected:
                run = run_respawn(args, etcd)
                results["respawn"].append(run)
                print(f"[{repeat + 1}/{args.repeats}] respawn: {run}", file=sys.stderr, flush=True)
            for variant in AT_ONCE:
                if variant in selected:
                    run = run_respawn_at_once(variant, args, etcd)
                    results[variant].append(run)
                    print(f"[{repeat + 1}/{args.repeats}] {variant}: {run}", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {}
    optimizer = "before the Wrapper" if args.eager_optimizer else "in the wrapped function"
    lines = [
        (
            f"Node killed -> first step at the full world size of 4 (seconds; median (min-max) of {args.repeats}; "
            f"2 active nodes x 2 workers + 1 spare node; DDP + AdamW built {optimizer}, Wrapper defaults; "
            f"lease_ttl={args.lease_ttl}, hot_spare_lease10: the rendezvous default {DEFAULT_LEASE_TTL}; "
            "no_warmup: Wrapper(warmup=None))"
        ),
        f"  {'system':<18} {'median':>8} {'min-max':>15} {'x hot spare':>12} {'restarted processes':>20} {'ok':>4}",
    ]
    hot = _median([r["seconds"] for r in results["node_kill"].get("hot_spare", [])])
    for system in SYSTEMS:
        runs = results["node_kill"].get(system)
        if not runs:
            continue
        seconds = [r["seconds"] for r in runs]
        median = _median(seconds)
        present = [s for s in seconds if s is not None]
        spread = f"{min(present):.3f}-{max(present):.3f}" if present else "-"
        ratio = f"{median / hot:.1f}" if median is not None and hot else "-"
        restarted = statistics.median(r["processes_restarted"] for r in runs)
        ok = all(r["finished"] for r in runs)
        summary[system] = {"median_seconds": median, "runs": seconds, "processes_restarted_median": restarted, "ok": ok}
        lines.append(
            f"  {system:<18} {_fmt(median):>8} {spread:>15} {ratio:>12} {restarted:>20g} {'yes' if ok else 'NO':>4}"
        )
    if hot is not None:
        verdict = "met" if hot < GOAL_SECONDS else f"missed by {hot - GOAL_SECONDS:.3f} s"
        lines.append(f"  goal: hot spare under {GOAL_SECONDS:g} s with no process restarted: {verdict}")
    late = summary.get("hot_spare_late")
    if late and late["median_seconds"] is not None:
        worst = max(r for r in late["runs"] if r is not None)
        met = late["median_seconds"] <= LATE_GOAL_SECONDS[0] and worst <= LATE_GOAL_SECONDS[1]
        lines.append(
            f"  goal: late hot spare, world size back in {LATE_GOAL_SECONDS[0]:g} s (median) and "
            f"{LATE_GOAL_SECONDS[1]:g} s (worst): {'met' if met else 'missed'} "
            f"(median {late['median_seconds']:.3f} s, worst {worst:.3f} s)"
        )
    if results["respawn"]:
        runs = results["respawn"]
        ready = _median([r["ready_seconds"] for r in runs])
        active = _median([r["active_seconds"] for r in runs])
        full = _median([r["full_world_seconds"] for r in runs])
        summary["respawn"] = {
            "ready_median_seconds": ready,
            "active_median_seconds": active,
            "full_world_median_seconds": full,
            "ok": all(r["finished"] for r in runs),
        }
        lines += [
            "",
            f"Worker SIGKILLed -> respawned process (median of {len(runs)}; 2 nodes x 2 workers, ftrun defaults)",
            f"  kill -> ready reserve (registered joiner):          {_fmt(ready)} s",
            f"  second fault -> respawned rank's first active step: {_fmt(active)} s",
            f"  second fault -> first step at world size 4:         {_fmt(full)} s",
        ]
    at_once_rows = [variant for variant in AT_ONCE if results[variant]]
    if at_once_rows:
        lines += [
            "",
            (
                "Worker SIGKILLed, respawn.rejoin=at_once -> first step at world size 4 again, no second fault "
                f"(seconds; median (min-max); 2 nodes x 2 workers; DDP + AdamW built {optimizer}; "
                "at_once_no_standby: ftrun --no-warm-standby)"
            ),
            f"  {'variant':<20} {'runs':>5} {'median':>8} {'min-max':>15} {'survivors pause':>16} {'standby':>8} {'ok':>4}",
        ]
    for variant in at_once_rows:
        runs = results[variant]
        full = [r["full_world_seconds"] for r in runs]
        median, stall = _median(full), _median([r["admission_stall_seconds"] for r in runs])
        present = [v for v in full if v is not None]
        spread = f"{min(present):.3f}-{max(present):.3f}" if present else "-"
        standby = sum(r["from_standby"] for r in runs)
        ok = all(r["finished"] for r in runs)
        summary[variant] = {
            "full_world_median_seconds": median,
            "runs": full,
            "admission_stall_median_seconds": stall,
            "from_standby": standby,
            "ok": ok,
        }
        lines.append(
            f"  {variant:<20} {len(runs):>5} {_fmt(median):>8} {spread:>15} {_fmt(stall):>16} "
            f"{standby:>8} {'yes' if ok else 'NO':>4}"
        )
    standby_median = summary.get("at_once", {}).get("full_world_median_seconds")
    if standby_median is not None:
        verdict = "met" if standby_median <= RESPAWN_GOAL_SECONDS else "missed"
        lines.append(
            f"  goal: with a warm standby, whole again within {RESPAWN_GOAL_SECONDS:g} s (median): {verdict} "
            f"({standby_median:.3f} s)"
        )
    results["summary"] = summary
    table = "\n".join(lines)
    print(table)
    results["phases"] = print_phase_table(
        "Where the recovery goes, per phase (ms; the longest across ranks, median of runs; detection: from the "
        "kill to the record of the node's death)",
        {system: [r["phases"] for r in runs] for system, runs in results["node_kill"].items() if system != "torchrun"}
        | {f"{variant} admission": [r["admission_phases"] for r in results[variant]] for variant in at_once_rows},
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**results, "table": table}, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    scratch.run_main(main)
