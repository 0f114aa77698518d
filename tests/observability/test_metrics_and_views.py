"""The agent's metrics from events (and over HTTP), and the live status view rendered to text."""

from __future__ import annotations

import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ft.observability.events import JobEvent
from elastic_ft.observability.live import render_live
from elastic_ft.observability.metrics import JobMetrics, MetricsEndpoint
from elastic_ft.runtime.net import free_port


def ev(name: str, t: float, source: str = "worker", **fields: object) -> JobEvent:
    where = {k: fields.pop(k) for k in ("node", "round", "iteration", "rank", "seq") if k in fields}
    return JobEvent(name, t, "run", source, data=fields, **where)  # type: ignore[arg-type]


JOB = [
    ev("iteration_started", 1.0, node="a", rank=0, iteration=0, world_size=6, active_world_size=4, seq=0),
    ev("fault_detected", 5.0, "agent", node="b", rank=3, kind="process_died", seq=1),
    ev("fault_detected", 5.0, node="a", rank=0, iteration=0, kind="RuntimeError", seq=2),
    ev("node_died", 5.2, "agent", node="b", ranks=[2, 3], reporter="a", seq=3),
    ev("restart_decided", 5.6, node="a", rank=0, iteration=0, fault_time=5.0, kind="terminated", seq=4),
    ev("spare_activated", 5.8, node="c", rank=4, iteration=1, seq=5),
    ev("iteration_started", 5.9, node="c", rank=4, iteration=1, world_size=4, active_world_size=4, seq=6),
    ev("iteration_started", 6.25, node="a", rank=0, iteration=1, world_size=4, active_world_size=4, seq=7),
    ev("iteration_started", 6.3, node="a", rank=1, iteration=1, world_size=4, active_world_size=4, seq=8),
    ev("respawned", 7.0, "agent", node="a", rank=6, local_rank=0, seq=9),
]


def values(metrics: JobMetrics) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_counts_are_of_this_nodes_events_and_gauges_the_jobs() -> None:
    on_a = JobMetrics("a", lambda: ({"txn": 7, "range": 3}, {("txn", "UNAVAILABLE"): 2}))
    for event in JOB:
        on_a.observe(event)
    got = values(on_a)
    assert got[("elastic_ft_restarts_total", (("kind", "terminated"),))] == 1
    assert got[("elastic_ft_faults_total", (("kind", "RuntimeError"),))] == 1
    assert got[("elastic_ft_faults_total", (("kind", "node_died"),))] == 1  # a reported b's death
    assert ("elastic_ft_faults_total", (("kind", "process_died"),)) not in got  # b's own fault, counted on b
    assert got[("elastic_ft_respawns_total", ())] == 1
    assert got[("elastic_ft_active_world_size", ())] == 4 and got[("elastic_ft_reserve_ranks", ())] == 0
    assert got[("elastic_ft_terminated_ranks", ())] == 2  # ranks 2 and 3
    # the fault at 5.0 to a's first rank resuming at 6.25: one observation, in the 2 s bucket, not the 1 s one
    assert got[("elastic_ft_fault_to_resume_seconds_count", ())] == 1
    assert got[("elastic_ft_fault_to_resume_seconds_bucket", (("le", "2.0"),))] == 1
    assert got[("elastic_ft_fault_to_resume_seconds_bucket", (("le", "1.0"),))] == 0
    assert got[("elastic_ft_etcd_requests_total", (("kind", "txn"),))] == 7
    assert got[("elastic_ft_etcd_errors_total", (("code", "UNAVAILABLE"), ("kind", "txn")))] == 2
    on_c = JobMetrics("c", lambda: ({}, {}))
    for event in JOB:
        on_c.observe(event)
    got = values(on_c)
    assert got[("elastic_ft_spare_activations_total", ())] == 1
    assert ("elastic_ft_restarts_total", (("kind", "terminated"),)) not in got  # reported on a only


def test_the_latency_is_observed_whichever_end_reaches_the_log_first() -> None:
    order = [JOB[0], JOB[7], JOB[4], JOB[8]]  # a's rank 0 logged its start before the restart's report
    metrics = JobMetrics("a", lambda: ({}, {}))
    for event in order:
        metrics.observe(event)
    got = values(metrics)
    assert got[("elastic_ft_fault_to_resume_seconds_count", ())] == 1
    assert got[("elastic_ft_fault_to_resume_seconds_sum", ())] == pytest.approx(1.25)


def test_the_endpoint_serves_the_metrics_over_http_as_events_arrive() -> None:
    arrived: list[JobEvent] = []
    metrics = JobMetrics("a", lambda: ({"put": 1}, {}))
    endpoint = MetricsEndpoint(
        metrics,
        free_port("127.0.0.1"),
        lambda after: [e for e in arrived if after is None or (e.seq or 0) > after],
        interval=0.05,
        addr="127.0.0.1",
    )
    endpoint.start()
    try:
        arrived.extend(JOB[:5])
        endpoint.poll()
        arrived.extend(JOB[5:])
        endpoint.poll()
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        endpoint.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["elastic_ft_restarts"].samples[0].value == 1
    assert families["elastic_ft_active_world_size"].samples[0].value == 4
    assert "python_gc_objects_collected_total" not in text  # its own registry only


STATUS = {
    "run": "job42",
    "closed": False,
    "round": 0,
    "rounds_completed": 1,
    "master": "h:1",
    "next_round": 1,
    "members": [
        {"rank": 0, "node": "a", "host": "h1", "pid": 10, "state": "alive"},
        {"rank": 1, "node": "b", "host": "h2", "pid": 11, "state": "dead"},
    ],
    "joined_next_round": [],
    "config": None,
    "terminated_ranks": [2, 3],
    "in_process_restarts": 1,
    "workers": [
        {
            "rank": 0,
            "node": "a",
            "pid": 20,
            "state": "running",
            "iteration": 1,
            "rank_in_iteration": 0,
            "mode": "active",
        },
        {"rank": 2, "node": "b", "pid": 22, "state": "node dead", "iteration": 0, "rank_in_iteration": 2, "mode": None},
    ],
    "restart_in_progress": {
        "iteration": 1,
        "interrupted_at": 1700000000.0,
        "waiting_for": [5],
        "interruptions": [
            {"rank": 1, "initial_rank": 1, "kind": "RuntimeError", "message": "boom", "time": 1700000000.0}
        ],
    },
    "spare_nodes": 1,
    "active_world_size": 4,
    "respawns": 0,
    "joined": [],
    "activations": [],
    "process_restarts": 0,
    "escalations": [],
    "malformed": [],
}


def test_the_live_view_shows_nodes_ranks_the_restart_and_recent_events() -> None:
    from rich.console import Console

    console = Console(record=True, width=160, force_terminal=False)
    console.print(render_live(STATUS, JOB))
    text = console.export_text()
    assert "run job42" in text and "in-process restarts 1" in text
    assert "dead" in text and "node dead" in text
    assert (
        "restart in progress" in text and "by rank 1 (RuntimeError): boom" in text and "waiting for ranks: [5]" in text
    )
    assert "terminated ranks [2, 3]" in text and "spare nodes 1" in text
    assert "rank 3: fault_detected kind=process_died" in text and "respawned" in text
    assert re.search(r"^│ \d\d:\d\d:\d\d\.250 │ worker", text, re.MULTILINE)  # wall-clock times, to the millisecond
    row = next(line for line in text.splitlines() if " running " in line)
    assert " 0 " in row  # rank 0's last known step, from its iteration start
