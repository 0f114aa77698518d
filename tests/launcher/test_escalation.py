"""The agent's escalation rules as pure functions (no processes, no etcd), and what FtAgent refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.launcher.escalation import (
    Decision,
    Verdict,
    WorkerExit,
    classify_exit,
    decide,
    escalation,
    exit_barrier_done,
    restarts_left,
    retire_joiner,
)
from elastic_ft.rendezvous.rules import MembershipChange

R, S, A, G, U = (
    WorkerExit.RUNNING,
    WorkerExit.SUCCEEDED,
    WorkerExit.ABSORBED,
    WorkerExit.GAVE_UP,
    WorkerExit.UNWRAPPED,
)
NOTHING = MembershipChange()


@pytest.mark.parametrize(
    ("exitcode", "wrapped", "left", "expected"),
    [
        (None, True, None, R),
        (0, False, None, S),
        (0, True, {"kind": "RestartAbort", "gave_up": True}, S),  # the script handled it
        (-9, True, None, A),  # killed inside the Wrapper
        (1, True, {"kind": "HealthCheckError", "gave_up": False}, A),  # left the job alone
        (1, True, {"kind": "RestartAbort", "gave_up": True}, G),
        (1, False, None, U),  # never entered a Wrapper
        (1, True, {"kind": "completed", "gave_up": False}, WorkerExit.FAILED_AFTER_COMPLETION),  # its epilogue
        (-11, True, {"kind": "completed", "gave_up": False}, WorkerExit.FAILED_AFTER_COMPLETION),  # at exit
        (1, True, {"kind": "RestartLimitError", "gave_up": True, "fatal": True}, WorkerExit.FATAL),  # a bug
        (1, True, {"kind": "RestartLimitError", "gave_up": True, "fatal": False}, G),  # no progress
        (1, True, {"kind": "RestartLimitError", "gave_up": True, "fatal": "yes"}, G),  # untrusted: not True
    ],
)
def test_classify_exit(exitcode: int | None, wrapped: bool, left: dict | None, expected: WorkerExit) -> None:
    assert classify_exit(exitcode, wrapped, left) is expected


@pytest.mark.parametrize(
    ("workers", "change", "verdict", "reason"),
    [
        ({0: R, 1: R}, NOTHING, Verdict.CONTINUE, ""),
        ({0: R, 1: A}, NOTHING, Verdict.CONTINUE, ""),  # absorbed in-process
        ({0: R, 1: R}, MembershipChange(dead=("b",)), Verdict.CONTINUE, ""),  # a dead node is absorbed too
        ({0: R, 1: G}, NOTHING, Verdict.ESCALATE, "gave up on rank(s) [1]"),
        ({0: WorkerExit.FATAL, 1: G}, NOTHING, Verdict.FAIL, "stopped the job on rank(s) [0]: a fault repeats"),
        ({0: R, 1: U}, NOTHING, Verdict.ESCALATE, "rank(s) [1] failed, and the round's etcd store holds no"),
        ({0: A, 1: A}, NOTHING, Verdict.ESCALATE, "every local worker exited with an error"),
        ({0: S, 1: A}, NOTHING, Verdict.SUCCEEDED, ""),  # the job completed; the failure was absorbed
        ({0: S, 1: S}, MembershipChange(rejoined=("b",)), Verdict.SUCCEEDED, ""),
        ({0: R, 1: A}, MembershipChange(rejoined=("b",)), Verdict.FOLLOW, "re-joined"),
        ({0: R}, MembershipChange(moved_on=True), Verdict.FOLLOW, "moved on"),
        ({0: R}, MembershipChange(dead=("b",), admissible=("c",)), Verdict.FOLLOW, "the round has room"),
        ({0: G, 1: S}, MembershipChange(rejoined=("b",)), Verdict.ESCALATE, "gave up"),  # giving up comes first
        # The node's worker died and its respawned process was retired: the others completed the job.
        ({0: A, 1: WorkerExit.RETIRED}, NOTHING, Verdict.SUCCEEDED, ""),
        # A rank failed after the job completed: nothing restarts (and the reason says so); the others may
        # still run their epilogue, and are waited for.
        ({0: S, 1: WorkerExit.FAILED_AFTER_COMPLETION}, NOTHING, Verdict.SUCCEEDED, "rank(s) [1] failed after"),
        ({0: WorkerExit.FAILED_AFTER_COMPLETION, 1: A}, NOTHING, Verdict.SUCCEEDED, "not restarted"),
        ({0: R, 1: WorkerExit.FAILED_AFTER_COMPLETION}, NOTHING, Verdict.CONTINUE, ""),
        ({0: U, 1: WorkerExit.FAILED_AFTER_COMPLETION}, NOTHING, Verdict.ESCALATE, "rank(s) [0] failed"),
    ],
)
def test_decide(workers: dict, change: MembershipChange, verdict: Verdict, reason: str) -> None:
    decision = decide(workers, change)
    assert decision.verdict is verdict
    assert reason in decision.reason


def test_a_dead_node_in_process_restart_cannot_absorb_is_followed() -> None:
    decision = decide({0: R, 1: R}, MembershipChange(dead=("b",)), lost=("b",))
    assert (
        decision.verdict is Verdict.FOLLOW and "['b'] died before in-process restart could take over" in decision.reason
    )
    assert decide({0: S, 1: S}, MembershipChange(dead=("b",)), lost=("b",)).verdict is Verdict.SUCCEEDED


@pytest.mark.parametrize(
    ("joiner", "wrapped", "admitted", "finished", "retired"),
    [
        (True, False, False, True, True),  # still before the Wrapper when the job completed
        (True, False, False, False, False),  # the job still runs: it may yet be admitted
        (True, True, False, True, False),  # in the Wrapper it sees the end and returns by itself
        (True, False, True, True, False),  # admitted: it took part in the result
        (False, False, False, True, False),  # an active rank's epilogue runs as long as it needs
    ],
)
def test_only_a_respawned_process_the_job_completed_without_is_retired(
    joiner: bool, wrapped: bool, admitted: bool, finished: bool, retired: bool
) -> None:
    assert retire_joiner(joiner, wrapped, admitted, finished) is retired


def test_decide_needs_workers() -> None:
    with pytest.raises(ValueError, match="at least one local worker"):
        decide({}, NOTHING)


def test_restarts_are_counted_per_escalated_round() -> None:
    assert restarts_left(2, set(), 0) == 2
    assert restarts_left(2, {0}, 0) == 2  # another node escalated the same round: one restart
    assert restarts_left(2, {0}, 1) == 1
    assert restarts_left(2, {0, 3}, 5) == 0
    assert restarts_left(2, {0, 3}) == 0  # every escalation so far: what a (re)starting node has used
    assert restarts_left(1, {0, 3}) == -1  # more than allowed (the agent clamps its count at 0)


def test_exit_barrier_counts_dead_members_as_arrived() -> None:
    assert not exit_barrier_done({"a", "b"}, {"a"}, set())
    assert exit_barrier_done({"a", "b"}, {"a"}, {"b"})
    assert exit_barrier_done({"a", "b"}, {"a", "b"}, set())


# ---- what FtAgent refuses, before starting anything -------------------------------


def test_ft_agent_needs_the_etcdft_rendezvous_and_a_script(etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from elastic_ft.launcher.agent import FtAgent
    from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings

    logs = DefaultLogsSpecs(log_dir=str(tmp_path))
    static = StaticTCPRendezvous("127.0.0.1", 29999, 0, 1, run_id, 60)
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=static, entrypoint="train.py")
    with pytest.raises(TypeError, match="FtAgent needs the etcdft rendezvous, got StaticTCPRendezvous"):
        FtAgent(spec, logs_specs=logs)
    handler = EtcdftRendezvousHandler(make_settings(run_id=run_id, endpoint=etcd.endpoint, min_nodes=1, max_nodes=1))
    try:
        spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=handler, entrypoint=print)
        with pytest.raises(
            TypeError, match="FtAgent runs a script or binary entrypoint, got <built-in function print>"
        ):
            FtAgent(spec, logs_specs=logs)
        state, _ = handler._parts.whole.snapshot()
        assert not state.rounds and not state.alive  # nothing joined, nothing written
    finally:
        handler.shutdown()


def test_an_escalation_restarts_the_processes_while_restarts_are_left_and_a_fatal_fault_ends_the_job() -> None:
    gave_up = Decision(Verdict.ESCALATE, "the in-process restart layer gave up on rank(s) [1]")
    first = escalation(gave_up, 2, set(), current_round=0)
    assert first.restart and first.left == 2
    assert first.message == f"{gave_up.reason}: escalating to a process-level restart (2 of 2 left)"
    spent = escalation(gave_up, 2, {0, 1}, current_round=2)
    assert not spent.restart and spent.message.endswith("and no restarts are left (--max-restarts=2)")
    fatal = escalation(Decision(Verdict.FAIL, "a fault repeats"), 2, set(), current_round=0)
    assert not fatal.restart and fatal.message == "a fault repeats; ending the job"
    with pytest.raises(ValueError, match="ESCALATE or FAIL"):
        escalation(Decision(Verdict.CONTINUE), 2, set(), current_round=0)
