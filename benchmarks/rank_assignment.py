"""Time Tree rank reassignment at scale.

Scenario: hosts of 8 ranks under one root; the root allows all but 1/16 of
the ranks to be active (whole spare hosts) and is RESERVE; hosts allow 8
active ranks and are RESERVE | BACKFILL. A seeded random set of ranks
terminates (never rank 0, the rank whose call is timed for NVIDIA's
implementation).

Measured, as the median over repeats:

* ``reassign``: the per-rank computation once the grouping keys are known,
  i.e. :func:`elastic_ft.inprocess.rank_assignment.tree_engine.reassign_tree` from the initial
  assignment. This is what the goals bound.
* ``first call``: building the tree from the keys and the initial
  activation (informational).
* ``Tree() first call`` / ``Tree() reassign``: the public ``Tree`` on one
  rank with a ``torch.distributed.HashStore`` pre-filled with every other
  rank's keys, so that this rank is the last to arrive and gathers them
  (informational; includes the store exchange and JSON).
* ``nvidia ...``: the same scenario with ``nvidia_resiliency_ext`` 0.4.1's
  ``Tree``, if it can be imported, on a fake store that hands it the keys.

Usage (with the package installed, e.g. ``pip install -e .``):
``python benchmarks/rank_assignment.py [--quick] [--repeats N] [--no-nvidia]``.
Writes ``benchmarks/results/rank_assignment.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed

from elastic_ft.inprocess.rank_assignment import RankAssignmentCtx, Tree
from elastic_ft.inprocess.rank_assignment.tree_engine import (
    Layer,
    LayerFlag,
    build_tree_topology,
    initial_tree_assignment,
    reassign_tree,
)
from elastic_ft.inprocess.state import State

RANKS_PER_HOST = 8
SCENARIOS = [(16_384, 1_024, 50.0), (131_072, 8_192, 500.0)]
RESULTS = Path(__file__).resolve().parent / "results" / "rank_assignment.json"


def host_of(rank: int) -> str:
    return f"host{rank // RANKS_PER_HOST:06d}"


def layers(world_size: int) -> list[Layer]:
    return [
        Layer(min_ranks=1, max_ranks=world_size - world_size // 16, key_or_fn="root", flag=LayerFlag.RESERVE),
        Layer(
            min_ranks=1,
            max_ranks=RANKS_PER_HOST,
            key_or_fn=lambda state: host_of(state.rank),
            flag=LayerFlag.RESERVE | LayerFlag.BACKFILL,
        ),
    ]


def terminations(world_size: int, count: int) -> set[int]:
    return set(random.Random(world_size).sample(range(1, world_size), count))


def median_ms(fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None) -> float:
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bench_pure(world_size: int, terminated: set[int], repeats: int) -> tuple[dict[str, float], Any]:
    tree_layers = layers(world_size)
    ranks = list(range(world_size))
    keys = [["root"] * world_size, [host_of(rank) for rank in ranks]]

    def first() -> Any:
        return initial_tree_assignment(build_tree_topology(tree_layers, ranks, keys))

    topology = build_tree_topology(tree_layers, ranks, keys)
    initial = initial_tree_assignment(topology)
    result = reassign_tree(topology, initial, terminated)
    times = {
        "first call": median_ms(first, max(1, repeats // 2)),
        "reassign": median_ms(lambda: reassign_tree(topology, initial, terminated), repeats),
    }
    return times, result


def bench_public(world_size: int, terminated: set[int], repeats: int) -> dict[str, float]:
    """Tree on rank 0 with a HashStore already holding the other ranks' keys."""
    timeout = datetime.timedelta(seconds=60)
    state: dict[str, Any] = {}

    def setup() -> None:
        store = torch.distributed.HashStore()
        tree = Tree(layers(world_size), timeout=timeout, name="bench")
        prefix = "elastic_ft/rank_assignment/bench/0"
        for rank in range(1, world_size):
            store.set(f"{prefix}/keys/{rank}", json.dumps(["root", host_of(rank)]))
        store.add(f"{prefix}/arrived", world_size - 1)
        state.update(store=store, tree=tree)

    def first() -> None:
        state["ctx"] = state["tree"](RankAssignmentCtx(State(0, world_size), state["store"], set()))

    def again() -> None:
        state["tree"](RankAssignmentCtx(state["ctx"].state, state["store"], terminated))

    count = max(1, repeats // 4)
    first_ms = median_ms(first, count, setup)

    def setup_again() -> None:
        setup()
        first()

    return {"Tree() first call": first_ms, "Tree() reassign": median_ms(again, count, setup_again)}


def bench_nvidia(world_size: int, terminated: set[int], repeats: int) -> tuple[dict[str, float], Any]:
    from nvidia_resiliency_ext.inprocess import rank_assignment as nv
    from nvidia_resiliency_ext.inprocess.state import State as NvState

    class KeysStore:
        """Hands NVIDIA's Tree every rank's state and keys without a real store."""

        def send_state(self, state: object, rank: int) -> None:
            pass

        def send_key(self, key: object, rank: int) -> None:
            pass

        def get_states(self, ranks: range) -> list[Any]:
            return [NvState(rank=rank, world_size=world_size) for rank in ranks]

        def get_keys(self, ranks: range) -> list[list[str]]:
            return [["root", host_of(rank)] for rank in ranks]

    nv_layers = [
        nv.Layer(min_ranks=1, max_ranks=world_size - world_size // 16, key_or_fn="root", flag=nv.LayerFlag.RESERVE),
        nv.Layer(
            min_ranks=1,
            max_ranks=RANKS_PER_HOST,
            key_or_fn=lambda state: host_of(state.rank),
            flag=nv.LayerFlag.RESERVE | nv.LayerFlag.BACKFILL,
        ),
    ]
    store = KeysStore()
    state: dict[str, Any] = {}

    def setup() -> None:
        state["tree"] = nv.Tree(nv_layers)

    def first() -> None:
        state["ctx"] = state["tree"](nv.RankAssignmentCtx(NvState(rank=0, world_size=world_size), store, set()))

    def again() -> None:
        state["result"] = state["tree"](nv.RankAssignmentCtx(state["ctx"].state, store, set(terminated)))

    count = max(1, repeats // 4)
    first_ms = median_ms(first, count, setup)

    def setup_again() -> None:
        setup()
        first()

    again_ms = median_ms(again, count, setup_again)
    return {"nvidia first call": first_ms, "nvidia reassign": again_ms}, state["result"].state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 16,384-rank scenario")
    parser.add_argument(
        "--repeats",
        type=int,
        default=20,
        help="runs of the reassignment (first call: half, public Tree and NVIDIA: a quarter)",
    )
    parser.add_argument("--no-nvidia", action="store_true", help="skip nvidia_resiliency_ext")
    args = parser.parse_args()

    nvidia_note = None
    if args.no_nvidia:
        nvidia_note = "nvidia_resiliency_ext not timed: --no-nvidia given"
    else:
        try:
            import nvidia_resiliency_ext.inprocess.rank_assignment  # noqa: F401
        except (ImportError, RuntimeError, OSError) as error:  # optional: skip the comparison
            nvidia_note = f"nvidia_resiliency_ext not timed: {type(error).__name__}: {error}"

    scenarios = SCENARIOS[:1] if args.quick else SCENARIOS
    rows: list[dict[str, Any]] = []
    all_pass = True
    for world_size, count, goal_ms in scenarios:
        terminated = terminations(world_size, count)
        times, result = bench_pure(world_size, terminated, args.repeats)
        times.update(bench_public(world_size, terminated, args.repeats))
        nvidia_state = None
        if nvidia_note is None:
            nvidia_times, nvidia_state = bench_nvidia(world_size, terminated, args.repeats)
            times.update(nvidia_times)
        after = {
            "reassign": (result.world_size, result.active_world_size),
            "nvidia reassign": None
            if nvidia_state is None
            else (nvidia_state.world_size, nvidia_state.active_world_size),
        }
        for what, ms in times.items():
            goal = goal_ms if what == "reassign" else None
            sizes = after.get(what)
            row: dict[str, Any] = {
                "world_size": world_size,
                "terminations": count,
                "measure": what,
                "median_ms": round(ms, 2),
                "goal_ms": goal,
                "passed": None if goal is None else ms < goal,
                "world_size_after": None if sizes is None else sizes[0],
                "active_world_size_after": None if sizes is None else sizes[1],
            }
            all_pass = all_pass and row["passed"] is not False
            rows.append(row)

    header = f"{'world size':>10}  {'terminations':>12}  {'measure':<18}  {'median ms':>9}  {'goal ms':>7}  result"
    print(header)
    print("-" * len(header))
    for row in rows:
        goal = "-" if row["goal_ms"] is None else f"{row['goal_ms']:.0f}"
        verdict = "-" if row["passed"] is None else ("PASS" if row["passed"] else "FAIL")
        print(
            f"{row['world_size']:>10,}  {row['terminations']:>12,}  {row['measure']:<18}  "
            f"{row['median_ms']:>9.1f}  {goal:>7}  {verdict}"
        )
    if nvidia_note:
        print(nvidia_note)

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "rank_assignment",
                "scenario": "2 layers: root (max = 15/16 of ranks, RESERVE), hosts of 8 "
                "(max 8, RESERVE|BACKFILL); random terminations",
                "repeats": args.repeats,
                "python": platform.python_version(),
                "torch": torch.__version__,
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "nvidia_note": nvidia_note,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")
    return 0 if all_pass else 1


if __name__ == "__main__":
    sys.exit(main())
