"""Process-group formation on the Wrapper's store: a gloo group and DDP's first collectives, EtcdStore vs TCPStore.

Every in-process restart builds a new process group from the Wrapper's
store (under ``ftrun`` the round's etcd store), and the user's DDP
constructor on it: the part of a recovery the store's latency sets. N ranks
are simulated as N processes forked from one that imported torch, each with
its own store client (its TCPStore connection, its etcd client), as the
ranks of a job have. For each trial, every rank waits at a barrier, then
builds a ``ProcessGroupGloo`` on a fresh prefix of the store (gloo's
full-mesh rendezvous through the store: each rank publishes its address and
reads every other's) and runs what ``DistributedDataParallel``'s
constructor runs on it (an all-gather of the parameters' sizes, a broadcast
of a small model's parameters; these use no store). Timed: from the
barrier to the last rank done, medians over ``--trials``, both stores at
each N in one run, and the ratio EtcdStore/TCPStore. The etcd store is a
single-member etcd on loopback, with the client the Wrapper's hand-off
makes.

Prints a table and writes ``benchmarks/results/store_pg_formation.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import scratch

RESULTS = Path(__file__).resolve().parent / "results" / "store_pg_formation.json"
TIMEOUT = timedelta(seconds=120)
#: TCPStore; the etcd store as is (a prefix of it); the store CallWrapper.process_group_store() gives under ftrun.
STORES = ("TCPStore", "EtcdStore", "GroupStore")


def rank_main(rank: int, size: int, store_kind: str, where: dict[str, Any], trials: int, start: Any, out: Any) -> None:
    """One rank: ``trials`` groups (and a first, untimed one), each after the common barrier ``start``."""
    import torch
    import torch.distributed as dist

    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.etcd.endpoints import parse_endpoints
    from elastic_ft.etcd.group_store import group_store
    from elastic_ft.etcd.store import EtcdStore

    torch.set_num_threads(1)
    client = None
    if store_kind == "TCPStore":
        store: Any = dist.TCPStore("127.0.0.1", where["port"], size, rank == 0, TIMEOUT, wait_for_workers=False)
    else:
        client = EtcdClient(parse_endpoints(where["endpoint"]))
        store = EtcdStore(client, where["prefix"], TIMEOUT)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    params = [p.detach() for p in model.parameters()]
    for trial in range(trials + 1):
        start.wait()
        began = time.perf_counter()
        before = client.requests if client is not None else 0
        if store_kind == "GroupStore":  # what CallWrapper.process_group_store() gives: a fresh one per group
            view: Any = group_store(store, f"pg/{trial}/")
        else:
            view = dist.PrefixStore(f"pg/{trial}", store)
        group = dist.ProcessGroupGloo(view, rank, size, TIMEOUT)
        sizes = torch.tensor([p.numel() for p in params], dtype=torch.int64)
        group.allgather([[torch.empty_like(sizes) for _ in range(size)]], [sizes]).wait()
        group.broadcast([torch.cat([p.reshape(-1) for p in params])]).wait()
        if trial:  # the first one warms the connections up
            out.put((trial, rank, time.perf_counter() - began, (client.requests - before) if client else None))
        start.wait()  # nobody leaves before everyone is done: a group's peers may still connect
        del group
        if store_kind == "GroupStore":
            view.close()
    if client is not None:
        client.close()


def form(size: int, store_kind: str, where: dict[str, Any], trials: int) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("fork")
    start, out = context.Barrier(size), context.Queue()
    ranks = [
        context.Process(target=rank_main, args=(r, size, store_kind, where, trials, start, out)) for r in range(size)
    ]
    for process in ranks:
        process.start()
    results = [out.get(timeout=600) for _ in range(trials * size)]
    for process in ranks:
        process.join(60)
    by_trial: dict[int, list[tuple[float, int | None]]] = {}
    for trial, _rank, seconds, requests in results:
        by_trial.setdefault(trial, []).append((seconds, requests))
    return [
        {"seconds": max(s for s, _ in ranks_), "requests": sum(r or 0 for _, r in ranks_) or None}
        for _, ranks_ in sorted(by_trial.items())
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16,64")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import torch  # noqa: F401 - imported once here: the ranks are forked from this process

    from elastic_ft.etcd.server import EtcdServer
    from elastic_ft.runtime.net import free_port

    sizes = [int(size) for size in args.sizes.split(",")]
    rows = []
    with EtcdServer() as etcd:
        for size in sizes:
            for kind in STORES:
                where = {"port": free_port(), "endpoint": etcd.endpoint, "prefix": f"/bench/{uuid.uuid4().hex}/"}
                trials = form(size, kind, where, args.trials)
                row = {
                    "store": kind,
                    "ranks": size,
                    "seconds": statistics.median(t["seconds"] for t in trials),
                    "requests": trials[0]["requests"],
                    "trials": trials,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print("| ranks | TCPStore (s) | EtcdStore (s) | ratio | etcd requests | GroupStore (s) | ratio | etcd requests |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    table = []
    for size in sizes:
        by = {r["store"]: r for r in rows if r["ranks"] == size}
        tcp = by["TCPStore"]["seconds"]
        entry = {"ranks": size, "tcp_s": tcp}
        for kind in ("EtcdStore", "GroupStore"):
            entry[kind] = {
                "seconds": by[kind]["seconds"],
                "ratio": by[kind]["seconds"] / tcp,
                "requests": by[kind]["requests"],
            }
        table.append(entry)
        cells = " | ".join(
            f"{entry[k]['seconds']:.3f} | {entry[k]['ratio']:.2f}x | {entry[k]['requests']}"
            for k in ("EtcdStore", "GroupStore")
        )
        print(f"| {size} | {tcp:.3f} | {cells} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "args": {k: str(v) for k, v in vars(args).items()},
                "table": table,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    scratch.run_main(main)
