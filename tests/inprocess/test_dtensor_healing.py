"""Healing a ``state_dict()`` of DTensors under the default rank assignment: keyed by mesh and placements.

An HSDP 2 x 2 job (``dtensor_worker.py`` under ``ftrun``) whose Wrapper has no ``ShardedReplicas``: the plan
reads the layout from the DTensors themselves. A rank behind receives exactly its own shard from the other
replica; a world whose mesh changed shape heals nobody and every rank loads the checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.testing.local_cluster import TorchrunNode, ftrun_command

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("dtensor_worker.py")


def run_job(nodes: list[TorchrunNode], tmp_path: Path, etcd: EtcdServer, run_id: str, **settings: Any) -> str:
    work = tmp_path / "work"
    work.mkdir()
    node = TorchrunNode(
        "A",
        endpoint=etcd.endpoint,
        run_id=run_id,
        script=[str(WORKER)],
        nnodes="1:1",
        nproc_per_node=4,
        rdzv_conf="last_call_timeout=0.5,lease_ttl=1,join_timeout=60",
        max_restarts=0,
        log_path=tmp_path / "ftrun.log",
        extra_env={"OMP_NUM_THREADS": "1", "EFT_DTENSOR": json.dumps({"workdir": str(work), **settings})},
        launcher=ftrun_command(),
    )
    nodes.append(node)
    assert node.wait(300) == 0, node.log()[-8000:]
    return node.log()


def events(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    found = [json.loads(line) for path in (tmp_path / "work").glob("events-*.jsonl") for line in path.open()]
    return sorted((e for e in found if e["event"] == kind), key=lambda e: e["t"])


def story(tmp_path: Path, log: str) -> str:
    """What a failure message needs whole: every process's start and end, one line each, and the log's tail."""
    lines = [
        f"{e['event']} initial rank {e['rank']}: iteration {e.get('iteration', '-')} step {e['step']} "
        f"mesh {e['mesh']} {e.get('source', '')}"
        for e in events(tmp_path, "start") + events(tmp_path, "done")
    ]
    return "\n".join(lines) + "\n--- log tail ---\n" + log[-6000:]


def assert_replicas_agree(done: list[dict[str, Any]], why: str) -> None:
    """The ranks at the same coordinate of the shard dimension hold the same shard, bit for bit."""
    by_shard: dict[int, list[list[list[float]]]] = {}
    for event in done:
        by_shard.setdefault(event["coordinate"][1], []).append(event["shard"])
    assert sorted(by_shard) == [0, 1] and all(len(s) == 2 for s in by_shard.values()), why
    assert all(shards[0] == shards[1] for shards in by_shard.values()), why
    assert by_shard[0][0] != by_shard[1][0], why  # two different shards: a test that could fail


def test_a_rank_behind_receives_its_own_shard_from_the_other_replica(
    nodes: list[TorchrunNode], tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    """Rank 3 fails after its backward, before its optimizer step: it restarts one step behind, and the plan,
    keyed by the DTensors' mesh (2, 2) and placements, sends it shard 1 from rank 1, never rank 0's shard of the
    same shape."""
    log = run_job(nodes, tmp_path, etcd, run_id, steps=16, fault="lag", fault_step=7)
    why = story(tmp_path, log)
    transfers = re.findall(r"(\d+)->(\d+) \(shard (\d+)\)", log)
    assert set(transfers) == {("1", "3", "1")}, why
    assert "of mesh [2, 2]" in log, why
    restarted = [e for e in events(tmp_path, "start") if e["iteration"] == 1]
    assert sorted(e["rank"] for e in restarted) == [0, 1, 2, 3], why
    assert {e["source"] for e in restarted} == {"kept"} and {e["step"] for e in restarted} == {8}, why
    done = events(tmp_path, "done")
    assert len(done) == 4 and {e["step"] for e in done} == {16}, why
    assert_replicas_agree(done, why)


def test_a_mesh_that_changed_shape_heals_nobody_and_every_rank_loads_the_checkpoint(
    nodes: list[TorchrunNode], tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    """Rank 3's process is killed: the three survivors cannot use their 2 x 2 shards on 3 ranks, nor can the
    1 x 3 shards serve the respawned world of 4; each change of shape goes back to the checkpoint (DCP reshards
    it), and no shard of one layout is ever sent to a rank of another.

    The checks follow the iterations, not particular processes: which processes make up the iteration of 3
    ranks (the survivors, or two of them and the respawned one when a restart outlasts its start-up) is not
    what this test is about."""
    log = run_job(nodes, tmp_path, etcd, run_id, steps=40, fault="sigkill", fault_step=7)
    why = story(tmp_path, log)
    assert not re.findall(r"\d+->\d+ \(shard", log), why
    assert "this iteration has 3 active ranks" in log, why
    starts = events(tmp_path, "start")
    assert [e["mesh"] for e in starts if e["iteration"] == 0] == [[2, 2]] * 4, why
    assert [e["mesh"] for e in starts if e["iteration"] == 1] == [[1, 3]] * 3, why
    assert {e["source"] for e in starts if e["iteration"] >= 1} == {"checkpoint"}, why
    done = events(tmp_path, "done")
    assert done and {e["step"] for e in done} == {40}, why
    if done[0]["mesh"] == [2, 2]:  # the respawned process came back before the end
        assert len(done) == 4 and "this iteration has 4 active ranks" in log, why
        assert_replicas_agree(done, why)
    else:
        assert [e["mesh"] for e in done] == [[1, 3]] * 3, why
