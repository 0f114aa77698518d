"""``ftrun --replica-groups``: one node per replica group, its id taken in etcd, its failures its own.

Real ``ftrun`` processes (one per node, on this host), real etcd, gloo. A SIGKILLed worker makes its node's
torch agent restart that node's workers; the other node's workers never stop, and the group heals from them.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.keys import RunKeys
from elastic_ft.replicas.manager import LEASE_TTL
from elastic_ft.testing.local_cluster import ftrun_command
from tests.replicas.job import run_replicated
from tests.replicas.test_replica_groups import assert_same_as_the_replay, fault_step

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HSDP_WORKER = Path(__file__).with_name("hsdp_worker.py")


def close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(
        math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-7)
        for p, q in zip(a, b, strict=True)
        for x, y in zip(p, q, strict=True)
    )


@pytest.mark.parametrize(
    ("kind", "longest_pause"),
    [
        # The sentinel revokes the killed rank's lease: the healthy group goes on alone at once.
        ("sigkill", 3.0),
        # The rank's process group dies, its sentinel with it: its records stay until their lease expires or its
        # respawned process replaces them, and the healthy group waits that long, not for gloo's wait for a peer
        # that gave up the group (about 50 s; docs/inprocess.md, "Replica groups").
        ("sigkill_group", LEASE_TTL + 5.0),
    ],
)
def test_each_node_is_a_replica_group_and_a_killed_worker_restarts_only_its_own(
    etcd: EtcdServer, tmp_path: Path, reap_pids: list[int], kind: str, longest_pause: float
) -> None:
    settings = {"steps": 300, "step_sleep": 0.05, "fault": {"replica": 1, "step": 40, "kind": kind}}
    job = run_replicated(etcd.endpoint, 2, tmp_path, settings, reap_pids, launcher="ftrun")
    why = job.describe()
    assert job.codes == [0, 0], why
    ids = sorted(int(m) for log in job.logs for m in re.findall(r"this node runs replica group (\d) of 2", log))
    assert ids == [0, 1], why  # each node took its own id
    (healthy,) = job.of(0)
    steps = [step for step, _, _ in healthy.commits]
    struck = fault_step(tmp_path)
    assert steps[0] <= struck < steps[-1] == 300, why  # one process from before the fault to the end
    pause = healthy.longest_pause()
    assert pause < longest_pause, f"longest pause {pause:.2f} s\n{why}"  # loose: the benchmark has numbers
    (back,) = job.of(1)  # the restarted worker; the killed one left no record
    assert back.commits[-1][0] == 300 and any(n == 2 for _, _, n in back.commits), why
    assert close(back.weights, healthy.weights), why
    assert_same_as_the_replay(job, tmp_path, 2, 300)
    client = EtcdClient(etcd.endpoints)
    try:
        slots, _ = client.get_prefix(RunKeys("/elastic_ft", job.run_id).replicas.slots)
    finally:
        client.close()
    assert slots == [], slots  # released as the nodes ended


def stop_once_healed(out: Path, stop: Path, timeout: float = 180.0) -> None:
    """Once both ranks of the restarted group (``hsdp_1``) healed past the fault, name a stop step 100 steps past the
    healthy group's latest quorum: the healthy group trains until then however long the restart took on a
    loaded host (its processes' start-up is seconds), and both groups end at the same step (100 steps, 5 s: the
    groups must not pass it before the file appears, or each would stop where it read it)."""

    def logs() -> str:
        return "".join(path.read_text(errors="replace") for path in out.glob("replica[0-9].log"))

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "record.fault.json").exists():
            healed = re.findall(r"replica hsdp_1 rank \d: healed to step (\d+)", logs())
            if sum(int(step) > fault_step(out) for step in healed) >= 2:
                break
        time.sleep(0.2)
    latest = max(map(int, re.findall(r"replica hsdp_0 rank \d: in quorum \d+ of .* at step (\d+)", logs())), default=0)
    (out / "stop.tmp").write_text(str(latest + 100))
    os.replace(out / "stop.tmp", stop)


def test_hsdp_2x2_a_lost_rank_restarts_its_group_which_heals_shard_by_shard(
    etcd: EtcdServer, tmp_path: Path, reap_pids: list[int]
) -> None:
    """Two groups of two ranks sharding with FSDP2; rank 1 of one group is SIGKILLed. Its node restarts both of
    its ranks, each heals its own shard (DTensors, checked against the shard it holds) from the same rank of the
    other group, and both groups end with the same shards."""
    stop = tmp_path / "stop"
    settings: dict[str, Any] = {
        "steps": 10**6,
        "step_sleep": 0.05,
        "fault": {"replica": 1, "rank": 1, "step": 30},
        "stop_file": str(stop),
    }
    ends = lambda: stop_once_healed(tmp_path, stop)
    job = run_replicated(
        etcd.endpoint, 2, tmp_path, settings, reap_pids, launcher="ftrun", nproc=2, script=HSDP_WORKER, meanwhile=ends
    )
    why = job.describe()
    assert job.codes == [0, 0], why
    finals: dict[tuple[int, int], dict[str, Any]] = {}
    for path in tmp_path.glob("record.[0-9]*.json"):
        document = json.loads(path.read_text())
        finals[(int(path.name.split(".")[1]), document["rank"])] = document
    assert sorted(finals) == [(0, 0), (0, 1), (1, 0), (1, 1)], why
    for rank in (0, 1):
        # The healthy group's processes never restarted.
        assert finals[(0, rank)]["commits"][0][0] <= fault_step(tmp_path), why
        assert finals[(1, rank)]["commits"][0][0] > 30, why  # the other group's did, and healed past the fault
        assert close(finals[(0, rank)]["weights"], finals[(1, rank)]["weights"]), why
    assert not close(finals[(0, 0)]["weights"][:1], finals[(0, 1)]["weights"][:1])  # two different shards
    assert "healed to step" in job.logs[0] + job.logs[1], why


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--spare-nodes=1"], "--spare-nodes do not apply"),
        (["--node-relay", "--record=/tmp/x"], "--node-relay, --record do not apply"),
        (["--rdzv-backend=c10d"], "needs --rdzv-backend=etcdft, not c10d"),
    ],
)
def test_flags_of_the_whole_job_restart_are_refused_by_name(flags: list[str], message: str) -> None:
    command = [*ftrun_command(), "--replica-groups", "--nnodes=2", "--rdzv-endpoint=127.0.0.1:1", *flags, "x.py"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_an_etcd_with_tls_or_credentials_is_refused_before_a_slot_is_taken(tmp_path: Path) -> None:
    """The workers' variables carry neither TLS files nor credentials: refused by name, nothing written."""
    from elastic_ft.launcher.replica_mode import transport_conflict
    from elastic_ft.rendezvous.config import make_settings

    password = tmp_path / "password"
    password.write_text("secret\n")
    plain = make_settings(run_id="job", endpoint="127.0.0.1:2379", min_nodes=1, max_nodes=2)
    assert transport_conflict(plain) is None
    with_credentials = make_settings(
        run_id="job", endpoint="127.0.0.1:2379", min_nodes=1, max_nodes=2, user="root", password_file=str(password)
    )
    message = transport_conflict(with_credentials)
    assert message is not None and "does not hand TLS files or etcd credentials" in message
