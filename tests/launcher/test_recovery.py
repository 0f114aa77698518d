"""Real training recovers from every fault kind in-process: ``examples/train_ftrun.py`` under two ``ftrun`` nodes.

Each test runs the reference script (DDP, ``torch.optim.AdamW``, a
``DataLoader`` with ``DistributedSampler``, an atomic checkpoint every 20
steps, default Wrapper settings, peer state healing) on 2 nodes x 2 workers
against a real etcd, injects one real fault at step 30, and checks from what
the script recorded: the surviving workers kept their processes, went on
from their own state at step 30 (no checkpoint read, no step redone),
finished every step, and did so within a loose bound (the benchmark,
``benchmarks/recovery.py``, carries the figures).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.testing.local_cluster import TorchrunNode, ftrun_command

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_ftrun.py"
CONF = "last_call_timeout=0.5,lease_ttl=2,join_timeout=60"
STEPS = 80
#: Two nodes of two workers: initial ranks 0 to 3.
WORLD = 4
#: How long a restart may take to reach a rank blocked in C code before its monitor process terminates it
#: (AdaptiveTimeouts.delivery_floor's default, which the job's short steps leave in force).
DELIVERY_BOUND = 3.0
FAULT_STEP = 30

pytestmark = pytest.mark.slow


def run_job(nodes: list[TorchrunNode], tmp_path: Path, etcd: EtcdServer, run_id: str, *script_args: str) -> list[int]:
    start_job(nodes, tmp_path, etcd, run_id, *script_args)
    return [node.wait(240) for node in nodes]


def start_job(nodes: list[TorchrunNode], tmp_path: Path, etcd: EtcdServer, run_id: str, *script_args: str) -> None:
    """Start the two nodes of the job, without waiting for them."""
    workdir = tmp_path / "work"
    for tag in "AB":
        nodes.append(
            TorchrunNode(
                tag,
                endpoint=etcd.endpoint,
                run_id=run_id,
                script=[
                    str(SCRIPT),
                    "--workdir",
                    str(workdir),
                    "--steps",
                    str(STEPS),
                    "--fault-step",
                    str(FAULT_STEP),
                    "--monitor-logs",
                    *script_args,
                ],
                nnodes="2:2",
                nproc_per_node=2,
                rdzv_conf=CONF,
                max_restarts=0,
                log_path=tmp_path / f"{tag}.log",
                extra_env={"OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"},
                launcher=ftrun_command(),
            )
        )


def stop_once_iteration_started(nodes: list[TorchrunNode], tmp_path: Path, iteration: int, steps_after: int) -> None:
    """Once all four ranks started ``iteration``, end training ``steps_after`` steps past where they resumed
    (the script's ``--stop-file``). Sized by the event, not by a step count, the run stays right however
    slowly a new process starts on a loaded machine."""
    deadline = time.monotonic() + 180
    while len(found := [e for e in events(tmp_path) if e["event"] == "start" and e["iteration"] == iteration]) < 4:
        assert time.monotonic() < deadline, f"{len(found)} of 4 ranks started iteration {iteration}\n{logs(nodes)}"
        assert all(node.process.poll() is None for node in nodes), logs(nodes, tmp_path / "work")
        time.sleep(0.2)
    stop = tmp_path / "work" / "stop"
    stop.with_suffix(".tmp").write_text(str(max(e["resumed_at"] for e in found) + steps_after))
    stop.with_suffix(".tmp").replace(stop)


def events(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in (tmp_path / "work").glob("events-*.jsonl") for line in path.open()]


def results(tmp_path: Path) -> dict[int, dict[str, Any]]:
    found = (json.loads(path.read_text()) for path in (tmp_path / "work").glob("done-*.json"))
    return {result["initial_rank"]: result for result in found}


def logs(nodes: list[TorchrunNode], workdir: Path | None = None) -> str:
    text = "\n".join(f"==== {node.tag}\n{node.log()[-8000:]}" for node in nodes)
    for path in sorted(workdir.glob("monitor-*.log")) if workdir else ():
        text += f"\n==== {path.name}\n{path.read_text(errors='replace')[-3000:]}"
    return text


def recovery_seconds(tmp_path: Path) -> float:
    """From the fault to the first completed step of the last surviving rank in the next iteration. The
    initial world's ranks only: a process respawned for a lost rank (initial rank 4 on) joins when it is ready,
    seconds later, and its start is not the survivors' recovery."""
    recorded = events(tmp_path)
    (fault,) = [e for e in recorded if e["event"] == "fault"]
    firsts: dict[int, float] = {}
    for event in sorted(recorded, key=lambda e: e["t"]):
        if event["event"] == "first_step" and event["t"] > fault["t"] and event["rank"] < WORLD:
            firsts.setdefault(event["rank"], event["t"])
    return max(firsts.values()) - fault["t"]


def assert_recovered(
    tmp_path: Path, nodes: list[TorchrunNode], codes: list[int], survivors: list[int], *, may_lose: int = 0
) -> None:
    """``survivors`` finished in their own processes, from their state at the fault; ``may_lose`` of them may be
    missing, each only if its own monitor terminated it when it could not restart (a gloo race, see
    docs/inprocess.md), never by a crash."""
    assert codes == [0, 0], logs(nodes, tmp_path / "work")
    done = results(tmp_path)
    missing = set(survivors) - set(done)
    # A process its node respawned for a lost rank (initial rank 4 on) joins the running world once it is
    # ready (respawn.rejoin: at_once): on a loaded machine that can be before a rank lost to the race below
    # is terminated. It then finishes with the survivors, healed, and is checked as they are.
    joiners = {rank for rank in done if rank >= 4}
    lost = 4 - len(survivors) + len(missing)
    assert set(done) - joiners <= set(survivors) and len(missing) <= may_lose, logs(nodes, tmp_path / "work")
    assert len(joiners) <= lost, logs(nodes, tmp_path / "work")
    for rank in missing:
        # Terminated by its monitor: inactive after the restart request, or blocked in C code where the
        # restart could not reach it (the same race, caught at the delivery bound).
        monitor_log = (tmp_path / "work" / f"monitor-{rank}.log").read_text()
        terminated = "after its restart request" in monitor_log or "has not reached the main thread" in monitor_log
        assert terminated, logs(nodes, tmp_path / "work")
    survivors = sorted(done)
    first_pids = {e["rank"]: e["pid"] for e in sorted(events(tmp_path), key=lambda e: e["t"]) if e["event"] == "start"}
    for rank, result in done.items():
        assert result["pid"] == first_pids[rank], f"rank {rank} was restarted as a new process: {result}"
        assert (result["step"], result["iteration"], result["world_size"]) == (STEPS, 1, len(survivors)), result
        # From its own state: the fault's step, or a little later where the faulty rank went on for a
        # few steps (a GIL-held sleep ends early when its monitor signals it, before SIGTERM lands).
        assert result["resumed_at"] >= FAULT_STEP, result
        assert result["process_restarts"] == 0
    assert len({result["resumed_at"] for result in done.values()}) == 1, done
    reads = [e for e in events(tmp_path) if e["event"] == "checkpoint_read" and e["iteration"] > 0]
    assert reads == [], reads  # no checkpoint read after the fault, no step redone
    # Every survivor ends with the same model: the same steps, on the same data.
    assert len({round(result["checksum"], 6) for result in done.values()}) == 1, done


@pytest.mark.parametrize(
    ("fault", "survivors", "bound", "may_lose"),
    [
        ("raise", [0, 1, 2, 3], 5.0, 0),
        # A peer blocked in DDP's backward sometimes never sees its gloo send fail (measured:
        # 2 to 5 runs in 20 of the GIL-held hang); its monitor then terminates it too, and the job goes on
        # at 2. A SIGKILLed rank's connections close at once, which can strand a peer the same way (seen in
        # the Slurm test's node kill, 1 run in 30 beside busy loops); so can a stopped rank's, all at once
        # when its monitor terminates it (seen once, in a run beside another test).
        ("sigkill", [0, 2, 3], 5.0, 1),
        ("hang_gil_released", [0, 1, 2, 3], 10.0, 0),
        ("hang_gil_held", [0, 2, 3], 10.0, 1),
        ("sigstop", [0, 2, 3], 10.0, 1),
    ],
)
def test_every_fault_kind_recovers_in_process(
    nodes: list[TorchrunNode],
    tmp_path: Path,
    etcd: EtcdServer,
    run_id: str,
    fault: str,
    survivors: list[int],
    bound: float,
    may_lose: int,
) -> None:
    codes = run_job(nodes, tmp_path, etcd, run_id, "--fault", fault, "--fault-rank", "1")
    assert_recovered(tmp_path, nodes, codes, survivors, may_lose=may_lose)
    # A stranded survivor holds the restart until its monitor process terminates it, at the delivery bound.
    stranded = set(survivors) - set(results(tmp_path))
    assert recovery_seconds(tmp_path) < bound + DELIVERY_BOUND * bool(stranded), logs(nodes, tmp_path / "work")


def test_a_group_held_by_user_code_does_not_stall_recovery(
    nodes: list[TorchrunNode], tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    codes = run_job(nodes, tmp_path, etcd, run_id, "--fault", "raise", "--fault-rank", "2", "--hold-group")
    assert_recovered(tmp_path, nodes, codes, [0, 1, 2, 3])
    assert recovery_seconds(tmp_path) < 5.0, logs(nodes, tmp_path / "work")


def test_a_slow_but_healthy_step_is_not_a_hang(
    nodes: list[TorchrunNode], tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    # Rank 1 spends 4 s in one C call (no Python code runs, no step): 80 times the step
    # time, well past the adaptive soft timeout. It burns CPU, so it is working, and the
    # other ranks, waiting for it, see it active through its heartbeats.
    codes = run_job(nodes, tmp_path, etcd, run_id, "--fault", "slow_step", "--fault-rank", "1", "--slow-seconds", "4")
    assert codes == [0, 0], logs(nodes, tmp_path / "work")
    done = results(tmp_path)
    assert sorted(done) == [0, 1, 2, 3], logs(nodes, tmp_path / "work")
    assert all((r["iteration"], r["step"], r["resumed_at"]) == (0, STEPS, 0) for r in done.values()), done


def test_a_joiners_admission_stalls_the_survivors_for_one_planned_restart(
    nodes: list[TorchrunNode], tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    """Rank 1 is SIGKILLed and its node respawns it (``respawn.rejoin: at_once``, the default). The survivors
    train on at world size 3 while the new process starts, never waiting for it, and its admission costs them
    one planned restart: one short gap in their steps, and no other restart."""
    start_job(
        nodes,
        tmp_path,
        etcd,
        run_id,
        "--fault",
        "sigkill",
        "--fault-rank",
        "1",
        "--steps",
        str(10**9),
        "--stop-file",
        str(tmp_path / "work" / "stop"),
        "--step-wait",
        "0.02",
        "--record-steps",
    )
    stop_once_iteration_started(nodes, tmp_path, iteration=2, steps_after=100)
    codes = [node.wait(240) for node in nodes]
    assert codes == [0, 0], logs(nodes, tmp_path / "work")
    recorded = sorted(events(tmp_path), key=lambda e: e["t"])
    (fault,) = [e for e in recorded if e["event"] == "fault"]
    (joiner_ready,) = [e for e in recorded if e["event"] == "ready" and e["t"] > fault["t"]]
    survivors = (0, 2, 3)
    steps = [e for e in recorded if e["event"] == "step" and e["rank"] in survivors]
    # Iteration 0 at 4, iteration 1 at 3 (the survivors alone, while the new process starts), iteration 2 at 4
    # with the joiner: its admission is the one restart after the fault's.
    assert sorted({(e["iteration"], e["world_size"]) for e in steps}) == [(0, 4), (1, 3), (2, 4)]
    assert {r["initial_rank"]: r["iteration"] for r in results(tmp_path).values()} == {0: 2, 2: 2, 3: 2, 4: 2}
    for rank in survivors:
        mine = [e["t"] for e in steps if e["rank"] == rank]
        last_before = {i: max(e["t"] for e in steps if e["rank"] == rank and e["iteration"] == i) for i in (0, 1)}
        first_after = {i: min(e["t"] for e in steps if e["rank"] == rank and e["iteration"] == i) for i in (1, 2)}
        # They trained while the joiner started (imported torch, built its data loader): nothing waited for it.
        assert last_before[1] > joiner_ready["t"], (rank, joiner_ready, last_before)
        # The admission: one gap, loosely bounded (the benchmark carries the figure, about 0.3 s).
        assert first_after[2] - last_before[1] < 3.0, (rank, first_after, last_before)
        # No other pause: between the restarts, steps follow each other closely.
        gaps = [b - a for a, b in itertools.pairwise(mine) if first_after[1] < b <= last_before[1]]
        assert max(gaps, default=0.0) < 2.0, (rank, max(gaps))
