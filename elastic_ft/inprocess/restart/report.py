"""A restart's report and the restart limits: the job's one account of why it restarts, and when it stops.

After every restart's termination barrier, every rank knows the same
faults and the same ranks that left. :class:`RestartReporter` has the
lowest rank still in the job log and record the restart once, with the
cause's traceback (:func:`~elastic_ft.coordination.fault_records.restart_cause`),
and every rank apply the restart limits alike
(:func:`~elastic_ft.coordination.fault_records.give_up`).
"""

from __future__ import annotations

import logging

from elastic_ft.coordination.fault_records import give_up, group_faults, restart_cause, restart_reporter
from elastic_ft.coordination.iteration import IterationView
from elastic_ft.coordination.termination import TerminationResult
from elastic_ft.inprocess.exception import RestartLimitError
from elastic_ft.inprocess.restart.logs import get_logger
from elastic_ft.inprocess.state import State
from elastic_ft.observability import sink as event_sink

log = get_logger("wrapper")


class RestartReporter:
    """Reports each restart once for the job and stops restarting at the limits (a limit of None: none)."""

    def __init__(self, max_identical_faults: int | None, max_restarts_without_progress: int | None) -> None:
        self.max_identical_faults = max_identical_faults
        self.max_restarts_without_progress = max_restarts_without_progress

    def report(self, store: IterationView, state: State, result: TerminationResult) -> str | None:
        """Log and record the restart once for the job, with every fault grouped and each text once.

        After the termination barrier, so every fault of the iteration is
        recorded (a dead node's ranks are reported only once its lease
        expires), and every rank knows the same ranks left: the lowest rank
        still in the job (:func:`restart_reporter`) reports, with the
        traceback of the exception that caused the restart, if one did; the
        others log one line at DEBUG. Returns that traceback on the
        reporting rank.
        """
        reports = state.rank == restart_reporter(state.world_size, result.terminated)
        if not reports and not log.isEnabledFor(logging.DEBUG):
            return None  # one store read per restart for the job, not one per rank
        faults = group_faults(store.interruptions())
        summary = "; ".join(group.describe() for group in faults) or "no fault recorded"
        if not reports:
            log.debug("rank %s: iteration %d restarts: %s", state.rank, state.iteration, summary)
            return None
        cause = restart_cause(faults)
        if cause is None:
            shown = ""
        elif result.history.repeats > 1:  # its traceback was shown at its first restart
            shown = f" (the same fault as in the last {result.history.repeats - 1} iteration(s))"
        else:
            shown = f"\n{cause.kind} on rank {cause.ranks[0]}:\n{cause.traceback}"
        log.warning(
            "iteration %d restarts (%d rank(s), %d left): %s%s",
            state.iteration,
            state.world_size,
            len(result.terminated),
            summary,
            shown,
        )
        times = [group.time for group in faults if group.time is not None]
        event_sink.emit(
            "restart_decided",
            rank=state.initial_rank,
            iteration=state.iteration,
            fault_time=min(times) if times else None,
            kind=faults[0].kind if faults else "unknown",  # the cause
            faults=[{"kind": g.kind, "ranks": list(g.ranks), "message": g.message} for g in faults],
            terminated=list(result.terminated),
        )
        return None if cause is None else cause.traceback

    def check_limits(
        self, store: IterationView, state: State, result: TerminationResult, cause_traceback: str | None, step: int
    ) -> None:
        """Stop restarting when the restart limits are reached (every rank decides alike, from the same result).

        Raises:
            RestartLimitError: on every rank; its message names the last
                iteration's faults, and carries the cause's traceback on the
                reporting rank, which also logs it.
        """
        verdict = give_up(result.history, self.max_identical_faults, self.max_restarts_without_progress)
        if verdict is None:
            return
        reason, fatal = verdict.reason, verdict.fatal
        if not fatal:
            # The identical-fault rule names its fault; the no-progress rule names those of the last iteration.
            faults = group_faults(store.interruptions())
            reason += "; the last iteration ended on: " + (
                "; ".join(g.describe() for g in faults) or "no fault recorded"
            )
        reports = state.rank == restart_reporter(state.world_size, result.terminated)
        message = f"in-process restart gives up after iteration {state.iteration}: {reason}"
        if reports:
            log.error("%s", message)
            event_sink.emit(
                "gave_up",
                rank=state.initial_rank,
                iteration=state.iteration,
                kind="restart_limit",
                message=reason,
                step=step,
                fatal=fatal,
            )
            if cause_traceback:
                message += f"\nThe fault, as it was raised:\n{cause_traceback}"
        else:
            reporter = restart_reporter(state.world_size, result.terminated)
            message += f" (rank {reporter}'s log shows its traceback)"
        raise RestartLimitError(message, fatal)
