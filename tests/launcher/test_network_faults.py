"""Hosts and links fail, on three test hosts (network namespaces): ``benchmarks/network_faults.py`` for ftrun.

Each test is one job of 3 hosts x 2 workers running the reference script
with default settings, its scenarios one after another (``--one-job``);
every fault hits host 2. The checks are the issue's goals, loosened for a
loaded 2-core CI machine (the benchmark carries the numbers).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elastic_ft.testing.netns import unavailable

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "network_faults.py"
#: The benchmark keeps its work directories with this set (benchmarks/scratch.py): the test reads the logs.
KEEP_WORKDIRS = "EFT_KEEP_WORKDIRS"
#: The host every fault hits (the benchmark's FAULTY).
FAULTY_HOST = 2
REASON = unavailable()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]


@pytest.fixture
def run(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., dict[str, dict]]]:
    """Run the benchmark for ftrun: ``run(scenarios, downtime=3.0)`` returns its rows by scenario. The jobs' work
    directories go after a test that passed; a failed one keeps them (their path is in its message)."""
    kept: list[str] = []
    failed_before = request.session.testsfailed

    def run_benchmark(scenarios: str, downtime: float = 3.0) -> dict[str, dict]:
        out = tmp_path / f"network_faults-{downtime:g}.json"
        done = subprocess.run(
            [sys.executable, str(BENCHMARK), *_arguments(scenarios, downtime), "--out", str(out)],
            capture_output=True,
            text=True,
            env={**os.environ, KEEP_WORKDIRS: "1"},
            timeout=1500,
            check=False,
        )
        kept.extend(re.findall(r"work directories kept in (\S+)", done.stderr))
        assert done.returncode == 0 and out.exists(), done.stdout[-5000:] + done.stderr[-5000:]
        rows = {row["scenario"]: row for row in json.loads(out.read_text())["runs"]}
        for row in rows.values():
            assert "error" not in row, f"{row}\n{done.stdout[-5000:]}"
            workdir = Path(row["workdir"])
            row["faulty_host_log"] = _warnings_of(workdir, [FAULTY_HOST], 4000)
            row["survivors_log"] = _warnings_of(workdir, [h for h in range(3) if h != FAULTY_HOST], 3000)
            row["restarts_log"] = _restart_reports(workdir)
        return rows

    yield run_benchmark
    if request.session.testsfailed == failed_before:
        for path in kept:
            shutil.rmtree(path, ignore_errors=True)


def _arguments(scenarios: str, downtime: float) -> list[str]:
    return [
        "--systems",
        "ftrun",
        "--scenarios",
        scenarios,
        "--repeats",
        "1",
        # One job takes the test's scenarios in turn: one start-up of three hosts, not one per scenario.
        "--one-job",
        "--window",
        "10",
        # Each step leaves the CPUs idle for 50 ms, as a step on GPUs does: three simulated hosts of two
        # workers share two cores with the other pytest process, and spinning they took a third of its time.
        "--step-wait",
        "0.05",
        "--downtime",
        str(downtime),
        # A SIGKILLed host comes back as new processes: its launcher and workers import torch while the
        # other hosts train on the same two cores (20 to 25 s on an idle machine, over the default 60 s
        # cap once the other pytest process loads it too). The checks below bound what they time.
        "--cap",
        "150",
    ]


def _why(scenario: str, row: dict) -> str:
    """A failed check's message: the scenario's row, then what the hosts logged (pytest shortens a repr)."""
    logs = ("faulty_host_log", "survivors_log", "restarts_log")
    fields = {key: value for key, value in row.items() if key not in logs}
    return (
        f"{scenario}: {fields}\nthe job's restarts:\n{row.get('restarts_log', '')}\n"
        f"host {FAULTY_HOST} logged:\n{row.get('faulty_host_log', '')}\n"
        f"the other hosts logged:\n{row.get('survivors_log', '')}"
    )


def _warnings_of(workdir: Path, hosts: list[int], limit: int) -> str:
    """The warnings and errors the launchers and workers of ``hosts`` logged (the last ``limit`` characters)."""
    lines = [
        line
        for host in hosts
        for log in sorted(workdir.glob(f"host{host}-*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if line[:1] in ("W", "E")
    ]
    return "\n".join(lines)[-limit:]


def _restart_reports(workdir: Path) -> str:
    """Every host's restart reports (one per iteration: its faults) and give-up reasons (the last 3,000
    characters): what ended each iteration, whichever host saw it."""
    marks = (" restarts (", "RestartLimitError", "the same fault ended", "iterations in a row")
    lines = [
        line
        for log in sorted(workdir.glob("host*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if any(mark in line for mark in marks)
    ]
    return "\n".join(lines)[-3000:]


@pytest.mark.timeout(1600)
def test_lost_hosts_are_fenced_and_counted_out_fast_and_come_back_without_restarting_the_others(
    run: Callable[..., dict[str, dict]],
) -> None:
    rows = run("cut,sigkill,sigstop,peers_only,etcd_only")
    for scenario, row in rows.items():
        # The survivors train again in the shrunken world well before a 10 s lease would expire (a host
        # that reaches its peers but not etcd is left to its lease: it still trains with them meanwhile) ...
        bound = 20.0 if scenario == "etcd_only" else 6.0
        assert row["resume"] is not None and row["resume"] < bound, _why(scenario, row)
        # ... soon after the first agent confirmed the loss, even when the host announces itself again
        # (peers_only: it still reaches etcd) before the survivors' loops read the board: well inside the
        # lease, loose as timed tests are here (a loaded CI host measured 1.1 s; benchmarks/network_faults.py
        # carries the number) ...
        if scenario != "etcd_only":
            assert row["absorb"] is not None and row["absorb"] < 3.0, _why(scenario, row)
        # ... nothing the lost host computes in the old membership counts after they did ...
        assert row["stale"] == 0, _why(scenario, row)
        # ... and it trains again in the running world, with no survivor's process restarted.
        assert row["rejoin"] is not None, _why(scenario, row)
        assert row["restarted"] == 0, _why(scenario, row)


@pytest.mark.timeout(1600)
@pytest.mark.parametrize(("scenarios", "downtime"), [("cut,etcd_only,peers_only", 20.0), ("cut", 60.0)])
def test_a_host_cut_off_for_long_fences_itself_and_rejoins_in_its_own_processes(
    run: Callable[..., dict[str, dict]], scenarios: str, downtime: float
) -> None:
    """20 s and 60 s: every lease the host held ends, its etcd calls fail for that long, and it comes back."""
    for scenario, row in run(scenarios, downtime).items():
        assert row["resume"] is not None and row["resume"] < (20.0 if scenario == "etcd_only" else 6.0), _why(
            scenario, row
        )
        assert row["stale"] == 0, _why(scenario, row)  # fenced during the cut
        # It trains again in the running world, in the processes it had (the goal: 5 s after the heal), but for
        # a rank gloo holds out of every restart's reach (a send cut mid-flight, which gloo never fails before
        # the group's timeout: elastic_ft/inprocess/delivery/watcher.py; its monitor process replaces it) ...
        assert row["rejoin"] is not None and row["rejoin"] < 15.0, _why(scenario, row)
        assert row["replaced"] <= row["out_of_reach"], _why(scenario, row)
        # ... no survivor restarted, and its ftrun never gave up on the job.
        assert row["restarted"] == 0 and not row["launcher_exited"], _why(scenario, row)


@pytest.mark.timeout(600)
def test_a_host_cut_off_again_and_again_is_counted_out_and_back_each_time(run: Callable[..., dict[str, dict]]) -> None:
    row = run("repeated")["repeated"]
    why = _why("repeated", row)
    # The same agent, so the same node, lost three times: the survivors go on without it each time (the
    # second loss once took the Wrapper's 60 s hang timeout: its node was absorbed already) and it rejoins.
    assert len(row["resumes"]) == len(row["rejoins"]) == 3, why
    assert all(r is not None and r < 6.0 for r in row["resumes"]), why
    # It rejoins each time in the processes it had, but for ranks gloo held out of every restart's reach (their
    # monitor processes replace them, and the new processes start beside the training survivors) ...
    assert all(r is not None and r < 15.0 for r in row["rejoins"]), why
    assert len(row["replacements"]) == 3 and row["replaced"] <= row["out_of_reach"], why
    # ... and no survivor restarted.
    assert row["restarted"] == 0, why


@pytest.mark.timeout(1200)
def test_an_arriving_host_joins_in_process_and_a_lossy_link_or_a_busy_host_kills_nobody(
    run: Callable[..., dict[str, dict]],
) -> None:
    rows = run("arrival,lossy,cpu")
    arrival = rows["arrival"]
    assert arrival["rejoin"] is not None and arrival["rejoin"] < 15.0, _why("arrival", arrival)
    assert arrival["restarted"] == 0, _why("arrival", arrival)
    for scenario in ("lossy", "cpu"):
        # No node is taken for dead (no lease revoked), no process of the other hosts restarted.
        row = rows[scenario]
        assert row["revocations"] == 0 and row["restarted"] == 0, _why(scenario, row)
    # A host whose cores are saturated is not even restarted in-process, and loses no process.
    assert rows["cpu"]["restarts"] == 0 and rows["cpu"]["killed"] == 0, _why("cpu", rows["cpu"])
    # Under 30 % loss the Wrapper's adaptive hang detection may restart the iteration in-process (a step
    # stalls past the soft timeout while TCP retransmits), and a rank of the lossy host blocked in DDP's
    # backward may not take that restart before its hard timeout ends it (1 run of 4 here; its node
    # respawns it, and it rejoins): the benchmark reports how often (``killed``), docs/deployment.md says why.
