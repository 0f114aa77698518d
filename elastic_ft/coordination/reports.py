"""Reports, from outside a process, that it died inside the Wrapper: by its monitor process, or by ``ftrun``'s
agent, which sees a worker exit or a node lost before any heartbeat times out.

They act on both views: the job-wide records say where the process was
(its last ``position``), and its iteration's barriers get its arrival.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.barriers import NO_WAIT
from elastic_ft.coordination.iteration import (
    COMPLETED,
    iteration_store,
    report_rank_gone,
)
from elastic_ft.coordination.job import WITHDRAWN, job_store
from elastic_ft.keys import EXIT_BARRIER


def report_process_gone(base: dist.Store, initial_rank: int, initial_world_size: int, kind: str, message: str) -> bool:
    """Report, from outside, that the process of ``initial_rank`` died inside the Wrapper.

    Uses the position the process published last, so the other ranks restart
    without it at once. Idempotent (barrier arrivals are per rank), so the
    process's own monitor process may report it too. Returns False when
    there is nothing to report: the process never entered the Wrapper, or
    left it already.
    """
    job = job_store(base)
    if not job.is_wrapped(initial_rank) or job.left(initial_rank) is not None:
        return False
    position = job.position(initial_rank)
    if position is None and initial_rank >= initial_world_size:
        # A joiner that was never admitted: withdraw it, so no restart admits a dead process. One admitted
        # already, but dead before it took its place, is recorded lost in that iteration: the ranks waiting
        # there for it stand in for it (IterationRecords.stand_in_for_lost).
        held = job.claim_admission(initial_rank, WITHDRAWN)
        admitted_to = keys.parse_count(held) if held != WITHDRAWN else None
        if admitted_to is not None:
            iteration = iteration_store(base, admitted_to)
            if iteration.outcome() != COMPLETED:
                iteration.record_lost(initial_rank)
    if position is not None:
        iteration = iteration_store(base, position["iteration"])
        if iteration.outcome() != COMPLETED:
            report_rank_gone(
                iteration,
                position["rank"],
                position["world_size"],
                kind,
                message,
                interrupt=bool(position["active"]),
            )
    if initial_rank < initial_world_size:  # joiners are not counted by the exit barrier
        job.arrive_and_wait(EXIT_BARRIER, [initial_rank], initial_world_size, NO_WAIT)
    return True


def report_node_gone(
    base: dist.Store, initial_ranks: Sequence[int], initial_world_size: int, message: str
) -> list[int]:
    """Report, from outside, that a node died with the processes of ``initial_ranks``; returns those reported.

    Its joiners that hold no place yet are withdrawn first: reporting an
    active rank may complete the restart whose last arriver admits joiners,
    and a dead process admitted would hold the next iteration's barrier.
    """
    job = job_store(base)
    ranks = sorted(initial_ranks, key=lambda rank: job.position(rank) is not None)
    return [rank for rank in ranks if report_process_gone(base, rank, initial_world_size, "node_died", message)]
