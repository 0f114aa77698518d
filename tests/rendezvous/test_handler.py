"""The etcdft handler against a real etcd: the rendezvous semantics one by one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings
from elastic_ft.runtime.net import free_port
from elastic_ft.testing.etcd_cluster import EtcdCluster

NODE_SCRIPT = Path(__file__).with_name("node.py")

HandlerFactory = Callable[..., EtcdftRendezvousHandler]


@pytest.fixture
def make_handler(etcd: EtcdServer, run_id: str) -> Iterator[HandlerFactory]:
    handlers: list[EtcdftRendezvousHandler] = []

    def make(min_nodes: int = 2, max_nodes: int = 3, **conf: Any) -> EtcdftRendezvousHandler:
        conf = {"last_call_timeout": 0.5, "lease_ttl": 1, "join_timeout": 30, **conf}
        settings = make_settings(
            run_id=run_id,
            endpoint=etcd.endpoint,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr="127.0.0.1",
            **conf,
        )
        handler = EtcdftRendezvousHandler(settings)
        handlers.append(handler)
        return handler

    yield make
    for handler in handlers:
        handler.shutdown()


def rendezvous_all(handlers: list[EtcdftRendezvousHandler], timeout: float = 30) -> list[RendezvousInfo]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in handlers]
        return [f.result(timeout=timeout) for f in futures]


def in_background(handler: EtcdftRendezvousHandler) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["info"] = handler.next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - start


def assert_consistent(infos: list[RendezvousInfo]) -> None:
    assert sorted(i.rank for i in infos) == list(range(len(infos)))
    assert {i.world_size for i in infos} == {len(infos)}
    assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1


# ---- 1, 2: barrier and last call -----------------------------------------------


def test_barrier_waits_for_last_call_after_min(make_handler: HandlerFactory) -> None:
    handlers = [make_handler(min_nodes=2, max_nodes=3, last_call_timeout=1.0) for _ in range(2)]
    start = time.monotonic()
    infos = rendezvous_all(handlers)
    elapsed = time.monotonic() - start
    assert_consistent(infos)
    assert 0.9 < elapsed < 5, elapsed


def test_barrier_closes_at_once_at_max(make_handler: HandlerFactory) -> None:
    handlers = [make_handler(min_nodes=2, max_nodes=3, last_call_timeout=20) for _ in range(3)]
    start = time.monotonic()
    infos = rendezvous_all(handlers)
    assert time.monotonic() - start < 5
    assert_consistent(infos)


def test_last_call_admits_a_node_arriving_together(make_handler: HandlerFactory) -> None:
    handlers = [make_handler(min_nodes=2, max_nodes=4, last_call_timeout=1.5) for _ in range(3)]
    first = [in_background(h) for h in handlers[:2]]
    time.sleep(0.5)  # min reached, last call running
    third = in_background(handlers[2])
    for thread, _ in [*first, third]:
        thread.join(20)
    infos = [box["info"] for _, box in [*first, third]]
    assert_consistent(infos)
    assert infos[0].world_size == 3


# ---- 3: overall timeout ------------------------------------------------------------


def test_join_timeout_is_non_retryable_and_explains(make_handler: HandlerFactory, etcd_client: EtcdClient) -> None:
    handler = make_handler(min_nodes=2, max_nodes=2, join_timeout=1)
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"1 node\(s\) joined, at least 2 needed"):
        handler.next_rendezvous()
    assert 0.9 < time.monotonic() - start < 5
    # The timed-out node withdrew its join, so it is not counted later.
    kvs, _ = etcd_client.get_prefix(f"/elastic_ft/{handler.settings.run_id}/rdzv/round/")
    assert [kv.key for kv in kvs if "/join/" in kv.key] == []


def test_timeout_option_of_torchrun_is_join_timeout(make_handler: HandlerFactory) -> None:
    handler = make_handler(min_nodes=2, max_nodes=2, join_timeout=None, timeout=1)
    assert handler.settings.join_timeout == 1
    with pytest.raises(RendezvousTimeoutError):
        handler.next_rendezvous()


# ---- 4: exclusivity and num_nodes_waiting ----------------------------------------------


def test_late_node_waits_and_joins_next_round(make_handler: HandlerFactory) -> None:
    a, b = (make_handler(min_nodes=2, max_nodes=3, last_call_timeout=0.3) for _ in range(2))
    rendezvous_all([a, b])
    late = make_handler(min_nodes=2, max_nodes=3, last_call_timeout=0.3)
    thread, box = in_background(late)
    wait_until(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, 5, "the late node to be seen")
    time.sleep(1.0)  # well past last call: the late node must not form its own group
    assert thread.is_alive() and not box
    # Polling num_nodes_waiting costs no etcd request (watch-fed view).
    before = a.client.requests_by_kind.copy()
    for _ in range(200):
        assert a.num_nodes_waiting() == 1
    assert set(a.client.requests_by_kind - before) <= {"keep_alive"}
    infos = rendezvous_all([a, b])
    thread.join(10)
    infos.append(box["info"])
    assert_consistent(infos)
    assert infos[0].world_size == 3
    # a and b kept their ranks; the late node got the new one.
    assert (infos[0].rank, infos[1].rank, infos[2].rank) in {(0, 1, 2), (1, 0, 2)}
    assert all(h.num_nodes_waiting() == 0 for h in (a, b, late))


def test_spare_behind_full_round_is_not_counted_and_does_not_time_out(make_handler: HandlerFactory) -> None:
    a, b = (make_handler(min_nodes=1, max_nodes=2, last_call_timeout=0.2, join_timeout=2) for _ in range(2))
    a_rank = rendezvous_all([a, b])[0].rank
    spare = make_handler(min_nodes=1, max_nodes=2, last_call_timeout=0.2, join_timeout=2)
    thread, box = in_background(spare)
    time.sleep(3.0)  # longer than join_timeout: a spare keeps waiting
    assert thread.is_alive() and not box
    assert a.num_nodes_waiting() == 0
    # b leaves for good; a re-rendezvouses and the spare takes b's place.
    b.shutdown()
    infos = rendezvous_all([a])
    thread.join(10)
    assert_consistent([infos[0], box["info"]])
    assert infos[0].rank == a_rank and box["info"].rank == 1 - a_rank


# ---- 5, 7: consistency and fast re-rendezvous -----------------------------------------


def test_many_nodes_agree(make_handler: HandlerFactory) -> None:
    handlers = [make_handler(min_nodes=8, max_nodes=8) for _ in range(8)]
    infos = rendezvous_all(handlers)
    assert_consistent(infos)
    assert len({h.node for h in handlers}) == 8


def test_survivors_keep_previous_ranks(make_handler: HandlerFactory) -> None:
    handlers = [make_handler(min_nodes=1, max_nodes=4, last_call_timeout=0.3) for _ in range(4)]
    infos = rendezvous_all(handlers)
    assert_consistent(infos)
    before = {h.node: i.rank for h, i in zip(handlers, infos, strict=True)}
    gone = next(h for h in handlers if before[h.node] == 1)
    gone.shutdown()
    survivors = [h for h in handlers if h is not gone]
    again = rendezvous_all(survivors)
    assert_consistent(again)
    after = {h.node: i.rank for h, i in zip(survivors, again, strict=True)}
    # Ranks 0 and 2 exist in a world of 3 and stay put; rank 3 moves to the gap.
    for node, rank in before.items():
        if rank in (0, 2):
            assert after[node] == rank
    assert sorted(after.values()) == [0, 1, 2]


def test_rerendezvous_skips_last_call_when_previous_group_is_accounted_for(make_handler: HandlerFactory) -> None:
    # A last call of 30 s: only the fast rule can close the second round quickly.
    handlers = [make_handler(min_nodes=2, max_nodes=4, last_call_timeout=30) for _ in range(4)]
    first = rendezvous_all(handlers)  # max reached: closes at once
    leaving = handlers.pop()
    leaving.shutdown()
    start = time.monotonic()
    second = rendezvous_all(handlers)
    assert time.monotonic() - start < 3
    assert_consistent(second)
    assert [i.rank for i in second] == [i.rank for i in first[:3]] or sorted(i.rank for i in second) == [0, 1, 2]


# ---- 6: fault tolerance with real processes -------------------------------------------


class NodeProcess:
    def __init__(self, etcd: EtcdServer, run_id: str, min_nodes: int, max_nodes: int, **conf: Any) -> None:
        args = [f"{k}={v}" for k, v in {"last_call_timeout": 0.5, "lease_ttl": 1, **conf}.items()]
        self.proc = subprocess.Popen(
            [sys.executable, str(NODE_SCRIPT), etcd.endpoint, run_id, str(min_nodes), str(max_nodes), *args],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.node = json.loads(self.proc.stdout.readline())["node"]  # type: ignore[union-attr]

    def result(self) -> dict[str, int]:
        return json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def test_node_dying_before_completion_is_dropped(
    make_handler: HandlerFactory, etcd: EtcdServer, run_id: str, etcd_client: EtcdClient, reap_pids: list[int]
) -> None:
    doomed = NodeProcess(etcd, run_id, 3, 3)
    reap_pids.append(doomed.proc.pid)
    join_key = f"/elastic_ft/{run_id}/rdzv/round/0/join/{doomed.node}"
    wait_until(lambda: etcd_client.get(join_key)[0] is not None, 20, "the doomed node to join")
    doomed.kill()
    a, b = (make_handler(min_nodes=2, max_nodes=3, last_call_timeout=0.3) for _ in range(2))
    infos = rendezvous_all([a, b])
    assert_consistent(infos)
    assert infos[0].world_size == 2


def test_member_death_after_completion_is_watched(
    make_handler: HandlerFactory, etcd: EtcdServer, run_id: str, etcd_client: EtcdClient, reap_pids: list[int]
) -> None:
    other = NodeProcess(etcd, run_id, 2, 2)
    reap_pids.append(other.proc.pid)
    # The other node is the monitor (as the first to come): otherwise ``a``'s own monitor thread would publish
    # the death on the board, a write this test would count as a request of the watching node.
    monitor_key = f"/elastic_ft/{run_id}/rdzv/monitor"
    wait_until(lambda: etcd_client.get(monitor_key)[0] is not None, 20, "the other node to become the monitor")
    a = make_handler(min_nodes=1, max_nodes=2, last_call_timeout=30)
    info = a.next_rendezvous()  # max reached with the other node: no last call
    assert other.result()["world_size"] == 2 and info.world_size == 2
    assert a.num_nodes_waiting() == 0
    requests_before = a.client.requests_by_kind.copy()
    other.kill()
    seen_after = wait_until(lambda: a.num_nodes_waiting() >= 1, 10, "the death to be seen")
    assert seen_after < 4  # lease_ttl=1 plus etcd's expiry sweep
    new_kinds = set(a.client.requests_by_kind - requests_before)
    assert new_kinds <= {"keep_alive"}, f"death must be seen by watch, not requests: {new_kinds}"
    start = time.monotonic()
    again = a.next_rendezvous()
    assert again.world_size == 1 and again.rank == 0
    assert time.monotonic() - start < 2


# ---- 8: the round's store and bootstrap info ---------------------------------------


def test_round_store_is_shared_and_scoped_per_round(make_handler: HandlerFactory, etcd_client: EtcdClient) -> None:
    a, b = (make_handler(min_nodes=2, max_nodes=2) for _ in range(2))
    first = rendezvous_all([a, b])
    first[0].store.set("hello", "round0")
    assert first[1].store.get("hello") == b"round0"
    second = rendezvous_all([a, b])
    assert not second[0].store.check(["hello"])
    second[1].store.set("hello", "round1")
    assert second[0].store.get("hello") == b"round1"
    assert first[0].store.get("hello") == b"round0"
    run = a.settings.run_prefix
    assert etcd_client.get(f"{run}round/0/store/hello")[0] is not None
    assert etcd_client.get(f"{run}round/1/store/hello")[0] is not None
    # Bootstrap info is rank 0's address and a port it chose for that round.
    for infos in (first, second):
        assert infos[0].bootstrap_store_info.master_addr == "127.0.0.1"
        assert 0 < infos[0].bootstrap_store_info.master_port < 65536


def test_old_rounds_are_garbage_collected(make_handler: HandlerFactory, etcd_client: EtcdClient) -> None:
    a, b = (make_handler(min_nodes=2, max_nodes=2) for _ in range(2))
    for round_number in range(4):
        infos = rendezvous_all([a, b])
        infos[0].store.set("k", str(round_number))
    run = a.settings.run_prefix
    kvs, _ = etcd_client.get_prefix(run)
    rounds = {int(kv.key[len(run) :].split("/")[1]) for kv in kvs if kv.key.startswith(f"{run}round/")}
    rdzv_rounds = {int(kv.key.split("/round/")[1].split("/")[0]) for kv in kvs if "/rdzv/round/" in kv.key}
    assert rounds == {2, 3} and rdzv_rounds == {2, 3}


def test_torch_agent_rank_assignment_runs_on_the_round_store(make_handler: HandlerFactory) -> None:
    """torch's agent assigns worker ranks through the store (set, multi_get, multi_set, get)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec

    handlers = [make_handler(min_nodes=2, max_nodes=2) for _ in range(2)]
    infos = rendezvous_all(handlers)
    spec = WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=handlers[0], entrypoint="x")
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(SimpleElasticAgent._assign_worker_ranks, None, i.store, i.rank, i.world_size, spec)  # type: ignore[arg-type]
            for i in infos
        ]
        workers = [w for f in futures for w in f.result(timeout=30)]
    assert sorted(w.global_rank for w in workers) == [0, 1, 2, 3]
    assert {w.world_size for w in workers} == {4}


# ---- 9: closing and shutdown ------------------------------------------------------


def test_set_closed_reaches_everyone(make_handler: HandlerFactory) -> None:
    a, b = (make_handler(min_nodes=2, max_nodes=3) for _ in range(2))
    rendezvous_all([a, b])
    waiting = make_handler(min_nodes=3, max_nodes=3)
    thread, box = in_background(waiting)
    time.sleep(0.3)
    assert not b.is_closed()
    a.set_closed()
    wait_until(b.is_closed, 5, "b to see the close")
    thread.join(5)
    # The node that waited was never a member: for it the job is over, not failed.
    assert isinstance(box.get("error"), RendezvousGracefulExitError), box
    assert "was closed while node" in str(box["error"])
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()  # a member asking for another round: an error


def test_shutdown_leaves_cleanly(make_handler: HandlerFactory, etcd_client: EtcdClient) -> None:
    a, b = (make_handler(min_nodes=2, max_nodes=2) for _ in range(2))
    rendezvous_all([a, b])
    run = a.settings.run_prefix
    assert etcd_client.get(f"{run}rdzv/alive/{b.node}")[0] is not None
    assert b.shutdown() is True
    assert b.shutdown() is True  # idempotent
    assert etcd_client.get(f"{run}rdzv/alive/{b.node}")[0] is None
    assert etcd_client.get(f"{run}rdzv/round/0/left/{b.node}")[0] is not None
    time.sleep(0.3)
    assert a.num_nodes_waiting() == 0  # a clean departure is not a failure
    with pytest.raises(RendezvousStateError):
        b.next_rendezvous()


def test_shutdown_does_not_wait_for_a_standby_next_rendezvous(make_handler: HandlerFactory) -> None:
    """torch's agent may shut a handler down while another thread waits in next_rendezvous() (here a node alone
    below min_nodes): the wait ends with RendezvousClosedError, and shutdown() returns, without the join timeout."""
    lonely = make_handler(min_nodes=2, max_nodes=2, join_timeout=120)
    thread, box = in_background(lonely)
    wait_until(lambda: lonely.requests > 0 and thread.is_alive(), 10, "the node to wait in its round")
    time.sleep(0.3)
    start = time.monotonic()
    assert lonely.shutdown() is True
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 10
    assert isinstance(box.get("error"), RendezvousClosedError), box


# ---- 10, 11: configuration and bad input --------------------------------------------


def test_unreachable_etcd_fails_fast_and_names_endpoints(run_id: str) -> None:
    port = free_port()
    settings = make_settings(
        run_id=run_id, endpoint=f"127.0.0.1:{port}", min_nodes=1, max_nodes=1, connect_timeout=1, request_timeout=1
    )
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        EtcdftRendezvousHandler(settings)
    assert time.monotonic() - start < 5


def test_get_backend_and_run_id(make_handler: HandlerFactory, run_id: str) -> None:
    handler = make_handler()
    assert handler.get_backend() == "etcdft"
    assert handler.get_run_id() == run_id
    assert handler.use_agent_store is False


# ---- 12: JSON only, all under the run's prefix --------------------------------------------


def test_everything_is_json_under_the_run_prefix(make_handler: HandlerFactory, etcd_client: EtcdClient) -> None:
    a, b = (make_handler(min_nodes=2, max_nodes=2) for _ in range(2))
    rendezvous_all([a, b])
    rendezvous_all([a, b])
    b.shutdown()
    run = a.settings.run_prefix
    kvs, _ = etcd_client.get_prefix("/")
    mine = [kv for kv in kvs if kv.key.startswith(run)]
    assert mine, "the run wrote nothing?"
    for kv in mine:
        if "/store/" not in kv.key:
            json.loads(kv.value)
    other_runs = {kv.key.split("/")[2] for kv in kvs}
    assert a.settings.run_id in other_runs
    # (The etcd is shared with other tests, some with prefixes of their own: look at this run's keys.)
    outside = sorted(kv.key for kv in kvs if a.settings.run_id in kv.key and not kv.key.startswith(run))
    assert outside == [], outside[:5]


@pytest.mark.integration
def test_etcd_away_during_a_join_is_waited_out_until_join_timeout(run_id: str) -> None:
    with EtcdCluster(members=1) as own_etcd:
        settings = make_settings(
            run_id=run_id,
            endpoint=own_etcd.endpoint,
            min_nodes=2,
            max_nodes=2,
            local_addr="127.0.0.1",
            connect_timeout=2,
            request_timeout=1,
            lease_ttl=1,
            join_timeout=6,
        )
        handler = EtcdftRendezvousHandler(settings)
        start = time.monotonic()
        thread, box = in_background(handler)
        time.sleep(0.5)  # joined, waiting for a second node
        own_etcd.kill_member(0)
        thread.join(20)
        assert not thread.is_alive(), "next_rendezvous hung after etcd went away"
        # Not before the user's bound (an outage is waited out), and soon after it, saying why.
        assert 6.0 <= time.monotonic() - start < 6.0 + 3.0
        assert isinstance(box.get("error"), RendezvousTimeoutError), box
        assert "etcd at" in str(box["error"]) and "has not answered for the last" in str(box["error"])
        handler.shutdown()


@pytest.mark.integration
def test_a_join_completes_across_an_etcd_restart(run_id: str) -> None:
    with EtcdCluster(members=1) as own_etcd:
        settings = {
            "run_id": run_id,
            "endpoint": own_etcd.endpoint,
            "min_nodes": 2,
            "max_nodes": 2,
            "local_addr": "127.0.0.1",
            "connect_timeout": 2,
            "request_timeout": 1,
            "lease_ttl": 5,
            "last_call_timeout": 0.2,
            "join_timeout": 60,
        }
        first = EtcdftRendezvousHandler(make_settings(**settings))
        thread, box = in_background(first)
        time.sleep(0.5)  # joined, waiting for a second node
        own_etcd.kill_member(0)
        time.sleep(4.0)  # four of the client's bounds: a wait that gave up on etcd would have ended
        own_etcd.restart_member(0)
        second = EtcdftRendezvousHandler(make_settings(**settings))
        try:
            info = second.next_rendezvous()
            thread.join(30)
            assert "info" in box, box
            assert sorted([info.rank, box["info"].rank]) == [0, 1]
        finally:
            first.shutdown()
            second.shutdown()
