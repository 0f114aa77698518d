"""What the monitor process's question "is my rank resending lost data?" costs, asked as the monitor asks it.

The monitor process asks it ten times a second while its rank neither makes
progress nor uses CPU (waiting on a peer, a GPU, a restart). Two ways to
answer, side by side, for a rank holding N TCP connections, both ends of
each (2N sockets; a gloo rank holds two connections per peer per group):

* ``tables``: read ``/proc/<pid>/net/tcp`` and ``tcp6`` and match the
  rank's socket inodes (the kernel walks its whole connection hash table to
  write them, whatever the rank holds);
* ``probe``: :class:`elastic_ft.inprocess.hangs.resends.ResendProbe`, what
  the monitor uses: the tables only for sockets new to it, then one
  ``sock_diag`` lookup by address per connection.

Each row is the CPU time (user and kernel) of the asking process per
question, the median of ``--repeats`` runs of ``--questions`` questions, and
what ten questions a second cost as a share of one core. Prints a table,
writes ``benchmarks/results/monitor_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).resolve().parent / "results" / "monitor_cost.json"
#: A process holding N connections (both ends of each, as a rank's groups hold: half connected, half accepted).
HOLDER = """
import socket, sys
listener = socket.create_server(("127.0.0.1", 0))
held = []
for _ in range(int(sys.argv[1])):
    held.append(socket.create_connection(listener.getsockname()))
    held.append(listener.accept()[0])
print("ready", flush=True)
sys.stdin.read()
"""
#: The monitor's samples per second while its rank is quiet (elastic_ft/inprocess/hangs/monitor.py).
SAMPLES_PER_SECOND = 10


def cpu_per_question(ask: Callable[[], bool], questions: int) -> float:
    """CPU seconds (user and kernel) of this process per call of ``ask``."""
    start = time.process_time()
    for _ in range(questions):
        ask()
    return (time.process_time() - start) / questions


def measure(connections: int, questions: int, repeats: int) -> dict[str, Any]:
    from elastic_ft.inprocess.hangs.resends import ResendProbe, resending_by_tables

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(connections)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        if holder.stdout is None or holder.stdout.readline().strip() != "ready":
            raise RuntimeError("the process holding the connections did not start")
        probe = ResendProbe(holder.pid)
        probe.resending(time.monotonic())  # learns the addresses: the one read of the tables a new socket costs
        ways: dict[str, Callable[[], bool]] = {
            "tables": lambda: resending_by_tables(holder.pid),
            "probe": lambda: probe.resending(time.monotonic()),
        }
        runs = {name: [cpu_per_question(ask, questions) for _ in range(repeats)] for name, ask in ways.items()}
        probe.close()
    finally:
        holder.kill()
        holder.wait()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return {
        "connections": connections,
        "ms_per_question": {name: round(value * 1e3, 4) for name, value in medians.items()},
        "core_share_at_10_per_s": {name: round(value * SAMPLES_PER_SECOND, 5) for name, value in medians.items()},
        "ratio": round(medians["tables"] / medians["probe"], 1) if medians["probe"] > 0 else None,
        "runs_ms": {name: [round(v * 1e3, 4) for v in values] for name, values in runs.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", default="2,16,64", help="comma-separated connection counts")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    try:
        counts = [int(count) for count in args.connections.split(",")]
    except ValueError:
        parser.error(f"--connections must be comma-separated integers, got {args.connections!r}")
    if any(count < 1 for count in counts) or args.questions < 1 or args.repeats < 1:
        parser.error("--connections, --questions and --repeats must be at least 1")
    rows = [measure(count, args.questions, args.repeats) for count in counts]
    print(
        "\n| connections (sockets held) | tables (ms/question) | probe (ms/question) | tables / probe | core at 10/s: tables | probe |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        ms, share = row["ms_per_question"], row["core_share_at_10_per_s"]
        print(
            f"| {row['connections']} ({2 * row['connections']}) | {ms['tables']:.3f} | {ms['probe']:.4f} | {row['ratio']} | "
            f"{share['tables'] * 100:.2f} % | {share['probe'] * 100:.3f} % |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "args": {**vars(args), "out": str(args.out)},
        "runs": rows,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
