"""End-to-end tests of the in-process restart Wrapper: real processes, gloo on CPU, real faults.

Each test starts a job of 2 to 4 independent rank processes running
``tests/inprocess/worker.py`` (see that file for the scenarios) and asserts
the job's outcome: what the function returned on every rank and in which
iteration, which ranks finished, and how the others exited.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.inprocess.job import RankOutcome, describe, run_job

pytestmark = [pytest.mark.timeout(180), pytest.mark.integration]  # every test here starts processes


def job(scenario: dict[str, Any], world_size: int, tmp_path: Path, timeout: float = 90) -> list[RankOutcome]:
    outcomes = run_job(scenario, world_size, tmp_path, timeout)
    job.details = describe(outcomes, tmp_path)  # type: ignore[attr-defined]
    return outcomes


def details() -> str:
    return job.details  # type: ignore[attr-defined]


def assert_finished(outcome: RankOutcome, iteration: int, rank: int, world_size: int) -> None:
    """The rank returned the function's result from ``iteration`` as ``rank`` of ``world_size``."""
    assert outcome.returncode == 0, details()
    assert outcome.result is not None, details()
    assert (outcome.result["iteration"], outcome.result["rank"], outcome.result["world_size"]) == (
        iteration,
        rank,
        world_size,
    ), details()
    # Every rank of the final iteration summed the same ones through 5 all-reduces.
    assert outcome.result["value"] == world_size**5, details()


def fault(rank: int, kind: str, step: int | str = 2, iteration: int = 0) -> dict[str, Any]:
    return {"rank": rank, "kind": kind, "step": step, "iteration": iteration}


def test_exception_on_one_rank_restarts_all_ranks(tmp_path: Path) -> None:
    outcomes = job({"faults": [fault(1, "raise")]}, 3, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=3)
        # Called once per iteration, with the same arguments.
        assert [call["iteration"] for call in outcome.report["calls"]] == [0, 1], details()
    assert outcomes[1].report["calls"][0]["fault"] == "raise"


def test_a_job_under_a_profiler_restarts(tmp_path: Path) -> None:
    """A withdrawn restart left CPython 3.11 looping at the next profiled call (cProfile, coverage, a debugger)."""
    outcomes = job({"faults": [fault(1, "raise")], "profiled": True}, 3, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=3)
        assert outcome.report["profiled_calls"][0] > 0, details()


@pytest.mark.parametrize("kind", ["raise", "sigkill"])
def test_the_users_abort_runs_once_per_restart_on_every_rank(tmp_path: Path, kind: str) -> None:
    """As NVIDIA's Wrapper does: once per restart per rank, whichever thread unwinds first (the rank that raised
    leaves the function before its monitor thread starts the restart; the others are interrupted by theirs), and
    once on a rank that leaves the job."""
    scenario = {
        "count_aborts": True,
        # Rank 3 sleeps in Python outside the collective: its monitor thread interrupts it.
        "faults": [fault(1, kind), fault(3, "sleep_python")],
        "failing_hooks": [{"hook": "finalize", "ranks": [2], "error": "Exception"}],
    }
    outcomes = job(scenario, 4, tmp_path)
    # Rank 2 leaves (its finalize fails); rank 1 either stays or is dead.
    survivors = {0: 0, 1: 1, 3: 2} if kind == "raise" else {0: 0, 3: 1}
    for initial_rank, rank in survivors.items():
        assert_finished(outcomes[initial_rank], iteration=1, rank=rank, world_size=len(survivors))
    for initial_rank in (0, 2, 3) if kind == "sigkill" else (0, 1, 2, 3):
        aborts = outcomes[initial_rank].report["aborts"]
        assert [abort["iteration"] for abort in aborts] == [0], (initial_rank, aborts, details())
    assert outcomes[2].report["error"] == "RuntimeError", details()  # its finalize failed: it left, aborted once
    # The monitor thread aborts a main thread it must interrupt; a main thread that raised aborts itself first.
    assert outcomes[3].report["aborts"][0]["thread"].startswith("elastic_ft-monitor-thread"), details()
    if kind == "raise":
        assert outcomes[1].report["aborts"][0]["thread"] == "MainThread", details()


@pytest.mark.parametrize("kind, exit_code", [("exit", 17), ("sigkill", -signal.SIGKILL)])
def test_dead_rank_is_dropped_and_ranks_shift(tmp_path: Path, kind: str, exit_code: int) -> None:
    outcomes = job({"faults": [fault(1, kind)]}, 3, tmp_path)
    assert outcomes[1].returncode == exit_code, details()
    assert outcomes[1].report is None
    assert_finished(outcomes[0], iteration=1, rank=0, world_size=2)
    assert_finished(outcomes[2], iteration=1, rank=1, world_size=2)  # shifted down from 2
    assert "terminated" in (tmp_path / "monitor1.log").read_text()


def test_hang_with_gil_released_hits_soft_timeout_and_all_ranks_restart(tmp_path: Path) -> None:
    # Rank 1 sits in a C sleep (GIL released) while ranks 0 and 2 wait for it in an
    # all-reduce: nobody executes bytecode, the soft timeout fires, the abort closes
    # rank 1's connections, and when its sleep returns it restarts with the others.
    scenario = {
        "faults": [fault(1, "sleep_gil_released")],
        "hang_seconds": 3,
        "soft_timeout": 1,
        "hard_timeout": 10,
    }
    outcomes = job(scenario, 3, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=3)
    assert "soft timeout" in (tmp_path / "monitor1.log").read_text()


def test_hang_with_gil_held_hits_hard_timeout_sigterm_then_sigkill(tmp_path: Path) -> None:
    # Ranks 1 and 2 hang in C with the GIL held; rank 2 also ignores SIGTERM. Their
    # monitor processes terminate them: SIGTERM is enough for rank 1, rank 2 needs the
    # SIGKILL after the grace time. Rank 0 (blocked in gloo until its short timeout)
    # carries on alone.
    scenario = {
        "faults": [fault(1, "sleep_gil_held"), fault(2, "sleep_gil_held_ignoring_sigterm")],
        "soft_timeout": 1,
        "hard_timeout": 4,
        "termination_grace_time": 1,
        "gloo_timeout": 2,
    }
    outcomes = job(scenario, 3, tmp_path)
    assert outcomes[1].returncode == -signal.SIGTERM, details()
    assert outcomes[2].returncode == -signal.SIGKILL, details()
    assert_finished(outcomes[0], iteration=1, rank=0, world_size=1)
    log2 = (tmp_path / "monitor2.log").read_text()
    assert log2.index("SIGTERM") < log2.index("SIGKILL")
    assert "SIGKILL" not in (tmp_path / "monitor1.log").read_text()


def test_completion_timeout_restarts(tmp_path: Path) -> None:
    # Rank 0 dawdles after its last collective in iteration 0 longer than the others
    # are willing to wait at the completion barrier.
    scenario = {"faults": [fault(0, "slow_python", step="end")], "slow_seconds": 4, "completion_timeout": 1}
    outcomes = job(scenario, 2, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=2)


def test_initialize_raising_exception_restarts(tmp_path: Path) -> None:
    # The other rank waits in init_process_group for rank 1, which never comes: only
    # gloo's timeout can unblock that wait (no abort reaches it), so keep it short.
    scenario = {"failing_hooks": [{"hook": "initialize", "ranks": [1], "error": "Exception"}], "gloo_timeout": 3}
    outcomes = job(scenario, 2, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=2)
        # Initialize failed before the function's first call: it only ran in iteration 1.
        assert [call["iteration"] for call in outcome.report["calls"]] in ([0, 1], [1]), details()
    assert [call["iteration"] for call in outcomes[1].report["calls"]] == [1]


def test_initialize_raising_base_exception_ends_the_wrapper_on_that_rank(tmp_path: Path) -> None:
    scenario = {"failing_hooks": [{"hook": "initialize", "ranks": [1], "error": "BaseException"}], "gloo_timeout": 3}
    outcomes = job(scenario, 3, tmp_path)
    assert outcomes[1].returncode != 0, details()
    assert outcomes[1].error == "KeyboardInterrupt", details()
    assert outcomes[1].report["calls"] == []
    assert_finished(outcomes[0], iteration=1, rank=0, world_size=2)
    assert_finished(outcomes[2], iteration=1, rank=1, world_size=2)


@pytest.mark.parametrize("hook, error", [("health_check", "HealthCheckError"), ("finalize", "RuntimeError")])
def test_failing_health_check_or_finalize_drops_the_rank(tmp_path: Path, hook: str, error: str) -> None:
    # Rank 2 raises in iteration 0; during the restart, rank 1's hook fails (the health
    # check runs twice per iteration: before the function and after the fault).
    calls = [2] if hook == "health_check" else [1]
    scenario = {
        "faults": [fault(2, "raise")],
        "failing_hooks": [{"hook": hook, "ranks": [1], "error": "Exception", "calls": calls}],
    }
    outcomes = job(scenario, 3, tmp_path)
    assert outcomes[1].returncode == 1, details()
    assert outcomes[1].error == error, details()
    assert_finished(outcomes[0], iteration=1, rank=0, world_size=2)
    assert_finished(outcomes[2], iteration=1, rank=1, world_size=2)


def test_a_health_check_failing_once_before_the_function_restarts_everyone_and_the_rank_stays(
    tmp_path: Path,
) -> None:
    # NVIDIA's test_transient_unhealthy: unhealthy before the function is a fault of the iteration; the check
    # after finalize passes, so the rank takes part in the next iteration.
    scenario = {
        "failing_hooks": [{"hook": "health_check", "ranks": [0], "error": "Exception", "calls": [1]}],
        "gloo_timeout": 3,
    }
    outcomes = job(scenario, 3, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=3)


def test_a_health_check_failing_before_the_function_and_after_finalize_drops_the_rank(tmp_path: Path) -> None:
    scenario = {
        "failing_hooks": [{"hook": "health_check", "ranks": [0], "error": "Exception", "calls": [1, 2]}],
        "gloo_timeout": 3,
    }
    outcomes = job(scenario, 3, tmp_path)
    assert outcomes[0].error == "HealthCheckError", details()
    assert outcomes[0].returncode == 1
    # Rank 0 hosts the store: it stays until the others are done.
    assert_finished(outcomes[1], iteration=1, rank=0, world_size=2)
    assert_finished(outcomes[2], iteration=1, rank=1, world_size=2)


def test_retry_controller_limits_iterations(tmp_path: Path) -> None:
    scenario = {
        "faults": [fault(1, "raise", iteration=0), fault(1, "raise", iteration=1)],
        "retry": {"max_iterations": 2},
    }
    outcomes = job(scenario, 2, tmp_path)
    for outcome in outcomes:
        assert outcome.returncode == 1, details()
        assert outcome.error == "RestartAbort", details()
        assert [call["iteration"] for call in outcome.report["calls"]] == [0, 1]


def test_retry_controller_stops_below_min_world_size(tmp_path: Path) -> None:
    scenario = {"faults": [fault(2, "exit")], "retry": {"min_world_size": 3}}
    outcomes = job(scenario, 3, tmp_path)
    assert outcomes[2].returncode == 17, details()
    for outcome in outcomes[:2]:
        assert outcome.error == "RestartAbort", details()
        assert "min_world_size" in outcome.report["error_message"]


def test_atomic_block_defers_termination(tmp_path: Path) -> None:
    # Rank 0 writes a "checkpoint" inside atomic() when rank 1 raises; the restart
    # must wait for the block to finish, so the checkpoint is complete.
    scenario = {
        "faults": [fault(1, "raise", step=2), fault(0, "atomic_checkpoint", step=2)],
        "checkpoint_lines": 100,
    }
    outcomes = job(scenario, 2, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=2)
    lines = (tmp_path / "checkpoint.txt").read_text().splitlines()
    assert lines == [f"line {line}" for line in range(100)]
    first_call = outcomes[0].report["calls"][0]
    assert first_call["atomic_left"] <= first_call["restart_received"], details()


def test_a_restart_never_lands_inside_an_optimizer_step(tmp_path: Path) -> None:
    # Rank 1 raises while rank 0 is 0.5 s into a 1.5 s optimizer step (Python code all along): the
    # restart waits for the step and its post hook, so rank 0's state is one whole step further.
    scenario = {
        "faults": [fault(1, "raise_later", step=2), fault(0, "slow_optimizer_step", step=2)],
        "optimizer_seconds": 1.5,
        "raise_delay": 0.5,
    }
    outcomes = job(scenario, 2, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=2)
    first, second = outcomes[0].report["calls"]
    assert first["step_entered"] < first["step_left"] <= first["restart_received"], details()
    assert outcomes[1].report["calls"][0]["fault"] == "raise_later"
    assert (first["optimizer_steps"], second["optimizer_steps"]) == (0, 1), details()


def test_an_optimizer_step_that_raises_does_not_hold_the_restart(tmp_path: Path) -> None:
    # The step raises after its update: the lock it held for the restart is given back, and the
    # iteration restarts like after any exception.
    scenario = {"faults": [fault(0, "failing_optimizer_step", step=2)], "optimizer_seconds": 0.1}
    outcomes = job(scenario, 2, tmp_path, timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=2)
    assert "step_left" not in outcomes[0].report["calls"][0], details()  # no post hook ran


def test_dcp_optimizer_initialisation_is_not_a_training_step(tmp_path: Path) -> None:
    """DCP builds an optimizer's state with one lr-0 step: not counted; a loaded checkpoint's step is set."""
    (outcome,) = job({"dcp_optimizer_steps": 3, "steps": 0}, 1, tmp_path)
    assert outcome.returncode == 0, details()
    assert outcome.result is not None, outcome.output
    assert outcome.result["after_dcp_init"] == 0 and outcome.result["params_unchanged"], outcome.result
    assert outcome.result["after_training"] == 3, outcome.result
    assert outcome.result["after_load_and_one_step"] == 101, outcome.result


def test_monitor_processes_append_their_pids_for_wait_daemon(tmp_path: Path) -> None:
    """``monitor_process_pidfile``: one file per rank with ``{rank}``, else one line per rank in one file; the
    wait daemon returns once every listed process is gone."""
    per_rank, shared = tmp_path / "monitor-{rank}.pid", tmp_path / "monitors.pid"
    for name, pidfile in (("per-rank", per_rank), ("shared", shared)):
        outcomes = job({"steps": 1, "monitor_process_pidfile": str(pidfile)}, 2, tmp_path / name)
        assert all(o.returncode == 0 for o in outcomes), details()
    pids = [int((tmp_path / f"monitor-{rank}.pid").read_text()) for rank in range(2)]
    lines = shared.read_text().split()
    assert len(lines) == 2 and all(line.isdigit() for line in lines) and all(pid > 0 for pid in pids), lines
    from elastic_ft.runtime import wait_daemon

    assert wait_daemon.main([str(shared), "--timeout", "30"]) == 0  # the monitors ended with their ranks


def test_a_section_without_hang_protection_outlasts_both_timeouts(tmp_path: Path) -> None:
    """``disable_hang_protection()`` (NVIDIA 0.6), entered by every rank (a collective checkpoint, say): a stall
    inside it, past the hard timeout, restarts and kills nobody. A rank waiting for another one's unprotected
    section keeps its own timeouts, as in NVIDIA's Wrapper."""
    scenario = {
        "soft_timeout": 1.0,
        "hard_timeout": 1.5,
        "unprotected_seconds": 3.0,
        "faults": [fault(0, "unprotected_sleep", step=1), fault(1, "unprotected_sleep", step=1)],
    }
    outcomes = job(scenario, 2, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, 0, rank, 2)  # iteration 0: no restart


def test_ping_keeps_a_rank_busy_in_c_code_alive(tmp_path: Path) -> None:
    # Rank 1 spends 3 s in one C call (no bytecode, so no automatic heartbeat) while
    # a helper thread pings; the soft timeout is 1 s, yet nothing restarts.
    scenario = {
        "faults": [fault(1, "slow_c_call_with_pings", step="end")],
        "slow_seconds": 3,
        "soft_timeout": 1,
        "hard_timeout": 2,
    }
    outcomes = job(scenario, 2, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=0, rank=rank, world_size=2)


def test_missing_pings_after_the_first_restart_a_livelock(tmp_path: Path) -> None:
    # Once rank 1 pinged, a busy loop (executing bytecode, so automatic heartbeats
    # continue) without pings is caught by the soft timeout.
    scenario = {"faults": [fault(1, "livelock_after_ping", step="end")], "soft_timeout": 1, "hard_timeout": 10}
    outcomes = job(scenario, 2, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=2)


def test_swallowed_restart_is_raised_again_and_logged_with_its_location(tmp_path: Path) -> None:
    scenario = {"faults": [fault(0, "raise"), fault(1, "swallow_once")], "debug_log": True}
    outcomes = job(scenario, 2, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=2)
    assert "RankShouldRestart suppressed at" in outcomes[1].output, details()
    assert "worker.py" in outcomes[1].output.split("RankShouldRestart suppressed at", 1)[1].splitlines()[0]


def test_spare_rank_is_activated_after_a_failure(tmp_path: Path) -> None:
    scenario = {"faults": [fault(1, "exit")], "max_active_world_size": 3, "warmup_probe": True}
    outcomes = job(scenario, 4, tmp_path)
    assert outcomes[1].returncode == 17, details()
    # Rank 3 was a spare in iteration 0 (never called), active in iteration 1.
    assert [call["iteration"] for call in outcomes[3].report["calls"]] == [1], details()
    # It warmed up once, while it waited in reserve, before any process group existed in it; an active rank
    # never waited, and never warmed up (the workers here fork from a server that imported torch already:
    # tests/launcher/test_spares.py checks what the warm-up saves a fresh process).
    assert [(w["groups"], w["initialized"]) for w in outcomes[3].report["warmups"]] == [(0, False)], details()
    assert outcomes[3].report["warmups"][0]["at"] < outcomes[3].report["calls"][0]["entered"], details()
    assert all(outcomes[rank].report["warmups"] == [] for rank in (0, 2)), details()
    assert_finished(outcomes[0], iteration=1, rank=0, world_size=3)
    assert_finished(outcomes[2], iteration=1, rank=1, world_size=3)
    assert_finished(outcomes[3], iteration=1, rank=2, world_size=3)


def test_spare_returns_none_when_no_fault(tmp_path: Path) -> None:
    outcomes = job({"max_active_world_size": 2}, 3, tmp_path)
    assert_finished(outcomes[0], iteration=0, rank=0, world_size=2)
    assert_finished(outcomes[1], iteration=0, rank=1, world_size=2)
    assert outcomes[2].returncode == 0 and outcomes[2].report == {"calls": [], "warmups": [], "result": None}, details()


def test_nvidia_hook_forms_rank_filter_fault_counter_completion_terminate(tmp_path: Path) -> None:
    # 3 ranks; the deprecated rank_filter (divisible by 2, at most 4) leaves rank 2 a spare. Rank 1
    # raises: FaultCounter(max_rank_faults=0) takes it out (its terminate hook runs), the spare
    # replaces it, and every remaining rank's completion hook runs once.
    scenario = {"faults": [fault(1, "raise")], "nvidia_hooks": True}
    outcomes = job(scenario, 3, tmp_path)
    assert outcomes[1].returncode == 1 and outcomes[1].error == "HealthCheckError", details()
    assert "FaultCounterExceeded" in outcomes[1].output, details()
    assert outcomes[1].report["hooks"] == [
        {"hook": "finalize", "iteration": 0, "mode": "ACTIVE", "fn_exception": "RuntimeError"},
        {"hook": "terminate", "iteration": 0, "mode": "TERMINATED", "fn_exception": "RuntimeError"},
    ], details()
    # Rank 0's collective may or may not have failed on the fault before the restart reached it.
    assert [(c["hook"], c["iteration"]) for c in outcomes[0].report["hooks"]] == [
        ("finalize", 0),
        ("completion", 1),
    ], details()
    assert outcomes[0].report["hooks"][0]["fn_exception"] in (None, "RuntimeError"), details()
    assert outcomes[2].report["calls"] and [c["iteration"] for c in outcomes[2].report["calls"]] == [1], details()
    assert outcomes[2].report["hooks"][-1] == {
        "hook": "completion",
        "iteration": 1,
        "mode": "ACTIVE",
        "fn_exception": None,
    }, details()
    assert_finished(outcomes[0], iteration=1, rank=0, world_size=2)
    assert_finished(outcomes[2], iteration=1, rank=1, world_size=2)


def test_no_active_rank_left_stops_every_rank_with_restart_abort(tmp_path: Path) -> None:
    # 3 ranks, active world size divisible by 2: ranks 0 and 1 active, 2 a spare. Rank 1 dies: 0 and
    # the spare go on. Rank 2 dies: 1 rank left, no active rank, so RestartAbort, not a wait forever.
    scenario = {"faults": [fault(1, "exit"), fault(2, "exit", iteration=1)], "rank_filter_divisor": 2}
    outcomes = job(scenario, 3, tmp_path, timeout=60)
    assert outcomes[1].returncode == 17 and outcomes[2].returncode == 17, details()
    assert outcomes[0].error == "RestartAbort", details()
    assert (
        "the rank assignment left no active rank in iteration 2 (world size 1)" in outcomes[0].report["error_message"]
    ), details()


def test_two_faults_at_once_cause_one_restart(tmp_path: Path) -> None:
    scenario = {"faults": [fault(1, "raise"), fault(2, "exit")], "last_call_wait": 0.3}
    outcomes = job(scenario, 4, tmp_path)
    assert outcomes[2].returncode == 17, details()
    assert_finished(outcomes[0], iteration=1, rank=0, world_size=3)
    assert_finished(outcomes[1], iteration=1, rank=1, world_size=3)
    assert_finished(outcomes[3], iteration=1, rank=2, world_size=3)
    assert [call["iteration"] for call in outcomes[1].report["calls"]] == [0, 1]


def test_etcd_store_factory(tmp_path: Path, etcd: Any) -> None:
    scenario = {
        "faults": [fault(1, "raise")],
        "etcd_endpoints": [[endpoint.host, endpoint.port] for endpoint in etcd.endpoints],
        "etcd_prefix": f"/elastic_ft/wrapper-test-{uuid.uuid4().hex}/store/",
    }
    outcomes = job(scenario, 2, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=2)


def test_a_restart_leaves_no_mesh_of_the_last_iteration_in_dtensors_caches(tmp_path: Path) -> None:
    # A DeviceMesh equals any other of its layout, whatever its groups: DTensor's caches would answer iteration 1's
    # detach with iteration 0's mesh, whose group names iteration 1 gave to other groups, or to none.
    outcomes = job({"dtensor_gather": True, "faults": [fault(1, "raise", step=0)]}, 4, tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_finished(outcome, iteration=1, rank=rank, world_size=4)
        assert [call.get("gathered") for call in outcome.report["calls"]] == [list(map(float, range(8)))] * 2


def test_a_rank_frozen_with_its_monitor_is_reported_by_its_ring_predecessor(tmp_path: Path) -> None:
    # Rank 1 and its monitor process stop (a frozen host): no heartbeat comes, and nothing of rank 1 reports.
    # Rank 0's monitor checks rank 1's heartbeats with its own (one request for both) and, after the heartbeat
    # timeout, reports it gone: ranks 0 and 2 finish without it, long before their soft timeout.
    scenario = {"faults": [fault(1, "sigstop_with_monitor")], "heartbeat_timeout": 2}
    outcomes = job(scenario, 3, tmp_path, timeout=30)
    assert_finished(outcomes[0], iteration=1, rank=0, world_size=2)
    assert_finished(outcomes[2], iteration=1, rank=1, world_size=2)
    assert outcomes[1].returncode == -9, details()  # still stopped: the test ends it
    assert "initial rank 1 sent no heartbeat for 2 s" in (tmp_path / "monitor0.log").read_text(), details()
