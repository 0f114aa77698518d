"""No orphans: a SIGKILLed ftrun or torchrun agent takes its workers, monitor processes and embedded etcd along."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.runtime.reaper import REAPER_ENV, Reaper, kill_marked
from elastic_ft.testing.local_cluster import descendants, torchrun_command
from elastic_ft.testing.netns import unavailable

pytestmark = pytest.mark.integration  # every test here starts processes

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train_ftrun.py"
FTRUN = [sys.executable, "-m", "elastic_ft.launcher.ftrun"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _names(pids: list[int]) -> list[str]:
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            names.append("?")
    return names


def _runs_standby(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"elastic_ft.inprocess.restart.standby" in cmdline.read()
    except OSError:
        return False


def _train(launcher: list[str], tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start a launcher training two workers, wait until both train, return it and what it started."""
    work = tmp_path / "work"
    log = (tmp_path / "launcher.log").open("wb")
    process = subprocess.Popen(
        [*launcher, str(TRAIN), "--workdir", str(work), "--steps", "100000"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 120
    while not all((work / f"events-{rank}.jsonl").exists() for rank in (0, 1)):
        assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.log").read_text()
        time.sleep(0.1)
    time.sleep(1.0)  # the data loader workers too
    return process, descendants(process.pid)


def _sigkill_and_watch(process: subprocess.Popen[bytes], started: list[int]) -> tuple[float, list[int]]:
    """SIGKILL the launcher alone; seconds until nothing it started is alive (or 10), and what was left."""
    os.kill(process.pid, signal.SIGKILL)
    killed = time.monotonic()
    process.wait()
    while (left := [pid for pid in started if _alive(pid)]) and time.monotonic() - killed < 10:
        time.sleep(0.02)
    return time.monotonic() - killed, left


@pytest.mark.slow
def test_a_sigkilled_ftrun_leaves_nothing_behind(tmp_path: Path) -> None:
    process, _ = _train([*FTRUN, "--nproc-per-node=2", "--monitor-interval=0.1"], tmp_path)
    deadline = time.monotonic() + 90  # the node's warm standby starts once the workers have run a while
    while not (standby := [pid for pid in descendants(process.pid) if _runs_standby(pid)]):
        assert time.monotonic() < deadline, (tmp_path / "launcher.log").read_text()
        time.sleep(0.1)
    started = descendants(process.pid)
    names = _names(started)
    # Two workers, their monitor processes and data loader workers, the embedded etcd, the reaper, the standby.
    assert names.count("eft-monitor") == 2 and "etcd" in names and "eft-reaper" in names, names
    assert set(standby) <= set(started), (standby, started)
    etcd_pid = started[names.index("etcd")]
    with open(f"/proc/{etcd_pid}/cmdline", "rb") as cmdline:
        arguments = cmdline.read().split(b"\0")
    data_dir = Path(arguments[arguments.index(b"--data-dir") + 1].decode())
    assert data_dir.exists()
    seconds, left = _sigkill_and_watch(process, started)
    try:
        assert not left and seconds < 2.0, (seconds, _names(left))
        deadline = time.monotonic() + 2
        while data_dir.parent.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not data_dir.parent.exists(), "the embedded etcd's data directory was left behind"
    finally:
        for pid in left:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_sigkilled_torchrun_agent_on_etcdft_takes_its_workers_along(
    etcd: EtcdServer, run_id: str, tmp_path: Path
) -> None:
    launcher = [
        *torchrun_command(),
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=etcdft",
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={run_id}",
        "--monitor-interval=0.1",
    ]
    process, started = _train(launcher, tmp_path)
    assert _names(started).count("eft-monitor") == 2, _names(started)
    seconds, left = _sigkill_and_watch(process, started)
    try:
        assert not left and seconds < 2.0, (seconds, _names(left))
    finally:
        for pid in left:
            os.kill(pid, signal.SIGKILL)


def test_the_reaper_kills_only_what_carries_its_token() -> None:
    marked = subprocess.Popen(["sleep", "60"], env={**os.environ, REAPER_ENV: "1:test-token"})
    other = subprocess.Popen(["sleep", "60"], env={**os.environ, REAPER_ENV: "1:another-token"})
    try:
        assert kill_marked("1:test-token", sweep=0.2) == [marked.pid]
        assert marked.wait(5) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for process in (marked, other):
            process.kill()
            process.wait()


#: A test driver as the benchmarks run (``scratch.run_main``): starts a 3-member etcd cluster, and a test bed
#: when asked, with a process in its host; asks its reaper to run one command at exit and takes another back;
#: prints what it started, then waits to be killed.
DRIVER = """
import json, subprocess, sys, time
sys.path.insert(0, {benchmarks!r})
import scratch
from elastic_ft.runtime.reaper import current_reaper
from elastic_ft.testing.etcd_cluster import EtcdCluster
from elastic_ft.testing.netns import TestBed

def main():
    cluster = EtcdCluster(members=3).start()
    reaper = current_reaper()
    reaper.run_on_exit(["touch", {ran!r}])
    reaper.run_on_exit(["touch", {forgotten!r}])
    reaper.forget(argv=["touch", {forgotten!r}])
    started = {{"data": str(cluster.workdir), "bed": None, "reaper": reaper.process.pid}}
    if {bed!r}:
        bed = TestBed(2).start()
        sleeper = bed.popen(1, ["sleep", "600"])
        started["bed"] = {{"namespaces": [bed.namespace(h) for h in range(2)], "bridge": bed.bridge,
                           "sleeper": sleeper.pid}}
    print(json.dumps(started), flush=True)
    time.sleep(600)

scratch.run_main(main)
"""


def _links_and_namespaces() -> str:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return links + namespaces


@pytest.mark.parametrize("bed", [False, True], ids=["etcd cluster", "etcd cluster and test bed"])
def test_a_sigkilled_test_driver_leaves_no_etcd_data_or_test_bed_behind(tmp_path: Path, bed: bool) -> None:
    if bed and (reason := unavailable()) is not None:
        pytest.skip(reason)
    ran, forgotten = tmp_path / "ran", tmp_path / "forgotten"
    code = DRIVER.format(
        benchmarks=str(TRAIN.parents[1] / "benchmarks"), ran=str(ran), forgotten=str(forgotten), bed=bed
    )
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert driver.stdout is not None
    started = json.loads(driver.stdout.readline())
    members = [pid for pid in descendants(driver.pid) if _names([pid]) == ["etcd"]]
    leftovers = members + ([started["bed"]["sleeper"]] if bed else [])
    try:
        assert len(members) == 3 and all(_alive(pid) for pid in leftovers), (started, _names(leftovers))
        assert Path(started["data"]).is_dir(), started
        if bed:
            assert all(name in _links_and_namespaces() for name in started["bed"]["namespaces"]), started
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 20
        while _alive(started["reaper"]) and time.monotonic() < deadline:  # it exits once it cleaned up
            time.sleep(0.05)
        assert not _alive(started["reaper"]), "the reaper did not finish its clean-up within 20 s"
        assert not [pid for pid in leftovers if _alive(pid)], _names(leftovers)
        assert not Path(started["data"]).exists(), "the cluster's data directory was left behind"
        assert ran.exists() and not forgotten.exists()
        if bed:
            left = _links_and_namespaces()
            names = [*started["bed"]["namespaces"], started["bed"]["bridge"]]
            assert not [name for name in names if name in left], left
    finally:
        for pid in leftovers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_path_holding_a_newline_is_refused_before_anything_is_sent_to_the_reaper() -> None:
    # (a command's arguments travel as JSON, newlines escaped)
    class NoPipe:  # a process whose pipe must not be touched
        @property
        def stdin(self) -> None:
            raise AssertionError("the task was sent")

    reaper = Reaper(NoPipe(), "1:token")  # type: ignore[arg-type]  # a stand-in with no pipe at all
    with pytest.raises(ValueError, match="holds a newline"):
        reaper.remove_on_exit('/tmp/a\nrun ["rm"]')


def test_the_reaper_takes_the_tasks_a_launcher_wrote_just_before_it_died(tmp_path: Path) -> None:
    """A busy host may run the reaper only after its launcher died: the tasks still waiting in the pipe are run
    all the same (the reaper is stopped while they are written and the launcher is killed, so it wakes to both)."""
    launcher = subprocess.Popen(["sleep", "600"])
    reaper = subprocess.Popen(
        [sys.executable, "-m", "elastic_ft.runtime.reaper", str(launcher.pid), "no-such-token"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    ran, kept = tmp_path / "ran", tmp_path / "kept"
    kept.mkdir()
    try:
        time.sleep(0.5)  # the reaper waits on the launcher by now
        os.kill(reaper.pid, signal.SIGSTOP)
        assert reaper.stdin is not None
        reaper.stdin.write(f"run {json.dumps(['touch', str(ran)])}\nrmtree {kept}\n".encode())
        reaper.stdin.flush()
        launcher.kill()
        launcher.wait()
        os.kill(reaper.pid, signal.SIGCONT)
        assert reaper.wait(20) == 0
        assert ran.exists() and not kept.exists()
    finally:
        for process in (launcher, reaper):
            if process.poll() is None:
                process.kill()


def test_the_reaper_takes_the_tasks_of_a_launcher_dead_before_the_reaper_ran(tmp_path: Path) -> None:
    """A busy host may start the reaper only after its launcher died, before it could watch it: the tasks in the
    pipe are run all the same, and without waiting for an end of the pipe that another process may hold open."""
    launcher = subprocess.Popen(["sleep", "600"])
    launcher.kill()
    launcher.wait()
    ran, kept = tmp_path / "ran", tmp_path / "kept"
    kept.mkdir()
    read_end, write_end = os.pipe()
    os.write(write_end, f"run {json.dumps(['touch', str(ran)])}\nrmtree {kept}\n".encode())
    try:
        reaper = subprocess.Popen(
            [sys.executable, "-m", "elastic_ft.runtime.reaper", str(launcher.pid), "no-such-token"],
            stdin=read_end,
            start_new_session=True,
        )
        try:
            assert reaper.wait(20) == 0
        finally:
            if reaper.poll() is None:
                reaper.kill()
        assert ran.exists() and not kept.exists()
    finally:
        os.close(read_end)
        os.close(write_end)
