"""A process's event sink: torch's events handler and the run's etcd log, off the caller's thread, never blocking."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.events import handlers as torch_handlers

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.endpoints import parse_endpoints
from elastic_ft.etcd.event_log import EventLog
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.keys import RunKeys
from elastic_ft.observability import sink as event_sink
from elastic_ft.observability.sink import EventsHandoff, EventSink
from elastic_ft.testing.fault_proxy import FaultProxy


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(json.loads(record.getMessage()))


@pytest.fixture
def torch_handler() -> Iterator[_Collect]:
    """A torch events handler, registered as a user registers theirs for --event-log-handler."""
    handler = _Collect()
    torch_handlers._log_handlers["elastic_ft_test"] = handler
    try:
        yield handler
    finally:
        del torch_handlers._log_handlers["elastic_ft_test"]


def test_events_reach_torchs_handler_and_the_run_log_in_order(
    etcd_client: EtcdClient, run_id: str, torch_handler: _Collect
) -> None:
    keys = RunKeys("/elastic_ft", run_id)
    sink = EventSink(run_id, "agent", EventLog(etcd_client, keys).append, "elastic_ft_test", node="n0").start()
    sink.emit("workers_started", round=0, ranks=[0, 1], pids=[11, 12])
    sink.emit("fault_detected", source="worker", rank=1, iteration=0, kind="RuntimeError", message="boom")
    assert sink.close(timeout=10)
    stored = EventLog(etcd_client, keys).read().events
    assert [(e.name, e.source, e.node) for e in stored] == [
        ("workers_started", "agent", "n0"),
        ("fault_detected", "worker", "n0"),
    ]
    assert [r["name"] for r in torch_handler.records] == ["elastic_ft.workers_started", "elastic_ft.fault_detected"]
    assert torch_handler.records[1]["metadata"]["rank"] == 1 and torch_handler.records[1]["source"] == "WORKER"


def test_an_unknown_torch_handler_or_a_bad_event_is_logged_once_and_the_rest_goes_on(
    etcd_client: EtcdClient, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = RunKeys("/elastic_ft", run_id)
    sink = EventSink(run_id, "agent", EventLog(etcd_client, keys).append, "no-such-handler").start()
    with caplog.at_level(logging.WARNING, logger="elastic_ft.observability.sink"):
        sink.emit("no_such_event")
        sink.emit("job_finished", state="SUCCEEDED")
        sink.emit("job_finished", state="SUCCEEDED")
        assert sink.close(timeout=10)
    assert [e.name for e in EventLog(etcd_client, keys).read().events] == ["job_finished", "job_finished"]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no torch events handler named 'no-such-handler'" in m for m in messages) == 1
    assert sum("dropping an invalid event no_such_event" in m for m in messages) == 1


def test_emit_never_blocks_the_caller_when_etcd_is_frozen(etcd: EtcdServer, run_id: str) -> None:
    endpoint = etcd.endpoints[0]
    with FaultProxy((endpoint.host, endpoint.port)) as proxy:
        client = EtcdClient(parse_endpoints(proxy.endpoint), request_timeout=0.5, connect_timeout=1.0)
        try:
            sink = EventSink(run_id, "worker", EventLog(client, RunKeys("/elastic_ft", run_id)).append).start()
            proxy.freeze()
            started = time.monotonic()
            for step in range(200):
                sink.emit("progress", rank=0, step=step)
            assert time.monotonic() - started < 0.5  # queued, not sent, by the caller
            assert not sink.close(timeout=2.0)  # bounded: gives up on a frozen etcd ...
            assert sink.dropped == 0  # ... but drops nothing while it waits
        finally:
            proxy.thaw()
            client.close()


def test_events_emitted_while_etcd_is_away_are_stored_once_and_in_order_when_it_returns(
    etcd: EtcdServer, run_id: str
) -> None:
    endpoint = etcd.endpoints[0]
    keys = RunKeys("/elastic_ft", run_id)
    with FaultProxy((endpoint.host, endpoint.port)) as proxy:
        client = EtcdClient(parse_endpoints(proxy.endpoint), request_timeout=0.5, connect_timeout=1.0)
        try:
            sink = EventSink(run_id, "worker", EventLog(client, keys).append).start()
            sink.emit("iteration_started", rank=0, iteration=0)
            time.sleep(0.3)
            proxy.freeze()
            for iteration in range(1, 6):
                sink.emit("iteration_started", rank=0, iteration=iteration)
            time.sleep(4.0)  # four of the client's bounds: the sender keeps what etcd did not take
            proxy.thaw()
            assert sink.close(timeout=10.0)
            assert sink.dropped == 0
        finally:
            proxy.thaw()
            client.close()
    reader = EtcdClient(etcd.endpoints)
    try:
        stored = EventLog(reader, keys).read().events
    finally:
        reader.close()
    assert [event.iteration for event in stored if event.name == "iteration_started"] == [0, 1, 2, 3, 4, 5]


def test_progress_is_sampled_when_it_changes_and_once_more_at_the_end(etcd_client: EtcdClient, run_id: str) -> None:
    keys = RunKeys("/elastic_ft", run_id)
    current = {"rank": 0, "step": 1}
    sink = EventSink(run_id, "worker", EventLog(etcd_client, keys).append).start()
    sink.sample_progress(lambda: dict(current), 0.05)
    time.sleep(0.5)  # about ten samples of the same step: one event
    sink.sample_progress(lambda: dict(current), 3600.0)  # no more periodic samples after the next
    time.sleep(0.2)
    current["step"] = 7  # reached after the last periodic sample: only the final one sees it
    assert sink.close(timeout=5)
    assert [e.data["step"] for e in EventLog(etcd_client, keys).read(stream="progress").events] == [1, 7]


def test_the_workers_hand_off_is_checked() -> None:
    handoff = EventsHandoff("/elastic_ft", "run", "node0", 4096, "console", 0.5)
    assert EventsHandoff.from_env(handoff.to_env()) == handoff
    assert EventsHandoff.from_env({}) is None
    for bad in (
        '{"etcd_prefix": 1}',
        "not json",
        json.dumps({**handoff.__dict__, "capacity": 0}),
        json.dumps({**handoff.__dict__, "progress_interval": -1}),
    ):
        with pytest.raises(ValueError, match="ELASTIC_FT_EVENTS"):
            EventsHandoff.from_env({"ELASTIC_FT_EVENTS": bad})


def test_without_a_sink_emit_does_nothing() -> None:
    previous = event_sink.install(None)
    try:
        event_sink.emit("job_finished", state="SUCCEEDED")  # no sink: no error, nothing sent
        assert event_sink.installed() is None
    finally:
        event_sink.install(previous)
