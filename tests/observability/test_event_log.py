"""The run's event log on a real etcd: order, bound, concurrent writers, lost answers, forged slots."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.endpoints import parse_endpoints
from elastic_ft.etcd.event_log import EventLog
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.keys import RunKeys
from elastic_ft.observability.events import JobEvent
from elastic_ft.testing.fault_proxy import FaultProxy


def progress(run_id: str, rank: int, step: int) -> JobEvent:
    return JobEvent("progress", 1700000000.0 + step, run_id, "worker", rank=rank, data={"step": step})


def fault(run_id: str, rank: int, step: int) -> JobEvent:
    return JobEvent(
        "fault_detected", 1700000000.0 + step, run_id, "worker", rank=rank, data={"kind": "RuntimeError", "step": step}
    )


@pytest.fixture
def keys(run_id: str) -> RunKeys:
    return RunKeys("/elastic_ft", run_id)


def test_events_come_back_in_the_order_they_were_logged(etcd_client: EtcdClient, keys: RunKeys) -> None:
    log = EventLog(etcd_client, keys)
    assert [log.append(fault(keys.run_id, 0, step)) for step in range(5)] == [0, 1, 2, 3, 4]
    found = log.read()
    assert [e.data["step"] for e in found.events] == [0, 1, 2, 3, 4]
    assert [e.seq for e in found.events] == [0, 1, 2, 3, 4] and not found.malformed
    assert [e.seq for e in log.read(after=2).events] == [3, 4]
    assert log.read(after=4).events == []  # one read of the counter, nothing else


def test_each_stream_keeps_only_its_last_capacity_events(etcd_client: EtcdClient, keys: RunKeys) -> None:
    log = EventLog(etcd_client, keys, capacity=4)
    log.append(fault(keys.run_id, 0, 0))
    for step in range(1, 11):
        log.append(progress(keys.run_id, 0, step))
    assert [e.data["step"] for e in log.read(stream="progress").events] == [7, 8, 9, 10]
    assert etcd_client.count_prefix(keys.events_ring("progress")) == 4
    # however much progress was sampled, the fault is still there
    assert [(e.name, e.data["step"]) for e in log.read().events] == [("fault_detected", 0)]
    assert [e.data["step"] for e in log.read_all().events] == [0, 7, 8, 9, 10]  # merged by time


def test_concurrent_writers_get_distinct_numbers_and_lose_nothing(etcd: EtcdServer, keys: RunKeys) -> None:
    def write(rank: int) -> None:
        client = EtcdClient(etcd.endpoints)
        try:
            log = EventLog(client, keys)
            for step in range(15):
                log.append(fault(keys.run_id, rank, step))
        finally:
            client.close()

    threads = [threading.Thread(target=write, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    client = EtcdClient(etcd.endpoints)
    try:
        events = EventLog(client, keys).read().events
    finally:
        client.close()
    assert [e.seq for e in events] == list(range(60))
    assert sorted((e.rank, e.data["step"]) for e in events) == [(r, s) for r in range(4) for s in range(15)]
    for rank in range(4):  # each writer's events in its own order
        assert [e.data["step"] for e in events if e.rank == rank] == list(range(15))


def test_a_writer_appends_with_one_request_and_one_more_when_overtaken(
    etcd_client: EtcdClient, etcd: EtcdServer, keys: RunKeys
) -> None:
    # A node relay is its host's only writer: after its first append it knows the counter, so each append is
    # one transaction. Another writer in between costs it one refused try, never a number twice.
    log = EventLog(etcd_client, keys)
    assert log.append(fault(keys.run_id, 0, 0)) == 0
    before = etcd_client.requests
    assert [log.append(fault(keys.run_id, 0, step)) for step in (1, 2, 3)] == [1, 2, 3]
    assert etcd_client.requests - before == 3
    other = EtcdClient(etcd.endpoints)
    try:
        assert EventLog(other, keys).append(fault(keys.run_id, 1, 0)) == 4
    finally:
        other.close()
    before = etcd_client.requests
    assert log.append(fault(keys.run_id, 0, 4)) == 5
    assert etcd_client.requests - before == 2
    assert [e.seq for e in EventLog(etcd_client, keys).read().events] == [0, 1, 2, 3, 4, 5]


@pytest.fixture
def proxy(etcd: EtcdServer) -> Iterator[FaultProxy]:
    endpoint = etcd.endpoints[0]
    with FaultProxy((endpoint.host, endpoint.port)) as running:
        yield running


def test_an_append_whose_answer_is_lost_is_logged_once(
    etcd_client: EtcdClient, keys: RunKeys, proxy: FaultProxy
) -> None:
    client = EtcdClient(parse_endpoints(proxy.endpoint), request_timeout=1.0, connect_timeout=5.0)
    try:
        log = EventLog(client, keys)
        log.append(fault(keys.run_id, 0, 0))
        proxy.lose_next_reply(after=0)  # the transaction's answer is lost (the counter is known: no read first)
        assert log.append(fault(keys.run_id, 0, 1)) == 1
        assert proxy.replies_lost == 1
        log.append(fault(keys.run_id, 0, 2))
    finally:
        client.close()
    assert [e.data["step"] for e in EventLog(etcd_client, keys).read().events] == [0, 1, 2]


def test_forged_slots_are_skipped_and_listed(etcd_client: EtcdClient, keys: RunKeys) -> None:
    log = EventLog(etcd_client, keys)
    log.append(fault(keys.run_id, 0, 0))
    etcd_client.put(keys.event_slot(7), b"{not json")
    etcd_client.put(keys.event_slot(8), b'{"name": "rm -rf", "time": 1, "run_id": "x", "source": "worker", "seq": 8}')
    etcd_client.put(
        keys.event_slot(9), progress(keys.run_id, 0, 1).to_json().replace('"rank"', '"seq": 9, "rank"').encode()
    )
    etcd_client.put(keys.events_ring() + "x/y", b"{}")
    found = log.read()
    assert [e.data["step"] for e in found.events] == [0]
    reasons = {entry["key"].rsplit("/", 1)[-1]: entry["reason"] for entry in found.malformed}
    assert "not JSON" in reasons["7"] and "unknown event" in reasons["8"] and reasons["y"] == "not an event slot"
    assert "not an event of the main stream" in reasons["9"]  # a progress event where faults are kept
    etcd_client.put(keys.events_next(), b"many")
    with pytest.raises(ValueError, match="expected a count"):
        log.append(fault(keys.run_id, 0, 1))


def test_a_bad_capacity_is_refused_before_any_request(etcd_client: EtcdClient, keys: RunKeys) -> None:
    requests = etcd_client.requests
    for capacity in (0, -1, 100_001, True, 2.5):
        with pytest.raises(ValueError, match="capacity"):
            EventLog(etcd_client, keys, capacity)  # type: ignore[arg-type]
    assert etcd_client.requests == requests
