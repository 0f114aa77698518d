"""The agent's decisions about its node's new processes (pure): whether a dead worker is respawned, and when its
node asks the running world to admit the ones that are ready.

A respawned process joins the running world as a joiner at a restart
(:mod:`elastic_ft.coordination.job`); under ``respawn.rejoin: at_once`` the
node asks for that restart as soon as its joiners are ready. The I/O (the
job-wide budget's atomic count, the store reads, the request) stays in
:class:`~elastic_ft.launcher.agent.FtAgent`.
"""

from __future__ import annotations

from collections.abc import Sequence

#: How long a node waits for its other joiners once one is ready, so that one restart admits them all.
ADMISSION_BATCH_WAIT = 2.0


def respawn_refusal(
    local_rank: int, used_in_a_row: int, per_rank: int, job_finished: bool, accepts_joiners: bool
) -> str | None:
    """Why ``local_rank`` is not respawned, or None to respawn it (the job-wide budget, ``respawn.per_job``, is
    an atomic count the caller takes next)."""
    if used_in_a_row >= per_rank:
        return (
            f"local rank {local_rank} is not respawned: its last {used_in_a_row} new process(es) died before they "
            f"trained (respawn.per_rank={per_rank})"
        )
    if job_finished or not accepts_joiners:
        return f"local rank {local_rank} is not respawned: the job finished, or its rank assignment cannot grow"
    return None


def admission_due(
    ready: Sequence[int], starting: Sequence[int], ready_since: float, now: float, batch_wait: float
) -> tuple[bool, str]:
    """Whether the node asks for the restart that admits its ``ready`` joiners now, and why: at once when every
    joiner of the node is ready, else once the first has waited ``batch_wait`` seconds for the ``starting``
    others (one restart for them all, not one each)."""
    if not ready:
        return False, "no joiner is ready"
    still_starting = [rank for rank in starting if rank not in ready]
    if not still_starting:
        return True, f"joiner(s) {list(ready)} ready"
    if now - ready_since < batch_wait:
        return False, f"joiner(s) {still_starting} are nearly ready: one restart admits them all"
    return True, f"joiner(s) {list(ready)} ready; {still_starting} still starting after {batch_wait:g} s"


def reserve_only(active: int | None, max_active: int | None) -> bool:
    """The running iteration has as many active ranks as the round runs at most: ready joiners wait as reserve
    ranks, and no restart is asked for them."""
    return max_active is not None and active is not None and active >= max_active
