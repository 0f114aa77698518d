"""Where a recovery's seconds go: the Wrapper's ``recovery_phases`` events of a run, read back from etcd.

Each rank records, at its first step after a restart (or its admission),
the wall time of each moment of its recovery and the seconds of each phase
between them (``elastic_ft/inprocess/restart/phases.py``). A run's phases
are taken on its critical path: each phase's longest across the ranks.
Two come before the ranks' moments: ``detection``, from the fault (as the
script recorded it) to the restart's fault record (``restart_decided``'s
``fault_time``: the record of an exception, of a dead process reported by
its monitor process or agent, of a hang), and ``decision``, from that
record to the first rank's restart starting.
"""

from __future__ import annotations

import statistics
from typing import Any

from elastic_ft.inprocess.restart.phases import MOMENTS

#: The phases of a recovery in order: the two before the ranks' moments, then each moment's.
PHASES = ("detection", "decision", *MOMENTS[1:])


def run_phases(run_id: str, endpoints: Any, fault_time: float | None, last: bool = False) -> dict[str, float] | None:
    """The phases of the first restart of run ``run_id`` (``last``: of its last one; longest across ranks), from
    its event log; None if it recorded none. ``fault_time``: when the fault was injected (wall time), for the
    detection."""
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.etcd.event_log import EventLog
    from elastic_ft.keys import RunKeys

    client = EtcdClient(endpoints)
    try:
        events = EventLog(client, RunKeys("/elastic_ft", run_id)).read().events
    finally:
        client.close()
    return phases_of(events, fault_time, last)


def phases_of(events: list[Any], fault_time: float | None, last: bool = False) -> dict[str, float] | None:
    """The phases of the first (``last``: the last) restart among ``events`` (see :func:`run_phases`)."""
    decided = [e for e in events if e.name == "restart_decided" and isinstance(e.data.get("fault_time"), float)]
    timed = [e for e in events if e.name == "recovery_phases" and isinstance(e.data.get("phases"), list)]
    if not timed:
        return None
    iteration = (max if last else min)(e.iteration or 0 for e in timed)
    ranks = [e for e in timed if (e.iteration or 0) == iteration]
    result: dict[str, float] = {}
    # The restart into ``iteration`` was decided in the iteration before it.
    recorded = min((e.data["fault_time"] for e in decided if (e.iteration or 0) == iteration - 1), default=None)
    began = min(float(e.data["began"]) for e in ranks)
    if recorded is not None:
        if fault_time is not None:
            result["detection"] = max(0.0, recorded - fault_time)
        result["decision"] = max(0.0, began - recorded)
    for phase in MOMENTS[1:]:
        values = [float(p["seconds"]) for e in ranks for p in e.data["phases"] if p.get("phase") == phase]
        if values:
            result[phase] = max(values)
    ends = [float(p["at"]) for e in ranks for p in e.data["phases"] if p.get("phase") == "first_step"]
    origin = fault_time if fault_time is not None else (recorded if recorded is not None else began)
    if ends:
        result["total_to_first_step"] = max(ends) - origin
    return result


def print_phase_table(title: str, rows: dict[str, list[dict[str, float] | None]]) -> dict[str, dict[str, float]]:
    """Print the medians of each phase, one column per fault kind (``rows``: kind -> each run's phases); returns
    them."""
    medians: dict[str, dict[str, float]] = {}
    for kind, runs in rows.items():
        present = [run for run in runs if run]
        medians[kind] = {
            phase: statistics.median(run[phase] for run in present if phase in run)
            for phase in (*PHASES, "total_to_first_step")
            if any(phase in run for run in present)
        }
    kinds = [kind for kind in rows if medians[kind]]
    if not kinds:
        return medians
    print(f"\n{title}")
    print("| phase | " + " | ".join(kinds) + " |")
    print("| --- | " + " | ".join("---" for _ in kinds) + " |")
    for phase in (*PHASES, "total_to_first_step"):
        cells = [f"{medians[kind][phase] * 1e3:.0f}" if phase in medians[kind] else "-" for kind in kinds]
        print(f"| {phase.replace('_', ' ')} | " + " | ".join(cells) + " |")
    return medians
