"""The Wrapper's logs during a call: NVIDIA 0.6's ``nvrx`` logger gets them when the application configured it."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

from elastic_ft.inprocess.restart.logs import LOGGER_NAME, configure_logging, release_logging

SCRIPT = """
import datetime, io, logging, os
from elastic_ft.runtime.net import free_port
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="localhost", MASTER_PORT=str(free_port()))
import elastic_ft.inprocess as inprocess

@inprocess.Wrapper(store_kwargs={"port": free_port(), "timeout": datetime.timedelta(seconds=10)})
def fn():
    return 7

logger = logging.getLogger("nvrx")
logger.setLevel(logging.DEBUG)
said = []
for _ in range(2):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    assert fn() == 7
    logger.removeHandler(handler)
    said.append(stream.getvalue())
assert said[0] and len(said[0]) == len(said[1]), said
assert "iteration 0 completed" in said[0], said
assert logging.getLogger("elastic_ft.inprocess").handlers == []
print("ok")
"""


@pytest.mark.integration
def test_an_application_that_configured_nvidias_logger_gets_every_calls_logs_there() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    assert "logging not initialized" not in done.stderr  # configuring nvrx is configuring logging


def test_the_forwarding_is_undone_when_the_call_ends() -> None:
    nvidia = logging.getLogger("nvrx")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    nvidia.addHandler(handler)
    try:
        setup = configure_logging()
        logging.getLogger(LOGGER_NAME).warning("restarting")
        release_logging(setup)
        logging.getLogger(LOGGER_NAME).warning("after the call")
    finally:
        nvidia.removeHandler(handler)
    assert stream.getvalue() == "restarting\n"
    assert logging.getLogger(LOGGER_NAME).handlers == [] and logging.getLogger(LOGGER_NAME).propagate


MONITOR_LOG_SCRIPT = """
import logging, sys
from elastic_ft.inprocess.restart.logs import log_to_file
log_to_file(sys.argv[1], logging.INFO)
logging.getLogger("elastic_ft.inprocess.monitor_process").info("a verdict")
logging.getLogger("elastic_ft.etcd.outage").warning("etcd at x is unreachable")
logging.getLogger("elastic_ft.etcd.client").debug("below the level")
logging.getLogger("some_library").warning("not ours")
"""


@pytest.mark.integration
def test_the_monitor_process_logs_the_etcd_clients_outages_to_its_file(tmp_path) -> None:
    """The monitor process's stderr is not the rank's: what its etcd client records of an outage must reach the
    monitor's log file, beside its verdicts, or a monitor that cannot reach etcd says nothing anywhere."""
    path = tmp_path / "monitor.log"
    done = subprocess.run(
        [sys.executable, "-c", MONITOR_LOG_SCRIPT, str(path)], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    written = path.read_text()
    assert "a verdict" in written and "etcd at x is unreachable" in written, written
    assert "below the level" not in written and "not ours" not in written, written
    assert "etcd at x" not in done.stderr


@pytest.mark.integration
def test_an_application_that_configured_no_logging_gets_the_reports_on_stderr_without_a_warning() -> None:
    script = (
        "import logging\n"
        "from elastic_ft.inprocess.restart.logs import configure_logging, release_logging\n"
        "setup = configure_logging()\n"
        "logging.getLogger('elastic_ft.inprocess.restart').info('a restart report')\n"
        "release_logging(setup)\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "a restart report" in done.stderr and "Warning" not in done.stderr, done.stderr


@pytest.mark.integration
def test_the_not_configured_warning_is_shown_only_when_asked_and_points_at_the_applications_call(tmp_path) -> None:
    """NVIDIA's tests expect a ``UserWarning`` when a Wrapper call starts with no logging configured; a user who
    did not ask sees none (the reports reach stderr anyway). Asked for, it names the application's call."""
    script = tmp_path / "train.py"
    script.write_text(
        "import datetime, os\n"
        "from elastic_ft.runtime.net import free_port\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='localhost', "
        "MASTER_PORT=str(free_port()))\n"
        "import elastic_ft.inprocess as inprocess\n"
        "from elastic_ft.inprocess.restart.logs import LoggingNotConfiguredWarning\n"
        "assert issubclass(LoggingNotConfiguredWarning, UserWarning)\n"
        "@inprocess.Wrapper(store_kwargs={'port': free_port(), 'timeout': datetime.timedelta(seconds=10)})\n"
        "def fn():\n"
        "    return 7\n"
        "assert fn() == 7\n"
    )
    shown = {}
    for options in ([], ["-W", "default"]):
        done = subprocess.run(
            [sys.executable, *options, str(script)], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr
        shown[tuple(options)] = done.stderr
    assert "Warning" not in shown[()], shown[()]
    assert f"{script}:10: LoggingNotConfiguredWarning: logging is not configured" in shown[("-W", "default")]
