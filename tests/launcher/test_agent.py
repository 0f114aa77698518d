"""ftrun's agent with real processes: simulated nodes of gloo workers on one real etcd.

Each node is a real ``ftrun`` process; the workers run ``tests/launcher/worker.py``
under ``elastic_ft.Wrapper`` with its default store (the round's etcd store).
Faults are real: an exception, SIGKILL of a worker, SIGKILL of a whole node
(agent, workers and their monitor processes), every worker of a node exiting.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.event_log import EventLog
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.inprocess.hangs.monitor import MONITOR_LOST_EXIT_CODE, MONITOR_PROCESS_NAME
from elastic_ft.keys import RunKeys
from elastic_ft.observability.events import JobEvent
from elastic_ft.testing.local_cluster import TorchrunNode, descendants, ftrun_command, stranded_ranks

WORKER = Path(__file__).resolve().parent / "worker.py"
CONF = "last_call_timeout=0.5,lease_ttl=1,join_timeout=60"

pytestmark = pytest.mark.slow


def start(
    nodes: list[TorchrunNode],
    tmp_path: Path,
    etcd: EtcdServer,
    run_id: str,
    tag: str,
    scenario: dict[str, Any],
    *,
    nnodes: str = "2:2",
    nproc: int = 2,
    max_restarts: int = 2,
    extra_args: tuple[str, ...] = (),
    job_config: Path | None = None,
    conf: str = CONF,
    env: dict[str, str] | None = None,
) -> TorchrunNode:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    node = TorchrunNode(
        tag,
        endpoint=etcd.endpoint,
        run_id=run_id,
        script=[str(WORKER)],
        nnodes=nnodes,
        nproc_per_node=nproc,
        rdzv_conf=conf,
        max_restarts=max_restarts,
        log_path=tmp_path / f"{tag}.log",
        extra_env={
            "EFT_SCENARIO": json.dumps(scenario),
            "EFT_OUT": str(out),
            "OMP_NUM_THREADS": "1",
            "LOGLEVEL": "INFO",
            **(env or {}),
        },
        launcher=ftrun_command(),
        extra_args=(*extra_args, *([f"--job-config={job_config}"] if job_config else [])),
    )
    nodes.append(node)
    return node


def read(tmp_path: Path, pattern: str) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob(pattern))}


def wait_for(tmp_path: Path, pattern: str, count: int, timeout: float) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while len(found := read(tmp_path, pattern)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} x {pattern} not seen within {timeout} s: {sorted(found)}")
        time.sleep(0.1)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def logs(nodes: list[TorchrunNode]) -> str:
    return "\n".join(f"==== {n.tag}\n{n.log()[-6000:]}" for n in nodes)


def escalations(etcd: EtcdServer, run_id: str) -> list[dict[str, Any]]:
    client = EtcdClient(etcd.endpoints)
    try:
        kvs, _ = client.get_prefix(f"/elastic_ft/{run_id}/ftrun/escalations/")
        return [json.loads(kv.value) for kv in kvs]
    finally:
        client.close()


def events_of(etcd: EtcdServer, run_id: str) -> list[JobEvent]:
    """The run's event log, in log order."""
    client = EtcdClient(etcd.endpoints)
    try:
        return EventLog(client, RunKeys("/elastic_ft", run_id)).read().events
    finally:
        client.close()


def status_of(etcd: EtcdServer, run_id: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "elastic_ft.launcher.cli", "status", "--json"]
    done = subprocess.run(
        [*command, f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout)


def reserve_ready(
    etcd: EtcdServer, run_id: str, nodes: list[TorchrunNode], ranks: set[int], timeout: float = 90
) -> None:
    """Until ``ranks`` (initial ranks) wait to take a lost rank's place: on a loaded machine the spare's workers
    may still be starting when the active ones train, and a fault before they are ready shrinks the world
    instead. A spare that was a member of the first round waits in reserve; one that joined the running round
    late (it reached the rendezvous after the last call) waits as a joiner, admitted by the next restart."""
    deadline = time.monotonic() + timeout
    while True:
        reserve = {w["rank"] for w in status_of(etcd, run_id)["workers"] if w.get("mode") == "reserve"}
        text = "\n".join(node.log() for node in nodes)
        joining = {r for r in ranks if f"initial rank {r} waits for a restart to join the running world" in text}
        if ranks <= reserve | joining:
            return
        assert time.monotonic() < deadline, logs(nodes)
        time.sleep(0.5)


def finish(nodes: list[TorchrunNode], timeout: float = 120) -> list[int]:
    """Exit codes of `nodes`; a node still running after `timeout` fails with every log."""
    try:
        return [node.wait(timeout) for node in nodes]
    except subprocess.TimeoutExpired as still_running:  # its message holds the node's stacks
        every_log = sorted(nodes[0].log_path.parent.glob("*.log")) if nodes[0].log_path else []
        text = "\n".join(f"==== {path.name}\n{path.read_text(errors='replace')[-6000:]}" for path in every_log)
        pytest.fail(f"a node still runs after {timeout} s\n{text}\n{still_running}")


@pytest.mark.parametrize(
    ("kind", "victim", "relay"),
    [("sigkill", 3, False), ("sigkill", 0, False), ("raise", 3, False), ("sigkill", 0, True)],
)
def test_worker_fault_keeps_the_healthy_workers(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode], kind: str, victim: int, relay: bool
) -> None:
    """2 nodes x 2 workers; one worker fails at step 5: the other processes keep their PIDs.

    Killing initial rank 0 shows that no rank hosts the coordination: the
    Wrapper's store and the process groups' bootstrap live in etcd. With
    ``--node-relay``, the same through each node's relay.
    """
    scenario = {"steps": 20, "faults": [{"rank": victim, "kind": kind, "step": 5}]}
    extra = ("--node-relay",) if relay else ()
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario, extra_args=extra) for tag in "AB")
    assert finish([a, b]) == [0, 0], logs(nodes)
    assert ("its 2 workers reach etcd through it" in a.log() + b.log()) == relay
    started = read(tmp_path, "start-*.json")
    assert sorted(started) == ["start-A-0-0", "start-A-1-0", "start-B-0-0", "start-B-1-0"]  # never restarted
    done = read(tmp_path, "done-*.json")
    if kind == "sigkill":
        # The three survivors finished in the same processes, without the victim; its node respawned
        # it as initial rank 4, which no fault admitted: it waited as a joiner and left with the job,
        # or, still starting when the job completed, its agent stopped it.
        respawned = done.pop("done-4-0", None)
        assert respawned is None or respawned["result"] is None
        assert sorted(done) == sorted(f"done-{rank}-0" for rank in range(4) if rank != victim)
        for record in done.values():
            assert record["result"]["world_size"] == 3 and record["result"]["value"] == 3.0
            assert record["result"]["iteration"] == 1
        both = a.log() + b.log()
        assert f"rank {victim} (pid " in both and "ended with signal SIGKILL inside elastic_ft.Wrapper" in both
        # The node of the dead worker succeeds, and says which failure was absorbed.
        assert f"failures absorbed by in-process restart: {{{victim}: 'pid " in both
    else:
        # Everyone restarted in-process; the exception did not end any process.
        assert sorted(done) == ["done-0-0", "done-1-0", "done-2-0", "done-3-0"]
        for record in done.values():
            assert record["result"]["world_size"] == 4 and record["result"]["iteration"] == 1
    assert {r["result"]["store"] for r in done.values()} == {"EtcdStore"}
    pids = {(r["node"], r["initial_rank"]): r["pid"] for r in done.values()}
    by_rank = {record["rank"]: record["pid"] for record in started.values()}
    assert all(by_rank[rank] == pid for (_, rank), pid in pids.items())
    assert escalations(etcd, run_id) == []
    assert "restarting the workers" not in a.log() + b.log()
    status = status_of(etcd, run_id)
    assert status["in_process_restarts"] == 1 and status["process_restarts"] == 0
    if kind == "sigkill":
        # The node record lists the respawned process in the victim's place.
        assert [w["rank"] for w in status["workers"]] == [0, 1, 2, 3, 4]
        joined = [] if respawned is None else [{"initial_rank": 4, "admitted": None}]
        assert status["respawns"] == 1 and status["joined"] == joined
        assert status["terminated_ranks"] == [victim]
        assert status["workers"][victim]["state"] == "absorbed (-9)"
        assert status["workers"][4]["state"] == ("retired (-15)" if respawned is None else "succeeded (0)")
    else:
        assert [w["rank"] for w in status["workers"]] == [0, 1, 2, 3]
        assert status["terminated_ranks"] == []
        assert {w["state"] for w in status["workers"]} == {"succeeded (0)"}


def test_a_rank_whose_monitor_process_is_killed_is_replaced(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """SIGKILL rank 1's monitor process: the rank says so and exits at once (it would train on without hang
    protection, and nobody would report its death); its node replaces it, the others restart in-process."""
    # Iteration 0 lasts until the fault, however slowly the loaded host started the workers.
    scenario = {"steps": 60, "iteration_steps": {"0": 3000}, "step_seconds": 0.05}
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario) for tag in "AB")
    started = wait_for(tmp_path, "start-*.json", 4, 90)
    wait_for(tmp_path, "step-*.json", 4, 90)  # every worker trains inside the Wrapper, its monitor running
    rank_pid = next(record["pid"] for record in started.values() if record["rank"] == 1)
    (monitor,) = [pid for pid in descendants(rank_pid) if _comm(pid) == MONITOR_PROCESS_NAME]
    os.kill(monitor, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(rank_pid):
        assert time.monotonic() < deadline, f"the rank outlived its monitor process\n{logs(nodes)}"
        time.sleep(0.05)
    assert finish([a, b]) == [0, 0], logs(nodes)
    both = a.log() + b.log()
    assert f"monitor process {monitor} ended (signal SIGKILL): this rank would run on without hang" in both
    assert f"rank 1 (pid {rank_pid}) ended with exit code {MONITOR_LOST_EXIT_CODE} inside elastic_ft.Wrapper" in both
    done = read(tmp_path, "done-*.json")
    survivors = {name: record for name, record in done.items() if record["initial_rank"] in (0, 2, 3)}
    assert len(survivors) == 3 and all(record["result"]["iteration"] >= 1 for record in survivors.values()), done
    assert "done-1-0" not in done
    status = status_of(etcd, run_id)
    assert status["terminated_ranks"] == [1] and status["respawns"] == 1, status
    assert escalations(etcd, run_id) == []
    (lost,) = [e for e in events_of(etcd, run_id) if e.name == "fault_detected" and e.data["kind"] == "monitor_lost"]
    assert lost.rank == 1 and str(monitor) in lost.data["message"]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_a_rank_failing_after_the_job_completed_restarts_nothing(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """Rank 2 exits with code 23 after its Wrapper completed the job: no node restarts its workers (that would
    train the completed job again); its node reports the failure (a non-zero exit), the other one succeeds."""
    scenario = {"steps": 20, "exit_after_wrapper": {"rank": 2, "code": 23}}
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario) for tag in "AB")
    codes = dict(zip("AB", finish([a, b]), strict=True))
    started = read(tmp_path, "start-*.json")
    assert sorted(started) == ["start-A-0-0", "start-A-1-0", "start-B-0-0", "start-B-1-0"]
    holder = next(name.split("-")[1] for name, record in started.items() if record["rank"] == 2)
    assert codes == {tag: 1 if tag == holder else 0 for tag in "AB"}, logs(nodes)
    done = read(tmp_path, "done-*.json")
    assert sorted(done) == ["done-0-0", "done-1-0", "done-2-0", "done-3-0"]
    assert {record["result"]["iteration"] for record in done.values()} == {0}
    both = a.log() + b.log()
    assert re.search(r"rank 2 \(pid \d+\) ended with exit code 23 after its elastic_ft.Wrapper completed the job", both)
    assert "the job completed, but rank(s) [2] failed after their elastic_ft.Wrapper completed the job" in both
    assert "restarting the workers" not in both and "escalating" not in both, logs(nodes)
    assert escalations(etcd, run_id) == []


def test_killed_node_is_absorbed_in_process(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """SIGKILL a whole node (agent, workers, monitors): the survivors go on in-process without it."""
    scenario = {"steps": 120, "step_seconds": 0.05}
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario) for tag in "AB")
    started = wait_for(tmp_path, "start-*.json", 4, 90)
    # Every worker trains inside the Wrapper (its step 1), however slowly the loaded host started it: a node
    # killed before its workers entered the Wrapper is restarted by its node's agent, not absorbed in-process.
    wait_for(tmp_path, "step-*.json", 4, 90)
    killed = b.kill()
    assert finish([a]) == [0], logs(nodes)
    done = read(tmp_path, "done-*.json")
    a_ranks = sorted(r["rank"] for name, r in started.items() if name.startswith("start-A"))
    assert sorted(r["initial_rank"] for r in done.values()) == a_ranks
    for record in done.values():
        assert record["result"] is not None, f"{done}\n{logs(nodes)}"
        assert record["result"]["world_size"] == 2 and record["result"]["iteration"] == 1, f"{done}\n{logs(nodes)}"
        assert record["restart"] == 0  # same processes
    assert not any(alive(pid) for pid in killed)
    assert "reported its rank(s)" in a.log()
    assert escalations(etcd, run_id) == []


def test_every_worker_killed_at_once_restarts_the_job_instead_of_stranding_the_respawned(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """SIGKILL all four workers of the job at once: no rank is left to run the restart that would admit the
    processes ftrun respawns. They see it and give up; the agents restart the job's processes, as torchrun
    does, and the job finishes."""
    scenario = {"steps": 120, "step_seconds": 0.05}
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario) for tag in "AB")
    started = wait_for(tmp_path, "start-*-0.json", 4, 90)
    wait_for(tmp_path, "step-*.json", 4, 90)
    for record in started.values():
        os.kill(record["pid"], signal.SIGKILL)
    assert finish([a, b], 180) == [0, 0], logs(nodes)
    done = read(tmp_path, "done-*.json")
    # Everyone finished in the restarted processes (TORCHELASTIC_RESTART_COUNT 1 on both nodes).
    assert sorted(done) == ["done-0-1", "done-1-1", "done-2-1", "done-3-1"], f"{done}\n{logs(nodes)}"
    recorded = escalations(etcd, run_id)
    assert len(recorded) == 1 and "the in-process restart layer gave up" in recorded[0]["reason"], recorded
    both = a.log() + b.log()
    gave_up = re.findall(r"RestartAbort: initial rank (\d+) cannot join: (.*); nothing can admit it", both)
    assert gave_up, both
    assert {int(rank) for rank, _ in gave_up} <= {4, 5, 6, 7}, gave_up
    assert all(
        why
        == "iteration 0 ended with every rank of its world of 4 terminated, and nobody was admitted into iteration 1"
        for _, why in gave_up
    ), gave_up


def test_a_respawned_worker_the_job_completed_without_is_stopped(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """A respawned process still blocked before the Wrapper when the others completed does not hold the job."""
    scenario = {"steps": 20, "faults": [{"rank": 3, "kind": "sigkill", "step": 5}], "respawn_blocks": True}
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario) for tag in "AB")
    assert finish([a, b], 150) == [0, 0], logs(nodes)
    # Held from the last rank's completion to the nodes' exit: the retirement (a SIGTERM, a short grace), not
    # the blocked process's 600 s. Timed from the completion, not from the start, which a loaded host slows.
    completed = max(path.stat().st_mtime for path in (tmp_path / "out").glob("done-*.json"))
    assert time.time() - completed < 30, f"the blocked respawned process held the job\n{logs(nodes)}"
    both = a.log() + b.log()
    assert re.search(
        r"the job completed before respawned rank 4 \(pid \d+\) entered elastic_ft\.Wrapper: "
        r"stopping it",
        both,
    ), both
    assert "failures absorbed by in-process restart: {3: 'pid " in both
    done = read(tmp_path, "done-*.json")
    assert sorted(done) == ["done-0-0", "done-1-0", "done-2-0"]
    status = status_of(etcd, run_id)
    assert status["workers"][4]["state"] == "retired (-15)"
    assert status["process_restarts"] == 0 and escalations(etcd, run_id) == []
    assert not alive(status["workers"][4]["pid"])


def test_node_lost_before_its_workers_entered_the_wrapper_is_followed(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """In-process restart cannot absorb ranks that never entered the Wrapper: the survivor re-rendezvouses."""
    scenario = {"steps": 20, "slow_start_group_rank": 1}
    # Both nodes must share round 0: a long last call (the round closes as soon as max_nodes=2 joined)
    # keeps a node started late on a loaded machine from joining as a later, growing node.
    conf = CONF.replace("last_call_timeout=0.5", "last_call_timeout=20")
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario, nnodes="1:2", conf=conf) for tag in "AB")
    started = wait_for(tmp_path, "start-*.json", 4, 90)
    slow_tag = next(name.split("-")[1] for name, record in started.items() if record["rank"] >= 2)  # group rank 1
    slow = a if slow_tag == "A" else b
    time.sleep(1)
    slow.kill()
    survivor = a if slow is b else b
    assert survivor.wait(120) == 0, logs(nodes)
    # Killed before its workers entered the Wrapper, or (on a loaded machine) before its agent published them.
    assert re.search(
        r"died before (all its workers entered elastic_ft\.Wrapper|publishing its ranks)", survivor.log()
    ), survivor.log()
    done = read(tmp_path, "done-*.json")
    assert len(done) == 2 and {r["result"]["world_size"] for r in done.values()} == {2}
    assert {r["node"] for r in done.values()} == {survivor.tag}


def test_every_worker_of_a_node_failing_escalates(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """Both workers of node group rank 1 exit, and respawning is off: that node escalates; the job
    restarts at the process level."""
    scenario = {"steps": 20, "node_exit": {"group_rank": 1, "restart": 0}}
    config = tmp_path / "job.yaml"
    config.write_text("respawn: {per_rank: 0}\n")
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario, job_config=config) for tag in "AB")
    assert finish([a, b]) == [0, 0], logs(nodes)
    done = read(tmp_path, "done-*.json")
    # Everyone finished in the restarted processes (TORCHELASTIC_RESTART_COUNT 1 on both nodes).
    assert sorted(done) == ["done-0-1", "done-1-1", "done-2-1", "done-3-1"]
    for record in done.values():
        assert record["result"]["world_size"] == 4
    recorded = escalations(etcd, run_id)
    assert len(recorded) == 1 and "every local worker exited" in recorded[0]["reason"]
    table = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_ft.launcher.cli",
            "status",
            f"--rdzv-endpoint={etcd.endpoint}",
            f"--rdzv-id={run_id}",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "process-level restarts: 1" in table and "every local worker exited with an error" in table
    assert "escalating to a process-level restart (2 of 2 left)" in a.log() + b.log()


def test_wrapper_giving_up_escalates(etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]) -> None:
    """RetryController allows one iteration; a fault makes every Wrapper give up: a process-level restart follows."""
    scenario = {"steps": 20, "retry": {"max_iterations": 1}, "faults": [{"rank": 2, "kind": "raise", "step": 3}]}
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario) for tag in "AB")
    assert finish([a, b]) == [0, 0], logs(nodes)
    done = read(tmp_path, "done-*.json")
    assert sorted(done) == ["done-0-1", "done-1-1", "done-2-1", "done-3-1"]
    recorded = escalations(etcd, run_id)
    assert len(recorded) == 1 and "the in-process restart layer gave up" in recorded[0]["reason"]


def test_failure_outside_the_wrapper_behaves_like_torchrun(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """Without the Wrapper nothing can absorb a fault: the node escalates, and with no restarts left fails."""
    scenario = {"steps": 20, "no_wrapper": True, "faults": [{"rank": 1, "kind": "exit", "step": 3}]}
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario, max_restarts=0) for tag in "AB")
    assert finish([a, b]) == [1, 1], logs(nodes)
    # The node of rank 1 fails on its exit; the other on its workers' broken collectives.
    assert a.log().count("is not the round's store), and no restarts are left") == 1, a.log()
    assert b.log().count("is not the round's store), and no restarts are left") == 1, b.log()
    assert "ChildFailedError" in a.log() and "ChildFailedError" in b.log()


def test_spare_node_waits_without_error_and_exits_with_the_job(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    # Nothing dies here, so no need for a 1 s lease (fast death detection): on a loaded 2-core
    # machine a starved agent could miss a whole 1 s TTL and be taken for dead (docs/launcher.md).
    scenario, conf = {"steps": 100, "step_seconds": 0.05}, CONF.replace("lease_ttl=1", "lease_ttl=3")
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario, conf=conf) for tag in "AB")
    wait_for(tmp_path, "start-*.json", 4, 90)
    spare = start(nodes, tmp_path, etcd, run_id, "C", scenario, conf=conf)
    time.sleep(3)
    assert spare.process.poll() is None, spare.log()  # waiting, not crashed
    assert finish([a, b]) == [0, 0], logs(nodes)
    assert spare.wait(30) == 0, spare.log()  # the job finished without it: a clean exit
    assert not read(tmp_path, "start-C-*.json")
    assert "restarting the workers" not in a.log() + b.log()
    assert len(read(tmp_path, "done-*.json")) == 4


def test_spare_replaces_a_killed_node(etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]) -> None:
    # The job trains until the spare's workers train in it (however slowly they start under load), then a few
    # steps more: it ends at that event, not at a step count.
    scenario = {"steps": 6000, "step_seconds": 0.05, "stop_file": "stop"}
    a, b = (start(nodes, tmp_path, etcd, run_id, tag, scenario) for tag in "AB")
    wait_for(tmp_path, "step-*.json", 4, 90)  # every worker trains inside the Wrapper
    spare = start(nodes, tmp_path, etcd, run_id, "C", scenario)
    time.sleep(2)
    b.kill()
    deadline = time.monotonic() + 150
    while sum(r.get("node") == "C" for r in read(tmp_path, "step-*.json").values()) < 2:
        assert time.monotonic() < deadline, f"the spare's workers did not train within 150 s\n{logs(nodes)}"
        time.sleep(0.2)
    time.sleep(1)
    (tmp_path / "out" / "stop").touch()
    assert finish([a, spare], 150) == [0, 0], logs(nodes)
    done = read(tmp_path, "done-*.json")
    # Gloo's gap (docs/inprocess.md, Known limitations): a survivor of B's SIGKILL may stay blocked in C code
    # and be terminated by its monitor process; at most one, and the job goes on without it.
    stranded = stranded_ranks(a.log())
    finished = sorted(r["node"] for r in done.values())
    assert len(stranded) <= 1, f"{stranded}\n{logs(nodes)}"
    assert finished.count("C") == 2 and finished.count("A") >= 2 - len(stranded), f"{done}\n{logs(nodes)}"
    assert {(r["result"] or {}).get("world_size") for r in done.values()} == {len(done)}, f"{done}\n{logs(nodes)}"
    # The waiting node takes the dead one's place in the running round: its workers join the running
    # world in-process, and A's workers are not restarted (no rule-4 restart into a new round).
    assert "joined running round 0" in spare.log(), spare.log()
    assert "restarting the workers" not in a.log(), a.log()
    assert len({r["pid"] for r in read(tmp_path, "start-A-*.json").values()}) == 2
    assert escalations(etcd, run_id) == []  # a membership change, not counted as a restart
