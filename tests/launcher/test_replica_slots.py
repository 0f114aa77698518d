"""Replica group ids for ``ftrun --replica-groups`` nodes, taken and held in a real etcd."""

from __future__ import annotations

import time
import uuid

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.endpoints import parse_endpoints
from elastic_ft.keys import ReplicaKeys
from elastic_ft.launcher.replica_slots import ReplicaSlot, SlotError
from elastic_ft.runtime.net import free_port


@pytest.fixture
def keys() -> ReplicaKeys:
    """A run of its own per test (the etcd server is shared)."""
    return ReplicaKeys(f"/elastic_ft/slots-{uuid.uuid4().hex[:8]}/")


def test_nodes_take_the_lowest_free_ids_and_a_released_one_goes_to_the_next(
    etcd_client: EtcdClient, keys: ReplicaKeys
) -> None:
    first, second = (ReplicaSlot(etcd_client, keys, f"node{i}", 2, 5) for i in range(2))
    assert (first.claim(10), second.claim(10)) == (0, 1)
    third = ReplicaSlot(etcd_client, keys, "node2", 2, 5)
    started = time.monotonic()
    with pytest.raises(SlotError, match=r"all 2 replica group ids are held \(0: node0, 1: node1\)"):
        third.claim(1.0)
    assert time.monotonic() - started < 5
    first.release()
    assert third.claim(10) == 0
    second.release()
    third.release()
    assert etcd_client.get_prefix(keys.slots)[0] == []


def test_a_claim_retried_after_it_was_applied_keeps_its_id(etcd_client: EtcdClient, keys: ReplicaKeys) -> None:
    slot = ReplicaSlot(etcd_client, keys, "node0", 3, 5)
    assert slot.claim(10) == 0
    again = ReplicaSlot(etcd_client, keys, "node0", 3, 5)  # the same owner asking again, as after a lost answer
    assert again.claim(10) == 0
    slot.release()


def test_keys_that_name_no_slot_are_ignored(etcd_client: EtcdClient, keys: ReplicaKeys) -> None:
    for name in ("x", "-1", "7", "01a", "00", "\u0660"):  # "00" and an Arabic-Indic zero are not slot 0
        etcd_client.put(keys.slots + name, b"noise")
    slot = ReplicaSlot(etcd_client, keys, "node0", 2, 5)
    assert slot.claim(10) == 0
    slot.release()


def test_a_lease_etcd_lost_is_replaced_and_the_id_held_again(etcd_client: EtcdClient, keys: ReplicaKeys) -> None:
    slot = ReplicaSlot(etcd_client, keys, "node0", 2, 2)
    assert slot.claim(10) == 0
    slot.keep()
    (held,), _ = etcd_client.get_prefix(keys.slots)
    etcd_client.revoke_lease(held.lease)  # what an etcd frozen past the TTL does to every lease
    deadline = time.monotonic() + 10
    while True:
        found, _ = etcd_client.get_prefix(keys.slots)
        if found and found[0].lease != held.lease:
            break
        assert time.monotonic() < deadline, found
        time.sleep(0.1)
    assert (found[0].key, found[0].value) == (keys.slot(0), b"node0")
    slot.release()
    assert etcd_client.get_prefix(keys.slots)[0] == []


def test_an_unreachable_etcd_fails_the_claim_within_its_bound_saying_so(keys: ReplicaKeys) -> None:
    client = EtcdClient(parse_endpoints(f"127.0.0.1:{free_port()}"), connect_timeout=0.5, request_timeout=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(SlotError, match="no replica group id within 2 s: etcd was unreachable"):
            ReplicaSlot(client, keys, "node0", 2, 5).claim(2.0)
        assert time.monotonic() - started < 6
    finally:
        client.close()


def test_a_job_has_at_least_one_group(etcd_client: EtcdClient, keys: ReplicaKeys) -> None:
    with pytest.raises(ValueError, match="at least one replica group, got 0"):
        ReplicaSlot(etcd_client, keys, "node0", 0, 5)
