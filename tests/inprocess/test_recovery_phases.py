"""Where a rank's recovery time goes (``elastic_ft.inprocess.restart.phases``, pure)."""

from __future__ import annotations

import pytest

from elastic_ft.inprocess.restart.phases import MOMENTS, RecoveryClock, phases


def test_each_phase_is_the_time_between_two_consecutive_moments() -> None:
    times = iter([10.05, 10.10, 10.30, 10.31, 10.50, 10.52, 10.60, 10.61, 10.90])
    clock = RecoveryClock(clock=lambda: next(times))
    clock.start(delivered_at=10.0)
    for moment in MOMENTS[1:-1]:
        clock.mark(moment)
    timed = clock.finish()
    assert timed is not None and not clock.open
    assert {p["phase"]: p["seconds"] for p in timed["phases"]} == {  # type: ignore[attr-defined]
        "unwound": 0.05,
        "released": 0.05,
        "finalized": 0.2,
        "terminated": 0.01,
        "assigned": 0.19,
        "started": 0.02,
        "checked": 0.08,
        "healed": 0.01,
        "first_step": 0.29,
    }
    assert [p["phase"] for p in timed["phases"]] == list(MOMENTS[1:])  # type: ignore[attr-defined]
    assert timed["began"] == 10.0 and timed["total"] == pytest.approx(0.9)


def test_the_event_carries_them_as_a_list_of_flat_records() -> None:
    """What the event model takes (JobEvent: scalars, or lists of flat mappings)."""
    from elastic_ft.observability.events import JobEvent

    fields = phases({"delivered": 1.0, "terminated": 1.4, "first_step": 2.0})
    event = JobEvent("recovery_phases", 2.0, "run", "worker", rank=0, iteration=1, data=fields)
    assert JobEvent.from_json(event.to_json()).data["phases"][1] == {"phase": "first_step", "seconds": 0.6, "at": 2.0}


def test_moments_not_passed_merge_into_the_next_phase_and_a_mark_counts_once() -> None:
    merged = phases({"delivered": 1.0, "terminated": 1.4, "first_step": 2.0})["phases"]
    assert [(p["phase"], p["seconds"]) for p in merged] == [("terminated", 0.4), ("first_step", 0.6)]  # type: ignore[attr-defined]
    times = iter([5.0, 5.5, 6.0])
    clock = RecoveryClock(clock=lambda: next(times))
    clock.start()
    clock.mark("unwound")
    clock.mark("unwound")  # the second pass of a moment changes nothing
    timed = clock.finish()
    assert [(p["phase"], p["seconds"]) for p in timed["phases"]] == [("unwound", 0.5), ("first_step", 0.5)]  # type: ignore[index]


def test_nothing_is_timed_outside_a_restart_and_unknown_moments_are_refused() -> None:
    clock = RecoveryClock()
    clock.mark("healed")
    assert clock.finish() is None
    with pytest.raises(ValueError, match="unknown recovery moment 'lunch'"):
        clock.mark("lunch")
