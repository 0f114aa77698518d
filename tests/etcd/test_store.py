"""EtcdStore keeps torch's Store semantics: every assertion runs against both
EtcdStore (on a real etcd) and torch's own TCPStore."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.runtime.net import free_port

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
    # torch's C++ reaches these two by their C++ names (getNumKeys, deleteKey).
    assert prefixed.num_keys() == 2
    assert prefixed.delete_key("x") is True and prefixed.delete_key("x") is False
    assert prefixed.num_keys() == 1 and not prefixed.check(["x"])
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


# ---- the rest of torch's Store contract (torch 2.13), as torch's own store tests exercise it ----


def test_has_extended_api(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, _ = store_pair
    assert a.has_extended_api() is True


def test_empty_large_and_unusual_values_and_keys(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    a.set("empty", b"")
    assert b.get("empty") == b""
    assert b.check(["empty"])
    big = bytes(range(256)) * 4096  # 1 MiB
    a.set("big", big)
    assert b.get("big") == big
    for key in ("with/slash", "ключ", "sp ace", "a" * 200):
        a.set(key, key.encode())
        assert b.get(key) == key.encode()


def test_append_creates_and_multi_set_get_empty_lists(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    a.append("fresh", "x")
    assert b.get("fresh") == b"x"
    a.multi_set([], [])
    assert b.multi_get([]) == []


def test_list_keys_lists_this_stores_keys(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    before = set(a.list_keys())
    internal = a.num_keys() - len(before)  # TCPStore counts a key of its own, which it does not list
    a.set("lk1", "x")
    b.multi_set(["lk2", "dir/lk3"], ["y", "z"])
    assert set(b.list_keys()) - before == {"lk1", "lk2", "dir/lk3"}
    b.delete_key("lk1")
    assert set(a.list_keys()) - before == {"lk2", "dir/lk3"}
    assert len(a.list_keys()) + internal == a.num_keys()


def test_timeout_property_and_set_timeout(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, _ = store_pair
    assert a.timeout == TIMEOUT
    a.set_timeout(timedelta(milliseconds=250))
    assert a.timeout == timedelta(milliseconds=250)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        a.wait(["never"])  # the store's timeout when none is given
    assert time.monotonic() - start < 1.5


def test_clone_shares_the_keys_and_outlives_its_python_reference(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    clone = a.clone()
    clone.set("cloned", "1")
    assert b.get("cloned") == b"1"
    assert clone.add("cloned-n", 2) == 2 and a.add("cloned-n", 1) == 3
    # Through a PrefixStore the clone is made from C++; it must still work once Python drops it.
    prefixed = dist.PrefixStore("pre", a)
    prefixed.set("k", "v")
    clones = [prefixed.clone() for _ in range(3)]
    gc.collect()
    assert [c.get("k") for c in clones] == [b"v"] * 3

    # One clone per thread, as torch intends clone() for.
    def work(store: dist.Store, index: int) -> None:
        for _ in range(10):
            store.add("per-thread", 1)
        store.set(f"thread-{index}", str(index))

    threads = [threading.Thread(target=work, args=(a.clone(), i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.get("per-thread") == b"30"
    assert b.multi_get([f"thread-{i}" for i in range(3)]) == [b"0", b"1", b"2"]


def test_store_barrier(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    done: list[str] = []
    thread = threading.Thread(target=lambda: (b.barrier("bar", 2, timedelta(seconds=5)), done.append("b")))
    thread.start()
    time.sleep(0.2)
    assert done == []  # b waits for a
    a.barrier("bar", 2, timedelta(seconds=5))
    thread.join(5)
    assert done == ["b"]
    with pytest.raises(dist.DistStoreError):
        a.barrier("lonely", 2, timedelta(milliseconds=300))


def test_queue_is_fifo_and_nonblocking_pop_of_empty_raises(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    assert a.queue_len("q") == 0
    for item in ("1", b"2", "3"):
        a.queue_push("q", item)
    assert b.queue_len("q") == 3
    assert [b.queue_pop("q"), a.queue_pop("q", False), b.queue_pop("q")] == [b"1", b"2", b"3"]
    with pytest.raises(dist.QueueEmptyError):
        a.queue_pop("q", False)
    assert not a.check(["q"])  # an empty queue is not there
    a.queue_push("q/sub", "other")  # queues whose names share a prefix stay apart
    assert (a.queue_len("q"), a.queue_len("q/sub")) == (0, 1)


def test_a_queue_holding_items_counts_as_its_name_for_check_and_wait(
    store_pair: tuple[dist.Store, dist.Store],
) -> None:
    """As TCPStore's server does: a pushed queue is seen by check and wait, not by num_keys or list_keys. (A
    TCPStore client's check of a queue was seen False in the full suite and True alone: only ours is held to it.)"""
    a, b = store_pair
    if not isinstance(b, EtcdStore):
        pytest.skip("TCPStore's client answers check() on a queue inconsistently")
    keys_before = b.num_keys()
    assert not b.check(["foo"])
    a.queue_push("foo", "item")
    assert b.check(["foo"]) and b.check(["foo", "foo"])
    b.wait(["foo"], timedelta(seconds=5))
    assert b.num_keys() == keys_before
    a.set("plain", "v")
    assert b.check(["foo", "plain"]) and not b.check(["foo", "absent"])
    assert "foo" not in b.list_keys()
    assert b.queue_pop("foo") == b"item"
    assert not b.check(["foo"])


@pytest.mark.parametrize("names", [["late"], ["late", "other"]])
def test_wait_returns_when_a_queue_is_pushed(store_pair: tuple[dist.Store, dist.Store], names: list[str]) -> None:
    a, b = store_pair
    for name in names[1:]:
        a.set(name, "here")
    pushing, pushed = threading.Event(), threading.Event()

    def push() -> None:
        pushing.set()
        a.queue_push(names[0], "x")
        pushed.set()

    threading.Timer(0.3, push).start()
    b.wait(names, timedelta(seconds=10))
    # The wait ended because of the push (not before it began); the pushing call itself may return a moment
    # after the store woke the waiter.
    assert pushing.is_set() and pushed.wait(5)


def test_blocking_queue_pop_waits_for_a_push_then_times_out(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    threading.Timer(0.3, lambda: a.queue_push("bq", "late")).start()
    start = time.monotonic()
    assert b.queue_pop("bq") == b"late"
    assert 0.2 < time.monotonic() - start < 1.9
    b.set_timeout(timedelta(milliseconds=300))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        b.queue_pop("bq")


def test_concurrent_pops_take_each_item_once(store_pair: tuple[dist.Store, dist.Store]) -> None:
    a, b = store_pair
    for i in range(30):
        a.queue_push("work", str(i))
    taken: list[bytes] = []
    lock = threading.Lock()

    def drain(store: dist.Store) -> None:
        while True:
            try:
                item = store.queue_pop("work", False)
            except dist.QueueEmptyError:
                return
            with lock:
                taken.append(item)

    threads = [threading.Thread(target=drain, args=(s,)) for s in (a.clone(), b.clone(), b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(int(x) for x in taken) == list(range(30))


def test_a_batch_of_arrivals_is_one_transaction_and_counts_each_rank_once(etcd: EtcdServer, run_id: str) -> None:
    """A node's ranks arrive in one transaction; concurrent batches (nodes) number every arrival once, in
    order within a batch; a resend of a batch that committed counts nothing twice, and a rank another process
    arrived for is left out of the batch, not the whole batch."""
    client = EtcdClient(etcd.endpoints)
    store = EtcdStore(client, f"/elastic_ft/{run_id}/round/0/store/", TIMEOUT)
    numbers: list[int | None] = []

    def node(first: int) -> None:
        numbers.extend(store.arrive_batch([(f"arrived/{r}", f"token{r}") for r in range(first, first + 8)], "slots/"))

    before = client.requests_by_kind["txn"]
    threads = [threading.Thread(target=node, args=(8 * i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert client.requests_by_kind["txn"] - before == 16  # one transaction per node of 8 ranks, no retries
    assert sorted(n for n in numbers if n is not None) == list(range(1, 129))  # every number once
    assert store.arrivals("slots/") == 128 and store.arrivals("nothing/") == 0
    resent = store.arrive_batch([(f"arrived/{r}", f"token{r}") for r in range(8)], "slots/")
    assert None not in resent and store.arrivals("slots/") == 128  # a resend: counted, not again
    mixed = store.arrive_batch([("arrived/3", "other"), ("arrived/500", "t500"), ("arrived/501", "t501")], "slots/")
    assert mixed == [None, 129, 130]  # rank 3 is another process's arrival; the rest counted in order
    with pytest.raises(ValueError, match="1 to 32 arrivals, got 33"):
        store.arrive_batch([(f"x/{r}", "t") for r in range(33)], "slots/")
    client.close()


def test_wrapper_barrier_on_an_etcd_store_counts_in_one_transaction_per_rank(etcd: EtcdServer, run_id: str) -> None:
    from elastic_ft.coordination.iteration import iteration_store

    client = EtcdClient(etcd.endpoints)
    base = EtcdStore(client, f"/elastic_ft/{run_id}/round/0/store/", TIMEOUT)
    views = [iteration_store(base, 3) for _ in range(4)]
    before = client.requests_by_kind.copy()
    for rank in range(3):
        assert views[rank].arrive_and_wait("b", [rank], 4, timedelta(0)) is None
    assert client.requests_by_kind["txn"] - before["txn"] == 3  # one transaction per arrival
    assert views[3].arrive_and_wait("b", [3, 1], 4, timedelta(seconds=10)) == ""  # rank 1 again: counted once
    assert all(view.arrive_and_wait("b", [0], 4, timedelta(seconds=10)) == "" for view in views)
    with pytest.raises(Exception, match="1 of 2 ranks arrived"):
        views[0].arrive_and_wait("c", [0], 2, timedelta(seconds=0.5))
    client.close()


def test_a_barrier_waits_on_its_watch_and_does_not_poll_while_etcd_is_busy(etcd: EtcdServer, run_id: str) -> None:
    """The barrier's result comes with its watch event. Other writes (heartbeats, other jobs) move etcd's revision
    between the wait's read and its watch's creation: that costs the wait one read of the result, not a poll
    every wait slice."""
    from elastic_ft.coordination.iteration import iteration_store

    client, other = EtcdClient(etcd.endpoints), EtcdClient(etcd.endpoints)
    base = EtcdStore(client, f"/elastic_ft/{run_id}/round/0/store/", TIMEOUT)
    other_base = EtcdStore(other, base.prefix, TIMEOUT)  # referenced here: a view holds only its C++ part
    waiter, last = iteration_store(base, 1), iteration_store(other_base, 1)
    busy = threading.Event()

    def keep_etcd_busy() -> None:
        while not busy.is_set():
            other.put(f"/elastic_ft/{run_id}/noise", b"x")
            time.sleep(0.005)

    noise = threading.Thread(target=keep_etcd_busy)
    noise.start()
    try:
        results: list[object] = []
        thread = threading.Thread(target=lambda: results.append(waiter.arrive_and_wait("b", [0], 2, TIMEOUT * 5)))
        thread.start()
        time.sleep(0.5)  # arrived, watching (and the one read its watch's creation asked for)
        before = client.requests_by_kind.copy()
        time.sleep(1.0)  # a second of waiting on a moving revision
        during = sum(client.requests_by_kind.values()) - sum(before.values())
        assert last.arrive_and_wait("b", [1], 2, TIMEOUT * 5) == ""
        thread.join(5)
        assert results == [""]
    finally:
        busy.set()
        noise.join()
    # No poll (it would be 20 requests): the result comes with the watch's event. What remains is the barrier's
    # own read once a second, for a last arrival that died before publishing (_StalledBarrier).
    assert during <= 2, (before, client.requests_by_kind)
    client.close()
    other.close()


def _wait_in_threads(views: list, ranks: list[int], world_size: int, timeout: float) -> tuple[dict, list]:
    """Ranks arriving at the termination barrier and waiting, each in a thread: (results by rank, threads)."""
    from elastic_ft.keys import TERMINATION_BARRIER

    results: dict[int, object] = {}

    def wait(rank: int) -> None:
        try:
            results[rank] = views[rank].arrive_and_wait(
                TERMINATION_BARRIER, [rank], world_size, timedelta(seconds=timeout)
            )
        except Exception as error:  # noqa: BLE001 - the test reads it
            results[rank] = error

    threads = [threading.Thread(target=wait, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    return results, threads


@pytest.mark.parametrize("last_arriver", ["gone", "unknown", "forged", "not known gone"])
def test_a_barrier_whose_last_arriver_died_before_publishing_completes(
    store_pair: tuple[dist.Store, dist.Store], monkeypatch: pytest.MonkeyPatch, last_arriver: str
) -> None:
    """The rank whose arrival completes the termination barrier is killed (a hard timeout's SIGKILL) before it
    publishes the result: the waiting ranks publish in its place once it is recorded gone (or, after a longer
    grace, when it died before even recording itself as the last, or its record is malformed), instead of
    waiting out the barrier timeout although every rank arrived. A last arriver not known to be gone may still
    publish: nobody replaces it."""
    from elastic_ft import keys
    from elastic_ft.coordination import barriers
    from elastic_ft.coordination.barriers import Barriers
    from elastic_ft.coordination.iteration import iteration_store
    from elastic_ft.coordination.termination import TerminationResult
    from elastic_ft.keys import TERMINATION_BARRIER

    monkeypatch.setattr(barriers, "_STALL_UNKNOWN", 3.0)
    views = [iteration_store(store_pair[rank % 2], 5) for rank in range(3)]
    results, threads = _wait_in_threads(views, [0, 1], 3, timeout=6 if last_arriver == "not known gone" else 20)
    while views[2].barriers._arrivals(TERMINATION_BARRIER) < 2:
        time.sleep(0.01)
    with monkeypatch.context() as patch:
        patch.setattr(Barriers, "_publish", lambda *args, **kwargs: None)  # dies right after counting itself
        assert views[2].arrive_and_wait(TERMINATION_BARRIER, [2], 3, timedelta(0)) is None
    if last_arriver == "unknown":
        views[2].store.delete_key(keys.barrier_last(TERMINATION_BARRIER))  # died before recording itself as the last
    if last_arriver == "forged":  # the store is untrusted: a record that names no rank reads as unknown
        views[2].store.set(keys.barrier_last(TERMINATION_BARRIER), "rank two\x00")
    if last_arriver != "not known gone":
        views[2].record_terminated([2])  # what its monitor process or its agent reports
    started = time.monotonic()
    for thread in threads:
        thread.join(timeout=30)
    waited = time.monotonic() - started
    if last_arriver == "not known gone":
        assert all("3 of 3 ranks arrived" in str(results[rank]) for rank in (0, 1)), results
        assert not views[0].store.check([keys.barrier_done(TERMINATION_BARRIER)])
        return
    expected = TerminationResult(world_size=3, terminated=(2,)).to_json()
    assert results == {0: expected, 1: expected}
    assert waited < 15, waited  # the grace period, not the 20 s barrier timeout
