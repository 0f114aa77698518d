"""Wrapper behaviours NVIDIA's own 0.4.1 tests rely on, run in a one-rank job (a real process, a real TCPStore)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.inprocess.job import free_port_pair

pytestmark = pytest.mark.integration  # every test here starts processes

PRELUDE = """
import datetime, json, logging
import torch.distributed as dist
from elastic_ft import inprocess

KWARGS = dict(
    store_kwargs={"timeout": datetime.timedelta(seconds=10)},
    monitor_thread_interval=datetime.timedelta(milliseconds=5),
    last_call_wait=datetime.timedelta(milliseconds=5),
    termination_grace_time=datetime.timedelta(milliseconds=5),
)
report = {}
"""


def run(body: str) -> dict:
    port = free_port_pair()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    script = PRELUDE + textwrap.dedent(body) + "\nprint('REPORT', json.dumps(report))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def test_a_function_raising_rank_should_restart_asks_for_a_restart() -> None:
    report = run(
        """
        calls = []

        @inprocess.Wrapper(initialize=inprocess.initialize.RetryController(max_iterations=3), **KWARGS)
        def fn(call_wrapper: inprocess.CallWrapper | None = None):
            calls.append(call_wrapper.iteration)
            if call_wrapper.iteration < 2:
                raise inprocess.monitor_thread.RankShouldRestart
            return "done"

        report["result"] = fn()
        report["calls"] = calls
        """
    )
    assert report == {"result": "done", "calls": [0, 1, 2]}


def test_an_assignment_that_activates_nobody_is_a_fault_and_its_next_error_ends_the_call() -> None:
    report = run(
        """
        class Once(inprocess.rank_assignment.RankAssignment):
            calls = 0
            def __call__(self, ctx):
                Once.calls += 1
                if Once.calls > 1:
                    raise ZeroDivisionError("second assignment")
                return ctx  # mode stays INITIALIZED: no rank is active or a spare

        @inprocess.Wrapper(rank_assignment=Once(), **KWARGS)
        def fn():
            return "never"

        try:
            fn()
        except ZeroDivisionError as error:
            report["error"] = str(error)
        """
    )
    assert report == {"error": "second assignment"}


def test_the_call_leaves_no_log_handler_and_refuses_an_initialized_process_group() -> None:
    report = run(
        """
        log = logging.getLogger("elastic_ft.inprocess")
        @inprocess.Wrapper(**KWARGS)
        def fn():
            report["during"] = len(log.handlers)
            return 1

        fn()
        report["after"] = (len(log.handlers), log.propagate)
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            fn()
        except ValueError as error:
            report["error"] = str(error)
        dist.destroy_process_group()
        """
    )
    assert report["during"] == 1 and report["after"] == [0, True]
    assert report["error"].startswith("the Wrapper needs not torch.distributed.is_initialized()")


def test_a_call_leaves_no_wrapper_or_store_alive_without_a_garbage_collection() -> None:
    """NVIDIA's tear-down counts every TCPStore still alive after each call, with no collection first.

    A reference cycle through the CallWrapper (its monitor thread's bound
    method, its last fault's traceback, a leaving rank's error and its
    context) kept the store, and its listening socket, alive until the
    collector ran; a second call on the same port then failed to listen.
    """
    report = run(
        """
        import gc
        from elastic_ft.inprocess.restart.call import CallWrapper

        class Unhealthy(inprocess.health_check.HealthCheck):
            def __init__(self, fail_times):
                self.fail_times = fail_times

            def __call__(self, state):
                if self.fail_times:
                    self.fail_times -= 1
                    raise ZeroDivisionError
                return state

        def alive():
            return sum(isinstance(o, (CallWrapper, dist.TCPStore)) for o in gc.get_objects())

        gc.collect()
        gc.disable()
        outcomes = {}

        @inprocess.Wrapper(**KWARGS)
        def returns():
            return 1

        returns()
        outcomes["returned"] = alive()

        @inprocess.Wrapper(**KWARGS, health_check=Unhealthy(fail_times=1))
        def heals():
            return 1

        heals()
        outcomes["unhealthy once"] = alive()

        @inprocess.Wrapper(**KWARGS, health_check=Unhealthy(fail_times=100))
        def leaves():
            raise RuntimeError

        try:
            leaves()
        except inprocess.exception.HealthCheckError:
            pass  # while handled, the error's traceback holds the call's frames
        outcomes["left unhealthy"] = alive()

        @inprocess.Wrapper(**KWARGS, initialize=inprocess.initialize.RetryController(max_iterations=2))
        def aborts():
            raise KeyError

        for attempt in range(2):  # the same Wrapper called again: its port must be free
            try:
                aborts()
            except inprocess.exception.RestartAbort:
                pass
            outcomes[f"aborted {attempt}"] = alive()
        report.update(outcomes)
        """
    )
    assert report == {"returned": 0, "unhealthy once": 0, "left unhealthy": 0, "aborted 0": 0, "aborted 1": 0}
