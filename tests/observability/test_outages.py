"""etcd's outages as the job saw them (``elastic_ft.observability.outages``), and where they are shown."""

from __future__ import annotations

import logging
import time

import pytest

from elastic_ft.etcd.kv import EtcdUnavailableError
from elastic_ft.etcd.outage import Outages, bounded, grace, patiently, time_left
from elastic_ft.observability.events import JobEvent
from elastic_ft.observability.outages import describe_outage, outages
from elastic_ft.observability.timeline import build_timeline
from elastic_ft.runtime.waits import Backoff


def event(
    name: str, t: float, *, node: str = "n0", rank: int | None = None, source: str = "agent", **data: object
) -> JobEvent:
    return JobEvent(name=name, time=t, run_id="run", source=source, node=node, rank=rank, data=data)


def test_the_processes_spans_merge_into_the_jobs_outages_with_who_waited() -> None:
    events = [
        event("etcd_unavailable", 100.0, node="a"),
        event("etcd_unavailable", 101.0, node="b"),
        event("etcd_unavailable", 100.5, node="a", rank=0, source="worker"),
        event("etcd_available", 130.0, node="a", seconds=30.0, since=100.0),
        event("etcd_available", 131.0, node="b", seconds=30.0, since=101.0),
        event("etcd_available", 129.0, node="a", rank=0, source="worker", seconds=28.5, since=100.5),
        event("fault_detected", 140.0, node="a", rank=1, source="worker", kind="raise"),
        event("etcd_unavailable", 200.0, node="b"),  # a second one, not over yet
    ]
    first, second = outages(events)
    assert (first.start, first.end, first.seen_by) == (100.0, 131.0, ("node a", "node b", "rank 0"))
    assert (second.start, second.end, second.seen_by) == (200.0, None, ("node b",))
    assert second.seconds(now=210.0) == 10.0


def test_an_end_whose_start_left_the_log_still_counts() -> None:
    (only,) = outages([event("etcd_available", 50.0, seconds=20.0, since=30.0)])
    assert (only.start, only.end) == (30.0, 50.0)


def test_status_describes_an_outage_in_one_line() -> None:
    record = {"start": 100.0, "end": None, "seconds": 12.0, "seen_by": ["node a", "rank 0", "rank 1"]}
    text = describe_outage(record)
    assert "now (still going on)" in text and "(12.0 s)" in text and "1 node process(es) and 2 rank(s)" in text


def test_the_timeline_shades_the_outages() -> None:
    events = [
        event("iteration_started", 90.0, rank=0, source="worker", world_size=1, active_world_size=1, step=0),
        event("etcd_unavailable", 100.0),
        event("etcd_available", 130.0, seconds=30.0, since=100.0),
    ]
    timeline = build_timeline(events)
    assert timeline.counts()["etcd_outages"] == 1
    assert (timeline.etcd_outages[0].start, timeline.etcd_outages[0].end) == (100.0, 130.0)


# ---- the process's record and its waits (elastic_ft.etcd.outage) ----


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    clock = [10.0]
    record = Outages(clock=lambda: clock[0], wall=lambda: 1000.0 + clock[0])
    with caplog.at_level(logging.WARNING, logger="elastic_ft.etcd.outage"):
        for _ in range(5):
            record.failed("http://e:2379", "Deadline Exceeded")
        assert record.down_since() == 10.0
        clock[0] = 40.0
        record.answered("http://e:2379")
        record.answered("http://e:2379")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "unreachable (Deadline Exceeded)" in messages[0]
    assert "answers again after 30.0 s away (5 request(s) retried)" in messages[1]
    assert (record.count, record.seconds, record.down_since(), record.last_ended) == (1, 30.0, None, 40.0)


def test_backoff_doubles_to_its_cap_with_jitter_in_the_upper_half() -> None:
    backoff = Backoff(first=0.1, cap=0.4)
    pauses = [backoff.next() for _ in range(5)]
    for pause, ceiling in zip(pauses, [0.1, 0.2, 0.4, 0.4, 0.4], strict=True):
        assert ceiling / 2 <= pause <= ceiling
    backoff.reset()
    assert backoff.next() <= 0.1
    with pytest.raises(ValueError, match="0 < first <= cap"):
        Backoff(first=1.0, cap=0.5)


def test_a_bound_caps_every_wait_inside_it_and_only_tightens() -> None:
    assert time_left(15.0) == 15.0
    with bounded(2.0, "outer"):
        assert 1.9 < time_left(15.0) <= 2.0
        with bounded(60.0, "looser"):
            assert time_left(15.0) <= 2.0  # an inner bound never extends the outer one
        with grace(5.0, "the last read"):
            assert 4.9 < time_left(15.0) <= 5.0  # ... except a grace, for a wait's last read
    assert time_left(15.0) == 15.0


def test_patiently_retries_an_unreachable_etcd_until_its_bound_and_says_so() -> None:
    calls = []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise EtcdUnavailableError("no answer")
        return "ok"

    assert patiently(flaky, "a read", seconds=5.0) == "ok" and len(calls) == 3
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=r"a read: etcd was unreachable for the last .* and a read ended"):
        patiently(lambda: (_ for _ in ()).throw(EtcdUnavailableError("no answer")), "a read", seconds=0.3)
    assert time.monotonic() - started < 1.0
