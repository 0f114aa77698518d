"""The fault matrix (benchmarks/fault_matrix.py) runs green: every fault kind under ftrun, with history checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MATRIX = Path(__file__).resolve().parents[2] / "benchmarks" / "fault_matrix.py"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 12 jobs of 2 nodes x 2 workers, each on its own 3-member etcd
def test_every_fault_of_the_matrix_passes_its_checks(tmp_path: Path) -> None:
    out = tmp_path / "fault_matrix.json"
    done = subprocess.run(
        [sys.executable, str(MATRIX), "--out", str(out)], capture_output=True, text=True, timeout=1800, check=False
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    failed = {run["scenario"]: run["problems"] for run in runs if run["problems"]}
    assert failed == {}, done.stdout[-4000:]
    assert done.returncode == 0
    by_name = {run["scenario"]: run for run in runs}
    # Worker faults and etcd faults are absorbed in-process: no process restart, every expected rank finishes
    # (but a survivor terminated for gloo's gap, which the matrix names and allows once per scenario).
    for name in ("worker exception", "worker SIGKILL", "etcd leader SIGKILLed", "etcd frozen 10 s"):
        run = by_name[name]
        assert run["process_restarts"] == 0, run
        assert run["survivors"] >= run["expected_survivors"] - len(run["stranded"]), run
    killed = by_name["node SIGKILL"]
    assert killed["survivors"] == 2 - len(killed["stranded"]), killed
    assert killed["world_size"] == [killed["survivors"]], killed
