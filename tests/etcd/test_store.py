"""EtcdStore keeps torch's Store semantics: every assertion runs against both
EtcdStore (on a real etcd) and torch's own TCPStore."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.net import free_port

TIMEOUT = timedelta(seconds=2)


@pytest.fixture(params=["etcd", "tcp"])
def store_pair(
    request: pytest.FixtureRequest, etcd: EtcdServer, run_id: str
) -> Iterator[tuple[dist.Store, dist.Store]]:
    """Two handles on one store, as two processes of a job would have."""
    if request.param == "etcd":
        clients = [EtcdClient(etcd.endpoints), EtcdClient(etcd.endpoints)]
        prefix = f"/elastic_ft/{run_id}/round/0/store/"
        yield EtcdStore(clients[0], prefix, TIMEOUT), EtcdStore(clients[1], prefix, TIMEOUT)
        for client in clients:
            client.close()
    else:
        port = free_port()
        server = dist.TCPStore("127.0.0.1", port, 2, True, TIMEOUT, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", port, 2, False, TIMEOUT)
        yield server, client


def test_set_get_across_handles(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    a.set("k", "v")
    assert b.get("k") == b"v"
    a.set("bin", b"\x00\xff\x10")
    assert b.get("bin") == b"\x00\xff\x10"
    a.set("k", "w")
    assert b.get("k") == b"w"


def test_get_blocks_until_set(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    threading.Timer(0.3, lambda: a.set("late", "x")).start()
    start = time.monotonic()
    assert b.get("late") == b"x"
    assert 0.2 < time.monotonic() - start < 1.9


def test_get_times_out(store_pair: tuple[dist.Store, dist.Store]) -> None:
    _, b = store_pair
    b.set_timeout(timedelta(milliseconds=300))
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):
        b.get("never")
    assert 0.25 < time.monotonic() - start < 1.5


def test_add_counts_atomically(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    assert a.add("n", 2) == 2
    assert b.add("n", 3) == 5
    assert a.add("n", -1) == 4
    assert b.get("n") == b"4"
    assert a.add("n", 0) == 4


def test_add_from_threads_loses_nothing(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair

    def bump(store: dist.Store) -> None:
        for _ in range(20):
            store.add("shared", 1)

    threads = [threading.Thread(target=bump, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.get("shared") == b"40"


def test_compare_set(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    assert a.compare_set("cs", "", "first") == b"first"  # missing + empty expected: set
    assert b.compare_set("cs", "wrong", "x") == b"first"  # mismatch: current value
    assert b.compare_set("cs", "first", "second") == b"second"  # match: set
    assert a.get("cs") == b"second"
    assert a.compare_set("missing", "expected", "x") == b"expected"  # missing + non-empty expected
    assert not a.check(["missing"])


def test_wait_and_check(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    assert not b.check(["w1", "w2"])
    threading.Timer(0.2, lambda: a.set("w1", "1")).start()
    threading.Timer(0.4, lambda: a.set("w2", "2")).start()
    b.wait(["w1", "w2"])
    assert b.check(["w1", "w2"])
    with pytest.raises(dist.DistStoreError):
        b.wait(["w3"], timedelta(milliseconds=200))


def test_delete_key_and_num_keys(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    base = a.num_keys()  # TCPStore keeps an internal key of its own
    a.set("d1", "x")
    a.set("d2", "y")
    assert b.num_keys() == base + 2
    assert b.delete_key("d1") is True
    assert b.delete_key("d1") is False
    assert a.num_keys() == base + 1
    assert not a.check(["d1"])


def test_multi_get_multi_set_append(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    a.multi_set(["m1", "m2", "m3"], ["1", "2", b"\x03"])
    assert b.multi_get(["m3", "m1", "m2"]) == [b"\x03", b"1", b"2"]
    a.append("log", "ab")
    # TCPStore's append gets no reply: only a round trip on the same connection
    # orders it before another client's append.
    assert a.get("log") == b"ab"
    b.append("log", b"cd")
    assert a.get("log") == b"abcd"


def test_multi_get_waits_for_missing_keys(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    a.set("mg1", "1")
    threading.Timer(0.3, lambda: a.set("mg2", "2")).start()
    assert b.multi_get(["mg1", "mg2"]) == [b"1", b"2"]


def test_prefix_store_over_etcd_store(etcd: EtcdServer, run_id: str) -> None:
    """torch wraps stores in PrefixStore (C++ calls back into Python)."""
    client = EtcdClient(etcd.endpoints)
    store = EtcdStore(client, f"/elastic_ft/{run_id}/round/0/store/", TIMEOUT)
    prefixed = dist.PrefixStore("agent", store)
    prefixed.set("x", "1")
    assert prefixed.get("x") == b"1"
    assert prefixed.add("c", 5) == 5
    assert store.get("agent/x") == b"1"
    client.close()


def test_etcd_store_keys_stay_under_prefix(etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(etcd.endpoints)
    prefix = f"/elastic_ft/{run_id}/round/7/store/"
    store = EtcdStore(client, prefix, TIMEOUT)
    store.set("a", "1")
    store.add("b", 1)
    store.append("c", "x")
    store.multi_set(["d"], ["1"])
    kvs, _ = client.get_prefix(f"/elastic_ft/{run_id}/")
    data = sorted(kv.key for kv in kvs if kv.key.startswith(prefix))
    tokens = [kv for kv in kvs if not kv.key.startswith(prefix)]
    assert data == [prefix + k for k in "abcd"]
    # One write token per write, beside the store and inside the round, each on the store's lease.
    assert len(tokens) == 4
    assert all(kv.key.startswith(f"/elastic_ft/{run_id}/round/7/store.writes/") and kv.lease for kv in tokens)
    client.close()


def test_etcd_store_rejects_bad_prefix(etcd: EtcdServer) -> None:
    client = EtcdClient(etcd.endpoints)
    with pytest.raises(ValueError, match="must end with '/'"):
        EtcdStore(client, "/no/slash")
    client.close()
