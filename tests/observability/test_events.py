"""The event model, the events file, fault grouping and the timeline's model: pure, no etcd."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_ft.coordination.fault_records import Interruption, group_faults, restart_reporter
from elastic_ft.observability.event_files import read_events_file, write_events_file
from elastic_ft.observability.events import EVENTS, JobEvent
from elastic_ft.observability.timeline import build_timeline
from elastic_ft.untrusted import MalformedRecord


def event(name: str, t: float, **fields: object) -> JobEvent:
    where = {k: fields.pop(k) for k in ("node", "round", "iteration", "rank", "seq") if k in fields}
    source = "agent" if name in ("workers_started", "node_died", "respawned", "escalated", "job_finished") else "worker"
    if name in ("node_joined", "round_closed", "node_left"):
        source = "rendezvous"
    return JobEvent(name, t, "run", str(fields.pop("source", source)), data=fields, **where)  # type: ignore[arg-type]


def test_an_event_round_trips_through_json_and_torch() -> None:
    original = event(
        "fault_detected",
        1700000000.5,
        node="n0",
        round=2,
        iteration=1,
        rank=3,
        kind="RuntimeError",
        message="boom",
        step=30,
    )
    back = JobEvent.from_json(original.to_json())
    assert back == original
    torch_event = original.to_torch()
    assert torch_event.name == "elastic_ft.fault_detected"
    assert torch_event.source.name == "WORKER" and torch_event.timestamp == 1700000000500
    assert torch_event.metadata["rank"] == 3 and torch_event.metadata["kind"] == "RuntimeError"
    assert json.loads(torch_event.serialize())["metadata"]["message"] == "boom"  # what handlers receive


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"name": "no_such_event", "time": 1, "run_id": "r", "source": "agent"}, "unknown event 'no_such_event'"),
        ({"name": "progress", "time": "now", "run_id": "r", "source": "worker"}, "event has time='now'"),
        ({"name": "progress", "time": float("inf"), "run_id": "r", "source": "worker"}, "event has time=inf"),
        ({"name": "progress", "time": 1, "run_id": "r", "source": "kernel"}, "event source 'kernel'"),
        ({"name": "progress", "time": 1, "run_id": "r", "source": "worker", "rank": -1}, "rank=-1"),
        ({"name": "progress", "time": 1, "run_id": "r", "source": "worker", "rank": True}, "rank=True"),
        ({"name": "progress", "time": 1, "run_id": "r", "source": "worker", "data": {"x": {"y": 1}}}, "data x="),
        ({"name": "progress", "time": 1, "run_id": 7, "source": "worker"}, "must be strings"),
        ([1, 2], "is not a JSON object"),
    ],
)
def test_a_malformed_event_is_refused_with_what_is_wrong(document: object, expected: str) -> None:
    with pytest.raises(MalformedRecord, match=expected.replace("(", r"\(")):
        JobEvent.from_json(json.dumps(document))


def test_long_texts_are_cut_and_every_name_is_documented() -> None:
    long = event("gave_up", 1.0, rank=1, message="x" * 10_000)
    assert len(long.data["message"]) == 500
    assert all(description for description in EVENTS.values())
    # A line that shows an event cuts its long values after a whole word (a list's too), with an ellipsis.
    faults = [{"kind": "exception", "ranks": [rank], "message": "boom on\nrank"} for rank in range(40)]
    shown = event("restart_decided", 1.0, rank=0, message="it waits for rank 12 " * 20, faults=faults).describe()
    message, listed = shown.split(" message=")[1].split(" faults=")
    assert message.startswith("'it waits for rank 12 it") and message.endswith(" …'") and len(message) <= 122
    assert listed.startswith('[{"kind": "exception"') and listed.endswith(" …") and len(listed) <= 160
    assert "\n" not in shown


def test_an_events_file_is_read_in_log_order_and_bad_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = [event("progress", 3.0, rank=0, step=5, seq=2), event("iteration_started", 1.0, rank=0, seq=0, step=0)]
    write_events_file(str(path), events)
    assert [e.seq for e in read_events_file(str(path))] == [0, 2]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(MalformedRecord, match="holds no events"):
        read_events_file(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(events[0].to_json() + "\nnot json\n")
    with pytest.raises(MalformedRecord, match=r"bad.jsonl:2: an event is not JSON"):
        read_events_file(str(bad))


def test_one_fault_seen_by_every_rank_is_reported_once_with_its_ranks() -> None:
    records = [
        Interruption(1, "terminated", "process 4242 died", 10.0),  # its monitor process reports it first,
        Interruption(1, "terminated", "pid 4242: signal SIGKILL", 10.05),  # then its agent
        Interruption(0, "RuntimeError", "[gloo] Connection closed by peer [127.0.0.1]:38211", 10.1),
        Interruption(2, "RuntimeError", "[gloo] Connection closed by peer [127.0.0.1]:40917", 10.2),
        Interruption(3, "RuntimeError", "[gloo] Connection closed by peer [127.0.0.1]:40917", 10.3),
    ]
    groups = group_faults(records)
    assert [(g.kind, g.ranks) for g in groups] == [("terminated", (1,)), ("RuntimeError", (0, 2, 3))]
    assert (groups[0].message, groups[0].time) == ("pid 4242: signal SIGKILL", 10.0)  # once, in detail
    assert groups[1].describe() == "RuntimeError on ranks [0, 2, 3]: [gloo] Connection closed by peer [127.0.0.1]:38211"
    assert restart_reporter(4, [1]) == 0
    assert restart_reporter(4, [0, 1]) == 2
    assert restart_reporter(2, [0, 1]) is None


def test_the_timeline_model_holds_what_the_picture_draws() -> None:
    events = [
        event("round_closed", 0.0, round=0, members=["a", "b"], reason="2 joined"),
        *[
            event("iteration_started", 1.0 + r / 10, rank=r, iteration=0, active_world_size=4, world_size=6, step=0)
            for r in range(6)
        ],
        event("progress", 2.0, rank=0, iteration=0, step=20),
        event("fault_detected", 3.0, rank=3, source="agent", kind="process_died", message="pid 1: SIGKILL"),
        event("node_died", 3.1, node="b", ranks=[2, 3], reporter="a"),
        event("fault_detected", 3.05, rank=0, iteration=0, kind="peer_lost", message="Connection reset by peer"),
        event("restart_decided", 3.6, rank=0, iteration=0, fault_time=3.0, kind="terminated", faults=[]),
        event("spare_activated", 3.8, rank=4, iteration=1),
        *[
            event("iteration_started", 3.9, rank=r, iteration=1, active_world_size=4, world_size=4, step=20)
            for r in (0, 1, 4, 5)
        ],
        event("escalated", 9.0, round=0, reason="x"),
        event("progress", 10.0, rank=4, iteration=1, step=60),
    ]
    timeline = build_timeline(events)
    assert timeline.counts() == {
        "faults": 2,
        "broken_connections": 1,
        "restarts": 1,
        "escalations": 1,
        "rounds": 1,
        "activations": 1,
        "respawns": 0,
        "ranks": 6,
        "world_changes": 1,
        "etcd_outages": 0,
        "lost_stretches": 2,
    }
    # Shaded as the goodput report counts it: the restart until the next iteration started, the escalation on.
    assert [(span.label, span.start, span.end) for span in timeline.lost] == [
        ("recovery", 3.0, 3.9),
        ("process_restarts", 9.0, 10.0),
    ]
    assert timeline.ettr == pytest.approx((10.0 - 0.9 - 1.0) / 10.0)
    (restart,) = timeline.restarts
    assert (restart.start, restart.end) == (3.0, 3.9)
    assert timeline.progress[4] == [(1.4, 0), (3.9, 20), (10.0, 60)]
    assert [m.label for m in timeline.faults] == ["r3 process_died", "b died"]
    with pytest.raises(MalformedRecord, match="no events"):
        build_timeline([])
    with pytest.raises(MalformedRecord, match="2 runs"):
        build_timeline([events[0], JobEvent("progress", 1.0, "other", "worker")])
