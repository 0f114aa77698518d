"""End to end: real ``torchrun --rdzv-backend=etcdft`` nodes on loopback, gloo on CPU."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import time
from pathlib import Path

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.testing.local_cluster import TorchrunNode

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train.py"
CONF = "last_call_timeout=1,lease_ttl=2,join_timeout=60"


def test_entry_point_is_registered_for_torchrun() -> None:
    points = importlib.metadata.entry_points(group="torchrun.handlers")
    (point,) = [p for p in points if p.name == "etcdft"]
    creator = point.load()()
    assert callable(creator)


def test_torch_registry_creates_etcdft_handler(etcd: EtcdServer, run_id: str) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import handler_registry

    from elastic_ft.rendezvous.registration import create_etcdft_handler

    handler_registry.register("etcdft", create_etcdft_handler)
    params = RendezvousParameters("etcdft", etcd.endpoint, run_id, 1, 2, timeout="900", last_call_timeout="2")
    handler = handler_registry.create_handler(params)
    assert handler.get_backend() == "etcdft"
    handler.shutdown()


def start(
    nodes: list[TorchrunNode],
    tmp_path: Path,
    etcd: EtcdServer,
    run_id: str,
    tag: str,
    *,
    steps: int,
    nnodes: str = "1:2",
    nproc: int = 1,
    step_time: float = 0.05,
    until_world_size: int = 0,
) -> TorchrunNode:
    script = [str(TRAIN), "--workdir", str(tmp_path / "work"), "--steps", str(steps), "--step-time", str(step_time)]
    node = TorchrunNode(
        tag,
        endpoint=etcd.endpoint,
        run_id=run_id,
        script=[*script, "--until-world-size", str(until_world_size)],
        nnodes=nnodes,
        nproc_per_node=nproc,
        rdzv_conf=CONF,
        log_path=tmp_path / f"{tag}.log",
        extra_env={"LOGLEVEL": "INFO"},
    )
    nodes.append(node)
    return node


def results(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "work").glob("done-*.json"))]


def wait_for_round_of(etcd: EtcdServer, run_id: str, size: int, timeout: float) -> None:
    """Block until some round of the run has closed with ``size`` members."""
    client = EtcdClient(etcd.endpoints)
    deadline = time.monotonic() + timeout
    try:
        while True:
            kvs, _ = client.get_prefix(f"/elastic_ft/{run_id}/rdzv/round/")
            sizes = [len(json.loads(kv.value)["members"]) for kv in kvs if kv.key.endswith("/result")]
            if size in sizes:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"no round of {size} nodes within {timeout} s (rounds: {sizes})")
            time.sleep(0.1)
    finally:
        client.close()


def wait_for(path_glob: str, root: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(list(root.glob(path_glob))) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} x {path_glob} not seen within {timeout} s")
        time.sleep(0.1)


@pytest.mark.slow
def test_two_nodes_train_together(etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]) -> None:
    a = start(nodes, tmp_path, etcd, run_id, "A", steps=20, nnodes="2", nproc=2)
    b = start(nodes, tmp_path, etcd, run_id, "B", steps=20, nnodes="2", nproc=2)
    assert a.wait(120) == 0, a.log()
    assert b.wait(120) == 0, b.log()
    done = results(tmp_path)
    assert sorted(r["rank"] for r in done) == [0, 1, 2, 3]
    assert {r["world_size"] for r in done} == {4}
    assert {r["node"] for r in done} == {"A", "B"}
    # Both agents called shutdown(): leases revoked at once, departures marked clean.
    client = EtcdClient(etcd.endpoints)
    rdzv = f"/elastic_ft/{run_id}/rdzv/"
    assert client.get_prefix(rdzv + "alive/")[0] == []
    assert len(client.get_prefix(rdzv + "round/0/left/")[0]) == 2
    client.close()


@pytest.mark.slow
def test_killed_node_survivors_rerendezvous_and_finish(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    trio = [start(nodes, tmp_path, etcd, run_id, tag, steps=80, step_time=0.1, nnodes="1:3") for tag in "ABC"]
    wait_for_round_of(etcd, run_id, 3, 90)  # the three nodes are in one round (a slow starter may join late)
    wait_for("checkpoint.pt", tmp_path / "work", 1, 90)
    killed = trio[1].kill()
    assert len(killed) >= 2  # the agent and its worker
    for survivor in (trio[0], trio[2]):
        assert survivor.wait(120) == 0, survivor.log()
    done = results(tmp_path)
    assert sorted((r["node"], r["world_size"]) for r in done) == [("A", 2), ("C", 2)]
    # Every survivor's workers were started again and resumed from the checkpoint.
    # (TORCHELASTIC_RESTART_COUNT may stay 0: when the agent learns of the death
    # through num_nodes_waiting() before its workers fail, torch counts a
    # membership change, not a retry.)
    assert all(r["resumed_from"] > 0 for r in done), done


@pytest.mark.slow
def test_late_node_joins_next_round(etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]) -> None:
    # A trains on past its 80 steps until B is in: however slowly B starts, it finds the job running.
    a = start(nodes, tmp_path, etcd, run_id, "A", steps=80, step_time=0.1, until_world_size=2)
    work = tmp_path / "work"
    wait_for("checkpoint.pt", work, 1, 90)  # A trains alone (min 1)
    b = start(nodes, tmp_path, etcd, run_id, "B", steps=80, step_time=0.1)
    assert a.wait(150) == 0, a.log()
    assert b.wait(150) == 0, b.log()
    done = results(tmp_path)
    assert sorted((r["node"], r["world_size"]) for r in done) == [("A", 2), ("B", 2)]
    # A's agent saw the waiting node through num_nodes_waiting() and restarted its workers.
    assert "Detected 1 new nodes" in a.log(), a.log()[-3000:]


@pytest.mark.slow
def test_sigterm_to_torchrun_lets_the_lease_expire(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    a = start(nodes, tmp_path, etcd, run_id, "A", steps=200, step_time=0.1, nnodes="1")
    wait_for("checkpoint.pt", tmp_path / "work", 1, 90)
    client = EtcdClient(etcd.endpoints)
    alive = f"/elastic_ft/{run_id}/rdzv/alive/"
    assert len(client.get_prefix(alive)[0]) == 1
    os.kill(a.pid, signal.SIGTERM)
    assert a.wait(60) != 0
    # torch does not call shutdown() on a signal (a restarted agent may come
    # back); the node leaves when its lease (lease_ttl=2) runs out.
    deadline = time.monotonic() + 6
    while client.get_prefix(alive)[0]:
        assert time.monotonic() < deadline, "the dead node's lease never expired"
        time.sleep(0.1)
    client.close()


@pytest.mark.slow
def test_spare_node_waits_then_replaces_a_killed_node(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    a = start(nodes, tmp_path, etcd, run_id, "A", steps=80, step_time=0.1, nnodes="1:2")
    b = start(nodes, tmp_path, etcd, run_id, "B", steps=80, step_time=0.1, nnodes="1:2")
    wait_for_round_of(etcd, run_id, 2, 90)  # A and B train; the round is full
    wait_for("checkpoint.pt", tmp_path / "work", 1, 90)
    restarts_before = a.log().count("Detected 1 new nodes")
    spare = start(nodes, tmp_path, etcd, run_id, "C", steps=80, step_time=0.1, nnodes="1:2")
    time.sleep(3)
    assert spare.process.poll() is None, spare.log()  # waiting, not crashed
    assert a.log().count("Detected 1 new nodes") == restarts_before  # a spare behind a full round restarts nothing
    b.kill()
    assert a.wait(150) == 0, a.log()
    assert spare.wait(150) == 0, spare.log()
    done = results(tmp_path)
    assert sorted((r["node"], r["world_size"]) for r in done) == [("A", 2), ("C", 2)]


@pytest.mark.slow
def test_waiting_node_of_a_plain_torchrun_job_exits_when_the_job_ends(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    # torch's agent ends with shutdown(), never set_closed(): once every member left, the job is
    # over, and a node waiting behind the full round (a spare, without a deadline) leaves at once,
    # through torch's RendezvousGracefulExitError, without running a worker; so does a node that
    # arrives after the end. (torch 2.13's launch_agent then fails on agent.run()'s None result,
    # so torchrun exits 1 there; ftrun's agent turns it into exit 0, see test_agent.py.)
    a = start(nodes, tmp_path, etcd, run_id, "A", steps=30, step_time=0.1, nnodes="1:2")
    b = start(nodes, tmp_path, etcd, run_id, "B", steps=30, step_time=0.1, nnodes="1:2")
    wait_for_round_of(etcd, run_id, 2, 90)
    waiting = start(nodes, tmp_path, etcd, run_id, "C", steps=30, step_time=0.1, nnodes="1:2")
    assert a.wait(120) == 0, a.log()
    assert b.wait(120) == 0, b.log()
    ended = time.monotonic()
    for node in (waiting, start(nodes, tmp_path, etcd, run_id, "D", steps=30, step_time=0.1, nnodes="1:2")):
        code = node.wait(30)
        assert time.monotonic() - ended < 25, node.log()  # at once, not after join_timeout
        assert "Rendezvous gracefully exited: the rendezvous" in node.log(), node.log()
        assert "was closed while node" in node.log(), node.log()
        assert code == 0 or "'NoneType' object has no attribute 'is_failed'" in node.log(), node.log()
    assert {r["node"] for r in results(tmp_path)} == {"A", "B"}  # neither C nor D ran a worker
