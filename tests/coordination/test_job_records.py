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
    yield job_store(EtcdStore(client, f"/elastic_ft/{run_id}/round/0/store/", timedelta(seconds=5))), client
    client.close()


def write_records(job: JobView) -> None:
    for rank in range(RANKS):
        if rank % 3 == 0:
            continue  # never sent one
        job.send_heartbeat(rank, active_at=1000.0 + rank, reserve=rank % 7 == 0, next_in=1.0)
        job.record_position(rank, iteration=rank % 5, rank=rank, world_size=RANKS, active=rank % 2 == 0)
    job.set(f"{keys.HEARTBEAT}4", "not json")  # malformed: skipped
    job.set(f"{keys.POSITION}5", '{"iteration": -1}')
    for rank in (10, 11):
        job.set(keys.barrier_arrived(EXIT_BARRIER, rank), "1")
    for rank in (400, 401, 402):
        job.register_joiner(rank)
    job.claim_admission(400, "7")
    job.claim_admission(402, "withdrawn")


def test_batched_reads_answer_as_one_read_per_rank_does(job: tuple[JobView, EtcdClient | None]) -> None:
    view, _ = job
    write_records(view)
    ranks = list(range(RANKS))
    heartbeats = view.heartbeats(ranks)
    assert heartbeats == {rank: view.heartbeat(rank) for rank in ranks if view.heartbeat(rank) is not None}
    assert 4 not in heartbeats and 3 not in heartbeats and heartbeats[7].reserve and heartbeats[8].active_at == 1008.0
    positions = view.positions(ranks)
    assert positions == {rank: view.position(rank) for rank in ranks if view.position(rank) is not None}
    assert 5 not in positions and positions[8] == {"iteration": 3, "rank": 8, "world_size": RANKS, "active": 1}
    assert view.arrivals(EXIT_BARRIER, ranks) == {10, 11}
    assert view.admissions([400, 401, 402]) == {400: "7", 402: "withdrawn"}
    assert joined_ranks(view) == [400]
    assert view.heartbeats([]) == {} and view.arrivals(EXIT_BARRIER, []) == set()


def test_on_etcd_reading_every_peer_costs_a_request_per_128_ranks(job: tuple[JobView, EtcdClient | None]) -> None:
    view, client = job
    if client is None:
        pytest.skip("request counts are etcd's")
    write_records(view)
    before = client.requests
    view.heartbeats(list(range(RANKS)))
    view.arrivals(EXIT_BARRIER, list(range(RANKS)))
    assert client.requests - before == 2 * -(-RANKS // 128)  # one per rank each would be 1200
