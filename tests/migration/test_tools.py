"""``shared_utils.inject_fault`` (NVIDIA 0.6), also as ``inprocess.tools.inject_fault`` (0.4.1): fault injection."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastic_ft.shared_utils.inject_fault import (
    CustomFault,
    Fault,
    InjectedException,
    clear_workload_exception,
    inject_fault,
    maybe_raise_workload_exception,
    register_fault,
)

NVIDIA_FAULTS = {
    "GPU_ERROR",
    "GPU_SLEEP",
    "WORKLOAD_EXC",
    "ASYNC_EXC",
    "SIGNAL_EXC",
    "OS_ABORT",
    "LOCK_GIL",
    "SEGFAULT",
    "SIGINT",
    "SIGKILL",
    "SIGTERM",
    "SIGSTOP",
}


def test_the_fault_names_are_nvidias() -> None:
    assert set(Fault.__members__) == NVIDIA_FAULTS
    assert Fault["LOCK_GIL"] is Fault.LOCK_GIL  # NVIDIA's test app parses names this way


def _chosen(monkeypatch: pytest.MonkeyPatch, seed: int, world_size: int, **kwargs: object) -> list[int]:
    """The ranks that arm a fault for ``seed``: every rank draws the same scenario."""
    armed: list[int] = []
    register_fault("RECORD", lambda delay, callback: armed.append(int(os.environ["RANK"])))
    fault = CustomFault("RECORD")
    for rank in range(world_size):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        inject_fault(faults=(fault,), seed=seed, **kwargs)  # type: ignore[arg-type]
    return armed


def test_every_rank_draws_the_same_scenario_and_keep_alive_ranks_are_spared(monkeypatch: pytest.MonkeyPatch) -> None:
    for seed in range(20):
        chosen = _chosen(monkeypatch, seed, 8, num_faults=(1, 3), keep_alive=2, delay=(0.0, 0.1))
        assert 1 <= len(chosen) <= 3 and min(chosen) >= 2
        assert chosen == _chosen(monkeypatch, seed, 8, num_faults=(1, 3), keep_alive=2, delay=(0.0, 0.1))
    assert _chosen(monkeypatch, 1, 4, num_faults=9, keep_alive=1, delay=0.0) == [1, 2, 3]  # capped by the world


def test_a_workload_exception_is_raised_by_the_training_loops_next_check() -> None:
    clear_workload_exception()
    called = threading.Event()
    os.environ.update(RANK="0", WORLD_SIZE="1")
    inject_fault(faults=(Fault.WORKLOAD_EXC,), num_faults=1, keep_alive=0, delay=0.05, seed=0, callback=called.set)
    maybe_raise_workload_exception()  # not yet
    assert called.wait(5)
    time.sleep(0.05)
    with pytest.raises(InjectedException):
        maybe_raise_workload_exception()
    maybe_raise_workload_exception()  # raised once


def test_an_asynchronous_exception_lands_in_the_main_thread() -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1")
    with pytest.raises(InjectedException):
        inject_fault(faults=(Fault.ASYNC_EXC,), num_faults=1, keep_alive=0, delay=0.05, seed=0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.01)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("fault", "code"),
    [("SIGKILL", -signal.SIGKILL), ("SEGFAULT", -signal.SIGSEGV), ("OS_ABORT", -signal.SIGABRT), ("SIGNAL_EXC", 3)],
)
def test_process_faults_end_the_process_as_named(fault: str, code: int) -> None:
    script = (
        "import sys, time\n"
        "from elastic_ft.shared_utils.inject_fault import Fault, InjectedException, inject_fault\n"
        f"inject_fault(faults=(Fault.{fault},), num_faults=1, keep_alive=0, delay=0.05, seed=0)\n"
        "try:\n    time.sleep(10)\nexcept InjectedException:\n    sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == code, done.stderr[-2000:]


@pytest.mark.integration
def test_lock_gil_holds_the_gil_for_good() -> None:
    script = (
        "import threading, time, sys\n"
        "from elastic_ft.shared_utils.inject_fault import Fault, inject_fault\n"
        "beats = []\n"
        "threading.Thread(target=lambda: [beats.append(time.sleep(0.01)) for _ in iter(int, 1)], daemon=True).start()\n"
        "inject_fault(faults=(Fault.LOCK_GIL,), num_faults=1, keep_alive=0, delay=0.0, seed=0)\n"
        "time.sleep(0.5)\n"
        "print('alive')\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"},
            capture_output=True,
            timeout=5,
            check=False,
        )


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="at least one fault"):
        inject_fault(faults=(), num_faults=1, keep_alive=0, delay=0.0, seed=0)
    with pytest.raises(ValueError, match=r"num_faults=\(3, 1\) is invalid"):
        inject_fault(faults=(Fault.SIGINT,), num_faults=(3, 1), keep_alive=0, delay=0.0, seed=0)
    with pytest.raises(ValueError, match="no handler is registered"):
        inject_fault(faults=(CustomFault("NEVER_REGISTERED"),), num_faults=1, keep_alive=0, delay=0.0, seed=0)
    with pytest.raises(TypeError, match="callable handler"):
        register_fault("X", "not callable")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a Fault or a non-empty name"):
        register_fault("", lambda delay, callback: None)


@pytest.mark.integration
def test_the_0_4_1_path_is_a_deprecated_name_of_the_same_module() -> None:
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from elastic_ft.inprocess.tools.inject_fault import Fault, register_fault\n"
        "from elastic_ft.shared_utils import inject_fault\n"
        "assert Fault is inject_fault.Fault and register_fault is inject_fault.register_fault\n"
        "print([str(w.message) for w in caught if w.category is DeprecationWarning])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "elastic_ft.inprocess.tools is deprecated" in out
    assert "elastic_ft.shared_utils.inject_fault" in out
