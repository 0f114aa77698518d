"""The test harness's nodes (``elastic_ft.testing.local_cluster``): a node that outlives a wait says where
it is, so a hang found in a full run can be read after it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ft.testing.local_cluster import NodeStillRunning, TorchrunNode

#: A "launcher" that writes a line and then waits in a function whose name the stacks must show.
STUCK = (
    "import time\nprint('started', flush=True)\ndef stuck_in_shutdown():\n    time.sleep(120)\nstuck_in_shutdown()\n"
)


@pytest.mark.integration
def test_a_node_still_running_after_a_wait_reports_its_log_and_its_stacks(tmp_path: Path) -> None:
    node = TorchrunNode(
        "A",
        endpoint="127.0.0.1:1",
        run_id="harness",
        script=[],
        launcher=[sys.executable, "-c", STUCK],
        log_path=tmp_path / "A.log",
    )
    try:
        while "started" not in node.log():
            assert node.process.poll() is None, node.log()
            time.sleep(0.05)
        with pytest.raises(NodeStillRunning) as raised:
            node.wait(0.1)
        assert isinstance(raised.value, subprocess.TimeoutExpired)  # callers that catch it still do
        message = str(raised.value)
        assert "started" in message
        assert "stuck_in_shutdown" in message, message
    finally:
        node.kill()
