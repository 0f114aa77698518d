"""Goodput from a job's events: every second of wall time in one part, each restart by kind and phase."""

from __future__ import annotations

import math
from typing import Any

import pytest

from elastic_ft.observability.events import JobEvent
from elastic_ft.observability.goodput import PARTS, goodput, report_lines
from elastic_ft.untrusted import MalformedRecord

pytestmark = pytest.mark.unit


def event(name: str, time: float, **fields: Any) -> JobEvent:
    source = fields.pop("source", "agent" if name in ("escalated", "job_finished", "workers_started") else "worker")
    if name in ("node_joined", "round_closed", "round_opened"):
        source = "rendezvous"
    keys = ("iteration", "rank", "round", "node")
    placed = {key: fields.pop(key) for key in keys if key in fields}
    return JobEvent(name, time, "run", source, data=fields, **placed)


def restart(iteration: int, fault: float, decided: float, kind: str = "exception", rank: int = 1) -> JobEvent:
    faults = [{"kind": kind, "ranks": [rank], "message": "boom"}]
    return event("restart_decided", decided, iteration=iteration, rank=0, fault_time=fault, kind=kind, faults=faults)


def first_steps(
    iteration: int, at: dict[int, tuple[float, float, list[tuple[str, float]]]], step: int
) -> list[JobEvent]:
    """``recovery_phases`` of ``iteration`` by rank: (when, began, phases)."""
    return [
        event(
            "recovery_phases",
            when,
            iteration=iteration,
            rank=rank,
            step=step,
            began=began,
            phases=_phases(began, phases),
        )
        for rank, (when, began, phases) in at.items()
    ]


def _phases(began: float, phases: list[tuple[str, float]]) -> list[dict[str, Any]]:
    ended, timed = began, []
    for name, seconds in phases:
        ended += seconds
        timed.append({"phase": name, "seconds": seconds, "at": ended})
    return timed


def job(resumed_step: int = 201) -> list[JobEvent]:
    """Joined at 100, round closed at 101, first step at 104, 0.1 s a step, an exception at 120 (step 200) whose
    restart resumed at 121.5, training until 150, finished at 152."""
    return [
        event("node_joined", 100.0, node="a", round=0),
        event("round_closed", 101.0, node="a", round=0, members=["a"]),
        event("first_step", 104.0, rank=0, iteration=0, step=1),
        event("progress", 110.0, rank=0, iteration=0, step=61),
        event("progress", 115.0, rank=0, iteration=0, step=111),
        event("fault_detected", 119.99, rank=1, iteration=0, kind="exception", step=200),
        restart(0, 120.0, 120.2),
        *first_steps(
            1,
            {
                0: (121.0, 120.1, [("unwound", 0.3), ("first_step", 0.6)]),
                1: (121.5, 120.1, [("unwound", 0.4), ("first_step", 1.0)]),
            },
            resumed_step,
        ),
        event("completed", 150.0, rank=0, iteration=1, step=resumed_step + 290),
        event("completed", 149.9, rank=1, iteration=1, step=resumed_step + 284),
        event("job_finished", 152.0, node="a", state="SUCCEEDED"),
    ]


def test_every_second_of_the_wall_time_is_in_one_part() -> None:
    found = goodput(job())
    assert (found.start, found.end, found.finished) == (100.0, 152.0, True)
    expected = {"waiting_for_nodes": 1.0, "start_up": 3.0, "recovery": 1.5, "shutdown": 2.0, "redone": 0.0}
    for part, seconds in expected.items():
        assert math.isclose(found.parts[part], seconds, abs_tol=1e-9), (part, found.parts)
    assert math.isclose(found.parts["training"], 52.0 - 7.5)
    assert math.isclose(sum(found.parts.values()), found.wall) and set(found.parts) == set(PARTS)
    assert math.isclose(found.ettr, 44.5 / 52.0)
    # The restart: from its fault to the last rank's first step, by that rank's phases, detection first.
    assert found.by_kind("recovery") == {"exception": (1, pytest.approx(1.5))}
    assert found.by_phase("recovery") == pytest.approx({"detection": 0.1, "unwound": 0.4, "first_step": 1.0})
    (costliest,) = found.costliest()
    assert costliest.cause == "rank(s) [1]: boom" and costliest.kind == "exception"


def test_steps_taken_again_after_a_checkpoint_read_are_redone_not_training() -> None:
    """The job reached step 200; the restart resumed at 150 (a checkpoint): 50 steps at 0.1 s are redone."""
    found = goodput(job(resumed_step=151))
    assert found.redone_steps == 50 and found.step_seconds == pytest.approx(0.1)
    assert found.parts["redone"] == pytest.approx(5.0)
    assert found.parts["training"] == pytest.approx(52.0 - 7.5 - 5.0)
    assert sum(found.parts.values()) == pytest.approx(found.wall)


def test_a_fault_during_a_recovery_counts_its_seconds_once() -> None:
    """A second fault at 121.0, while the first restart runs until 121.5: its stretch starts at 121.5."""
    events = [
        *job()[:-3],
        restart(1, 121.0, 121.6, kind="hang", rank=0),
        *first_steps(2, {0: (124.0, 121.7, [("first_step", 2.3)])}, 202),
        *job()[-3:],
    ]
    found = goodput(events)
    (first, second) = [s for s in found.stretches if s.part == "recovery"]
    assert (first.start, first.end) == (120.0, 121.5)
    assert (second.start, second.end, second.kind) == (121.5, 124.0, "hang")
    assert sum(end - start for _, start, end in second.phases) == pytest.approx(second.seconds)
    assert found.parts["recovery"] == pytest.approx(4.0)
    assert sum(found.parts.values()) == pytest.approx(found.wall)


def test_a_process_restart_is_detection_waiting_for_nodes_and_start_up() -> None:
    events = [
        *job()[:-3],
        event("fault_detected", 130.0, source="agent", rank=1, kind="process_died", node="a"),
        event("escalated", 131.0, node="a", round=0, reason="rank(s) [1] failed outside a Wrapper"),
        event("round_closed", 133.0, node="a", round=1, members=["a"]),
        event("first_step", 136.0, rank=0, iteration=0, step=101),
        *job()[-3:],
    ]
    found = goodput(events)
    (stretch,) = [s for s in found.stretches if s.part == "process_restarts"]
    assert (stretch.start, stretch.end, stretch.kind) == (130.0, 136.0, "process_died")
    assert [(name, end - start) for name, start, end in stretch.phases] == [
        ("detection", 1.0),
        ("waiting for nodes", 2.0),
        ("start-up", 3.0),
    ]
    assert "failed outside a Wrapper" in stretch.cause
    assert found.redone_steps == 101  # the new processes resumed at step 100 (a checkpoint), the job was at 201
    assert sum(found.parts.values()) == pytest.approx(found.wall)


def test_a_running_job_is_reported_until_now() -> None:
    found = goodput(job()[:-3], now=160.0)
    assert (found.end, found.finished, found.parts["shutdown"]) == (160.0, False, 0.0)
    assert sum(found.parts.values()) == pytest.approx(60.0)
    lines = report_lines(found)
    assert lines[0].startswith("run run: 60.0 s of wall time (running); ETTR ")
    assert any(line.startswith("total") and "60.00" in line and "100.0%" in line for line in lines), lines


def test_no_events_or_several_runs_are_refused() -> None:
    with pytest.raises(MalformedRecord, match="no events to report on"):
        goodput([])
    other = JobEvent("progress", 101.0, "other", "worker", rank=0, data={"step": 1})
    with pytest.raises(MalformedRecord, match="belong to 2 runs"):
        goodput([*job(), other])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--events", "{missing}"], "cannot read the events file"),
        (["--events", "{bad}"], "bad.jsonl:2: an event is not JSON"),
        (["--events", "{two_runs}"], "belong to 2 runs"),
        ([], "give --events FILE, or --rdzv-endpoint and --rdzv-id"),
        (["--events", "{missing}", "--rdzv-id=x"], "not both"),
    ],
)
def test_elastic_ft_report_refuses_bad_input_with_what_is_wrong(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    from elastic_ft.launcher.cli import main
    from elastic_ft.observability.event_files import write_events_file

    bad = tmp_path / "bad.jsonl"
    bad.write_text(job()[0].to_json() + "\nnot json\n")
    two_runs = tmp_path / "two.jsonl"
    write_events_file(str(two_runs), [*job(), JobEvent("progress", 101.0, "other", "worker", rank=0, data={"step": 1})])
    paths = {"missing": tmp_path / "missing.jsonl", "bad": bad, "two_runs": two_runs}
    with pytest.raises(SystemExit) as exited:
        main(["report", *(arg.format(**paths) for arg in args)])
    assert exited.value.code == 2
    assert expected in capsys.readouterr().err


def test_elastic_ft_report_prints_the_table_and_the_json(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from elastic_ft.launcher.cli import main
    from elastic_ft.observability.event_files import write_events_file

    path = tmp_path / "events.jsonl"
    write_events_file(str(path), job())
    for extra, check in (([], "ETTR 85.6 %"), (["--json"], '"ettr": 0.8558')):
        with pytest.raises(SystemExit) as exited:
            main(["report", "--events", str(path), *extra])
        out = capsys.readouterr().out
        assert exited.value.code == 0 and check in out, out
    assert json.loads(out)["parts"]["recovery"] == 1.5


def test_a_long_cause_is_cut_after_a_word_and_says_so() -> None:
    """The report's line of a costliest fault fits 160 characters; a cause cut short ends after a whole word
    with an ellipsis rather than mid-word, so a reader knows the events hold more."""
    message = "rank 4 (initial rank 97) made no progress for 0.6 s: " + "it waits for\ninitial rank 12 " * 20
    flat = "rank(s) [1]: " + " ".join(message.split())
    events = job()
    events[6] = event(
        "restart_decided",
        120.2,
        iteration=0,
        rank=0,
        fault_time=120.0,
        kind="exception",
        faults=[{"kind": "exception", "ranks": [1], "message": message}],
    )
    found = goodput(events)
    (costliest,) = found.costliest()
    kept = costliest.cause.removesuffix(" …")
    assert len(costliest.cause) <= 200 and kept != costliest.cause, costliest.cause
    assert flat.startswith(kept + " ") and len(kept) > 150, costliest.cause  # whole words, one line
    (line,) = [line for line in report_lines(found) if line.startswith("  1. ")]
    head = "  1.   1.50 s at +20.0 s  exception: "
    assert len(line) <= 160 and line.startswith(head) and line.endswith(" …"), line
    assert flat.startswith(line.removeprefix(head).removesuffix(" …") + " "), line
    # A word longer than the line is cut inside it, still marked.
    events[6].data["faults"][0]["message"] = "x" * 300
    assert goodput(events).costliest()[0].cause == "rank(s) [1]: " + "x" * 186 + "…"
