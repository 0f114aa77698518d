"""Worker-side scale: one in-process restart's coordination for thousands of simulated ranks on a real 3-member etcd.

A restart's coordination is the Wrapper's real store protocol
(:mod:`elastic_ft.coordination`): every rank arrives at the **termination
barrier** of its iteration, whose last arriver publishes the
``TerminationResult`` (the terminated ranks, the joiners admitted, the fault
history), then at the **iteration barrier** of the next iteration; every
rank waits for each barrier's result. No torch training runs: the ranks are
simulated by a pool of threads over a few etcd connections.

Three protocols side by side, for N ranks in nodes of 8:

* **node relay** (``ftrun --node-relay``): a node's 8 arrivals leave as one
  transaction and the node waits on one watch, which is what the node's
  ``NodeRelay`` sends etcd for its ranks (:mod:`elastic_ft.etcd.node_relay`).
  Here each node calls the barrier once for its 8 ranks, with the same code
  the relay runs (``EtcdStore.arrive_batch``, ``watch_for``); the relay's local
  fan-out is measured apart on one real relay (second table);
* **per rank** (``ftrun``'s default, and plain ``torchrun``): each rank
  arrives in its own transaction and waits on its own watch;
* **TCPStore**: the same protocol on torch's ``TCPStore`` (libuv), one rank at
  a time (``compare_set`` + ``add`` to arrive, polling for the result), up to
  ``--tcp-max`` ranks.

Per restart: wall time (arrivals, then the waits), client requests per node,
etcd's gRPC requests and writes per node (``/metrics`` summed over the
members) and etcd's CPU seconds. The arrivals and the waits are timed as two
phases: a pool of threads cannot block thousands of simulated ranks at once,
so every node first arrives (without waiting), then every node reads the
result; a real rank's wait is a watch event, which costs etcd less than the
read measured here.

The simulation shares the machine's 2 cores with the 3 etcd members: where
the client's CPU (thread switches, protobuf) and not etcd is the bound, the
table's ``client cpu s`` column says so (the process's CPU seconds over the
phase).

A third table: one look period of a hang, every rank stalled: the judge's
look (its monitor reads every peer and publishes the evidence, each host
reads that) against every host reading every peer (the look without a
judge), with the culprit checked.

Prints four tables, writes ``benchmarks/results/worker_scale.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import scratch
from scale import etcd_metrics

HERE = Path(__file__).resolve().parent
RANKS_PER_NODE = 8
WAIT = datetime.timedelta(seconds=120)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def etcd_writes(cluster: Any) -> float:
    """Writes applied by the leader's store (puts and deletes in transactions included)."""
    import re
    import urllib.request

    total = 0.0
    pattern = re.compile(r"^etcd_mvcc_(put|delete)_total(\{[^}]*\})? ([0-9.e+]+)$")
    endpoint = cluster.endpoints[0]
    with urllib.request.urlopen(f"http://{endpoint.host}:{endpoint.port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            match = pattern.match(line)
            if match:
                total += float(match.group(3))
    return total


class Requests:
    """The requests of a phase: the clients' own count and etcd's (``/metrics``, summed over the members), from
    construction to :meth:`per_node`, which closes the clients."""

    def __init__(self, cluster: Any, connections: list[Any]) -> None:
        self.cluster, self.connections = cluster, connections
        self.client, self.etcd = sum(c.requests for c in connections), etcd_metrics(cluster)

    def per_node(self, nodes: int) -> dict[str, float]:
        after = etcd_metrics(self.cluster)
        requests = sum(c.requests for c in self.connections) - self.client
        for client in self.connections:
            client.close()
        return {
            "client_requests_per_node": requests / nodes,
            "etcd_requests_per_node": (after["grpc_handled"] - self.etcd["grpc_handled"]) / nodes,
            "etcd_cpu_s": after["cpu_s"] - self.etcd["cpu_s"],
        }


def restart_on_etcd(cluster: Any, ranks: int, *, relay: bool, threads: int, clients: int) -> dict:
    """One restart's two barriers for ``ranks`` ranks: per node of 8 (``relay``) or per rank."""
    from elastic_ft.coordination.iteration import iteration_store
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.etcd.store import EtcdStore
    from elastic_ft.keys import ITERATION_BARRIER, TERMINATION_BARRIER

    connections = [EtcdClient(cluster.endpoints, connect_timeout=30, request_timeout=30) for _ in range(clients)]
    prefix = f"/elastic_ft/worker-scale-{uuid.uuid4().hex[:8]}/round/0/store/"
    bases = [EtcdStore(client, prefix, WAIT) for client in connections]
    size = RANKS_PER_NODE if relay else 1
    callers = [list(range(first, min(first + size, ranks))) for first in range(0, ranks, size)]
    nodes = ranks // RANKS_PER_NODE
    counts = Requests(cluster, connections)
    before_writes, before_cpu = etcd_writes(cluster), cpu_seconds()
    phases: dict[str, float] = {}
    results: set[str] = set()
    lock = threading.Lock()
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for iteration, barrier in ((0, TERMINATION_BARRIER), (1, ITERATION_BARRIER)):
            views = [iteration_store(base, iteration) for base in bases]

            def arrive(index: int, these: list[int], views: list = views, barrier: str = barrier) -> None:
                views[index % len(views)].arrive_and_wait(barrier, these, ranks, datetime.timedelta(0))

            def wait(index: int, views: list = views, barrier: str = barrier) -> None:
                result = views[index % len(views)].arrive_and_wait(barrier, [], ranks, WAIT)
                with lock:
                    results.add(result or "")

            begun = time.perf_counter()
            list(pool.map(arrive, range(len(callers)), callers))
            arrived = time.perf_counter()
            list(pool.map(wait, range(len(callers))))
            phases[f"{barrier}_arrive_s"] = arrived - begun
            phases[f"{barrier}_wait_s"] = time.perf_counter() - arrived
            if len(results) != 1:
                raise RuntimeError(f"{barrier}: the ranks read {len(results)} different results")
            results.clear()
    elapsed = time.perf_counter() - start
    client_cpu = cpu_seconds() - before_cpu
    after_writes = etcd_writes(cluster)
    return {
        "protocol": "node relay" if relay else "per rank",
        "ranks": ranks,
        "nodes": nodes,
        "seconds": elapsed,
        **phases,
        **counts.per_node(nodes),
        "etcd_writes_per_node": (after_writes - before_writes) / nodes,
        "client_cpu_s": client_cpu,
    }


def exchange_on_etcd(cluster: Any, ranks: int, *, relay: bool, threads: int, clients: int) -> dict:
    """A ``Tree``'s first key exchange (hosts of 8 ranks): every rank publishes its grouping keys and counts
    itself in (per node of 8 in one transaction, as the relay sends them; or per rank), the last arriver reads
    them all and publishes the table, every node (or rank) reads the table. Decoding the table is each rank's own
    CPU, timed apart (median of 16): threads here would add thousands of ranks' decoding up on 2 cores."""
    from elastic_ft.coordination.barriers import await_value
    from elastic_ft.coordination.iteration import iteration_store
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.etcd.store import EtcdStore
    from elastic_ft.inprocess.rank_assignment.exchange import _decode_table, _encode_table
    from elastic_ft.keys import exchange_arrived, exchange_published, exchange_table

    connections = [EtcdClient(cluster.endpoints, connect_timeout=30, request_timeout=30) for _ in range(clients)]
    base_prefix = f"/elastic_ft/worker-scale-{uuid.uuid4().hex[:8]}/round/0/store/"
    bases = [EtcdStore(client, base_prefix, WAIT) for client in connections]
    views = [iteration_store(base, 0).store for base in bases]
    name = "elastic_ft/rank_assignment/tree/0"
    prefix = f"{iteration_store(bases[0], 0).key_prefix}/"
    size = RANKS_PER_NODE if relay else 1
    callers = [list(range(first, min(first + size, ranks))) for first in range(0, ranks, size)]
    nodes = ranks // RANKS_PER_NODE
    counts = Requests(cluster, connections)

    def publish(index: int, these: list[int]) -> None:
        base, view = bases[index % len(bases)], views[index % len(views)]
        arrivals = [(prefix + exchange_published(name, r), json.dumps(["root", f"host{r // 8:06d}"])) for r in these]
        numbers = base.arrive_batch(arrivals, prefix + exchange_arrived(name))
        if ranks in numbers:  # the last arriver: reads every rank's keys, publishes the table
            values = view.multi_get([exchange_published(name, peer) for peer in range(ranks)])
            view.set(exchange_table(name), _encode_table(values, 2))

    tables: set[bytes] = set()

    def read(index: int) -> None:
        table = await_value(views[index % len(views)], exchange_table(name), WAIT)
        if table is None:
            raise RuntimeError("the table never came")
        tables.add(table)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(publish, range(len(callers)), callers))
        published = time.perf_counter()
        list(pool.map(read, range(len(callers))))
    elapsed = time.perf_counter() - start
    requests = counts.per_node(nodes)
    (table,) = tables
    decode = []
    for _ in range(16):
        begun = time.perf_counter()
        _decode_table(table, ranks, 2, "bench", exchange_table(name))
        decode.append(time.perf_counter() - begun)
    return {
        "protocol": "node relay" if relay else "per rank",
        "ranks": ranks,
        "nodes": nodes,
        "seconds": elapsed,
        "publish_s": published - start,
        "read_s": elapsed - (published - start),
        "table_kib": len(table) / 1024,
        "decode_ms": statistics.median(decode) * 1000,
        **requests,
    }


def verdict_on_etcd(cluster: Any, ranks: int, *, judged: bool, threads: int, clients: int) -> dict:
    """One look period of a hang among ``ranks`` stalled ranks (hosts of 8, through their relays: one look a
    host): with a judge (its monitor reads every peer and publishes the evidence, every host reads that), or
    every host reading every peer (the look before the judge). The heartbeats and positions are written first,
    in batches, untimed."""
    from elastic_ft.coordination.fault_records import Heartbeat, PeerLook, encode_heartbeat
    from elastic_ft.coordination.job import job_store
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.etcd.store import EtcdStore
    from elastic_ft.inprocess.hangs.verdicts import StalledRank, hang_culprit, select_evidence
    from elastic_ft.keys import HEARTBEAT, POSITION, WRAPPER_JOB

    connections = [EtcdClient(cluster.endpoints, connect_timeout=30, request_timeout=30) for _ in range(clients)]
    base_prefix = f"/elastic_ft/worker-scale-{uuid.uuid4().hex[:8]}/round/0/store/"
    bases = [EtcdStore(client, base_prefix, WAIT) for client in connections]
    jobs = [job_store(base) for base in bases]
    now, culprit = time.time(), ranks // 3
    records = {}
    for rank in range(ranks):
        stopped = now - (30.0 if rank == culprit else 20.0 - rank / ranks)
        records[f"{WRAPPER_JOB}/{HEARTBEAT}{rank}"] = encode_heartbeat(
            now, stopped, rank != culprit, False, now + 3600
        ).encode()
        position = {"iteration": 0, "rank": rank, "world_size": ranks, "active": True}
        records[f"{WRAPPER_JOB}/{POSITION}{rank}"] = json.dumps(position).encode()
    keys = list(records)
    with ThreadPoolExecutor(threads) as pool:
        list(
            pool.map(
                lambda i: bases[i % clients].put_latest({k: records[k] for k in keys[i : i + 64]}),
                range(0, len(keys), 64),
            )
        )
    nodes = ranks // RANKS_PER_NODE
    others = list(range(1, ranks))
    blamed: set[int] = set()

    def blame(beats: dict[int, Heartbeat]) -> None:
        blamed.add(
            hang_culprit([StalledRank(rank, beat.active_at, beat.waiting) for rank, beat in beats.items()])[0].rank
        )

    def every_peer(node: int) -> None:
        found = jobs[node % clients].liveness.peer_records(others)
        blame(found.heartbeats)

    def judges_look(node: int) -> None:
        look, _ = jobs[node % clients].liveness.peer_look(None)
        if look is None or look.read_at is None:
            raise RuntimeError("the judge's look is not there")
        blame(look.beats)

    counts = Requests(cluster, connections)
    start = time.perf_counter()
    if judged:
        found = jobs[0].liveness.peer_records(others)
        evidence = select_evidence(found.heartbeats, 2.0)
        jobs[0].liveness.publish_peer_look(PeerLook(0, 0, time.time(), evidence))
    looked = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(judges_look if judged else every_peer, range(nodes)))
    elapsed = time.perf_counter() - start
    requests = counts.per_node(nodes)
    if blamed != {culprit}:
        raise RuntimeError(f"the looks blamed {sorted(blamed)}, not rank {culprit}")
    return {
        "protocol": "judge's look" if judged else "every peer, per host",
        "ranks": ranks,
        "nodes": nodes,
        "seconds": elapsed,
        "judge_s": looked - start,
        **requests,
    }


def restart_on_tcpstore(ranks: int, *, threads: int) -> dict:
    """The same two barriers on torch's TCPStore (libuv), one rank at a time, as NVIDIA's inprocess runs them."""
    import torch.distributed as dist

    from elastic_ft.coordination.iteration import iteration_store
    from elastic_ft.keys import ITERATION_BARRIER, TERMINATION_BARRIER
    from elastic_ft.runtime.net import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, WAIT, wait_for_workers=False, use_libuv=True)
    connections = [dist.TCPStore("127.0.0.1", port, None, False, WAIT, use_libuv=True) for _ in range(threads)]
    local = threading.local()
    counter = iter(range(10**9))
    counter_lock = threading.Lock()

    def store() -> dist.Store:
        if not hasattr(local, "index"):
            with counter_lock:
                local.index = next(counter)
        return connections[local.index % len(connections)]

    phases: dict[str, float] = {}
    start, before_cpu = time.perf_counter(), cpu_seconds()
    with ThreadPoolExecutor(threads) as pool:
        for iteration, barrier in ((0, TERMINATION_BARRIER), (1, ITERATION_BARRIER)):

            def arrive(rank: int, iteration: int = iteration, barrier: str = barrier) -> None:
                iteration_store(store(), iteration).arrive_and_wait(barrier, [rank], ranks, datetime.timedelta(0))

            def wait(_rank: int, iteration: int = iteration, barrier: str = barrier) -> str:
                return iteration_store(store(), iteration).arrive_and_wait(barrier, [], ranks, WAIT) or ""

            begun = time.perf_counter()
            list(pool.map(arrive, range(ranks)))
            arrived = time.perf_counter()
            seen = set(pool.map(wait, range(ranks)))
            phases[f"{barrier}_arrive_s"] = arrived - begun
            phases[f"{barrier}_wait_s"] = time.perf_counter() - arrived
            if len(seen) != 1:
                raise RuntimeError(f"{barrier} on TCPStore: the ranks read {len(seen)} different results")
    elapsed = time.perf_counter() - start
    del server
    return {
        "protocol": "TCPStore (libuv), per rank",
        "ranks": ranks,
        "nodes": ranks // RANKS_PER_NODE,
        "seconds": elapsed,
        **phases,
        "client_cpu_s": cpu_seconds() - before_cpu,
    }


def one_host(cluster: Any, repeats: int) -> dict:
    """One host's 8 ranks at a barrier of 8, through a real ``NodeRelay`` and straight to etcd: what the relay adds
    to a small job's barrier (median of ``repeats``)."""
    from elastic_ft.coordination.iteration import iteration_store
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.etcd.node_relay import NodeRelay, RelayClient
    from elastic_ft.etcd.store import EtcdStore

    root = f"/elastic_ft/worker-scale-host-{uuid.uuid4().hex[:8]}/"
    relay_client = EtcdClient(cluster.endpoints)
    directory = tempfile.mkdtemp(prefix="eft-relay-bench-")
    relay = NodeRelay(relay_client, root, RANKS_PER_NODE, os.path.join(directory, "relay.sock")).start()
    clients = [EtcdClient(cluster.endpoints) for _ in range(RANKS_PER_NODE)]
    rows = {}
    for name, relayed in (("direct", False), ("relay", True)):
        relays = [RelayClient(relay.path) if relayed else None for _ in clients]
        stores = [
            EtcdStore(client, f"{root}round/0/store/", WAIT, relay=r) for client, r in zip(clients, relays, strict=True)
        ]
        times, requests = [], []
        for repeat in range(repeats):
            views = [iteration_store(store, repeat) for store in stores]
            before = sum(c.requests for c in [*clients, relay_client])
            go = threading.Barrier(RANKS_PER_NODE + 1)

            def rank(r: int, views: list = views, go: threading.Barrier = go) -> None:
                go.wait()
                views[r].arrive_and_wait("bench", [r], RANKS_PER_NODE, WAIT)

            threads = [threading.Thread(target=rank, args=(r,)) for r in range(RANKS_PER_NODE)]
            for thread in threads:
                thread.start()
            go.wait()
            begun = time.perf_counter()
            for thread in threads:
                thread.join()
            times.append(time.perf_counter() - begun)
            requests.append(sum(c.requests for c in [*clients, relay_client]) - before)
        rows[name] = {"median_ms": statistics.median(times) * 1000, "requests": statistics.median(requests)}
        for r in relays:
            if r is not None:
                r.close()
    relay.close()
    os.rmdir(directory)
    for client in [*clients, relay_client]:
        client.close()
    return rows


def median_run(repeats: int, run: Any, *args: Any, **kwargs: Any) -> dict:
    """The row of the median time of ``repeats`` runs of ``run(*args, **kwargs)``."""
    rows = [run(*args, **kwargs) for _ in range(repeats)]
    return sorted(rows, key=lambda row: row["seconds"])[len(rows) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1024,4096,16384", help="simulated ranks (nodes of 8)")
    parser.add_argument("--per-rank-max", type=int, default=16384, help="largest N of the per-rank rows")
    parser.add_argument("--tcp-max", type=int, default=4096, help="largest N of the TCPStore rows")
    parser.add_argument(
        "--every-peer-max",
        type=int,
        default=1024,
        help="largest N of the hang looks' every-peer rows (its parsing, not etcd, bounds the simulation beyond)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="restarts per row (the median is printed)")
    parser.add_argument("--threads", type=int, default=64, help="threads simulating the ranks or nodes")
    parser.add_argument("--clients", type=int, default=8, help="etcd connections the threads share")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "worker_scale.json")
    args = parser.parse_args()
    from elastic_ft.testing.etcd_cluster import EtcdCluster

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    pool = {"threads": args.threads, "clients": args.clients}
    rows: list[dict] = []
    exchanges: list[dict] = []
    verdicts: list[dict] = []
    with EtcdCluster() as cluster:
        host = one_host(cluster, 20)
        for ranks in [int(s) for s in args.sizes.split(",") if s]:
            runs: list[tuple[str, Any]] = [
                (
                    "node relay",
                    lambda r=ranks: restart_on_etcd(cluster, r, relay=True, threads=args.threads, clients=args.clients),
                )
            ]
            if ranks <= args.per_rank_max:
                runs.append(
                    (
                        "per rank",
                        lambda r=ranks: restart_on_etcd(
                            cluster, r, relay=False, threads=args.threads, clients=args.clients
                        ),
                    )
                )
            if ranks <= args.tcp_max:
                runs.append(("tcp", lambda r=ranks: restart_on_tcpstore(r, threads=args.threads)))
            for _, run in runs:
                repeats = [run() for _ in range(args.repeats)]
                middle = sorted(repeats, key=lambda row: row["seconds"])[len(repeats) // 2]
                middle["repeats_s"] = [row["seconds"] for row in repeats]
                rows.append(middle)
                print(f"{middle['protocol']:>28} N={ranks:<6} {middle['seconds']:.2f} s", flush=True)
            for relay in (True, False):
                if relay or ranks <= args.per_rank_max:
                    exchanges.append(median_run(args.repeats, exchange_on_etcd, cluster, ranks, relay=relay, **pool))
            for judged in (True, False):
                if judged or ranks <= args.every_peer_max:
                    verdicts.append(median_run(args.repeats, verdict_on_etcd, cluster, ranks, judged=judged, **pool))
    print(
        "\nOne in-process restart's coordination (termination + iteration barriers), median of "
        f"{args.repeats}; `python benchmarks/worker_scale.py`:"
    )
    print(
        "| protocol | ranks | nodes | restart s | vs relay | termination arrive/wait s | iteration arrive/wait s | "
        "client req/node | etcd req/node | etcd writes/node | etcd cpu s | client cpu s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    relay_seconds = {row["ranks"]: row["seconds"] for row in rows if row["protocol"] == "node relay"}
    for row in rows:
        number = lambda key, digits=1, row=row: f"{row[key]:.{digits}f}" if key in row else "-"

        print(
            f"| {row['protocol']} | {row['ranks']} | {row['nodes']} | {row['seconds']:.2f} | "
            f"{row['seconds'] / relay_seconds[row['ranks']]:.1f}x | "
            f"{row['termination_barrier_arrive_s']:.2f} / {row['termination_barrier_wait_s']:.2f} | "
            f"{row['iteration_barrier_arrive_s']:.2f} / {row['iteration_barrier_wait_s']:.2f} | "
            f"{number('client_requests_per_node')} | {number('etcd_requests_per_node')} | "
            f"{number('etcd_writes_per_node')} | {number('etcd_cpu_s', 2)} | {row['client_cpu_s']:.2f} |"
        )
    print("\nA Tree's first key exchange (hosts of 8 ranks): publish, the last rank's table, every caller's read:")
    print(
        "| protocol | ranks | exchange s | publish s | read s | table KiB | decode ms/rank | client req/node | "
        "etcd req/node |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in exchanges:
        print(
            f"| {row['protocol']} | {row['ranks']} | {row['seconds']:.2f} | {row['publish_s']:.2f} | "
            f"{row['read_s']:.2f} | {row['table_kib']:.1f} | {row['decode_ms']:.1f} | "
            f"{row['client_requests_per_node']:.1f} | {row['etcd_requests_per_node']:.1f} |"
        )
    print(
        "\nOne look period of a hang (every rank stalled; hosts of 8, one look a host through its relay); the "
        "every-peer rows' requests grow with ranks x hosts (3 keys a rank, 128 keys a request):"
    )
    print("| protocol | ranks | nodes | look s | judge's read + write s | client req/node | etcd req/node |")
    print("|---|---|---|---|---|---|---|")
    for row in verdicts:
        print(
            f"| {row['protocol']} | {row['ranks']} | {row['nodes']} | {row['seconds']:.2f} | {row['judge_s']:.2f} | "
            f"{row['client_requests_per_node']:.1f} | {row['etcd_requests_per_node']:.1f} |"
        )
    print(f"\nOne host's {RANKS_PER_NODE} ranks at a barrier of {RANKS_PER_NODE} (median of 20):")
    print("| path | barrier ms | etcd requests (ranks + relay) |")
    print("|---|---|---|")
    for name, row in host.items():
        print(f"| {name} | {row['median_ms']:.1f} | {row['requests']:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": os.uname().nodename,
                "cpus": os.cpu_count(),
                "rows": rows,
                "exchanges": exchanges,
                "verdicts": verdicts,
                "one_host": host,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    scratch.run_main(main)
