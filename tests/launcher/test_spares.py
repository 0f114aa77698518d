"""Hot spares with real ``ftrun`` nodes and real etcd: reserve ranks activated in-process, respawned workers.

Every node is a real ``ftrun`` process of 2 gloo workers running
``tests/launcher/worker.py`` under ``elastic_ft.Wrapper`` with its default
settings for rank assignment; faults are real SIGKILLs of whole nodes
(agent, workers, monitor processes) or of single workers.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.testing.local_cluster import TorchrunNode, ftrun_command
from tests.launcher.test_agent import (
    alive,
    escalations,
    events_of,
    logs,
    read,
    reserve_ready,
    start,
    status_of,
    wait_for,
)

pytestmark = pytest.mark.slow

SPARE = ("--spare-nodes=1",)
LONG = {"steps": 400, "step_seconds": 0.05}  # 20 s of training: faults land mid-run


def _by_node(started: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    nodes: dict[str, list[dict[str, Any]]] = {}
    for name, record in started.items():
        nodes.setdefault(name.split("-")[1], []).append(record)
    return nodes


def _three_nodes(
    nodes: list[TorchrunNode], tmp_path: Path, etcd: EtcdServer, run_id: str, scenario: dict[str, Any]
) -> tuple[dict[str, TorchrunNode], dict[str, list[dict[str, Any]]]]:
    """2 active nodes and 1 hot spare; returns them by tag, and their workers.

    The spare is a member of the first round, or, where it reached the
    rendezvous after the last call (a loaded machine), a late member of the
    running round: the same ranks either way, and the same to these tests.
    """
    by_tag = {tag: start(nodes, tmp_path, etcd, run_id, tag, scenario, extra_args=SPARE) for tag in "ABC"}
    started = _by_node(wait_for(tmp_path, "start-*.json", 6, 90))
    return by_tag, started


def _holding(started: dict[str, list[dict[str, Any]]], ranks: set[int]) -> str:
    return next(tag for tag, workers in started.items() if {w["rank"] for w in workers} == ranks)


def test_a_killed_node_is_replaced_by_the_hot_spare_in_process(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """SIGKILL an active node: the spare's reserve ranks take its place; no process starts or stops anywhere."""
    # Iteration 0 lasts until the kill, however long the spare's workers took to be ready; iteration 1, 20 s.
    scenario = {**LONG, "iteration_steps": {"0": 3000}}
    by_tag, started = _three_nodes(nodes, tmp_path, etcd, run_id, scenario)
    spare, victim = _holding(started, {4, 5}), _holding(started, {2, 3})
    survivor = _holding(started, {0, 1})
    wait_for(tmp_path, "step-*.json", 1, 60)  # training
    reserve_ready(etcd, run_id, nodes, {4, 5})
    killed = by_tag[victim].kill()
    assert by_tag[survivor].wait(150) == 0, logs(nodes)
    assert by_tag[spare].wait(60) == 0, logs(nodes)
    done = read(tmp_path, "done-*.json")
    # The survivors' and the spare's processes finished, in the processes they started in.
    assert sorted(r["node"] for r in done.values()) == sorted([survivor, survivor, spare, spare])
    pids = {w["rank"]: w["pid"] for tag in (survivor, spare) for w in started[tag]}
    assert {r["initial_rank"]: r["pid"] for r in done.values()} == pids
    # The world size is back to 4, with the spare's ranks active, after one in-process restart.
    for record in done.values():
        assert record["restart"] == 0
        assert record["result"]["world_size"] == 4 and record["result"]["iteration"] == 1, f"{done}\n{logs(nodes)}"
    assert sorted(r["result"]["rank"] for r in done.values() if r["node"] == spare) == [2, 3]
    # The spare's ranks warmed up in reserve: their first call found torch._dynamo imported (the survivors,
    # which never waited and build no optimizer, did not import it).
    assert {r["node"]: r["result"]["dynamo_imported"] for r in done.values()} == {survivor: False, spare: True}
    assert not any(alive(pid) for pid in killed)
    both = by_tag[survivor].log() + by_tag[spare].log()
    assert "restarting the workers" not in both and "respawned" not in both
    assert escalations(etcd, run_id) == []
    status = status_of(etcd, run_id)
    assert (status["spare_nodes"], status["in_process_restarts"]) == (1, 1), f"{status}\n{logs(nodes)}"
    assert status["activations"] == [{"initial_rank": 4, "iteration": 1}, {"initial_rank": 5, "iteration": 1}]


def test_a_spare_that_dies_while_reserve_costs_the_active_ranks_nothing(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    by_tag, started = _three_nodes(nodes, tmp_path, etcd, run_id, {"steps": 160, "step_seconds": 0.05})
    spare = _holding(started, {4, 5})
    wait_for(tmp_path, "step-*.json", 1, 60)
    by_tag[spare].kill()
    actives = [tag for tag in by_tag if tag != spare]
    assert [by_tag[tag].wait(150) for tag in actives] == [0, 0], logs(nodes)
    done = read(tmp_path, "done-*.json")
    assert sorted(r["initial_rank"] for r in done.values()) == [0, 1, 2, 3]
    for record in done.values():  # never interrupted: still the first iteration
        assert record["result"]["iteration"] == 0 and record["result"]["world_size"] == 4
    assert escalations(etcd, run_id) == []


def test_when_spares_run_out_the_world_shrinks(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    # The job trains until the world has shrunk (however loaded the machine), then stops at that event.
    scenario = {"steps": 6000, "step_seconds": 0.05, "stop_file": "stop"}
    by_tag, started = _three_nodes(nodes, tmp_path, etcd, run_id, scenario)
    spare, victim = _holding(started, {4, 5}), _holding(started, {2, 3})
    survivor = _holding(started, {0, 1})
    wait_for(tmp_path, "step-*.json", 1, 60)
    reserve_ready(etcd, run_id, nodes, {4, 5})
    by_tag[victim].kill()
    # The spare is activated (iteration 1), then it dies too: the world shrinks to the survivor's 2 ranks.
    deadline = time.monotonic() + 60
    while not any(r.get("iteration") == 1 and r.get("node") == spare for r in read(tmp_path, "step-*.json").values()):
        assert time.monotonic() < deadline, logs(nodes)
        time.sleep(0.1)
    by_tag[spare].kill()
    deadline = time.monotonic() + 90
    while sum(r.get("iteration") == 2 for r in read(tmp_path, "step-*.json").values()) < 2:
        assert time.monotonic() < deadline, f"the survivor's ranks did not train in iteration 2\n{logs(nodes)}"
        time.sleep(0.1)
    (tmp_path / "out" / "stop").touch()
    assert by_tag[survivor].wait(150) == 0, logs(nodes)
    done = read(tmp_path, "done-*.json")
    assert sorted(r["initial_rank"] for r in done.values()) == [0, 1]
    for record in done.values():
        assert record["result"]["world_size"] == 2 and record["result"]["iteration"] == 2
        assert record["restart"] == 0
    assert escalations(etcd, run_id) == []


def test_a_respawned_worker_waits_as_reserve_then_is_activated_by_the_next_fault(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """respawn.rejoin=next_fault (the default is at_once): SIGKILL rank 3, the world shrinks to 3, its node
    respawns the process, which waits in reserve; the next fault (rank 0 raises once the respawned process
    is registered, however long its start took) activates it."""
    second_fault = {"rank": 0, "kind": "raise", "iteration": 1, "step": 10, "after_file": "reserve-registered"}
    scenario = {
        "steps": 200,
        "iteration_steps": {"1": 3000},  # iteration 1 ends with the second fault, not by its length
        "step_seconds": 0.05,
        "faults": [{"rank": 3, "kind": "sigkill", "step": 5}, second_fault],
    }
    config = tmp_path / "job.yaml"
    config.write_text("respawn: {rejoin: next_fault}\n")
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario, job_config=config) for tag in "AB")
    deadline = time.monotonic() + 90
    while "respawned as pid" not in a.log() + b.log() or [
        j["initial_rank"] for j in status_of(etcd, run_id)["joined"]
    ] != [4]:
        assert time.monotonic() < deadline and a.process.poll() is None and b.process.poll() is None, logs(nodes)
        time.sleep(0.5)
    (tmp_path / "out" / "reserve-registered").touch()
    assert [a.wait(150), b.wait(150)] == [0, 0], logs(nodes)
    done = read(tmp_path, "done-*.json")
    assert sorted(r["initial_rank"] for r in done.values()) == [0, 1, 2, 4]
    for record in done.values():
        assert record["result"]["world_size"] == 4 and record["result"]["iteration"] == 2
    assert done["done-4-0"]["result"]["rank"] == 3  # the respawned process took the dead rank's place
    assert done["done-4-0"]["result"]["dynamo_imported"] is True  # it warmed up before it registered
    assert "local rank 1 respawned as pid" in a.log() + b.log()
    status = status_of(etcd, run_id)
    assert status["respawns"] == 1 and [j["initial_rank"] for j in status["joined"]] == [4]
    assert escalations(etcd, run_id) == []
    # The run's events tell the same story: the death, the respawn, two restarts, the joiner activated.
    events = events_of(etcd, run_id)
    (died,) = [e for e in events if e.name == "fault_detected" and e.data["kind"] == "process_died"]
    (respawned,) = [e for e in events if e.name == "respawned"]
    assert died.rank == 3 and respawned.rank == 4 and respawned.time >= died.time
    assert sorted(e.iteration for e in events if e.name == "restart_decided") == [0, 1]
    assert [(e.rank, e.iteration) for e in events if e.name == "spare_activated"] == [(4, 2)]


def test_a_spare_arriving_while_the_job_trains_joins_without_restarting_anyone(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """The round closed with the 2 active nodes; the spare comes later, joins the running round as a hot
    spare (no process restarted), and replaces a node killed after that."""
    # Iteration 0 lasts until the node is killed, however long the spare took to start and register.
    scenario = {"steps": 100, "iteration_steps": {"0": 3000}, "step_seconds": 0.05}
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario, extra_args=SPARE) for tag in "AB")
    started = _by_node(wait_for(tmp_path, "start-*.json", 4, 90))
    wait_for(tmp_path, "step-*.json", 1, 60)
    spare = start(nodes, tmp_path, etcd, run_id, "C", scenario, extra_args=SPARE)
    late_workers = _by_node(wait_for(tmp_path, "start-C-*.json", 2, 90))["C"]
    assert sorted(w["rank"] for w in late_workers) == [4, 5]  # joiners: initial ranks above the world's
    deadline = time.monotonic() + 60
    while len((status := status_of(etcd, run_id))["joined"]) < 2:  # both registered: initialised, in reserve
        assert time.monotonic() < deadline, logs(nodes)
        time.sleep(0.2)
    late = [m for m in status["members"] if m.get("late")]
    assert [(m["rank"], m["state"]) for m in late] == [(2, "alive")]  # group rank 2, above the members
    assert status["spare_nodes"] == 1  # a spare whether it joined the round or the running round
    by_tag = {"A": a, "B": b}
    victim = _holding(started, {2, 3})
    survivor = _holding(started, {0, 1})
    by_tag[victim].kill()
    assert by_tag[survivor].wait(150) == 0, logs(nodes)
    assert spare.wait(60) == 0, logs(nodes)
    done = read(tmp_path, "done-*.json")
    assert sorted(r["initial_rank"] for r in done.values()) == [0, 1, 4, 5]
    for record in done.values():
        assert record["result"]["world_size"] == 4 and record["restart"] == 0
        assert record["result"]["dynamo_imported"] is (record["initial_rank"] in (4, 5))  # the joiners warmed up
    pids = {w["rank"]: w["pid"] for w in started[survivor] + late_workers}
    assert {r["initial_rank"]: r["pid"] for r in done.values()} == pids  # nobody restarted
    logged = by_tag[survivor].log() + spare.log()
    assert "joined running round 0" in spare.log() and "restarting the workers" not in logged
    assert escalations(etcd, run_id) == []
    events = events_of(etcd, run_id)
    hot_spare = [e for e in events if e.name == "node_joined" and e.data.get("role") == "hot_spare"]
    assert [(e.round, e.data["place"]) for e in hot_spare] == [(0, 2)]
    (died,) = [e for e in events if e.name == "node_died"]  # reported once, by one surviving agent
    assert sorted(died.data["ranks"]) == [2, 3] and died.data["reporter"] != died.node
    assert sorted(e.rank for e in events if e.name == "spare_activated") == [4, 5]


def test_rejoin_at_once_restores_the_world_size_without_waiting_for_a_fault(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """respawn.rejoin=at_once: once the respawned process is ready, its node asks for a restart that admits it."""
    scenario = {
        "steps": 100,
        "iteration_steps": {"1": 3000},  # iteration 1 ends when the respawned process is admitted, however late
        "step_seconds": 0.05,
        "faults": [{"rank": 3, "kind": "sigkill", "step": 5}],
    }
    config = tmp_path / "job.yaml"
    config.write_text("respawn: {rejoin: at_once}\n")
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario, job_config=config) for tag in "AB")
    assert [a.wait(150), b.wait(150)] == [0, 0], logs(nodes)
    logged = a.log() + b.log()
    # gloo's race (docs/inprocess.md, Known limitations) can strand a rank in a collective at the restart that
    # admits rank 4 (seen once, under load): its monitor terminates it at the delivery bound, and its node
    # respawns it as initial rank 5, admitted the same way one iteration later.
    stranded = [int(r) for r in re.findall(r"rank (\d+) \(pid \d+\) ended with signal SIGTERM inside", logged)]
    assert len(stranded) <= 1 and logged.count("restart_blocked on rank") == len(stranded), logs(nodes)
    joiners = list(range(4, 5 + len(stranded)))
    done = read(tmp_path, "done-*.json")
    assert sorted(r["initial_rank"] for r in done.values()) == sorted({0, 1, 2} - set(stranded)) + joiners
    for record in done.values():  # iteration 1: without rank 3; iteration 2: with the respawned rank 4
        assert record["result"]["world_size"] == 4 and record["result"]["iteration"] == 1 + len(joiners)
    assert "asking iteration 1 to restart and admit them (respawn.rejoin=at_once)" in logged
    status = status_of(etcd, run_id)
    assert status["joined"] == [{"initial_rank": j, "admitted": str(j - 2)} for j in joiners]
    assert status["activations"] == [{"initial_rank": j, "iteration": j - 2} for j in joiners]


def test_respawns_stop_at_the_job_budget(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """Two workers on two nodes killed at once; respawn.per_job=1: one is respawned, the other is not."""
    scenario = {
        "steps": 60,
        "faults": [{"rank": 1, "kind": "sigkill", "step": 5}, {"rank": 3, "kind": "sigkill", "step": 5}],
    }
    config = tmp_path / "job.yaml"
    config.write_text("respawn: {per_rank: 1, per_job: 1, rejoin: next_fault}\n")
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario, job_config=config) for tag in "AB")
    assert [a.wait(150), b.wait(150)] == [0, 0], logs(nodes)
    logged = a.log() + b.log()
    assert logged.count("respawned as pid") == 1 and "respawn.per_job=1 used" in logged
    done = read(tmp_path, "done-*.json")
    finished = sorted(r["initial_rank"] for r in done.values())
    # The respawned rank 4 waited in reserve and left with the job, or, still starting when the job
    # completed (a slow torch import), its agent stopped it.
    assert finished in ([0, 2, 4], [0, 2]), finished
    if finished == [0, 2]:
        assert next(w for w in status_of(etcd, run_id)["workers"] if w["rank"] == 4)["state"] == "retired (-15)"
    assert {r["result"]["world_size"] for r in done.values() if r["result"]} == {2}
    assert escalations(etcd, run_id) == []


def test_bad_spare_configuration_fails_before_anything_starts(etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("nodes: {min: 1, max: 2, spares: many}\n")
    cases = [
        (["--spare-nodes=-1"], "argument --spare-nodes: '-1' is not a number of nodes; expected a whole number"),
        (["--spare-nodes=1", "--rdzv-conf=spare_nodes=2"], "--spare-nodes=1 disagrees with --rdzv-conf spare_nodes=2"),
        ([f"--job-config={config}"], "nodes.spares"),
        (["--rdzv-conf=spare_nodes=x"], "spare_nodes='x' is invalid"),
    ]
    for flags, message in cases:
        command = [
            *ftrun_command(),
            "--nnodes=1:2",
            "--nproc-per-node=1",
            f"--rdzv-endpoint={etcd.endpoint}",
            f"--rdzv-id={run_id}",
            *flags,
            sys.executable,
            "-c",
            "raise SystemExit(3)",
        ]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and done.returncode != 3, done.stderr[-2000:]
        assert message in done.stderr, done.stderr[-3000:]


def test_with_segments_a_lost_nodes_ranks_go_to_a_spare_of_its_own_segment(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """``--segment-size 2``: nodes A, B (label x) and C, D (label y) train as two whole segments; the spares E (y)
    and F (x) wait. SIGKILL B: F, of B's segment, takes B's rank although E's rank is lower, and no other rank
    moves (with the default assignment, every rank above B's would shift down and E would take the last one)."""
    labels = {"A": "x", "B": "x", "C": "y", "D": "y", "E": "y", "F": "x"}
    by_tag = {
        tag: start(
            nodes,
            tmp_path,
            etcd,
            run_id,
            tag,
            LONG,
            nnodes="4:4",
            nproc=1,
            extra_args=("--spare-nodes=2", "--segment-size=2", f"--node-segment={label}"),
            env={"SLURM_PROCID": str(order)},
            # The first round must hold all six (its ranks follow SLURM_PROCID only among the nodes in it): on a
            # loaded host two of them may start seconds after the first four, past a short last call.
            conf="last_call_timeout=20,lease_ttl=1,join_timeout=60",
        )
        for order, (tag, label) in enumerate(labels.items())
    }
    started = _by_node(wait_for(tmp_path, "start-*.json", 6, 120))
    assert {tag: workers[0]["rank"] for tag, workers in started.items()} == {t: r for r, t in enumerate(labels)}
    wait_for(tmp_path, "step-*.json", 4, 90)  # every active worker trains inside the Wrapper
    by_tag["B"].kill()
    assert [by_tag[tag].wait(150) for tag in "ACDEF"] == [0] * 5, logs(nodes)
    results = {record["node"]: record["result"] for record in read(tmp_path, "done-*.json").values()}
    assert {tag: results[tag]["rank"] for tag in "ACDF"} == {"A": 0, "C": 2, "D": 3, "F": 1}, results
    assert {results[tag]["world_size"] for tag in "ACDF"} == {4}
    assert results["E"] is None, results  # still in reserve
    assert escalations(etcd, run_id) == []


def test_agents_beyond_max_nodes_and_spares_wait_as_spares_and_end_nothing(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """ft_launcher's issue #348: more agents alive than a round admits ended the job. Here a fourth agent, beyond
    max_nodes=2 plus 1 spare, waits outside the round; when an active node is killed, the spare takes its ranks
    in-process and the fourth joins the running round as the new spare; the job completes and every agent
    left, the fourth included, exits 0."""
    # Iteration 0 lasts until the kill; iteration 1 about 20 s, time for the fourth node to take the free place.
    scenario = {"steps": 100, "iteration_steps": {"0": 3000, "1": 400}, "step_seconds": 0.05}
    by_tag, started = _three_nodes(nodes, tmp_path, etcd, run_id, scenario)
    wait_for(tmp_path, "step-*.json", 1, 60)
    extra = start(nodes, tmp_path, etcd, run_id, "D", scenario, extra_args=SPARE)
    deadline = time.monotonic() + 60
    while len(status_of(etcd, run_id)["joined_next_round"]) < 1:  # D, the only node outside the round
        assert time.monotonic() < deadline and extra.process.poll() is None, logs(nodes)
        time.sleep(0.2)
    assert not list((tmp_path / "out").glob("start-D-*.json"))  # no worker started: it waits outside
    spare, victim = _holding(started, {4, 5}), _holding(started, {2, 3})
    survivor = _holding(started, {0, 1})
    by_tag[victim].kill()
    assert [by_tag[survivor].wait(150), by_tag[spare].wait(60), extra.wait(90)] == [0, 0, 0], logs(nodes)
    # Where the fourth node took the free place before the job ended (it does on an idle machine), its workers
    # were joiners of the running world, its new spare; on a loaded one the job may end first.
    late_workers = [w for w in read(tmp_path, "start-D-*.json").values()]
    assert sorted(w["rank"] for w in late_workers) in ([], [6, 7]), late_workers
    assert late_workers or "joined running round" not in extra.log(), logs(nodes)
    done = read(tmp_path, "done-*.json")
    assert sorted(r["initial_rank"] for r in done.values() if r["result"] is not None) == [0, 1, 4, 5]
    assert escalations(etcd, run_id) == []
