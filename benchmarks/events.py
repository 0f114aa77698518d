"""What recording events costs: the caller, etcd, and the readers; side by side with the alternatives.

One run, against a real single-member etcd on loopback:

1. the caller's cost of one event (what the main thread of a training
   process pays): ``emit()`` of elastic-ft's sink, against torch's own
   ``events.record`` to the ``null`` handler, called inline;
2. one event stored in etcd, sequentially: elastic-ft's ``EventLog.append``
   (bounded ring, numbered, applied once: a read and a transaction),
   against the simplest alternative, a plain ``put`` of a unique key
   (unbounded, no order, no protection against a resend applying twice);
3. appends from 8 writers at once (distinct numbers, nothing lost);
4. readers: ``read_all()`` of a full log (4096 events in each stream), and
   a follower's poll when nothing is new (``read(after=last)``).

Medians (and 90th percentiles) of repeats; prints a table, writes
``benchmarks/results/events.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from pathlib import Path

import scratch
from torch.distributed.elastic import events as torch_events

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.event_log import EventLog
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.keys import RunKeys
from elastic_ft.observability.events import JobEvent
from elastic_ft.observability.sink import EventSink

HERE = Path(__file__).resolve().parent


def fault(run_id: str, i: int) -> JobEvent:
    return JobEvent(
        "fault_detected",
        time.time(),
        run_id,
        "worker",
        node="n0",
        rank=i % 8,
        iteration=0,
        data={"kind": "RuntimeError", "message": "injected fault", "step": i},
    )


def quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))], "n": len(ordered)}


def caller_cost(repeats: int) -> dict[str, dict[str, float]]:
    sink = EventSink("bench", "worker", None)  # not started: measures the enqueue alone
    event = fault("bench", 0)
    torch_form = event.to_torch()
    results = {}
    for name, call in (
        ("elastic-ft emit()", lambda: sink.emit("progress", rank=0, step=1)),
        ("torch events.record(null)", lambda: torch_events.record(torch_form, "null")),
    ):
        samples = []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            call()
            samples.append((time.perf_counter_ns() - start) / 1000)
        results[name] = quantiles(samples)
        sink._queue.clear()
    return results


def storage_cost(etcd: EtcdServer, repeats: int) -> dict[str, dict[str, float]]:
    client = EtcdClient(etcd.endpoints)
    try:
        run = f"bench-{uuid.uuid4().hex[:8]}"
        log = EventLog(client, RunKeys("/elastic_ft", run))
        plain = f"/elastic_ft/{run}/plain/"
        results = {}
        for name, call in (
            ("EventLog.append (ring, numbered, once)", lambda i: log.append(fault(run, i))),
            (
                "plain put of a unique key",
                lambda i: client.put(plain + uuid.uuid4().hex, fault(run, i).to_json().encode()),
            ),
        ):
            samples = []
            for i in range(repeats):
                start = time.perf_counter()
                call(i)
                samples.append((time.perf_counter() - start) * 1000)
            results[name] = quantiles(samples)
        return results
    finally:
        client.close()


def concurrent_appends(etcd: EtcdServer, writers: int, each: int) -> dict[str, float]:
    run = f"bench-{uuid.uuid4().hex[:8]}"
    keys = RunKeys("/elastic_ft", run)
    barrier = threading.Barrier(writers + 1)

    def write(rank: int) -> None:
        client = EtcdClient(etcd.endpoints)
        try:
            log = EventLog(client, keys)
            client.get(keys.events_next())  # connected before the clock starts
            barrier.wait()
            for i in range(each):
                log.append(fault(run, rank * each + i))
        finally:
            client.close()

    threads = [threading.Thread(target=write, args=(rank,)) for rank in range(writers)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    client = EtcdClient(etcd.endpoints)
    try:
        numbers = [e.seq for e in EventLog(client, keys).read().events]
    finally:
        client.close()
    return {
        "writers": writers,
        "events": writers * each,
        "seconds": elapsed,
        "events_per_second": writers * each / elapsed,
        "numbers_distinct_and_complete": numbers == list(range(writers * each)),
    }


def read_cost(etcd: EtcdServer, repeats: int) -> dict[str, dict[str, float]]:
    client = EtcdClient(etcd.endpoints)
    try:
        run = f"bench-{uuid.uuid4().hex[:8]}"
        log = EventLog(client, RunKeys("/elastic_ft", run))
        for i in range(4096):
            log.append(fault(run, i))
            log.append(JobEvent("progress", time.time(), run, "worker", rank=i % 8, data={"step": i}))
        results = {}
        for name, call in (
            ("read_all() of 2 x 4096 events", lambda: log.read_all()),
            ("follower poll, nothing new", lambda: log.read(after=4095)),
        ):
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                call()
                samples.append((time.perf_counter() - start) * 1000)
            results[name] = quantiles(samples)
        return results
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "events.json")
    args = parser.parse_args()
    with EtcdServer() as etcd:
        caller = caller_cost(20 * args.repeats)
        storage = storage_cost(etcd, args.repeats)
        concurrent = concurrent_appends(etcd, 8, max(10, args.repeats // 8))
        reads = read_cost(etcd, max(5, args.repeats // 20))
    print("\ncaller's cost of one event (microseconds)")
    print(f"  {'':44} {'median':>8} {'p90':>8}")
    for name, q in caller.items():
        print(f"  {name:44} {q['median']:8.2f} {q['p90']:8.2f}")
    print("\nstoring one event in etcd, sequentially (milliseconds)")
    for name, q in storage.items():
        print(f"  {name:44} {q['median']:8.3f} {q['p90']:8.3f}")
    ours, plain = (q["median"] for q in storage.values())
    print(f"  ratio append / plain put: {ours / plain:.2f}")
    print(
        f"\n{concurrent['writers']} writers at once: {concurrent['events']} events in {concurrent['seconds']:.2f} s "
        f"({concurrent['events_per_second']:.0f}/s); numbers distinct and complete: "
        f"{concurrent['numbers_distinct_and_complete']}"
    )
    print("\nreading (milliseconds)")
    for name, q in reads.items():
        print(f"  {name:44} {q['median']:8.3f} {q['p90']:8.3f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"caller_us": caller, "storage_ms": storage, "concurrent": concurrent, "read_ms": reads}, indent=2)
        + "\n"
    )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    scratch.run_main(main)
