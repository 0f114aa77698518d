"""The quickstart's script (docs/quickstart.md) survives a worker's SIGKILL under ftrun, in-process; the README's
script (examples/minimal.py) runs as the README says."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ft.testing.local_cluster import descendants

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"
MINIMAL = SCRIPT.with_name("minimal.py")


def _workers(agent: int) -> list[int]:
    """The agent's worker processes: its children running the script (not their monitor processes)."""
    found = []
    for child in descendants(agent):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
            parent = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == agent and str(SCRIPT).encode() in command:
            found.append(child)
    return found


# solo: the survivors train a fixed number of steps (the quickstart has no stop hook) while the process
# started for the dead worker imports torch; next to another test's load the import can take longer.
@pytest.mark.slow
@pytest.mark.solo
def test_quickstart_survives_a_killed_worker(tmp_path: Path) -> None:
    checkpoint = tmp_path / "quickstart.pt"
    command = [
        sys.executable,
        "-m",
        "elastic_ft.launcher.ftrun",
        "--nproc-per-node=3",
        str(SCRIPT),
        "--checkpoint",
        str(checkpoint),
        "--epochs",
        "8",
    ]
    log = tmp_path / "ftrun.log"
    with log.open("w") as out:
        ftrun = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not checkpoint.exists():
            assert ftrun.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        workers = _workers(ftrun.pid)
        assert len(workers) >= 3, f"{workers}\n{log.read_text()[-2000:]}"
        os.kill(workers[-1], signal.SIGKILL)
        assert ftrun.wait(180) == 0, log.read_text()[-5000:]
    finally:
        if ftrun.poll() is None:
            os.killpg(ftrun.pid, signal.SIGKILL)
    text = log.read_text()
    finished = re.findall(r"rank (\d) finished at step (\d+)", text)
    # The survivors trained on at once without the dead worker; the process started in its place rejoined
    # the running world (respawn.rejoin: at_once, the default), and the three finished together.
    assert len(finished) == 3 and len({step for _, step in finished}) == 1, text[-3000:]
    # The script prints the RANK its process started with: 3 for the new process (ranks 0 to 2 were taken).
    assert sorted(rank for rank, _ in finished) == ["0", "1", "3"], text[-3000:]
    assert re.search(r"on 2 ranks", text), text[-3000:]  # trained on, in-process, without the dead worker
    assert "respawned as pid" in text, text[-3000:]


@pytest.mark.slow
def test_the_readmes_script_runs_under_ftrun_as_the_readme_says(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic_ft.launcher.ftrun", "--nproc-per-node=2", str(MINIMAL)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    finished = re.findall(r"rank (\d) finished at step (\d+)", done.stdout + done.stderr)
    assert sorted(finished) == [("0", "3000"), ("1", "3000")], (done.stdout + done.stderr)[-4000:]
