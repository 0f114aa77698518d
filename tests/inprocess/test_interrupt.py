"""Withdrawing a restart scheduled for the main thread, under a profiler.

CPython 3.11 keeps its "asynchronous exception pending" flag set after a
scheduled exception is cleared, and with a profiler active the next Python
call then loops forever at its entry. Each case runs in a fresh interpreter,
since the failure is a hang.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration  # each case starts an interpreter


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_profiled_call_after_a_withdrawal_returns() -> None:
    done = run(
        """
        import sys
        from elastic_ft.inprocess.delivery.interrupt import clear_main_thread_pending_exception

        def step():
            return 1

        clear_main_thread_pending_exception()
        calls = []
        sys.setprofile(lambda frame, event, arg: calls.append(event))
        step()
        sys.setprofile(None)
        print("returned", "call" in calls)
        """
    )
    assert (done.returncode, done.stdout.strip()) == (0, "returned True"), done.stderr


def test_a_restart_scheduled_after_a_withdrawal_is_still_raised() -> None:
    done = run(
        """
        import threading
        from elastic_ft.inprocess.delivery.interrupt import (
            clear_main_thread_pending_exception, raise_in_main_thread)
        from elastic_ft.inprocess.exception import RankShouldRestart

        clear_main_thread_pending_exception()
        try:
            threading.Thread(target=raise_in_main_thread, args=(RankShouldRestart,)).start()
            while True:
                pass
        except RankShouldRestart:
            print("raised")
        """
    )
    assert (done.returncode, done.stdout.strip()) == (0, "raised"), done.stderr


def test_only_the_main_thread_may_withdraw() -> None:
    done = run(
        """
        import threading
        from elastic_ft.inprocess.delivery.interrupt import clear_main_thread_pending_exception

        errors = []

        def other():
            try:
                clear_main_thread_pending_exception()
            except RuntimeError as error:
                errors.append(str(error))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        print(errors)
        """
    )
    assert "must be called from the main thread" in done.stdout, done.stderr
