"""When ``ftrun``'s agent lets in-process restart absorb a fault, and when it escalates.

Pure functions of what the agent observed; :mod:`elastic_ft.launcher.agent`
gathers the observations and carries out the decision. The rules, in order:

1. A worker whose in-process layer stopped the job (its ``elastic_ft.Wrapper``
   left with ``RestartLimitError`` for a fault that repeats identically: a
   bug that a process restart would only run into again) -> **fail**: stop
   the workers and end the job, whatever ``--max-restarts`` allows.
   A worker whose in-process layer gave up otherwise (``RestartAbort``, a
   barrier timeout or an internal error, the same on every rank) ->
   **escalate**.
2. A worker that failed outside the Wrapper (it never entered one) ->
   **escalate**: nothing in-process can recover it, so torchrun's
   behaviour applies.
3. Every local worker has exited: if one failed after its Wrapper completed
   the job (in the script's epilogue, or at interpreter exit) ->
   **succeeded**, with that failure as the reason: the training is done and
   a restart would only train it again from the last checkpoint, so nothing
   restarts, and the node reports the failure (its exit code, non-zero).
   Else if at least one succeeded (or was retired: a respawned process the
   job completed without, see :func:`retire_joiner`), the job completed
   in-process and the failures were absorbed -> **succeeded**; otherwise ->
   **escalate**.
4. A member died before its workers had all entered the Wrapper (or before
   it published its ranks), a member re-joined the rendezvous (its node
   escalated), the job moved on to a later round, or nodes wait for which
   the round has room (a newcomer below ``max`` that cannot take a place in
   the running round: a plain ``torchrun`` node, or none is open), or this
   node took a place in the running round but its world cannot grow
   in-process (its rank assignment admits no new ranks) -> **follow**:
   restart the local workers into the next round; in-process restart
   cannot finish a start-up a rank never reached, nor grow such a world.
5. Otherwise -> **continue**: failed workers that ran under the Wrapper are
   left to it (the agent reports them terminated in the round's store), and
   dead members whose workers were all under the Wrapper are absorbed the
   same way.

Escalating and following both stop the local workers and re-rendezvous, as
torchrun does. Only escalations count against ``--max-restarts``, and they
are counted job-wide (one key per escalated round in etcd), so every node
agrees on the count.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from elastic_ft.rendezvous.rules import MembershipChange


class WorkerExit(enum.Enum):
    """What a local worker's state means for the job."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    #: Failed inside the Wrapper, which goes on without it.
    ABSORBED = "absorbed"
    #: Its Wrapper gave up on the job.
    GAVE_UP = "gave_up"
    #: Its Wrapper stopped the job for good: a fault repeats identically.
    FATAL = "fatal"
    #: Failed outside any Wrapper: it never entered one.
    UNWRAPPED = "unwrapped"
    #: Failed after its Wrapper completed the job (the script's epilogue, or a crash at interpreter exit).
    FAILED_AFTER_COMPLETION = "failed_after_completion"
    #: A respawned process the job completed without, stopped by its agent (:func:`retire_joiner`).
    RETIRED = "retired"


def retire_joiner(joiner: bool, wrapped: bool, admitted: bool, job_finished: bool) -> bool:
    """Whether the agent stops a running worker because the job completed without it.

    A respawned process (``joiner``: its initial rank lies above the world)
    that was never admitted has no part in the result once every active rank
    completed (``job_finished``). Inside the Wrapper it sees that and returns
    by itself; before the Wrapper (importing, or in the script's own set-up,
    such as connecting to a store the completed ranks hosted and took with
    them) it may wait for minutes, and the job with it. Active ranks are
    never stopped: after the Wrapper returns, a script's own epilogue (a
    final checkpoint, an evaluation) runs as long as it needs.
    """
    return joiner and not wrapped and not admitted and job_finished


def classify_exit(
    exitcode: int | None, wrapped: bool, left: Mapping[str, object] | None, joiner: bool = False
) -> WorkerExit:
    """Classify a worker from its exit code (None: running) and the records its Wrapper left.

    Args:
        exitcode: the process's exit code, negative for a signal.
        wrapped: the process entered an ``elastic_ft.Wrapper``.
        left: how its Wrapper was left (``kind``, ``gave_up``), None if it
            was not (the process died inside it).
        joiner: a respawned process, not in the world it was started to
            join until a restart admits it: its failure before entering
            the Wrapper costs the world nothing.
    """
    if exitcode is None:
        return WorkerExit.RUNNING
    if exitcode == 0:
        return WorkerExit.SUCCEEDED
    if joiner and not wrapped:
        return WorkerExit.ABSORBED
    if not wrapped:
        return WorkerExit.UNWRAPPED
    if left is not None and left.get("kind") == "completed":
        return WorkerExit.FAILED_AFTER_COMPLETION
    if left is not None and left.get("gave_up"):
        return WorkerExit.FATAL if left.get("fatal") is True else WorkerExit.GAVE_UP
    return WorkerExit.ABSORBED


class Verdict(enum.Enum):
    CONTINUE = "continue"
    SUCCEEDED = "succeeded"
    ESCALATE = "escalate"
    FOLLOW = "follow"
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""


def _ranks(workers: Mapping[int, WorkerExit], kind: WorkerExit) -> list[int]:
    return sorted(rank for rank, exit_kind in workers.items() if exit_kind is kind)


def decide(
    workers: Mapping[int, WorkerExit],
    change: MembershipChange,
    lost: tuple[str, ...] = (),
    cannot_grow: bool = False,
) -> Decision:
    """The agent's next step, from its workers (by global rank) and the membership; see the module docstring.

    ``lost``: dead member nodes in-process restart cannot absorb (their
    workers had not all entered the Wrapper, or their ranks are unknown);
    ``cannot_grow``: this node joined the running round, whose world
    cannot take its workers in.
    """
    if not workers:
        raise ValueError("decide() needs at least one local worker")
    fatal = _ranks(workers, WorkerExit.FATAL)
    if fatal:
        return Decision(
            Verdict.FAIL,
            f"the in-process restart layer stopped the job on rank(s) {fatal}: a fault repeats (see their logs)",
        )
    gave_up = _ranks(workers, WorkerExit.GAVE_UP)
    if gave_up:
        return Decision(Verdict.ESCALATE, f"the in-process restart layer gave up on rank(s) {gave_up}")
    unwrapped = _ranks(workers, WorkerExit.UNWRAPPED)
    if unwrapped:
        return Decision(
            Verdict.ESCALATE,
            f"rank(s) {unwrapped} failed, and the round's etcd store holds no elastic_ft.Wrapper record of them "
            "running (they failed outside a Wrapper, or in one whose store_factory is not the round's store)",
        )
    if not _ranks(workers, WorkerExit.RUNNING):
        after = _ranks(workers, WorkerExit.FAILED_AFTER_COMPLETION)
        if after:
            return Decision(
                Verdict.SUCCEEDED,
                f"rank(s) {after} failed after their elastic_ft.Wrapper completed the job: not restarted (the "
                "training is done; a restart would train it again from the last checkpoint)",
            )
        if _ranks(workers, WorkerExit.SUCCEEDED) or _ranks(workers, WorkerExit.RETIRED):
            return Decision(Verdict.SUCCEEDED)
        return Decision(Verdict.ESCALATE, f"every local worker exited with an error: ranks {sorted(workers)}")
    if lost:
        return Decision(Verdict.FOLLOW, f"node(s) {list(lost)} died before in-process restart could take over")
    if cannot_grow:
        return Decision(
            Verdict.FOLLOW,
            "this node joined the running round, but its world cannot grow in-process (its rank "
            "assignment admits no new ranks)",
        )
    if change.rejoined:
        return Decision(Verdict.FOLLOW, f"node(s) {list(change.rejoined)} re-joined the rendezvous")
    if change.moved_on:
        return Decision(Verdict.FOLLOW, "the job moved on to a later rendezvous round")
    if change.admissible:
        return Decision(Verdict.FOLLOW, f"node(s) {list(change.admissible)} wait to join and the round has room")
    return Decision(Verdict.CONTINUE)


def exit_barrier_done(members: set[str], arrived: set[str], gone: set[str]) -> bool:
    """The agents' exit barrier: every member of the round finished or is gone (dead, or left through shutdown)."""
    return members <= arrived | gone


def restarts_left(max_restarts: int, escalated_rounds: set[int], current_round: int | None = None) -> int:
    """Process-level restarts left before escalating from ``current_round`` (None: after every escalation so far).

    Counts the escalations of earlier rounds only: several nodes escalating
    from the same round are one restart.
    """
    used = sum(1 for number in escalated_rounds if current_round is None or number < current_round)
    return max_restarts - used


@dataclass(frozen=True)
class Escalation:
    """What the agent does once in-process restart cannot absorb a fault: restart the processes (``restart``;
    ``left``: the process-level restarts left, this one included) or end the job, and the line it logs."""

    restart: bool
    left: int
    message: str


def escalation(decision: Decision, max_restarts: int, escalated_rounds: set[int], current_round: int) -> Escalation:
    """The tail of an ``ESCALATE`` or ``FAIL`` decision (pure): a process-level restart while ``--max-restarts``
    leaves one (never for ``FAIL``: the fault would repeat in new processes), else the end of the job."""
    if decision.verdict not in (Verdict.ESCALATE, Verdict.FAIL):
        raise ValueError(f"escalation() takes an ESCALATE or FAIL decision, got {decision.verdict.name}")
    left = 0 if decision.verdict is Verdict.FAIL else restarts_left(max_restarts, escalated_rounds, current_round)
    if left > 0:
        message = f"{decision.reason}: escalating to a process-level restart ({left} of {max_restarts} left)"
        return Escalation(True, left, message)
    if decision.verdict is Verdict.FAIL:
        return Escalation(False, 0, f"{decision.reason}; ending the job")
    return Escalation(False, 0, f"{decision.reason}, and no restarts are left (--max-restarts={max_restarts})")
