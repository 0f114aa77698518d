"""A 3-member etcd cluster: the rendezvous and store survive losing members."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings
from elastic_ft.testing.etcd_cluster import EtcdCluster


def make(cluster: EtcdServer, run_id: str, **conf: object) -> EtcdftRendezvousHandler:
    return EtcdftRendezvousHandler(
        make_settings(
            run_id=run_id,
            endpoint=cluster.endpoint,
            min_nodes=2,
            max_nodes=2,
            local_addr="127.0.0.1",
            lease_ttl=2,
            last_call_timeout=0.3,
            join_timeout=30,
            connect_timeout=5,
            request_timeout=2,
            **conf,
        )
    )


def test_rendezvous_and_store_survive_a_member_loss(etcd_cluster: EtcdServer, run_id: str) -> None:
    a, b = make(etcd_cluster, run_id), make(etcd_cluster, run_id)
    with ThreadPoolExecutor(2) as pool:
        first = [f.result(30) for f in [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]]
    first[0].store.set("before", "1")
    # Lose one member of three: the cluster keeps quorum, clients fail over.
    etcd_cluster.kill_member(0)
    assert first[1].store.get("before") == b"1"
    first[1].store.set("after", "2")
    assert first[0].store.get("after") == b"2"
    with ThreadPoolExecutor(2) as pool:
        second = [f.result(30) for f in [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]]
    assert sorted(i.rank for i in second) == [0, 1]
    assert [i.rank for i in second] == [i.rank for i in first]
    a.shutdown()
    b.shutdown()


def test_quorum_loss_gives_a_bounded_error(etcd_cluster: EtcdServer, run_id: str) -> None:
    client = EtcdClient(etcd_cluster.endpoints, request_timeout=1, connect_timeout=2)
    client.put("/probe", b"1")
    for index in range(3):
        etcd_cluster.kill_member(index)
    with pytest.raises(RendezvousConnectionError, match="127.0.0.1"):
        make(etcd_cluster, run_id)
    client.close()


def test_member_restart_keeps_the_data(etcd_cluster: EtcdServer) -> None:
    client = EtcdClient(etcd_cluster.endpoints, request_timeout=2, connect_timeout=10)
    client.put("/kept", b"yes")
    etcd_cluster.kill_member(1)
    etcd_cluster.restart_member(1)
    only_restarted = EtcdClient([etcd_cluster.endpoints[1]], request_timeout=2, connect_timeout=10)
    kv, _ = only_restarted.get("/kept")
    assert kv is not None and kv.value == b"yes"
    client.close()
    only_restarted.close()


def test_members_that_exit_unasked_are_found_and_restarted_together(etcd_cluster: EtcdCluster) -> None:
    assert etcd_cluster.exited_members() == []
    for index in (0, 2):
        process = etcd_cluster._members[index].process
        assert process is not None
        process.kill()  # not through kill_member: as a crash would
        process.wait()
    assert etcd_cluster.exited_members() == [0, 2]
    assert etcd_cluster.member_log(2).is_file()
    etcd_cluster.restart_members([0, 2])  # one at a time, the first would wait for quorum with the second
    assert etcd_cluster.exited_members() == []
    client = EtcdClient(etcd_cluster.endpoints, request_timeout=2, connect_timeout=10)
    client.put("/after", b"1")
    client.close()


def test_the_leader_is_found_through_an_election(etcd_cluster: EtcdCluster) -> None:
    """Asked while the members elect (the old leader just died), ``leader`` waits for the new one, and gives up
    with a clear error when no member is left to lead."""
    old = etcd_cluster.leader()
    etcd_cluster.kill_member(old)
    new = etcd_cluster.leader()
    assert new != old
    client = EtcdClient([etcd_cluster.endpoints[new]], request_timeout=2, connect_timeout=10)
    member, leader = client.member_status()
    client.close()
    assert member == leader
    etcd_cluster.kill_member(new)
    etcd_cluster.kill_member(next(index for index in range(3) if index not in (old, new)))
    with pytest.raises(RuntimeError, match="no etcd member reported itself the leader within 1.0 s"):
        etcd_cluster.leader(within=1.0)
    etcd_cluster.restart_members([0, 1, 2])
