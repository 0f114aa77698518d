"""``python -m elastic_ft.runtime.wait_daemon``: waits for every listed process, and only for them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ft.runtime.wait_daemon import listed_pids, main

pytestmark = pytest.mark.integration


def test_it_returns_once_every_listed_process_exited(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    pidfile = tmp_path / "pids"
    pidfile.write_text(f"{sleeper.pid}\nnot-a-pid\n")
    assert listed_pids(pidfile) == [sleeper.pid]
    started = time.monotonic()
    command = [sys.executable, "-m", "elastic_ft.runtime.wait_daemon", str(pidfile)]
    done = subprocess.run(command, check=False, timeout=30)  # the sleeper ends as a zombie: that counts as ended
    sleeper.wait()
    assert done.returncode == 0 and time.monotonic() - started >= 1.0


def test_a_timeout_or_a_missing_file_is_an_error(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "pids").write_text(f"{sleeper.pid}\n")
        assert main([str(tmp_path / "pids"), "--timeout", "0.5"]) == 1
        assert main([str(tmp_path / "missing")]) == 1
    finally:
        sleeper.kill()
        sleeper.wait()
