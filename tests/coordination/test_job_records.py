"""The job records read for many ranks at once: the same answers on an etcd store and on any other store, and
on etcd a few requests however many ranks (a monitor reads every peer's heartbeat at each look)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.job import JobView, job_store, joined_ranks
from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.keys import EXIT_BARRIER

RANKS = 300


@pytest.fixture(params=["etcd", "hash"])
def job(request: pytest.FixtureRequest, etcd: EtcdServer, run_id: str) -> Iterator[tuple[JobView, EtcdClient | None]]:
    if request.param == "hash":
        yield job_store(dist.HashStore()), None
        return
    client = EtcdClient(etcd.endpoints)
    # The test holds the store: a PrefixStore keeps only the C++ part of a Python store alive, and once the
    # collector freed the Python object, the view's store answers as a bare torch Store ("Not implemented").
    store = EtcdStore(client, f"/elastic_ft/{run_id}/round/0/store/", timedelta(seconds=5))
    yield job_store(store), client
    client.close()


def write_records(job: JobView) -> None:
    for rank in range(RANKS):
        if rank % 3 == 0:
            continue  # never sent one
        job.liveness.send_heartbeat(rank, active_at=1000.0 + rank, reserve=rank % 7 == 0, next_in=1.0)
        job.record_position(rank, iteration=rank % 5, rank=rank, world_size=RANKS, active=rank % 2 == 0)
    job.store.set(f"{keys.HEARTBEAT}4", "not json")  # malformed: skipped
    job.store.set(f"{keys.POSITION}5", '{"iteration": -1}')
    for rank in (10, 11):
        job.store.set(keys.barrier_arrived(EXIT_BARRIER, rank), "1")
    for rank in (400, 401, 402):
        job.register_joiner(rank)
    job.claim_admission(400, "7")
    job.claim_admission(402, "withdrawn")


def test_batched_reads_answer_as_one_read_per_rank_does(job: tuple[JobView, EtcdClient | None]) -> None:
    view, _ = job
    write_records(view)
    ranks = list(range(RANKS))
    heartbeats = view.liveness.heartbeats(ranks)
    assert heartbeats == {
        rank: view.liveness.heartbeat(rank) for rank in ranks if view.liveness.heartbeat(rank) is not None
    }
    assert 4 not in heartbeats and 3 not in heartbeats and heartbeats[7].reserve and heartbeats[8].active_at == 1008.0
    positions = view.positions(ranks)
    assert positions == {rank: view.position(rank) for rank in ranks if view.position(rank) is not None}
    assert 5 not in positions and positions[8] == {"iteration": 3, "rank": 8, "world_size": RANKS, "active": 1}
    assert view.arrivals(EXIT_BARRIER, ranks) == {10, 11}
    assert view.admissions([400, 401, 402]) == {400: "7", 402: "withdrawn"}
    assert joined_ranks(view) == [400]
    assert view.liveness.heartbeats([]) == {} and view.arrivals(EXIT_BARRIER, []) == set()
    records = view.liveness.peer_records(ranks)  # the monitor's look: the same answers in one read
    assert records.left == {10, 11}
    assert records.heartbeats == {rank: beat for rank, beat in heartbeats.items() if rank not in {10, 11}}
    assert records.positions == {rank: place for rank, place in positions.items() if rank not in {10, 11}}
    # A monitor's heartbeat reads its ring successor's records in the same request: whether it left, its beat.
    beyond = RANKS + 1
    assert view.liveness.send_heartbeat(beyond, ring=10) == (True, heartbeats[10])
    assert view.liveness.send_heartbeat(beyond, ring=8) == (False, heartbeats[8])
    assert view.liveness.send_heartbeat(beyond, ring=3) == (False, None)
    assert view.liveness.send_heartbeat(beyond) is None and view.liveness.heartbeat(beyond) is not None


def test_on_etcd_reading_every_peer_costs_a_request_per_128_ranks(job: tuple[JobView, EtcdClient | None]) -> None:
    view, client = job
    if client is None:
        pytest.skip("request counts are etcd's")
    write_records(view)
    before = client.requests
    view.liveness.heartbeats(list(range(RANKS)))
    view.arrivals(EXIT_BARRIER, list(range(RANKS)))
    assert client.requests - before == 2 * -(-RANKS // 128)  # one per rank each would be 1200
    before = client.requests
    view.liveness.peer_records(list(range(RANKS)))
    assert client.requests - before == -(-3 * RANKS // 128)  # left, heartbeats and positions in one read
    successor = view.liveness.heartbeat(2)
    before = client.requests
    assert view.liveness.send_heartbeat(1, ring=2) == (False, successor)
    assert client.requests - before == 1  # the heartbeat with its ring check in one request


def test_a_record_read_is_one_request_on_etcd_and_reads_as_before(job: tuple[JobView, EtcdClient | None]) -> None:
    """A restart's ranks all read the same single records at once: each read is one request (not an existence
    check and a read), with the same answers on any store, absent records included."""
    from elastic_ft.coordination.iteration import COMPLETED, iteration_store

    view, client = job
    base = view.base
    iteration = iteration_store(base, 3)
    absent = (
        iteration.outcome(),
        iteration.interruptions(),
        iteration.terminated_ranks(),
        iteration.active_world_size(),
        iteration.termination_result(),
        iteration.progressed(),
        view.liveness.heartbeat(7),
        view.position(7),
        view.latest_iteration(),
        view.left(7),
        view.joiners(),
    )
    assert absent == (None, [], [], None, None, False, None, None, 0, None, [])
    iteration.decide_outcome(COMPLETED)
    iteration.record_interruption(2, "exception", "boom")
    iteration.record_terminated([2, 5])
    iteration.set_active_world_size(6)
    iteration.mark_progressed()
    iteration.set_heal_progress(0, 40, fresh=False)
    view.liveness.send_heartbeat(7)
    view.record_position(7, iteration=3, rank=1, world_size=6, active=True)
    view.store.set(keys.LATEST_ITERATION, "3")
    view.record_left(7, "exception", gave_up=False)
    view.register_joiner(9)
    if client is not None:
        before = client.requests
    assert iteration.outcome() == COMPLETED
    assert [(r.rank, r.kind) for r in iteration.interruptions()] == [(2, "exception")]
    assert iteration.terminated_ranks() == [2, 5] and iteration.active_world_size() == 6 and iteration.progressed()
    assert iteration.heal_progresses(2) == [{"step": 40, "fresh": False}, None]
    assert view.liveness.heartbeat(7) is not None and view.position(7) == {
        "iteration": 3,
        "rank": 1,
        "world_size": 6,
        "active": 1,
    }
    assert view.latest_iteration() == 3 and view.left(7) == {
        "kind": "exception",
        "gave_up": False,
        "message": "",
        "fatal": False,
    }
    assert view.joiners() == [9]
    if client is not None:
        assert client.requests - before == 11  # one a read: eleven reads
