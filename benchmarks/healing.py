"""Peer state healing vs reloading a checkpoint: a hot spare replaces a killed node, at three state sizes.

One run measures, side by side, the reference script (``examples/train_ftrun.py``:
DDP, ``torch.optim.AdamW``, a ``DataLoader`` with ``DistributedSampler``, an
atomic checkpoint every ``--checkpoint-every`` steps, default Wrapper
settings) on 2 active ``ftrun`` nodes of 1 worker each and 1 hot spare node
(``--spare-nodes=1``), one etcd, at model sizes whose state (parameters and
AdamW's two moments) is about 10 MB, 100 MB and 1 GB:

* **heal**: the script gives the Wrapper its ``state_dict``/``load_state_dict``;
  the activated spare receives the state from the surviving rank;
* **checkpoint**: ``--reload-checkpoint``, the path before healing: every
  iteration reloads the last checkpoint from local disk, and the steps since
  it are done again.

The fault: SIGKILL of the node holding initial rank 1 (agent, worker,
monitor) once the job reached ``--kill-step``. Measured from the kill: the
activated spare's first step at the full world size of 2, the steps redone,
and the time until the world is back at the step it had reached (what the
fault really cost). A dead node is known dead when its lease expires
(``lease_ttl=1``): about 1 s of every row.

Transfer throughput: two processes on this host send the same state with
the healing transport (gloo, chunks, CRC-32 on both sides), and, in the same
processes, the same number of bytes over a plain loopback TCP socket
(iperf-like: one ``sendall`` stream into ``recv_into``): the bandwidth the
transport is compared against.

Prints tables and writes ``benchmarks/results/healing.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import scratch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_ftrun.py"
RESULTS = Path(__file__).resolve().parent / "results" / "healing.json"
CONF = "last_call_timeout=1,join_timeout=120,lease_ttl=1"
MODES = ("heal", "checkpoint")
#: Target state sizes (bytes): parameters + AdamW's exp_avg and exp_avg_sq, float32.
SIZES = {"10MB": 10e6, "100MB": 100e6, "1GB": 1e9}
HEALED = re.compile(r"healed from rank \d+ to step \d+ \(([\d.]+) MB\) in ([\d.]+) s")


def hidden_for(state_bytes: float) -> int:
    """The example's width whose state is ``state_bytes``: params = h^2 + 35h + 1, state = 12 bytes a param."""
    params = state_bytes / 12
    return int((-35 + math.sqrt(35**2 + 4 * params)) / 2)


def state_bytes(hidden: int) -> int:
    return 12 * (hidden * hidden + 35 * hidden + 1)


def _events(workdir: Path) -> list[dict[str, Any]]:
    found = []
    for path in workdir.glob("events-*.jsonl"):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(found, key=lambda e: e["t"])


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:g} s")
        time.sleep(0.05)


def _reached(workdir: Path, step: int) -> bool:
    return any(e["event"] == "step" and e["step"] >= step for e in _events(workdir))


def run_node_kill(mode: str, hidden: int, args: argparse.Namespace, etcd: Any) -> dict[str, Any]:
    from elastic_ft.testing.local_cluster import TorchrunNode, descendants, ftrun_command

    workdir = scratch.workdir(f"healing-{mode}-")
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    script = [
        str(SCRIPT),
        "--workdir",
        str(workdir),
        "--steps",
        str(args.kill_step + args.steps_after),
        "--hidden",
        str(hidden),
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--record-steps",
    ]
    if mode == "checkpoint":
        script.append("--reload-checkpoint")
    nodes = [
        TorchrunNode(
            tag,
            endpoint=etcd.endpoint,
            run_id=run_id,
            script=script,
            nnodes="2:2",
            nproc_per_node=1,
            rdzv_conf=CONF,
            max_restarts=1,
            log_path=workdir / f"node-{tag}.log",
            extra_env={"OMP_NUM_THREADS": "1"},
            launcher=ftrun_command(),
            extra_args=("--spare-nodes=1",),
        )
        for tag in "ABC"
    ]
    try:
        _wait(lambda: _reached(workdir, args.kill_step), args.cap, f"step {args.kill_step}")
        pid = next(e["pid"] for e in _events(workdir) if e["rank"] == 1)
        victim = next(node for node in nodes if pid in descendants(node.pid))
        killed_at = time.time()
        victim.kill()
        survivors = [node for node in nodes if node is not victim]
        finished = True
        try:
            _wait(lambda: all(node.process.poll() is not None for node in survivors), args.cap, "the job to finish")
        except TimeoutError:
            finished = False
        statuses = [node.process.poll() for node in survivors]
    finally:
        for node in nodes:
            node.terminate()
    events = _events(workdir)
    before = max(e["step"] for e in events if e["event"] == "step" and e["t"] < killed_at)
    spare = [e for e in events if e["t"] > killed_at and e["rank"] == 2]
    firsts = [e["t"] for e in spare if e["event"] == "first_step" and e["world_size"] == 2]
    starts = [e for e in spare if e["event"] == "start"]
    regained = [e["t"] for e in spare if e["event"] == "step" and e["step"] >= before]
    spare_log = "\n".join(node.log() for node in survivors)
    healed = HEALED.findall(spare_log)
    return {
        "first_full_step_seconds": firsts[0] - killed_at if firsts else None,
        "regained_seconds": regained[0] - killed_at if regained else None,
        # A survivor may finish one more step after the kill (the dead rank's gradients were in): none redone.
        "steps_redone": max(0, before - starts[0]["resumed_at"]) if starts else None,
        "heal_mb": float(healed[0][0]) if healed else None,
        "heal_seconds": float(healed[0][1]) if healed else None,
        "checkpoint_reads": sum(1 for e in spare if e["event"] == "checkpoint_read"),
        "finished": finished and statuses == [0, 0],
        "dir": str(workdir),
    }


# ---- transfer throughput: the healing transport vs a plain loopback socket ------------------------------


def transfer_peer(rank: int, store_port: int, socket_port: int, hidden: int, repeats: int, out: Path) -> None:
    """One side of the throughput measure (a separate process): rank 0 sends, rank 1 receives and times."""
    import torch
    import torch.distributed as dist

    from elastic_ft.inprocess.healing.transfer import receive_state, send_state

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=300))
    sys.path.insert(0, str(SCRIPT.parent))
    from train_ftrun import TrainingState

    state = TrainingState(hidden, 48)
    nbytes = 0
    if rank == 0:
        model, optimizer = state.model, state.optimizer
        model(torch.randn(4, 32)).sum().backward()
        optimizer.step()  # AdamW's moments exist: the whole state
        payload = state.state_dict()
        store.set("size", str(sum(t.numel() * t.element_size() for t in _tensors(payload))))
    size = int(store.get("size"))
    transfer, loopback = [], []
    for index in range(repeats):
        if rank == 0:
            store.wait([f"ready-{index}"])
            send_state(group, [1], payload, 1)
        else:
            store.set(f"ready-{index}", "1")
            started = time.perf_counter()
            received = receive_state(group, 0)
            transfer.append(time.perf_counter() - started)
            nbytes = received.nbytes
            del received
    buffer = bytearray(min(size, 64 << 20))
    for index in range(repeats):
        if rank == 1:
            with socket.create_server(("127.0.0.1", socket_port + index)) as server:
                store.set(f"listening-{index}", "1")
                connection, _ = server.accept()
                with connection:
                    view, left = memoryview(buffer), size
                    started = time.perf_counter()
                    while left:
                        got = connection.recv_into(view[: min(left, len(view))])
                        if not got:
                            raise RuntimeError("the loopback sender closed early")
                        left -= got
                    loopback.append(time.perf_counter() - started)
                    connection.sendall(b"k")
        else:
            store.wait([f"listening-{index}"])
            with socket.create_connection(("127.0.0.1", socket_port + index)) as connection:
                view, left = memoryview(buffer), size
                while left:
                    part = min(left, len(view))
                    connection.sendall(view[:part])
                    left -= part
                connection.recv(1)
    if rank == 1:
        out.write_text(
            json.dumps({"bytes": size, "transfer_bytes": nbytes, "transfer": transfer, "loopback": loopback})
        )


def _tensors(state: object) -> list[Any]:
    from elastic_ft.inprocess.healing.transfer import flatten_state

    return flatten_state(state)[1]


def measure_throughput(hidden: int, repeats: int) -> dict[str, Any]:
    from elastic_ft.runtime.net import free_ports

    out = scratch.workdir("healing-throughput-") / "result.json"
    store_port, socket_port = free_ports(2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peers = []
    for rank in (0, 1):
        command = [sys.executable, __file__, "--transfer-peer", str(rank), str(store_port), str(socket_port)]
        peers.append(subprocess.Popen([*command, str(hidden), str(repeats), str(out)], env=env))
    codes = [peer.wait(600) for peer in peers]
    if codes != [0, 0]:
        raise RuntimeError(f"the throughput peers exited with {codes}")
    found = json.loads(out.read_text())
    transfer, loopback = statistics.median(found["transfer"]), statistics.median(found["loopback"])
    return {
        "bytes": found["bytes"],
        "transfer_gbps": found["bytes"] / transfer / 1e9,
        "loopback_gbps": found["bytes"] / loopback / 1e9,
        "transfer_runs": found["transfer"],
        "loopback_runs": found["loopback"],
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if len(present) == len(values) and present else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "never" if value is None else f"{value:.{digits}f}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--transfer-peer":
        rank, store_port, socket_port, hidden, repeats = (int(v) for v in sys.argv[2:7])
        transfer_peer(rank, store_port, socket_port, hidden, repeats, Path(sys.argv[7]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--kill-step", type=int, default=15)
    parser.add_argument("--steps-after", type=int, default=10, help="steps the job runs past the kill step")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--cap", type=float, default=300.0, help="seconds after which a run counts as failed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sizes = [size for size in args.sizes.split(",") if size]
    unknown = [size for size in sizes if size not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}: expected some of {list(SIZES)}")
    from elastic_ft.etcd.server import EtcdServer

    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()},
        "args": {k: str(v) for k, v in vars(args).items()},
        "node_kill": {},
        "throughput": {},
    }
    with EtcdServer() as etcd:
        for size in sizes:
            hidden = hidden_for(SIZES[size])
            for repeat in range(args.repeats):
                for mode in MODES:
                    run = run_node_kill(mode, hidden, args, etcd)
                    results["node_kill"].setdefault(size, {}).setdefault(mode, []).append(run)
                    print(f"[{size} {repeat + 1}/{args.repeats}] {mode}: {run}", file=sys.stderr, flush=True)
            results["throughput"][size] = measure_throughput(hidden, args.repeats)
            print(f"[{size}] throughput: {results['throughput'][size]}", file=sys.stderr, flush=True)
    lines = [
        (
            f"Node killed at step {args.kill_step} -> hot spare at the full world size of 2 (seconds, median of "
            f"{args.repeats}; 2 active nodes x 1 worker + 1 hot spare; DDP + AdamW, Wrapper defaults; checkpoint "
            f"every {args.checkpoint_every} steps on local disk; lease_ttl=1)"
        ),
        (
            f"  {'state':<7} {'mode':<11} {'first full step':>16} {'x heal':>7} {'steps redone':>13} "
            f"{'back at fault step':>19} {'x heal':>7} {'ckpt reads':>11} {'ok':>4}"
        ),
    ]
    summary: dict[str, Any] = {}
    for size in sizes:
        by_mode = results["node_kill"][size]
        heal_first = _median([r["first_full_step_seconds"] for r in by_mode["heal"]])
        heal_back = _median([r["regained_seconds"] for r in by_mode["heal"]])
        for mode in MODES:
            runs = by_mode[mode]
            first = _median([r["first_full_step_seconds"] for r in runs])
            back = _median([r["regained_seconds"] for r in runs])
            redone = _median([r["steps_redone"] for r in runs])
            reads = statistics.median(r["checkpoint_reads"] for r in runs)
            ok = all(r["finished"] for r in runs)
            ratio_first = f"{first / heal_first:.2f}" if first is not None and heal_first else "-"
            ratio_back = f"{back / heal_back:.2f}" if back is not None and heal_back else "-"
            summary.setdefault(size, {})[mode] = {
                "first_full_step_median_seconds": first,
                "regained_median_seconds": back,
                "steps_redone_median": redone,
                "checkpoint_reads_median": reads,
                "ok": ok,
            }
            lines.append(
                f"  {size:<7} {mode:<11} {_fmt(first):>16} {ratio_first:>7} {_fmt(redone, 0):>13} "
                f"{_fmt(back):>19} {ratio_back:>7} {reads:>11g} {'yes' if ok else 'NO':>4}"
            )
    lines += [
        "",
        f"Healing transfer throughput vs loopback TCP (GB/s, median of {args.repeats}; two processes on this host)",
        f"  {'state':<7} {'MB':>8} {'transfer':>9} {'loopback':>9} {'loopback/transfer':>18} {'in process (healed)':>20}",
    ]
    for size in sizes:
        found = results["throughput"][size]
        heal_runs = results["node_kill"][size]["heal"]
        in_job = _median([r["heal_seconds"] for r in heal_runs])
        ratio = found["loopback_gbps"] / found["transfer_gbps"]
        summary[size]["throughput"] = {
            **{k: v for k, v in found.items() if not k.endswith("_runs")},
            "ratio": ratio,
            "heal_in_job_median_seconds": in_job,
        }
        lines.append(
            f"  {size:<7} {found['bytes'] / 1e6:>8.1f} {found['transfer_gbps']:>9.3f} {found['loopback_gbps']:>9.3f} "
            f"{ratio:>18.2f} {_fmt(in_job) + ' s':>20}"
        )
    lines.append("  goal: transfer within 2x of loopback; the spare's first full step with 0 steps redone")
    results["summary"] = summary
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**results, "table": table}, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    scratch.run_main(main)
