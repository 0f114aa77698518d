"""Scale benchmark: the etcdft rendezvous with thousands of simulated nodes on a real 3-member etcd.

A simulated node is a real ``EtcdftRendezvousHandler`` (its own lease, its
own watches, its own decisions) without torch workers. ``--procs`` worker
processes hold the nodes, each sharing one etcd client among its nodes, as
the issue asks ("many per process, threads with shared channels"): so a
process's leases share one keep-alive stream and its watches one watch
stream, as every client's do (``elastic_ft.etcd.session``). The etcd is a
3-member cluster on loopback (``elastic_ft.testing.etcd_cluster.EtcdCluster``).

For each N:

1. **round**: every node calls ``next_rendezvous()`` at once (min = max = N);
   the time until the last returns;
2. **death** (for N up to ``--death-max``, with ``--death-lease-ttl``, 1 s
   by default): after a
   first round, one node (not the monitor) crashes: its lease is left to
   expire, as when a host dies. The survivors act as torch's agent does: they
   poll ``num_nodes_waiting()`` every 0.1 s and re-rendezvous when it is
   positive. The time from the crash until every survivor is in the new
   round; also for the death of the monitor itself.

Per node and round it counts, on the client: etcd requests (keep-alives
apart) and watch events received (the median node, the most any node other
than the monitor and the closer got, and the two of them); on etcd's own
``/metrics`` (summed over the members): the watch events the members sent
(``etcd_debugging_mvcc_events_total``), the gRPC requests they handled, their
CPU seconds, resident memory and database size.

Prints a table, writes ``benchmarks/results/scale.json``. The run's event log
is left out (a no-op event sink): ``benchmarks/events.py`` measures it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import scratch

HERE = Path(__file__).resolve().parent


# ---- the worker process: a share of the nodes -------------------------------------------


def worker_main(endpoint: str, run_id: str, count: int, conf_json: str) -> None:
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.observability import sink as event_sink
    from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings

    conf = json.loads(conf_json)
    settings = make_settings(run_id=run_id, endpoint=endpoint, local_addr="127.0.0.1", **conf)
    event_sink.install(event_sink.EventSink(run_id, "rendezvous", None))

    class SharedClient(EtcdClient):
        """One connection for every node of this process; closed once, when the process ends."""

        def close(self) -> None:
            pass

        def really_close(self) -> None:
            super().close()

    client = SharedClient(
        settings.endpoints,
        connect_timeout=settings.connect_timeout,
        request_timeout=settings.request_timeout,
        tls=settings.tls,
        credentials=settings.credentials,
    )
    nodes = [EtcdftRendezvousHandler(settings, client) for _ in range(count)]
    for handler in nodes:
        handler._parts.ensure_session()  # a node's lease exists before the timed round, as from its second round on
    alive = list(range(count))
    reply({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        what = command["do"]
        if what == "round":
            reply(run_round([nodes[i] for i in alive], client, command["start"]))
        elif what == "crash":
            victim = pick_victim(nodes, alive, monitor=command["monitor"])
            if victim is None:
                reply({"crashed": None})
                continue
            crash(nodes[victim])
            alive.remove(victim)
            reply({"crashed": nodes[victim].node, "at": time.time()})
        elif what == "follow":
            reply(follow([nodes[i] for i in alive], client, command["timeout"]))
        elif what == "quit":
            for i in alive:
                nodes[i].shutdown()
            client.really_close()
            reply({"quit": True})
            return


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def pick_victim(nodes: list, alive: list[int], *, monitor: bool) -> int | None:
    for index in alive:
        if nodes[index].is_monitor == monitor:
            return index
    return None


def crash(handler: Any) -> None:
    """End a node as a host crash would: nothing said, its lease left to expire."""
    parts = handler._parts
    monitor = parts.seat.monitor
    if monitor is not None:
        monitor.stop()
    parts.whole.stop()
    parts.board.view.stop()
    if parts.presence.session is not None:
        parts.presence.session.close(revoke=False)


def counters(handlers: list, client: Any) -> dict:
    kinds = dict(client.requests_by_kind)
    return {
        "requests": sum(v for k, v in kinds.items() if k != "keep_alive"),
        "events": [h.watch_events for h in handlers],
        "live": [h._parts.whole.events_received for h in handlers],  # while it followed every key
    }


def deltas(handlers: list, client: Any, before: dict) -> dict:
    """Requests and watch events since ``before``, and each node's role: the monitor, a node that closed
    a round (it followed every key meanwhile), or a plain node."""
    after = counters(handlers, client)
    live = [a - b for a, b in zip(after["live"], before["live"], strict=True)]
    return {
        "requests": after["requests"] - before["requests"],
        "events": [a - b for a, b in zip(after["events"], before["events"], strict=True)],
        "roles": [
            "monitor" if h.is_monitor else "closer" if d else "node" for h, d in zip(handlers, live, strict=True)
        ],
    }


def run_each(node: Any, count: int) -> None:
    """Run ``node(i)`` for every simulated node at once, one thread each; return when all have."""
    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_round(handlers: list, client: Any, start: float) -> dict:
    before = counters(handlers, client)
    done: list[float | None] = [None] * len(handlers)
    sizes: list[int] = [0] * len(handlers)
    errors: list[str] = []

    def node(i: int) -> None:
        time.sleep(max(0.0, start - time.time()))
        try:
            info = handlers[i].next_rendezvous()
            sizes[i] = info.world_size
            done[i] = time.time()
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append(repr(exc))

    run_each(node, len(handlers))
    return {"done": done, "sizes": sizes, "errors": errors[:3], **deltas(handlers, client, before)}


def what_it_sees(handler: Any) -> str:
    """A node's view of the board, for a node that saw no change when it should have."""
    board, version = handler._parts.board.snapshot()
    if board is None:
        return f"member of round {handler._parts.state.value.member_round}, no board (version {version})"
    last = board.last.round if board.last is not None else None
    return (
        f"member of round {handler._parts.state.value.member_round}; board version {version}: monitor {board.monitor}, open round "
        f"{board.open_round}, last closed {last}, rejoined {len(board.rejoined)}, dead {list(board.dead)}; its "
        f"watch down for {handler._parts.board.view.disconnected_for():.1f} s"
    )


def follow(handlers: list, client: Any, timeout: float, settle: float = 3.0) -> dict:
    """Act as torch's agent: poll num_nodes_waiting() every 0.1 s, and re-rendezvous whenever it is positive.

    As the agent, a node goes on watching after its new round: nodes that
    lost their lease meanwhile (this simulation's overload) are left out of
    that round and wait in the next, and the others re-rendezvous again to
    admit them. A node is done once it has been in a round for ``settle``
    seconds with nobody waiting; its time is that of its last round.
    """
    before = counters(handlers, client)
    done: list[float | None] = [None] * len(handlers)
    sizes: list[int] = [0] * len(handlers)
    seen: list[float | None] = [None] * len(handlers)
    rounds: list[int] = [0] * len(handlers)
    errors: list[str] = []
    kinds: list[str] = []

    def node(i: int) -> None:
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        try:
            while quiet_since is None or time.monotonic() - quiet_since < settle:
                if time.monotonic() > deadline:
                    raise TimeoutError("no change seen" if seen[i] is None else "nodes still waiting")
                if handlers[i].num_nodes_waiting() == 0:
                    time.sleep(0.1)
                    continue
                seen[i] = seen[i] or time.time()
                info = handlers[i].next_rendezvous()
                sizes[i], done[i], rounds[i] = info.world_size, time.time(), rounds[i] + 1
                quiet_since = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append(f"{exc!r} [{what_it_sees(handlers[i])}]")
            board = handlers[i]._parts.board.snapshot()[0]
            kinds.append(
                f"{type(exc).__name__} after seeing {'a change' if seen[i] else 'no change'}; member of round "
                f"{handlers[i]._parts.state.value.member_round}, board: open {board.open_round if board else None}, last "
                f"{board.last.round if board and board.last else None}"
            )

    run_each(node, len(handlers))
    return {
        "done": done,
        "seen": seen,
        "sizes": sizes,
        "rounds": rounds,
        "errors": errors[:3],
        "error_kinds": kinds,
        **deltas(handlers, client, before),
    }


# ---- the parent: the cluster, the workers, the table -------------------------------------


class Workers:
    def __init__(self, endpoint: str, run_id: str, nodes: int, procs: int, conf: dict) -> None:
        shares = [nodes // procs + (1 if i < nodes % procs else 0) for i in range(procs)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", endpoint, run_id, str(share), json.dumps(conf)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=HERE,
            )
            for share in shares
            if share
        ]
        for message in self.gather():
            if not message.get("ready"):
                raise RuntimeError(f"a worker did not start: {message}")

    def send(self, command: dict, procs: list | None = None) -> None:
        for proc in procs or self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()

    def gather(self, procs: list | None = None) -> list[dict]:
        messages = []
        for proc in procs or self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {proc.pid} ended (exit {proc.wait()})")
            messages.append(json.loads(line))
        return messages

    def ask(self, command: dict) -> list[dict]:
        self.send(command)
        return self.gather()

    def crash(self, *, monitor: bool) -> dict:
        for proc in self.procs:
            self.send({"do": "crash", "monitor": monitor}, [proc])
            (answer,) = self.gather([proc])
            if answer["crashed"] is not None:
                return answer
        raise RuntimeError(f"no node to crash (monitor={monitor})")

    def close(self) -> None:
        try:
            self.ask({"do": "quit"})
        finally:
            for proc in self.procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eE]+|NaN|\+Inf)$")


def etcd_metrics(cluster: Any) -> dict[str, float]:
    """Sum, over the members, of the etcd metrics this benchmark reads (from each member's /metrics)."""
    wanted = {
        "etcd_debugging_mvcc_events_total": "watch_events",
        "process_cpu_seconds_total": "cpu_s",
        "process_resident_memory_bytes": "rss_bytes",
        "etcd_mvcc_db_total_size_in_bytes": "db_bytes",
        "etcd_debugging_mvcc_watcher_total": "watchers",
        "grpc_server_handled_total": "grpc_handled",
    }
    totals = dict.fromkeys(wanted.values(), 0.0)
    for endpoint in cluster.endpoints:
        with urllib.request.urlopen(f"http://{endpoint.host}:{endpoint.port}/metrics", timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            match = _METRIC.match(line)
            if match and match.group(1) in wanted:
                labels = match.group(2) or ""
                if match.group(1) == "grpc_server_handled_total" and 'grpc_type="unary"' not in labels:
                    continue  # requests, not the streams' ends
                totals[wanted[match.group(1)]] += float(match.group(3))
    return totals


def metric_delta(before: dict[str, float], after: dict[str, float], nodes: int) -> dict[str, float]:
    return {
        "etcd_watch_events_per_node": (after["watch_events"] - before["watch_events"]) / nodes,
        "etcd_requests_per_node": (after["grpc_handled"] - before["grpc_handled"]) / nodes,
        "etcd_cpu_s": after["cpu_s"] - before["cpu_s"],
        "etcd_rss_mib": after["rss_bytes"] / 2**20,
        "etcd_db_mib": after["db_bytes"] / 2**20,
        "etcd_watchers": after["watchers"],
    }


def summarize(answers: list[dict], start: float, nodes: int) -> dict:
    done = [t for a in answers for t in a["done"]]
    errors = [e for a in answers for e in a["errors"]]
    if errors or any(t is None for t in done):
        kinds = collections.Counter(k for a in answers for k in a.get("error_kinds", []))
        raise RuntimeError(f"nodes failed: {dict(kinds)}; the first: {errors[:3] or 'no answer'}")
    events = [e for a in answers for e in a["events"]]
    roles = [r for a in answers for r in a["roles"]]
    plain = [e for e, r in zip(events, roles, strict=True) if r == "node"] or [0]
    special = {r: e for e, r in zip(events, roles, strict=True) if r != "node"}
    return {
        "seconds": max(done) - start,
        "sizes": sorted({s for a in answers for s in a["sizes"]}),
        "client_requests_per_node": sum(a["requests"] for a in answers) / nodes,
        "events_median_node": statistics.median(plain),
        "events_max_node": max(plain),
        "events_monitor": special.get("monitor", 0),
        "events_closer": special.get("closer", 0),
        "events_mean": statistics.mean(events),
    }


def bench(cluster: Any, nodes: int, procs: int, death: bool, lease_ttl: int) -> dict:
    conf = {
        "min_nodes": nodes,
        "max_nodes": nodes,
        "last_call_timeout": 1.0,
        "lease_ttl": lease_ttl,
        "join_timeout": 600,
        "request_timeout": 30,
        "connect_timeout": 30,
    }
    if death:
        conf["min_nodes"] = 1
        conf["join_timeout"] = 120  # a simulation whose leases expire under its own load fails, not hangs
    run_id = f"scale-{uuid.uuid4().hex[:8]}"
    workers = Workers(cluster.endpoint, run_id, nodes, procs, conf)
    row: dict[str, Any] = {"nodes": nodes, "lease_ttl": lease_ttl}
    try:
        before = etcd_metrics(cluster)
        start = time.time() + 0.5
        answers = workers.ask({"do": "round", "start": start})
        after = etcd_metrics(cluster)
        row["round"] = {**summarize(answers, start, nodes), **metric_delta(before, after, nodes)}
        print(f"N={nodes:<5} round closed in {row['round']['seconds']:.2f} s", flush=True)
        if death:
            for monitor in (False, True):
                time.sleep(1.0)
                before = etcd_metrics(cluster)
                crashed = workers.crash(monitor=monitor)
                answers = workers.ask({"do": "follow", "timeout": 60})
                after = etcd_metrics(cluster)
                nodes -= 1
                summary = summarize(answers, crashed["at"], nodes)
                seen = [t for a in answers for t in a["seen"] if t is not None]
                summary["seen_seconds"] = max(seen) - crashed["at"]
                summary["rounds_max"] = max(r for a in answers for r in a["rounds"])  # more than 1: leases were lost
                if summary["sizes"] != [nodes]:
                    raise RuntimeError(f"the survivors' round has sizes {summary['sizes']}, not {nodes}")
                name = "monitor_death" if monitor else "death"
                row[name] = {**summary, **metric_delta(before, after, nodes)}
                print(
                    f"N={nodes + 1:<5} {name}: seen {summary['seen_seconds']:.2f} s, round again "
                    f"{summary['seconds']:.2f} s ({summary['rounds_max']} round(s) at most)",
                    flush=True,
                )
    finally:
        workers.close()
    return row


def bench_barrier(cluster: Any, ranks: int, *, counted: bool = True, threads: int = 32) -> dict:
    """The Wrapper's barrier on the round's etcd store: ``ranks`` simulated ranks arrive (``threads`` at a
    time, one etcd connection), then every rank waits for the result. Requests per rank, client and etcd.

    ``counted=False``: the barrier as before this issue, on the store's generic operations (a
    ``compare_set`` and an ``add``, a read and a compare-and-swap each, then polling for the result)."""
    import datetime
    from concurrent.futures import ThreadPoolExecutor

    from elastic_ft.coordination.iteration import iteration_store
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.etcd.store import EtcdStore

    client = EtcdClient(cluster.endpoints, connect_timeout=30, request_timeout=30)
    base = EtcdStore(client, f"/elastic_ft/barrier-{uuid.uuid4().hex[:8]}/round/0/store/")
    view = iteration_store(base, 0)
    if not counted:
        view.key_prefix = None  # hides the etcd store's one-request arrival: the generic path
    before, server_before = client.requests, etcd_metrics(cluster)
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda r: view.arrive_and_wait("bench", [r], ranks, datetime.timedelta(0)), range(ranks)))
        arrived = time.perf_counter() - start
        waited = list(
            pool.map(lambda r: view.arrive_and_wait("bench", [r], ranks, datetime.timedelta(60)), range(ranks))
        )
    elapsed = time.perf_counter() - start
    server = etcd_metrics(cluster)
    client.close()
    if set(waited) != {""}:
        raise RuntimeError(f"barrier results differ: {set(waited)}")
    return {
        "ranks": ranks,
        "barrier": "one transaction per arrival, a watch" if counted else "before: compare_set + add, polling",
        "arrive_s": arrived,
        "seconds": elapsed,
        "client_requests_per_rank": (client.requests - before) / ranks,
        "etcd_requests_per_rank": (server["grpc_handled"] - server_before["grpc_handled"]) / ranks,
    }


def bench_exchange(cluster: Any, ranks: int, threads: int = 32) -> dict:
    """A ``Tree`` (hosts of 8 ranks) at ``ranks`` ranks, its grouping keys exchanged through the etcd store.

    ``gather_keys`` blocks every rank until the last arrives, which a pool of
    threads cannot do for thousands of ranks; so its three steps are timed in
    turn: every other rank publishes and counts itself in (the same one
    transaction ``gather_keys`` sends), the last rank's ``gather_keys`` reads
    them all and publishes the table, and every other rank reads the table.
    Decoding it is each rank's own CPU, timed apart (median of 32): threads
    here would add 16k ranks' decoding up on 2 cores. Then the computation:
    the tree's first assignment and a reassignment (which needs no exchange:
    a ``Tree`` keeps the topology of its first call)."""
    import datetime
    import random
    from concurrent.futures import ThreadPoolExecutor

    from elastic_ft.coordination.iteration import iteration_store
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.etcd.store import EtcdStore
    from elastic_ft.inprocess.rank_assignment.exchange import _decode_table, gather_keys
    from elastic_ft.inprocess.rank_assignment.tree_engine import (
        Layer,
        LayerFlag,
        build_tree_topology,
        initial_tree_assignment,
        reassign_tree,
    )
    from elastic_ft.keys import exchange_arrived, exchange_published, exchange_table

    def host(rank: int) -> str:
        return f"host{rank // 8:06d}"

    client = EtcdClient(cluster.endpoints, connect_timeout=30, request_timeout=30)
    base = EtcdStore(client, f"/elastic_ft/exchange-{uuid.uuid4().hex[:8]}/round/0/store/")
    view = iteration_store(base, 0)
    name, prefix = "elastic_ft/rank_assignment/tree/0", f"{view.key_prefix}/"
    everyone = list(range(ranks))
    before, server_before = client.requests, etcd_metrics(cluster)
    start = time.perf_counter()

    def arrive(rank: int) -> None:
        keys = json.dumps(["root", host(rank)])
        base.arrive_batch([(prefix + exchange_published(name, rank), keys)], prefix + exchange_arrived(name))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(arrive, everyone[:-1]))
        arrived = time.perf_counter()
        columns = gather_keys(
            view, name, ranks - 1, everyone, ["root", host(ranks - 1)], datetime.timedelta(seconds=120), "bench"
        )
        tabled = time.perf_counter()
        tables = set(pool.map(lambda _r: view.get(exchange_table(name)), everyone[:-1]))
    read = time.perf_counter()
    server = etcd_metrics(cluster)
    (table,) = tables
    decode = []
    for _ in range(32):  # what each rank then spends on its own: inflate, parse, expand to columns
        begin = time.perf_counter()
        if _decode_table(table, ranks, 2, "bench", exchange_table(name)) != columns:
            raise RuntimeError("a rank would read another table than the last rank built")
        decode.append(time.perf_counter() - begin)
    layers = [
        Layer(min_ranks=1, max_ranks=ranks - ranks // 16, key_or_fn="root", flag=LayerFlag.RESERVE),
        Layer(min_ranks=1, max_ranks=8, key_or_fn="host", flag=LayerFlag.RESERVE | LayerFlag.BACKFILL),
    ]
    topology = build_tree_topology(layers, everyone, columns)
    initial = initial_tree_assignment(topology)
    computed = time.perf_counter()
    terminated = set(random.Random(ranks).sample(range(1, ranks), ranks // 16))
    reassign_tree(topology, initial, terminated)
    reassigned = time.perf_counter()
    client.close()
    return {
        "ranks": ranks,
        "publish_s": arrived - start,
        "table_s": tabled - arrived,
        "read_s": read - tabled,
        "table_bytes": len(table),
        "decode_ms": statistics.median(decode) * 1000,
        "exchange_s": read - start,
        "first_assignment_s": computed - read,
        "reassign_s": reassigned - computed,
        "client_requests_per_rank": (client.requests - before) / ranks,
        "etcd_requests_per_rank": (server["grpc_handled"] - server_before["grpc_handled"]) / ranks,
    }


COLUMNS = [
    ("N", lambda r, p: r["nodes"]),
    ("what", lambda r, p: p),
    ("lease_ttl", lambda r, p: r["lease_ttl"]),
    ("seconds", lambda r, p: r[p]["seconds"]),
    ("seen s", lambda r, p: r[p].get("seen_seconds", "")),
    ("req/node", lambda r, p: r[p]["client_requests_per_node"]),
    ("etcd req/node", lambda r, p: r[p]["etcd_requests_per_node"]),
    ("events/node", lambda r, p: r[p]["events_median_node"]),
    ("max node", lambda r, p: r[p]["events_max_node"]),
    ("monitor", lambda r, p: r[p]["events_monitor"]),
    ("closer", lambda r, p: r[p]["events_closer"]),
    ("etcd ev/node", lambda r, p: r[p]["etcd_watch_events_per_node"]),
    ("etcd cpu s", lambda r, p: r[p]["etcd_cpu_s"]),
    ("etcd MiB", lambda r, p: r[p]["etcd_rss_mib"]),
    ("db MiB", lambda r, p: r[p]["etcd_db_mib"]),
]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        for part in ("round", "death", "monitor_death"):
            if part not in row:
                continue
            cells = []
            for _, get in COLUMNS:
                value = get(row, part)
                cells.append(f"{value:.2f}" if isinstance(value, float) else str(value))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256,1024,4096")
    parser.add_argument("--procs", type=int, default=8, help="worker processes holding the nodes")
    parser.add_argument("--death-max", type=int, default=1024, help="largest N of the death measurement")
    parser.add_argument("--lease-ttl", type=int, default=10, help="lease TTL of the round measurement")
    parser.add_argument("--death-lease-ttl", type=int, default=1, help="lease TTL of the death measurement")
    parser.add_argument("--barrier-ranks", default="64,1024,16384", help="simulated ranks of the barrier rows")
    parser.add_argument("--exchange-ranks", default="1024,16384", help="ranks of the Tree key-exchange rows")
    parser.add_argument("--generic-barrier-max", type=int, default=1024, help="largest N of the before-rows")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "scale.json")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        endpoint, run_id, count, conf = args.worker
        worker_main(endpoint, run_id, int(count), conf)
        return
    from elastic_ft.testing.etcd_cluster import EtcdCluster

    # A timeout's SIGTERM must still stop the cluster (its members run in sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    with EtcdCluster() as cluster:
        for nodes in [int(s) for s in args.sizes.split(",") if s]:
            rows.append(bench(cluster, nodes, args.procs, death=False, lease_ttl=args.lease_ttl))
            if nodes <= args.death_max:
                try:
                    rows.append(bench(cluster, nodes, args.procs, death=True, lease_ttl=args.death_lease_ttl))
                except RuntimeError as exc:  # reported with the table: the simulation gave out at this size
                    print(f"N={nodes:<5} death: failed: {exc}", flush=True)
                    rows.append({"nodes": nodes, "lease_ttl": args.death_lease_ttl, "death_failed": str(exc)})
        sizes = [int(n) for n in args.barrier_ranks.split(",") if n]
        barriers = [bench_barrier(cluster, n) for n in sizes]
        barriers += [bench_barrier(cluster, n, counted=False) for n in sizes if n <= args.generic_barrier_max]
        exchanges = [bench_exchange(cluster, int(n)) for n in args.exchange_ranks.split(",") if n]
    print(table(rows))
    for row in rows:
        if "death_failed" in row:
            print(
                f"N={row['nodes']}, lease_ttl={row['lease_ttl']}: the death measurement failed: {row['death_failed']}"
            )
    print("\nThe Wrapper's barrier on the etcd store (each rank arrives, then waits for the result):")
    print("| barrier | ranks | arrive s | total s | requests/rank (client) | requests/rank (etcd) |")
    print("|---|---|---|---|---|---|")
    for b in barriers:
        print(
            f"| {b['barrier']} | {b['ranks']} | {b['arrive_s']:.2f} | {b['seconds']:.2f} | {b['client_requests_per_rank']:.2f} | "
            f"{b['etcd_requests_per_rank']:.2f} |"
        )
    print("\nA Tree's grouping keys exchanged through the etcd store (its first call), then computed:")
    print(
        "| ranks | publish s | table s | read s | table KB | decode ms/rank | exchange s | first assignment s | "
        "reassign s | requests/rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in exchanges:
        print(
            f"| {e['ranks']} | {e['publish_s']:.2f} | {e['table_s']:.2f} | {e['read_s']:.2f} | "
            f"{e['table_bytes'] / 1024:.1f} | {e['decode_ms']:.2f} | {e['exchange_s']:.2f} | "
            f"{e['first_assignment_s']:.3f} | {e['reassign_s']:.3f} | {e['etcd_requests_per_rank']:.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "rows": rows,
        "barriers": barriers,
        "exchanges": exchanges,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    scratch.run_main(main)
