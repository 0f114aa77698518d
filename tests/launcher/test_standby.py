"""The warm standby: a pre-started, warmed-up process takes a dead worker's place.

The plan (which worker commands a standby can run) is pure; the standby
process is started for real and handed a script; under ``ftrun`` with the
reference script, a SIGKILLed standby is replaced and a SIGKILLed worker's
place goes to the standby, which heals and trains, and the job's end stops
the one waiting then.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.inprocess.restart.standby import _may_leave_idle, _parse
from elastic_ft.launcher.ftrun import build_parser, parse_args
from elastic_ft.launcher.standby import STANDBY_DELAY, Standby, StandbyKeeper, StandbyPlan, standby_plan
from elastic_ft.testing.local_cluster import TorchrunNode, ftrun_command
from tests.launcher.test_healing import SCRIPT, events, logs, results, starts_after, stop_once_started, until_stopped
from tests.launcher.test_orphans import _alive

PYTHON = sys.executable


def test_the_plan_reads_the_commands_torchrun_starts() -> None:
    assert standby_plan(PYTHON, ["-u", "train.py", "--steps", "5"]) == StandbyPlan(
        PYTHON, ("-u",), "train.py", None, ("--steps", "5")
    )
    assert standby_plan(PYTHON, ["-u", "-m", "pkg.train", "-u"]) == StandbyPlan(
        PYTHON, ("-u",), None, "pkg.train", ("-u",)
    )
    assert standby_plan(PYTHON, ["-W", "ignore", "-X", "dev", "-B", "t.py"]) == StandbyPlan(
        PYTHON, ("-W", "ignore", "-X", "dev", "-B"), "t.py", None, ()
    )
    assert standby_plan(PYTHON, ["-u", "t.py"]).start_command() == [  # type: ignore[union-attr]
        PYTHON,
        "-u",
        "-m",
        "elastic_ft.inprocess.restart.standby",
    ]


@pytest.mark.parametrize(
    ("entrypoint", "args", "why"),
    [
        ("/usr/bin/env", ["train.py"], "the workers run '/usr/bin/env', not this Python"),
        (PYTHON, ["-c", "print(1)"], "option '-c' is not one a standby can take"),
        (PYTHON, ["-u", "-m"], "-m without a module"),
        (PYTHON, ["-u"], "names no script"),
        (PYTHON, ["-W"], "option '-W' is not one a standby can take"),
    ],
)
def test_the_plan_says_why_a_standby_cannot_run_a_command(entrypoint: str, args: list[str], why: str) -> None:
    reason = standby_plan(entrypoint, args)
    assert isinstance(reason, str) and why in reason, reason


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"[]", "hand-over is not a JSON object: []"),
        (b'{"env": {"A": 1}, "arguments": [], "script": "s", "stdout": "", "stderr": ""}', "'env', an object of"),
        (b'{"env": {}, "arguments": [1], "script": "s", "stdout": "", "stderr": ""}', "'arguments', a list"),
        (b'{"env": {}, "arguments": [], "script": "s", "module": "m", "stdout": "", "stderr": ""}', "exactly one"),
        (b'{"env": {}, "arguments": [], "script": "s", "stdout": null, "stderr": ""}', "'stdout', a path"),
    ],
)
def test_a_malformed_hand_over_is_refused_naming_the_field(line: bytes, error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=re.escape(error)):
        _parse(line)


PROBE = """
import json, os, sys
print("to stdout")
print("to stderr", file=sys.stderr)
json.dump({
    "argv": sys.argv, "name": __name__, "path0": sys.path[0], "value": os.environ.get("PROBE_VALUE"),
    "dynamo": "torch._dynamo" in sys.modules, "stdin": sys.stdin.read(),
    "etcd_store": "elastic_ft.etcd.store" in sys.modules and "grpc" in sys.modules,
    "groups": __import__("torch").distributed.is_initialized(),
    "policies": sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}),
    "session_nice": open("/proc/self/autogroup").read().split()[-1],
}, open(sys.argv[1], "w"))
sys.exit(3)
"""


def _ready(standby: Standby, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while not standby.poll_ready():
        assert standby.exitcode() is None and time.monotonic() < deadline, standby.exitcode()
        time.sleep(0.05)


@pytest.mark.integration
def test_a_standby_runs_a_script_as_python_would(tmp_path: Path) -> None:
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    plan = standby_plan(PYTHON, ["-u", str(script), str(tmp_path / "seen.json")])
    assert isinstance(plan, StandbyPlan)
    standby = Standby(plan, {**os.environ, "PROBE_VALUE": "the node's"})
    standby.start()
    try:
        _ready(standby)
        # It warmed and waits at idle CPU priority, wherever it may leave it again (as root here).
        assert _may_leave_idle()
        assert standby.pid is not None
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{standby.pid}/task")} == {os.SCHED_IDLE}
        # ... and so does its session, which the kernel weighs against the others first (autogroups: on here).
        assert Path(f"/proc/{standby.pid}/autogroup").read_text().split()[-1] == "19"
        out, err = tmp_path / "out.log", tmp_path / "err.log"
        process = standby.hand_over({**os.environ, "PROBE_VALUE": "the worker's"}, str(out), str(err))
        assert process is not None and process.wait(60) == 3
    finally:
        standby.stop()
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {
        "argv": [str(script), str(tmp_path / "seen.json")],
        "name": "__main__",
        "path0": str(script.parent),
        "value": "the worker's",
        "dynamo": True,  # warmed before the hand-over
        "etcd_store": True,  # the store the Wrapper connects to under ftrun, gRPC with it
        "stdin": "",
        "groups": False,
        "policies": [os.SCHED_OTHER],  # every thread of the worker, torch's too, at the usual priority
        "session_nice": "0",
    }
    assert out.read_text() == "to stdout\n" and err.read_text() == "to stderr\n"


@pytest.mark.integration
def test_a_hand_over_too_big_for_the_pipe_is_refused_and_a_stopped_standby_ends() -> None:
    plan = standby_plan(PYTHON, ["-u", "unused.py"])
    assert isinstance(plan, StandbyPlan)
    standby = Standby(plan, dict(os.environ))
    pid = standby.start()
    process = standby.process
    assert process is not None
    began = time.monotonic()
    # Refused at once, not written while the standby still imports: the agent never waits for it.
    assert standby.hand_over({**os.environ, "HUGE": "x" * (2 << 20)}, "", "") is None
    assert time.monotonic() - began < 1.0 and process.poll() is None and standby.process is process
    standby.stop()
    assert process.poll() == -signal.SIGTERM and not _alive(pid)
    assert standby.hand_over(dict(os.environ), "", "") is None  # nothing left to hand over


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_standbys_started_handed_over_and_stopped_again_and_again_leave_the_agent_nothing(tmp_path: Path) -> None:
    """An agent starts a standby after every respawn: over many, its descriptors and threads stay flat, and
    every standby and worker it started is gone."""
    script = tmp_path / "exits.py"
    script.write_text("import sys\nsys.exit(0)\n")
    plan = standby_plan(PYTHON, ["-u", str(script)])
    assert isinstance(plan, StandbyPlan)
    pids: list[int] = []

    def cycle(hand_over: bool) -> None:
        standby = Standby(plan, dict(os.environ))
        pids.append(standby.start())
        if not hand_over:  # the job ended, or the standby was not needed: stopped while it warms
            standby.stop()
            return
        worker = standby.hand_over(dict(os.environ), str(tmp_path / "out.log"), str(tmp_path / "err.log"))
        assert worker is not None and worker.wait(120) == 0
        assert standby.process is None and not standby.poll_ready()  # nothing of it left to the agent

    cycle(True)
    cycle(False)
    fds, threads = _open_fds(), threading.active_count()
    for hand_over in (True, False, True, False, False, True):
        cycle(hand_over)
    assert (_open_fds(), threading.active_count()) == (fds, threads)
    assert not [pid for pid in pids if _alive(pid)]


@pytest.mark.integration
def test_standbys_that_end_before_they_are_warm_turn_the_keeper_off(tmp_path: Path) -> None:
    """Each standby imports a ``torch`` that raises: three in a row end before they are warm, then the node keeps
    none, saying why; one is never started before the node has been quiet for the delay."""
    (tmp_path / "torch.py").write_text("raise ImportError('a broken torch')\n")
    plan = standby_plan(PYTHON, ["-u", "train.py"])
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    now = [0.0]
    keeper = StandbyKeeper(lambda: (plan, env), delay=1.0, clock=lambda: now[0])
    started: list[int] = []
    try:
        keeper.tick()
        assert keeper.standby is None  # not before the delay
        deadline = time.monotonic() + 120
        while keeper.off is None:
            assert time.monotonic() < deadline, started
            now[0] += 1.0
            keeper.tick()
            if keeper.standby is not None and keeper.standby.pid not in started:
                started.append(keeper.standby.pid)
            time.sleep(0.05)
    finally:
        keeper.stop()
    assert len(started) == 3 and not any(_alive(pid) for pid in started), started
    assert keeper.off == "3 standbys in a row ended before they were warm (the last with exit code 1)"
    now[0] += 10.0
    keeper.tick()
    assert keeper.standby is None and keeper.take() is None


@pytest.mark.integration
def test_a_respawn_without_a_standby_holds_the_next_one_back_too(tmp_path: Path) -> None:
    """A worker respawned as a new process imports torch as a standby would: the next standby starts a delay
    after it, not beside it (seen: one that started 5 s after such a respawn tripled its start-up)."""
    (tmp_path / "torch.py").write_text("raise ImportError('a broken torch')\n")  # should one start, it ends
    plan = standby_plan(PYTHON, ["-u", "train.py"])
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    now = [0.0]
    keeper = StandbyKeeper(lambda: (plan, env), delay=5.0, clock=lambda: now[0])
    try:
        now[0] = 4.0
        assert keeper.take() is None  # the respawn, with no standby to hand over
        now[0] = 8.0  # past the delay from the workers' start, not from the respawn
        keeper.tick()
        assert keeper.standby is None
        now[0] = 9.5
        keeper.tick()
        assert keeper.standby is not None
    finally:
        keeper.stop()


@pytest.mark.integration
def test_a_standby_still_warming_is_stopped_not_handed_the_place() -> None:
    """A standby warms at idle CPU priority: on a busy host the rest of its imports could wait far longer than
    a new process takes to start, so a respawn before it said ``ready`` starts a new process instead."""
    plan = standby_plan(PYTHON, ["-u", "train.py"])
    now = [0.0]
    keeper = StandbyKeeper(lambda: (plan, dict(os.environ)), delay=1.0, clock=lambda: now[0])
    try:
        now[0] = 1.0
        keeper.tick()
        standby = keeper.standby
        assert standby is not None and standby.process is not None
        process = standby.process
        assert keeper.take() is None  # it imports torch for seconds yet
        assert process.poll() is not None and not _alive(standby.pid) and keeper.standby is None
        now[0] = 1.5
        keeper.tick()
        assert keeper.standby is None  # the respawn held the next one back
    finally:
        keeper.stop()


def test_ftrun_takes_the_standby_delay_in_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    def parsed(*argv: str) -> float:
        args, _ = parse_args(build_parser(), [*argv, "train.py"])  # as ftrun parses its command line
        return args.warm_standby_delay

    assert parsed() == STANDBY_DELAY == 30.0 and parsed("--warm-standby-delay=2.5") == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(SystemExit):
            parsed(f"--warm-standby-delay={bad}")
        assert f"expected a number of seconds > 0, got '{bad}'" in capsys.readouterr().err


def test_a_keeper_with_no_plan_says_why_and_starts_nothing() -> None:
    keeper = StandbyKeeper(lambda: ("the workers run '/bin/x', not this Python", {}), delay=0.0)
    keeper.tick()
    assert keeper.off == "the workers run '/bin/x', not this Python" and keeper.standby is None


def _wait_log(node: TorchrunNode, pattern: str, nodes: list[TorchrunNode], tmp_path: Path) -> re.Match[str]:
    deadline = time.monotonic() + 180
    while (found := re.search(pattern, node.log())) is None:
        assert node.process.poll() is None and time.monotonic() < deadline, f"{pattern}\n{logs(nodes, tmp_path)}"
        time.sleep(0.1)
    return found


@pytest.mark.slow
def test_a_warm_standby_takes_a_killed_workers_place_and_a_dead_one_is_replaced(
    nodes: list[TorchrunNode], tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("respawn: {rejoin: at_once}\n")
    node = TorchrunNode(
        "A",
        endpoint=etcd.endpoint,
        run_id=run_id,
        # Each step waits 20 ms with the CPU idle, as a rank waits on its GPU: the standby (SCHED_IDLE) warms up in
        # that time, as on a GPU node; with every core busy (here, CPU training beside the other tests) it waits.
        script=[
            str(SCRIPT),
            "--workdir",
            str(tmp_path / "work"),
            "--record-digests",
            "--step-wait",
            "0.02",
            *until_stopped(tmp_path),
        ],
        nnodes="1:1",
        nproc_per_node=2,
        rdzv_conf="last_call_timeout=0.5,lease_ttl=1",
        log_path=tmp_path / "A.log",
        extra_env={"OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"},
        launcher=ftrun_command(),
        # Each standby starts once the node was quiet for 5 s, not the default 30 (the test waits for three).
        extra_args=(f"--job-config={config}", "--warm-standby-delay=5"),
    )
    nodes.append(node)
    first = int(_wait_log(node, r"warm standby ready \(pid (\d+)\)", nodes, tmp_path)[1])
    os.kill(first, signal.SIGKILL)  # dies while it waits: replaced
    died = rf"the warm standby \(pid {first}\) ended with signal SIGKILL before it was used; another starts in 5 s"
    second = int(_wait_log(node, rf"{died}(?s:.*)warm standby ready \(pid (\d+)\)", nodes, tmp_path)[1])
    (victim,) = {e["pid"] for e in events(tmp_path) if e["event"] == "start" and e["rank"] == 1}
    os.kill(victim, signal.SIGKILL)
    respawned = rf"local rank 1 respawned as pid {second} \(initial rank 2, the node's warm standby\)"
    _wait_log(node, respawned, nodes, tmp_path)
    # The next standby starts once the node has been quiet; the job's end stops it.
    third = int(_wait_log(node, rf"{respawned}(?s:.*)warm standby starting \(pid (\d+)\)", nodes, tmp_path)[1])
    stop_once_started(nodes, tmp_path, lambda event: event["rank"] == 2, 1)
    assert node.wait(120) == 0, logs(nodes, tmp_path)
    assert not _alive(third) and not _alive(second)
    done = results(tmp_path)
    assert sorted(done) == [0, 2], done
    iteration = max(r["iteration"] for r in done.values())
    started = starts_after(tmp_path, iteration)
    assert started[2]["pid"] == second, started
    assert started[0]["digest"] == started[2]["digest"], started  # healed bit for bit from rank 0
    assert not [e for e in events(tmp_path) if e["event"] == "checkpoint_read" and e["rank"] == 2]
    assert len({round(r["checksum"], 6) for r in done.values()}) == 1, done
