"""The two-minute soak (``benchmarks/soak.py --minutes 2``): random faults, one job, every check of the long run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _log_tails(workdir: Path, lines: int = 60) -> str:
    """The end of every node's and monitor process's log, warnings, errors, tracebacks and why a rank without
    progress was left alone ("not hung yet") only: what a failed run in CI leaves to read."""
    tails = []
    for log in sorted(workdir.glob("node-*.log")) + sorted(workdir.glob("monitor-*.log")):
        text = log.read_text(errors="replace").splitlines()
        kept = [line for line in text if line[:1] in ("W", "E") or line.startswith("[rank") or "not hung yet" in line]
        tails.append(f"--- {log.name}\n" + "\n".join(line[:400] for line in kept[-lines:]))
    return "\n".join(tails)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_minutes_of_random_faults_are_absorbed(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # Every kind of fault at least once in two minutes: evenly weighted.
    done = subprocess.run(
        # Each step leaves the CPUs idle for 50 ms, as a step on GPUs does (see test_network_faults.py).
        [
            sys.executable,
            str(SOAK),
            "--minutes",
            "2",
            "--weights",
            "1,1,1,1,1,1,1",
            "--seed",
            "7",
            "--step-wait",
            "0.05",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert out.exists(), done.stdout[-5000:] + done.stderr[-5000:]
    report = json.loads(out.read_text())
    if done.returncode != 0:  # pytest prints a failed test's output whole, where it shortens the assertion
        print(done.stdout[-20000:], done.stderr[-5000:], _log_tails(Path(report["workdir"])), sep="\n")
    assert done.returncode == 0, report["problems"]
    assert report["all"]["faults"] >= 15, report["by_kind"]
    assert report["escalations"] == 0 and report["steps_lost"] == 0 and report["steps_twice"] == 0
    assert report["same_state"] and not report["processes_left"]
    for pid, growth in report["growth"].items():
        assert growth["threads"] <= 8 and growth["fds"] <= 8, (pid, growth)


def test_resources_are_compared_only_between_samples_taken_while_the_process_trained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sample taken in the middle of a restart (groups and data loader workers torn down: fewer threads and
    fds) is no baseline: the soak once reported a worker's fds 'grown' by 14 from such a dip to its steady
    count, the same count as every other worker's."""
    monkeypatch.syspath_prepend(str(SOAK.parent))
    spec = importlib.util.spec_from_file_location("soak_under_test", SOAK)
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, soak)  # its dataclasses look their module up
    spec.loader.exec_module(soak)
    steps = [{"t": t, "iteration": i} for t, i in [(10.0, 1), (10.5, 1), (11.0, 1), (14.0, 2), (14.5, 2), (20.0, 2)]]
    samples = [{"t": t} for t in (9.0, 10.2, 10.5, 12.0, 14.2, 17.0, 21.0)]
    # 9.0: before any step; 12.0: between iterations 1 and 2 (a restart); 17.0: 5.5 s without a step; 21.0: after
    # the last step. 10.5 falls on a step: between it and the next.
    assert [s["t"] for s in soak._while_training(samples, steps)] == [10.2, 10.5, 14.2]
    assert soak._while_training(samples, []) == []
