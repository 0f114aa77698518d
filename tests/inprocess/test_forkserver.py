"""The test harness's fork server runs a script as ``python script.py`` would (``forkserver.py``)."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.inprocess.forkserver import ForkServer

pytestmark = pytest.mark.integration  # it starts processes

SCRIPT = """
import json, os, sys, threading, time
what = sys.argv[1]
if what == "report":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FORKED_VALUE"),
                      "main": __name__, "file": __file__, "path0": sys.path[0],
                      "torch": "torch" in sys.modules, "threads": threading.active_count()}))
elif what == "raise":
    raise ValueError("from the script")
elif what == "exit":
    sys.exit(3)
elif what == "thread":  # the interpreter waits for a non-daemon thread before it exits, as it would
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
else:
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    started = ForkServer(["torch"])
    yield started
    started.close()


def run(server: ForkServer, tmp_path: Path, *argv: str) -> tuple[int | None, str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    log = tmp_path / f"{argv[0]}.log"
    with log.open("wb") as output:
        pid = server.start([str(script), *argv], {**os.environ, "FORKED_VALUE": "42"}, str(tmp_path), output.fileno())
    code = server.wait(pid, 60)
    return code, log.read_text()


def test_a_forked_script_sees_its_own_argv_environment_directory_and_main(server: ForkServer, tmp_path: Path) -> None:
    code, output = run(server, tmp_path, "report", "x")
    assert code == 0, output
    seen = json.loads(output)
    script = str(tmp_path / "script.py")
    assert seen == {
        "argv": [script, "report", "x"],
        "cwd": str(tmp_path),
        "env": "42",
        "main": "__main__",
        "file": script,
        "path0": str(tmp_path),
        "torch": True,
        "threads": 1,
    }


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(server: ForkServer, tmp_path: Path) -> None:
    code, output = run(server, tmp_path, "raise")
    assert code == 1 and "Traceback" in output and "ValueError: from the script" in output, output


def test_sys_exit_gives_its_code_and_threads_are_joined_at_exit(server: ForkServer, tmp_path: Path) -> None:
    assert run(server, tmp_path, "exit")[0] == 3
    assert run(server, tmp_path, "thread") == (0, "thread done\n")


def test_a_killed_rank_reports_the_signal_and_a_running_one_times_out(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    with (tmp_path / "sleep.log").open("wb") as output:
        pid = server.start([str(script), "sleep"], dict(os.environ), str(tmp_path), output.fileno())
    assert server.wait(pid, 0.5) is None
    server.kill(pid)
    assert server.wait(pid, 30) == -signal.SIGKILL


def test_the_server_exits_when_its_owner_closes_it() -> None:
    started = ForkServer([])
    started.close()
    assert started.process.returncode == 0, sys.executable
