"""The store a process group is bootstrapped from (``elastic_ft.etcd.group_store``), and waits that watch from now on."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.group_store import GroupStore, group_store
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.etcd.store import EtcdStore


def test_a_gloo_group_forms_on_it_with_three_requests_per_rank(etcd: EtcdServer) -> None:
    size = 4
    prefix = f"/test/{uuid.uuid4().hex}/store/"
    clients = [EtcdClient(etcd.endpoints) for _ in range(size)]
    bases = [EtcdStore(client, prefix, timedelta(seconds=30)) for client in clients]
    for base in bases:
        base.set("warm", "1")  # each client's connection and write lease, as a running Wrapper has them
    before = [client.requests for client in clients]
    sums: list[float] = [0.0] * size
    stores = [group_store(base, "pg/0/") for base in bases]

    def rank_main(rank: int) -> None:
        group = dist.ProcessGroupGloo(stores[rank], rank, size, timedelta(seconds=30))
        tensor = torch.tensor([float(rank)])
        group.allreduce([tensor]).wait()
        sums[rank] = float(tensor)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert sums == [6.0] * size
        # A write, a watch and a list each: not a wait and a get per peer.
        assert [client.requests - b for client, b in zip(clients, before, strict=True)] == [3] * size
    finally:
        for store in stores:
            store.close()
        for client in clients:
            client.close()


def test_a_key_written_twice_or_changed_is_read_from_etcd(etcd: EtcdServer) -> None:
    client, writer = EtcdClient(etcd.endpoints), EtcdClient(etcd.endpoints)
    prefix = f"/test/{uuid.uuid4().hex}/pg/"
    store, other = GroupStore(client, prefix), GroupStore(writer, prefix)
    try:
        other.set("address", "first")
        assert store.get("address") == b"first"
        requests = client.requests
        assert store.get("address") == b"first"  # from the copy: no request
        assert client.requests == requests
        other.set("address", "second")  # written twice: etcd answers from now on
        deadline = time.monotonic() + 5
        while store.get("address") != b"second":
            assert time.monotonic() < deadline
        assert store.add("counter", 2) == 2 and other.add("counter", 3) == 5
        assert store.get("counter") == b"5"  # changed through add: never the copy's first value
        assert store.compare_set("flag", "", "a") == b"a" and store.get("flag") == b"a"
    finally:
        store.close()
        other.close()
        client.close()
        writer.close()


def test_a_wait_on_it_sees_keys_put_before_and_after_and_times_out_naming_the_rest(etcd: EtcdServer) -> None:
    client = EtcdClient(etcd.endpoints)
    prefix = f"/test/{uuid.uuid4().hex}/pg/"
    writer = EtcdStore(EtcdClient(etcd.endpoints), prefix)
    store = GroupStore(client, prefix, timedelta(seconds=2))
    try:
        writer.set("before", "1")
        threading.Timer(0.3, writer.set, ("after", "2")).start()
        started = time.monotonic()
        store.wait(["before", "after"])
        assert time.monotonic() - started < 1.5
        assert store.multi_get(["before", "after"]) == [b"1", b"2"]
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="keys: never"):
            store.get("never")
        assert 2.0 <= time.monotonic() - started < 3.0
    finally:
        store.close()
        client.close()
        writer.client.close()


def test_a_wait_sees_a_key_put_between_its_read_and_its_watch_at_once(etcd: EtcdServer) -> None:
    """The watch starts from now on (never late, as a watch from the past is); what came before it is read again."""
    client = EtcdClient(etcd.endpoints)
    store = EtcdStore(client, f"/test/{uuid.uuid4().hex}/store/", timedelta(seconds=30))
    writer = EtcdStore(EtcdClient(etcd.endpoints), store.prefix)
    watch = store._reads._watch

    def put_then_watch(*args: object, **kwargs: object) -> object:
        writer.set("k", "v")  # after the wait's read, before its watch
        return watch(*args, **kwargs)  # type: ignore[arg-type]

    store._reads._watch = put_then_watch  # type: ignore[method-assign]
    try:
        started = time.monotonic()
        store.wait(["k"])
        assert time.monotonic() - started < 1.0  # not at the next re-read, 10 s on
    finally:
        client.close()
        writer.client.close()
