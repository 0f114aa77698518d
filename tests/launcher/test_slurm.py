"""examples/slurm/train.sbatch under a real Slurm (slurmctld, four slurmd, munge) started by the test.

One ``ftrun`` per Slurm node through ``srun``, 3 active nodes and 1 hot
spare, etcd started by the script on the first node. One node's tasks are
SIGKILLed (its ftrun and its worker): the job goes on in-process, the spare
taking the lost rank (a survivor stranded in gloo's gap is replaced instead,
and its new process joins: see ``stranded``). ``scancel`` then leaves no process of the job behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_ft.runtime.net import free_port
from elastic_ft.testing.local_cluster import stranded_ranks
from elastic_ft.testing.slurm import SlurmCluster, missing_binaries

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(missing_binaries()), reason=f"Slurm is not installed: {missing_binaries()}"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the test's slurmd runs jobs as root"),
]


@pytest.fixture
def slurm() -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(nodes=4).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _job_processes(job: str) -> dict[int, str]:
    """Every live process of Slurm job ``job``, with the Slurm node it runs on."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        values = dict(item.decode(errors="replace").partition("=")[::2] for item in environ if b"=" in item)
        if values.get("SLURM_JOB_ID") == job and state not in ("Z", "X"):
            found[int(entry)] = values.get("SLURMD_NODENAME", "?")
    return found


def _steps(workdir: Path) -> list[dict[str, Any]]:
    events = []
    for path in workdir.glob("events-*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if e["event"] == "step"]


def _wait(condition: Any, timeout: float, what: str, log: Path, running: Any = None) -> Any:
    """``condition()`` once true; fails after ``timeout``, or as soon as ``running()`` says the job ended."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline or (running is not None and not running()):
            raise AssertionError(f"no {what} within {timeout:g} s; the job's output:\n{_decisions(log)}")
        time.sleep(0.5)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-6000:] if path.exists() else "(none)"


def stranded(log: Path) -> set[int]:
    """The initial ranks terminated for gloo's gap, from the job's output (:func:`stranded_ranks`)."""
    return stranded_ranks(log.read_text(errors="replace") if log.exists() else "")


def _decisions(log: Path) -> str:
    """The job output's warnings, errors and restarts (what decided the recovery), then its tail."""
    text = log.read_text(errors="replace") if log.exists() else ""
    kept = [
        line for line in text.splitlines() if re.match(r"[WE]\d{4} |.*(restarts|joins|about to be terminated)", line)
    ]
    return "\n".join(kept[-60:]) + "\n--- tail ---\n" + _tail(log)[-3000:]


def test_the_sbatch_script_trains_survives_a_node_kill_in_process_and_scancel_leaves_nothing(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    workdir = tmp_path / "run"
    output = tmp_path / "job.out"
    env = {
        **slurm.env,
        "SPARE_NODES": "1",
        "NPROC_PER_NODE": "1",
        "WORKDIR": str(workdir),
        "TRAIN": f"examples/train_ftrun.py --workdir {workdir} --steps 100000 --record-steps --global-batch 12",
        "PYTHON": sys.executable,
        "ETCD_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=4", f"--chdir={REPO}", f"--output={output}", "examples/slurm/train.sbatch"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job = submitted.stdout.strip().split(";")[0]
    try:
        # 3 active ranks train (one worker per active node); the spare node's worker waits as a reserve rank.
        running = lambda: slurm.job_state(job) is not None
        _wait(lambda: len({s["rank"] for s in _steps(workdir)}) >= 3, 240, "3 ranks training", output, running)
        steps = _steps(workdir)
        pid_of = {s["rank"]: s["pid"] for s in steps}
        assert sorted(pid_of) == [0, 1, 2]
        processes = _job_processes(job)
        node_of = {rank: processes.get(pid) for rank, pid in pid_of.items()}
        assert node_of == {0: "node1", 1: "node2", 2: "node3"}  # node ranks in SLURM_PROCID order
        # node2's tasks die (its ftrun and worker); etcd runs on node1, the spare on node4.
        victims = [pid for pid, node in processes.items() if node == "node2"]
        assert pid_of[1] in victims
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed_at = time.time()

        def resumed() -> bool:
            """The spare trains in the lost rank's place, and so does each survivor, or the process that
            replaced it if its monitor process terminated it (gloo's gap, see ``stranded``)."""
            ranks = {s["rank"] for s in _steps(workdir) if s["t"] > killed_at + 0.5}
            survivors = {0, 2} - stranded(output)
            return ({3} | survivors) <= ranks and len(ranks - {0, 1, 2, 3}) >= len(stranded(output))

        _wait(resumed, 120, "the survivors and the spare training after the kill", output, running)
        lost = stranded(output)
        assert len(lost) <= 1, _decisions(output)
        after = [s for s in _steps(workdir) if s["t"] > killed_at + 0.5]
        kept = {0, 2} - lost
        assert {s["pid"] for s in after if s["rank"] in kept} == {pid_of[r] for r in kept}, _decisions(output)
        assert max(s["iteration"] for s in after) >= 1
        assert slurm.job_state(job) == "RUNNING"
    finally:
        slurm.run("scancel", job, check=False)
    _wait(lambda: slurm.job_state(job) is None, 90, "the job left the queue after scancel", output)
    _wait(lambda: not _job_processes(job), 30, f"no process of job {job} left", output)


def test_a_cluster_stopped_while_a_cancelled_job_ends_leaves_no_step_daemon_and_no_task(tmp_path: Path) -> None:
    """As after a test that failed mid-job: the job is cancelled and the cluster stopped at once, before its step
    daemons (which detach from their slurmd) ended, one of them already dead and its task orphaned; stopping the
    cluster ends the daemons and every task, the orphan too."""
    cluster = SlurmCluster(nodes=2).start()
    try:
        marker = f"eft-step-{os.getpid()}-{time.monotonic_ns()}"
        script = tmp_path / "step.sh"
        script.write_text(f"#!/bin/bash\nexec -a {marker} sleep 600\n")
        script.chmod(0o755)
        submitted = cluster.run(
            "sbatch", "--parsable", "--nodes=2", f"--output={tmp_path / 'job.out'}", "--wrap", f"srun {script}"
        )
        job = submitted.strip().split(";")[0]
        _wait(lambda: len(_marked(marker)) == 2, 60, "the job's two tasks", tmp_path / "job.out")
        orphaned = _marked(marker)[0]
        os.kill(_parent(orphaned), signal.SIGKILL)  # the task's step daemon
        _wait(lambda: _parent(orphaned) not in cluster.step_daemons(), 10, "the step daemon gone", tmp_path / "job.out")
        cluster.run("scancel", job, check=False)
    finally:
        cluster.stop()
    assert cluster.step_daemons() == []
    assert _marked(marker) == []
    assert cluster.leftovers() == []


def _marked(marker: str) -> list[int]:
    """Live processes whose command line starts with ``marker``."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _cmdline(entry).startswith(marker)]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
