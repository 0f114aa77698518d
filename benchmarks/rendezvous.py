"""Rendezvous benchmark: etcdft side by side with torch's c10d and etcd-v2 backends.

One run measures, for every backend under equal settings (same min, max,
last call; etcdft's lease TTL equal to torch's keep-alive bound):

1. join: N nodes (threads, each with its own handler and connection) call
   ``next_rendezvous()`` at once; the time until all of them return, for
   N = 2, 8, 32, 64 with min = max = N;
2. kill: N nodes complete a round, one member (a separate process) is
   SIGKILLed, and the survivors re-rendezvous.  Survivors act as torch's
   agent does: they poll ``num_nodes_waiting()`` every 0.1 s and restart
   when it is positive.  A backend whose survivors cannot see the death that
   way is given the best case: its survivors re-rendezvous at the moment of
   the kill, as if their workers had failed at once.  Time from the kill to
   the completion of the survivors' round;
3. etcd requests per node per round for etcdft (keep-alives, which depend on
   time and not on N, are counted apart).

Prints a table, writes ``benchmarks/results/rendezvous.json``.
Needs ``pip install -e .[bench]`` (python-etcd, for torch's etcd-v2 backend).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path

import scratch
import torch.distributed as dist
from rdzv_backends import BACKENDS, Setting, make_handler

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.runtime.net import free_port

HERE = Path(__file__).resolve().parent


def run_all(handlers: list, timeout: float = 300, *, whole_round: bool = True) -> tuple[float, list]:
    """Call next_rendezvous on every handler at once; return the time until the last returns.

    With ``whole_round`` the handlers must be the whole round: ranks 0..N-1.
    """
    barrier = threading.Barrier(len(handlers) + 1)
    infos: list = [None] * len(handlers)
    errors: list[BaseException] = []

    def node(i: int) -> None:
        barrier.wait()
        try:
            infos[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join(timeout)
    elapsed = time.perf_counter() - start
    if errors or any(i is None for i in infos):
        raise RuntimeError(f"rendezvous failed: {errors[:1] or 'timed out'}")
    ranks = sorted(i.rank for i in infos)
    if len(set(ranks)) != len(ranks) or (whole_round and ranks != list(range(len(handlers)))):
        raise RuntimeError(f"inconsistent ranks {ranks}")
    return elapsed, infos


def shutdown(handlers: list) -> None:
    for handler in handlers:
        handler.shutdown()


def endpoint_for(backend: str, etcd: EtcdServer, tcp_port: int) -> str:
    return f"127.0.0.1:{tcp_port}" if backend == "c10d" else etcd.endpoint


def bench_join(backend: str, endpoint: str, n: int, repeats: int, last_call: float) -> dict:
    times = []
    requests: list[float] = []
    for _ in range(repeats):
        setting = Setting(n, n, last_call, 300, None)
        run_id = f"join-{uuid.uuid4().hex[:8]}"
        handlers = [make_handler(backend, endpoint, run_id, setting) for _ in range(n)]
        before = [Counter(h.client.requests_by_kind) for h in handlers] if backend == "etcdft" else []
        elapsed, _ = run_all(handlers)
        times.append(elapsed)
        if backend == "etcdft":
            deltas = [Counter(h.client.requests_by_kind) - b for h, b in zip(handlers, before, strict=True)]
            requests.append(statistics.mean(sum(v for k, v in d.items() if k != "keep_alive") for d in deltas))
        shutdown(handlers)
    row = {"backend": backend, "nodes": n, "median_s": statistics.median(times), "times_s": times}
    if requests:
        row["requests_per_node"] = statistics.median(requests)
    return row


def start_victim(backend: str, endpoint: str, run_id: str, setting: Setting) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--victim",
        backend,
        endpoint,
        run_id,
        json.dumps(setting.__dict__),
    ]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=HERE)


def bench_kill(backend: str, endpoint: str, n: int, repeats: int, last_call: float, liveness: int) -> dict:
    rerendezvous, detection = [], []
    watched = backend == "etcdft"
    for _ in range(repeats):
        setting = Setting(1, n, last_call, 300, liveness)
        run_id = f"kill-{uuid.uuid4().hex[:8]}"
        survivors = [make_handler(backend, endpoint, run_id, setting) for _ in range(n - 1)]
        victim = start_victim(backend, endpoint, run_id, setting)
        try:
            assert victim.stdout is not None and victim.stdout.readline().strip() == "joining"
            run_all(survivors, whole_round=False)  # max reached with the victim: closes at once
            if victim.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{backend}: the victim node did not complete the first round")
        finally:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
        killed_at = time.perf_counter()
        if watched:
            while not all(h.num_nodes_waiting() > 0 for h in survivors):
                time.sleep(0.1)
            detection.append(time.perf_counter() - killed_at)
        _, infos = run_all(survivors)
        if {i.world_size for i in infos} != {n - 1}:
            raise RuntimeError(f"{backend}: survivors' round has world sizes {[i.world_size for i in infos]}")
        rerendezvous.append(time.perf_counter() - killed_at)
        shutdown(survivors)
    row = {
        "backend": backend,
        "nodes": n,
        "median_s": statistics.median(rerendezvous),
        "times_s": rerendezvous,
        "liveness_s": liveness,
        "death_seen_by_watch": watched,
    }
    if detection:
        row["median_detection_s"] = statistics.median(detection)
    return row


def victim_main(backend: str, endpoint: str, run_id: str, setting_json: str) -> None:
    handler = make_handler(backend, endpoint, run_id, Setting(**json.loads(setting_json)))
    print("joining", flush=True)
    handler.next_rendezvous()
    print("ready", flush=True)
    time.sleep(3600)


def table(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> str:
    lines = [title, "  ".join(f"{h:>14}" for h, _ in columns)]
    for row in rows:
        cells = []
        for _, key in columns:
            value = row.get(key, "")
            cells.append(f"{value:>14.3f}" if isinstance(value, float) else f"{value!s:>14}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,8,32,64")
    parser.add_argument("--kill-nodes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--last-call", type=float, default=1.0)
    parser.add_argument("--liveness", type=int, default=2, help="lease TTL / keep-alive bound for all backends")
    parser.add_argument("--lease-ttl", type=int, default=1, help="an extra etcdft row with this lease TTL")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "rendezvous.json")
    parser.add_argument("--victim", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.victim:
        victim_main(*args.victim)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    backends = args.backends.split(",")
    tcp_port = free_port()
    tcp_server = dist.TCPStore(
        "127.0.0.1", tcp_port, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    join_rows, kill_rows = [], []
    with EtcdServer(enable_v2=True) as etcd:
        for n in sizes:
            for backend in backends:
                row = bench_join(backend, endpoint_for(backend, etcd, tcp_port), n, args.repeats, args.last_call)
                join_rows.append(row)
                print(f"join  {backend:>8} N={n:<3} median {row['median_s']:.3f} s", flush=True)
        kill_runs = [(b, args.liveness) for b in backends]
        if "etcdft" in backends and args.lease_ttl != args.liveness:
            kill_runs.append(("etcdft", args.lease_ttl))
        for backend, liveness in kill_runs:
            row = bench_kill(
                backend, endpoint_for(backend, etcd, tcp_port), args.kill_nodes, args.repeats, args.last_call, liveness
            )
            kill_rows.append(row)
            print(
                f"kill  {backend:>8} N={args.kill_nodes:<3} liveness {liveness} s: median {row['median_s']:.3f} s",
                flush=True,
            )
        etcd_version = ".".join(map(str, etcd.version()))
    del tcp_server

    for n in sizes:
        rows = [r for r in join_rows if r["nodes"] == n]
        ours = next((r for r in rows if r["backend"] == "etcdft"), None)
        others = [r for r in rows if r["backend"] != "etcdft"]
        if ours and others:
            fastest = min(others, key=lambda r: r["median_s"])
            ours["speedup_vs_fastest_builtin"] = fastest["median_s"] / ours["median_s"]
            ours["fastest_builtin"] = fastest["backend"]
    print()
    print(
        table(
            f"Rendezvous completion, min = max = N, last_call={args.last_call:g} s (median of {args.repeats})",
            join_rows,
            [
                ("backend", "backend"),
                ("N", "nodes"),
                ("median s", "median_s"),
                ("etcdft speedup", "speedup_vs_fastest_builtin"),
                ("etcd req/node", "requests_per_node"),
            ],
        )
    )
    print()
    print(
        table(
            f"Kill one of {args.kill_nodes} -> survivors' round complete, last_call={args.last_call:g} s "
            f"(median of {args.repeats})",
            kill_rows,
            [
                ("backend", "backend"),
                ("N", "nodes"),
                ("liveness s", "liveness_s"),
                ("median s", "median_s"),
                ("detect s", "median_detection_s"),
                ("seen by watch", "death_seen_by_watch"),
            ],
        )
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "etcd_version": etcd_version,
                "repeats": args.repeats,
                "last_call_timeout": args.last_call,
                "liveness": args.liveness,
                "lease_ttl": args.lease_ttl,
                "join": join_rows,
                "kill": kill_rows,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    scratch.run_main(main)
