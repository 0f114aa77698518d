"""The elastic-ft demo: torchrun on the etcdft rendezvous, one host, no set-up.

1. Starts an embedded etcd on a free loopback port.
2. Runs two simulated nodes (two ``torchrun --rdzv-backend=etcdft`` processes,
   two gloo workers each) training a small model together.
3. Runs three nodes again, SIGKILLs one mid-training (agent and workers), and
   shows the survivors re-rendezvous through etcd and finish from the last
   checkpoint.
4. Runs two ``ftrun`` nodes (two workers each) of ``train_ftrun.py`` (DDP,
   AdamW, a DataLoader, ``elastic_ft.Wrapper``) and SIGKILLs one worker: the
   other three keep their processes and their state and go on in-process
   at once, from the step they were at (no checkpoint read, no step
   redone); the killed worker's node starts a new process for it, which
   rejoins the running world, healed from a peer: the world size is 4
   again.
5. Runs ``ftrun --spare-nodes=1`` with three nodes: two train, the third's
   workers wait initialised as reserve ranks. One training node is
   SIGKILLed: the spare's ranks take its place in-process, healed with the
   survivors' model and optimizer state (compared bit for bit), the world
   size is 4 again, and no process is started or stopped on any surviving
   node.

The ``ftrun`` jobs' events stay in the demo's etcd: it prints the last
job's (``elastic-ft events``) and draws both jobs' timelines
(``elastic-ft timeline``) into ``--out`` (default ``demo-out/``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import tempfile
import time
from pathlib import Path

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.event_log import EventLog
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.keys import RunKeys
from elastic_ft.observability.events import one_line
from elastic_ft.observability.timeline import build_timeline, draw
from elastic_ft.runtime.reaper import ensure_reaper
from elastic_ft.testing.local_cluster import TorchrunNode, ftrun_command

TRAIN = Path(__file__).with_name("train.py")
TRAIN_FTRUN = Path(__file__).with_name("train_ftrun.py")


def _events(workdir: Path) -> list[dict]:
    found = []
    for path in workdir.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                found.append(json.loads(line))
    return found


def stop_when_regrown(workdir: Path, deadline: float) -> None:
    """Write the stop step (the newest step + 20) once a later iteration trains at world size 4, or at ``deadline``."""
    while time.monotonic() < deadline:
        events = _events(workdir)
        if any(e["event"] == "first_step" and e["world_size"] == 4 and e["iteration"] > 0 for e in events):
            break
        time.sleep(0.2)
    steps = [e["step"] for e in _events(workdir) if e["event"] == "step"] or [0]
    (workdir / "stop.tmp").write_text(str(max(steps) + 20))
    (workdir / "stop.tmp").replace(workdir / "stop")


CONF = "last_call_timeout=1,lease_ttl=2,join_timeout=60"


def run_nodes(
    etcd: EtcdServer, workdir: Path, run_id: str, tags: str, nnodes: str, nproc: int, steps: int, kill: str | None
) -> tuple[list[dict], dict[str, int | None]]:
    """Run ``tags`` as torchrun nodes of ``examples/train.py``, SIGKILL node ``kill`` once the job checkpointed;
    returns the results and each node's exit code (None: still running after 180 s, then stopped)."""
    nodes = [
        TorchrunNode(
            tag,
            endpoint=etcd.endpoint,
            run_id=run_id,
            script=[str(TRAIN), "--workdir", str(workdir), "--steps", str(steps), "--step-time", "0.1"],
            nnodes=nnodes,
            nproc_per_node=nproc,
            rdzv_conf=CONF,
            log_path=workdir.parent / f"{run_id}-{tag}.log",
        )
        for tag in tags
    ]
    codes: dict[str, int | None] = {}
    try:
        if kill is not None:
            while not (workdir / "checkpoint.pt").exists():
                time.sleep(0.1)
            time.sleep(1.0)
            victim = next(n for n in nodes if n.tag == kill)
            print(f"    SIGKILL node {kill}: agent and workers (pids {victim.kill()})", flush=True)
            codes[kill] = -9
        for node in nodes:
            if node.tag != kill:
                try:
                    codes[node.tag] = node.wait(180)
                except subprocess.TimeoutExpired:  # the act fails, and the logs are shown before they go
                    print(f"    node {node.tag} still runs after 180 s", flush=True)
                    codes[node.tag] = None
    finally:
        for node in nodes:
            node.terminate()
    done = [json.loads(p.read_text()) for p in sorted(workdir.glob("done-*.json"))]
    return done, codes


def show(done: list[dict], codes: dict[str, int | None]) -> None:
    print("    node  exit  rank  world  restarts  resumed-at-step  final-loss")
    for result in done:
        node = result["node"]
        code = codes.get(node)
        print(
            f"    {node:>4}  {'?' if code is None else code:>4}  {result['rank']:>4}  {result['world_size']:>5}  "
            f"{result['restart_count']:>8}  {result['resumed_from']:>15}  {result['loss']:.4f}"
        )


def _events(workdir: Path) -> list[dict]:
    return sorted(
        (json.loads(line) for p in workdir.glob("events-*.jsonl") for line in p.read_text().splitlines() if line),
        key=lambda e: e["t"],
    )


#: Events the demo prints of the hot-spare scene (the rest: ``elastic-ft events``).
SHOWN_EVENTS = ("round_closed", "node_died", "fault_detected", "restart_decided", "spare_activated", "healed")


def show_events(etcd: EtcdServer, run_id: str, since: float) -> None:
    """The run's events from ``since`` on, as ``elastic-ft events`` prints them (a selection)."""
    client = EtcdClient(etcd.endpoints)
    try:
        events = EventLog(client, RunKeys("/elastic_ft", run_id)).read().events
    finally:
        client.close()
    for event in sorted(events, key=lambda e: e.time):
        broken = event.name == "fault_detected" and event.data.get("kind") == "peer_lost"  # consequences
        if event.time >= since and event.name in SHOWN_EVENTS and not broken:
            print(f"    +{event.time - since:6.3f} s  {event.source:<10}  {one_line(event.describe(), 110)}")


def draw_timeline(etcd: EtcdServer, run_id: str, path: Path, title: str) -> None:
    client = EtcdClient(etcd.endpoints)
    try:
        events = EventLog(client, RunKeys("/elastic_ft", run_id)).read_all().events
    finally:
        client.close()
    counts = draw(build_timeline(events), str(path), title)
    print(
        f"    timeline: {path} ({counts['faults']} fault(s), {counts['restarts']} in-process restart(s), "
        f"{counts['ranks']} ranks, {len(events)} events)"
    )


def hot_spare_scene(etcd: EtcdServer, workdir: Path, root: Path) -> bool:
    """Scene 4: a node killed, its ranks replaced in-process by the hot spare's reserve ranks."""
    from elastic_ft.testing.local_cluster import descendants

    script = [str(TRAIN_FTRUN), "--workdir", str(workdir), "--steps", "400", "--record-digests"]
    # Progress sampled every 0.5 s (default 5 s) for the timeline picture of a job this short.
    config = root / "observed.yaml"
    config.write_text("observability:\n  progress_interval: 0.5\n")
    nodes = {
        tag: TorchrunNode(
            tag,
            endpoint=etcd.endpoint,
            run_id="demo-spares",
            script=script,
            nnodes="2",
            nproc_per_node=2,
            rdzv_conf="last_call_timeout=1,lease_ttl=1,join_timeout=60",
            log_path=root / f"demo-spares-{tag}.log",
            launcher=ftrun_command(),
            extra_args=("--spare-nodes=1", f"--job-config={config}"),
        )
        for tag in "ABC"
    }
    try:
        deadline = time.monotonic() + 120
        while len({e["rank"] for e in _events(workdir) if e["event"] == "first_step"}) < 4:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        time.sleep(2)
        pid_of = {e["rank"]: e["pid"] for e in _events(workdir)}
        processes = {tag: set(descendants(node.pid)) for tag, node in nodes.items()}  # reserve ranks' too
        victim = next(tag for tag in nodes if pid_of[2] in processes[tag])
        killed_at = time.time()
        print(f"    SIGKILL node {victim} (ranks 2 and 3): agent, workers and monitors")
        nodes[victim].kill()
        codes = {tag: node.wait(180) for tag, node in nodes.items() if tag != victim}
    finally:
        for node in nodes.values():
            node.terminate()
    done = [json.loads(p.read_text()) for p in sorted(workdir.glob("done-*.json"))]
    full = sorted(
        e["t"] for e in _events(workdir) if e["event"] == "first_step" and e["t"] > killed_at and e["world_size"] == 4
    )
    print("    node  exit  initial-rank  pid      rank  world  in-process-iteration  process-restarts")
    for r in done:
        print(
            f"    {r['node']:>4}  {codes.get(r['node'], '?'):>4}  {r['initial_rank']:>12}  {r['pid']:<7}  {r['rank']:>4}  "
            f"{r['world_size']:>5}  {r['iteration']:>20}  {r['process_restarts']:>16}"
        )
    same_processes = all(r["pid"] in processes[r["node"]] for r in done)
    if len(full) >= 4:
        print(
            f"    world size 4 again {full[3] - killed_at:.2f} s after the kill, in the same processes: {same_processes}"
        )
    starts = {e["rank"]: e for e in _events(workdir) if e["event"] == "start" and e["iteration"] == 1}
    healed = len(starts) == 4 and len({(e["digest"], e["resumed_at"]) for e in starts.values()}) == 1
    reads = [e for e in _events(workdir) if e["event"] == "checkpoint_read" and e["rank"] in (4, 5)]
    at = next(iter(starts.values()))["resumed_at"] if starts else "?"
    print(
        f"    the spare's ranks 4 and 5 were healed from the survivors: same state, bit for bit, at step {at}: "
        f"{healed}; checkpoints read by them: {len(reads)}"
    )
    print("    the run's events from the kill on (elastic-ft events), times after the kill:")
    show_events(etcd, "demo-spares", killed_at)
    return (
        sorted(r["initial_rank"] for r in done) == [0, 1, 4, 5]
        and all(r["world_size"] == 4 and r["iteration"] == 1 and r["process_restarts"] == 0 for r in done)
        and same_processes
        and healed
        and not reads
        and all(code == 0 for code in codes.values())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="where the timelines go")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_reaper()  # the etcd and the nodes it starts go with the demo, even if it is killed
    with tempfile.TemporaryDirectory(prefix="elastic-ft-demo-") as tmp, EtcdServer() as etcd:
        root = Path(tmp)
        print(f"embedded etcd {'.'.join(map(str, etcd.version()))} at {etcd.endpoint}")

        print("\n[1] two nodes x two workers, torchrun --rdzv-backend=etcdft --nnodes=2")
        start = time.monotonic()
        done, codes = run_nodes(etcd, root / "job1", "demo-train", "AB", "2", 2, args.steps, kill=None)
        show(done, codes)
        ok1 = len(done) == 4 and all(c == 0 for c in codes.values())
        print(f"    {'OK' if ok1 else 'FAILED'} in {time.monotonic() - start:.1f} s")

        print("\n[2] three nodes (--nnodes=1:3), node B is killed mid-training")
        start = time.monotonic()
        done, codes = run_nodes(etcd, root / "job2", "demo-fault", "ABC", "1:3", 1, args.steps, kill="B")
        show(done, codes)
        ok2 = sorted(r["node"] for r in done) == ["A", "C"] and all(r["world_size"] == 2 for r in done)
        print(
            f"    {'OK' if ok2 else 'FAILED'}: survivors re-rendezvoused without B in {time.monotonic() - start:.1f} s"
        )
        print(
            "\n[3] ftrun, two nodes x two workers (DDP + AdamW); the worker of rank 3 is SIGKILLed at step 30,"
            " and its node respawns it"
        )
        start = time.monotonic()
        workdir = root / "job3"
        nodes = [
            TorchrunNode(
                tag,
                endpoint=etcd.endpoint,
                run_id="demo-ftrun",
                script=[
                    str(TRAIN_FTRUN),
                    "--workdir",
                    str(workdir),
                    "--steps",
                    "100000",
                    "--stop-file",
                    str(workdir / "stop"),
                    "--record-steps",
                    "--fault",
                    "sigkill",
                    "--fault-rank",
                    "3",
                    "--fault-step",
                    "30",
                ],
                nnodes="2",
                nproc_per_node=2,
                rdzv_conf=CONF,
                log_path=root / f"demo-ftrun-{tag}.log",
                launcher=ftrun_command(),
            )
            for tag in "AB"
        ]
        try:
            # The respawned process takes some seconds to start (torch, the model, the Wrapper): training goes on
            # until it trains at world size 4 again (or 120 s pass), then 20 more steps.
            stop_when_regrown(workdir, deadline=time.monotonic() + 120)
            codes = {node.tag: node.wait(180) for node in nodes}
        finally:
            for node in nodes:
                node.terminate()
        done = [json.loads(p.read_text()) for p in sorted(workdir.glob("done-*.json"))]
        events = [json.loads(line) for p in workdir.glob("events-*.jsonl") for line in p.open()]
        fault = next((e["t"] for e in events if e["event"] == "fault"), None)
        resumed = [e["t"] for e in events if e["event"] == "first_step" and fault is not None and e["t"] > fault]
        print(
            "    node  exit  rank  pid      world  in-process-iteration  resumed-at-step  process-restarts  final-loss"
        )
        for r in done:
            print(
                f"    {r['node']:>4}  {codes[r['node']]:>4}  {r['initial_rank']:>4}  {r['pid']:<7}  {r['world_size']:>5}  "
                f"{r['iteration']:>20}  {r['resumed_at']:>15}  {r['process_restarts']:>16}  {r['loss']:.4f}"
            )
        # Rank 3 died; its node respawned it as initial rank 4, admitted into the running world at once.
        ok3 = (
            sorted(r["initial_rank"] for r in done) == [0, 1, 2, 4]
            and all(r["world_size"] == 4 and r["iteration"] == 2 and r["process_restarts"] == 0 for r in done)
            and all(code == 0 for code in codes.values())
        )
        shrunk = [t for t in resumed if any(e["t"] == t and e["world_size"] == 3 for e in events)]
        regrown = [e["t"] for e in events if e["event"] == "first_step" and e["world_size"] == 4 and e["iteration"] > 0]
        recovery = f"training resumed {max(shrunk) - fault:.2f} s after the kill, " if shrunk and fault else ""
        if regrown and fault:
            recovery += f"world size 4 again {max(regrown) - fault:.2f} s after it, "
        print(
            f"    {'OK' if ok3 else 'FAILED'}: three workers went on in-process, the respawned one rejoined "
            f"({recovery}{time.monotonic() - start:.1f} s in all)"
        )
        draw_timeline(
            etcd,
            "demo-ftrun",
            args.out / "timeline-ftrun.png",
            "demo [3]: ftrun, 2 nodes x 2 workers; rank 3 SIGKILLed at step 30",
        )
        print("\n[4] ftrun --spare-nodes=1, three nodes x two workers: two train, one waits in reserve; one is killed")
        start = time.monotonic()
        ok4 = hot_spare_scene(etcd, root / "job4", root)
        print(f"    {'OK' if ok4 else 'FAILED'}: ({time.monotonic() - start:.1f} s in all)")
        draw_timeline(
            etcd,
            "demo-spares",
            args.out / "timeline-spares.png",
            "demo [4]: ftrun --spare-nodes=1, 3 nodes x 2 workers; node with ranks 2, 3 SIGKILLed",
        )
        if not (ok1 and ok2 and ok3 and ok4):
            for log in sorted(root.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
            raise SystemExit(1)


if __name__ == "__main__":
    main()
