"""Observability end to end: a real ``ftrun`` job with a SIGKILLed worker, watched, scraped, recorded and drawn.

One job (an embedded etcd, three workers of ``examples/train_ftrun.py``:
DDP, AdamW, a DataLoader, default Wrapper settings) gives every check:
its metrics endpoint scraped over HTTP while it runs, ``status --watch``
rendered from the live etcd, torch's ``--event-log-handler`` receiving the
events, the events saved by ``--record`` in order and complete, the fault
reported once in the log, and ``elastic-ft timeline`` drawing the recorded
job after its etcd is gone.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.endpoints import parse_endpoints
from elastic_ft.etcd.event_log import EventLog
from elastic_ft.keys import RunKeys
from elastic_ft.observability.event_files import read_events_file
from elastic_ft.runtime.net import free_port

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_ftrun.py"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastic_ft.launcher.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.slow
def test_a_faulted_job_is_watched_scraped_recorded_and_drawn(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    record = tmp_path / "record"
    log_path = tmp_path / "ftrun.log"
    command = [
        sys.executable,
        "-m",
        "elastic_ft.launcher.ftrun",
        "--nproc-per-node=3",
        "--rdzv-id=observed",
        f"--metrics-port={port}",
        "--event-log-handler=console",
        f"--record={record}",
        str(TRAIN),
        "--workdir",
        str(tmp_path / "work"),
        "--steps",
        "300",
        "--fault",
        "sigkill",
        "--fault-rank",
        "1",
        "--fault-step",
        "40",
    ]
    launched = time.time()
    with log_path.open("w") as out:
        ftrun = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"embedded etcd at (\S+) for rdzv id", log_path.read_text())):
            assert ftrun.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        endpoint = found.group(1)
        # Scraped while the job runs: the SIGKILL counted, the restart's latency observed, the world shrunk.
        metrics: dict = {}
        # Events from the agent and the workers reach the log in any order: wait for both ends.
        while metrics.get(("elastic_ft_fault_to_resume_seconds_count", ())) != 1 or not metrics.get(
            ("elastic_ft_faults_total", (("kind", "process_died"),))
        ):
            assert ftrun.poll() is None and time.monotonic() < deadline, f"{metrics}\n{log_path.read_text()[-3000:]}"
            with contextlib.suppress(OSError):  # not serving yet
                metrics = scrape(port)
            time.sleep(0.1)
        assert metrics[("elastic_ft_faults_total", (("kind", "process_died"),))] == 1
        assert metrics[("elastic_ft_restarts_total", (("kind", "terminated"),))] == 1
        assert metrics[("elastic_ft_active_world_size", ())] == 2
        assert metrics[("elastic_ft_terminated_ranks", ())] == 1
        assert metrics[("elastic_ft_rendezvous_round_seconds_count", ())] == 1
        assert metrics[("elastic_ft_etcd_requests_total", (("kind", "txn"),))] > 0
        # The goodput so far: its parts sum to the wall time so far.
        ratio = metrics[("elastic_ft_goodput_ratio", ())]
        parts = {labels[0][1]: value for (name, labels), value in metrics.items() if name == "elastic_ft_wall_seconds"}
        assert 0 < ratio < 1 and parts["recovery"] > 0 and parts["training"] > 0, metrics
        assert ratio == pytest.approx(parts["training"] / sum(parts.values()), rel=0.02)
        # status --watch, rendered once from the live etcd, as the CLI draws it.
        from rich.console import Console

        from elastic_ft.launcher.status import collect_status
        from elastic_ft.observability.live import watch

        client = EtcdClient(parse_endpoints(endpoint))
        keys = RunKeys("/elastic_ft", "observed")
        console = Console(record=True, width=200, force_terminal=False)
        try:
            watch(
                lambda: (collect_status(client, keys), EventLog(client, keys).read().events),
                0.1,
                refreshes=1,
                console=console,
            )
        finally:
            client.close()
        view = console.export_text()
        assert "run observed" in view and "in-process restarts 1" in view, view
        assert "fault_detected kind=process_died" in view and "restart_decided" in view, view
        assert re.search(r"│ 1 +│ absorbed \(-9\)", view), view  # the killed rank: its death absorbed in-process
        assert ftrun.wait(180) == 0, log_path.read_text()[-5000:]
        ended = time.time()
    finally:
        if ftrun.poll() is None:
            ftrun.send_signal(signal.SIGKILL)
    log = log_path.read_text()
    events = read_events_file(str(record / "events.jsonl"))
    for stream in ("main", "progress"):  # every event of each stream kept, none lost, none twice
        numbers = sorted(e.seq for e in events if (e.name == "progress") == (stream == "progress"))
        assert numbers == list(range(len(numbers))), (stream, numbers)
    names = [e.name for e in events if e.name != "progress"]
    assert names[:4] == ["round_opened", "node_joined", "round_closed", "workers_started"], names
    assert names[4:7] == ["iteration_started"] * 3, names
    faults = [e for e in events if e.name == "fault_detected"]
    (fault,) = [e for e in faults if e.data["kind"] != "peer_lost"]  # the SIGKILL; the survivors' gloo errors follow
    assert (fault.source, fault.rank, fault.data["kind"]) == ("agent", 1, "process_died")
    assert all(e.source == "worker" and e.rank in (0, 2) for e in faults if e is not fault), faults
    assert "SIGKILL" in fault.data["message"]
    restart = next(e for e in events if e.name == "restart_decided")
    assert restart.iteration == 0 and restart.time >= fault.time - 1
    assert restart.data["kind"] == "terminated"  # the cause, not the broken connections it left
    assert restart.data["faults"][0]["kind"] == "terminated" and restart.data["faults"][0]["ranks"] == [1]
    resumed = [e for e in events if e.name == "iteration_started" and e.iteration == 1]
    assert sorted(e.rank for e in resumed) == [0, 2] and all(e.data["world_size"] == 2 for e in resumed)
    assert all(e.time > restart.data["fault_time"] for e in resumed), (restart, resumed)
    assert restart.data["terminated"] == [1]  # reported after the termination barrier: who left is known
    assert names[-2:] == ["job_finished", "node_left"], names
    assert all(e.run_id == "observed" for e in events)
    steps = {e.rank: e.data["step"] for e in events if e.name == "progress"}
    assert steps.get(0) == steps.get(2) == 300, steps  # the last progress sample: every step of the survivors
    # One log format; the fault reported once (its text once), not per rank; torch's handler got the events.
    restarts_logged = [line for line in log.splitlines() if "iteration 0 restarts" in line]
    assert len(restarts_logged) == 1 and restarts_logged[0].startswith("W"), restarts_logged
    assert re.search(
        r"\): terminated on rank 1: (pid \d+: signal SIGKILL|process \d+ died)(; peer_lost on (rank [02]|ranks \[0, 2\]): [^;]*)?$",
        restarts_logged[0],
    ), restarts_logged[0]  # the cause first, the broken connections once
    assert not re.search(r"^W.*ended with signal SIGKILL", log, re.MULTILINE)  # the agent does not warn a second time
    torch_events = [json.loads(line) for line in log.splitlines() if line.startswith('{"name": "elastic_ft.')]
    reported = [(e["source"], e["metadata"]["kind"]) for e in torch_events if e["name"] == "elastic_ft.fault_detected"]
    # The SIGKILL once; a survivor whose collective broke before the restart reached it adds its peer_lost.
    assert reported.count(("AGENT", "process_died")) == 1 and len(reported) <= 3, reported
    assert set(reported) <= {("AGENT", "process_died"), ("WORKER", "peer_lost")}, reported
    assert {e["name"] for e in torch_events} >= {"elastic_ft.round_closed", "elastic_ft.workers_started"}
    # The recorded job drawn after its embedded etcd is gone.
    picture = tmp_path / "timeline.png"
    drawn = cli("timeline", "--events", str(record / "events.jsonl"), "-o", str(picture))
    assert drawn.returncode == 0, drawn.stderr
    for drew in ("1 faults,", "broken_connections, 1 restarts,", "1 respawns,", "3 ranks,", "2 world_changes"):
        assert drew in drawn.stdout, drawn.stdout  # the SIGKILL, its restart, the respawn, the world 3 then 2
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 20_000
    _check_the_goodput_report(record / "events.jsonl", ended - launched)
    status = json.loads((record / "status.json").read_text())
    assert status["run"] == "observed" and status["closed"] is True
    gone = cli("status", f"--rdzv-endpoint={endpoint}", "--rdzv-id=observed", "--connect-timeout=1")
    assert gone.returncode == 3 and "no answer from etcd" in gone.stderr  # the embedded etcd stopped with the job


def _check_the_goodput_report(events: Path, measured: float) -> None:
    """``elastic-ft report`` on the recorded job: its parts sum to its wall time within 1 %, that wall time is the
    job's as the test measured it (less ftrun's own start before its first event), the SIGKILL is its one
    restart with its phases summing to it, and no step was redone (the survivors kept their state)."""
    shown = cli("report", "--events", str(events))
    assert shown.returncode == 0 and "ETTR" in shown.stdout and "costliest faults:" in shown.stdout, shown
    done = cli("report", "--events", str(events), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    wall = report["wall_seconds"]
    assert abs(sum(report["parts"].values()) - wall) <= 0.01 * wall, report
    assert measured - 15 < wall <= measured, (wall, measured)
    assert report["finished"] and 0 < report["ettr"] < 1, report  # a short job: its start-up weighs
    assert (
        report["recovery_by_kind"].keys() == {"terminated"} and report["recovery_by_kind"]["terminated"]["count"] == 1
    )
    (fault,) = report["costliest"]
    assert fault["kind"] == "terminated" and 0 < fault["seconds"] < 30, fault
    assert re.fullmatch(r"rank\(s\) \[1\]: (pid \d+: signal SIGKILL|process \d+ died)", fault["cause"]), fault
    # Each of the ~11 numbers is rounded to the millisecond.
    assert sum(report["recovery_by_phase"].values()) == pytest.approx(fault["seconds"], abs=0.006)
    assert report["redone_steps"] == 0 and report["parts"]["redone"] == 0, report
    # The 300 steps took their time in training, at the job's step time (from the steps' events).
    assert report["step_seconds"] is not None and report["step_seconds"] > 0, report
    assert report["parts"]["training"] >= 0.5 * 300 * report["step_seconds"], report
