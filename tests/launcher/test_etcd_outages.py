"""etcd away is not a fault: ``benchmarks/etcd_outages.py`` for ftrun, the 30 s and 60 s cases.

Each case is one job of 2 nodes x 2 workers running the reference script
with default settings, its etcd frozen, killed and restarted, without a
quorum, or restarted member by member while it trains. The checks are the
issue's goals, loosened only where a loaded 2-core CI machine needs it (the
benchmark carries the numbers): no rank stops, nothing restarts, every rank
finishes and both ``ftrun`` exit 0; a worker's fault during an outage is
recovered from in-process soon after etcd is back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "etcd_outages.py"

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def run(tmp_path: Path, kinds: str, durations: str) -> list[dict]:
    out = tmp_path / "etcd_outages.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARK),
            "--systems",
            "ftrun",
            "--kinds",
            kinds,
            "--durations",
            durations,
            "--repeats",
            "1",
            "--after",
            "10",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert out.exists(), done.stdout[-5000:] + done.stderr[-5000:]
    rows = json.loads(out.read_text())["runs"]
    for row in rows:
        assert "error" not in row, f"{row}\n{done.stdout[-5000:]}"
    return rows


def assert_trained_through(row: dict) -> None:
    assert row["ranks_finished"] == 4 and row["exit_codes"] == [0, 0], row
    assert row["ranks_stopped"] == 0 and row["in_process_restarts"] == 0 and row["processes_replaced"] == 0, row
    assert row["rate_during"] >= 0.7, row  # the benchmark's goal is 90 %; two pytest processes share the CPUs


@pytest.mark.timeout(1600)
def test_a_job_trains_through_etcd_frozen_and_restarted_for_30_s(tmp_path: Path) -> None:
    for row in run(tmp_path, "freeze,restart", "30"):
        assert_trained_through(row)


@pytest.mark.timeout(1600)
def test_a_job_trains_through_a_quorum_lost_for_60_s_and_a_rolling_restart(tmp_path: Path) -> None:
    rows = {row["kind"]: row for row in run(tmp_path, "quorum", "60") + run(tmp_path, "rolling", "10")}
    for row in rows.values():
        assert_trained_through(row)


@pytest.mark.timeout(1600)
def test_a_fault_during_an_outage_is_recovered_from_in_process_once_etcd_is_back(tmp_path: Path) -> None:
    (row,) = run(tmp_path, "fault", "30")
    assert row["ranks_finished"] == 4 and row["exit_codes"] == [0, 0], row
    assert row["in_process_restarts"] == 1 and row["processes_replaced"] == 0, row
    assert row["back_to_normal"] is not None and row["back_to_normal"] < 5.0, row  # the goal: 2 s
