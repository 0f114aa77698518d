"""What may happen at a rank's step boundary (pure): where a planned restart lands, and whether a step may commit.

Two decisions the Wrapper takes in the optimizer's pre-step hook and before
an ``atomic()`` section, each a function of plain values with its reason:

* :func:`planned_restart_step`: a planned restart (admitting joiners) lands
  at a step boundary every rank reaches; the first active rank to see the
  plan proposes one far enough ahead for every rank's monitor thread to
  learn of the plan first;
* :func:`fence_verdict`: a step commits only under the etcd lease the
  iteration began under, proven alive (:mod:`elastic_ft.runtime.local_board`).
"""

from __future__ import annotations

import enum
import math

#: How many steps ahead a planned restart lands while the job's typical step time is not known yet.
UNKNOWN_STEP_LEAD = 5
#: The nearest a planned restart may land: the next step may be under way on some rank already.
MIN_LEAD_STEPS = 2
#: The shortest step time the lead is computed with (a faster loop would make the lead huge for nothing).
_SHORTEST_STEP = 1e-3


def planned_restart_step(done: int, typical_step: float | None, lead_seconds: float) -> int:
    """The step boundary a planned restart proposes, ``done`` steps into the iteration: ``lead_seconds`` of steps
    of the typical length ahead (:data:`UNKNOWN_STEP_LEAD` steps while it is unknown), at least
    :data:`MIN_LEAD_STEPS`."""
    if typical_step is None:
        return done + max(MIN_LEAD_STEPS, UNKNOWN_STEP_LEAD)
    return done + max(MIN_LEAD_STEPS, math.ceil(lead_seconds / max(typical_step, _SHORTEST_STEP)))


class Fence(enum.Enum):
    GO = "go"  # the lease the iteration began under is proven alive
    WAIT = "wait"  # not proven now: the others may be counting this node out; wait for the proof
    FENCED = "fenced"  # the node holds a new lease: the others may have counted it out; restart


def fence_verdict(proven: bool, generation: int, began_under: int) -> tuple[Fence, str]:
    """Whether a step or an atomic section may begin, and why: ``proven`` says the node's lease is proven alive
    now, ``generation`` is the lease it holds, ``began_under`` the one the iteration began under."""
    if generation != began_under:
        return Fence.FENCED, (
            f"its node announced itself on a new etcd lease (generation {generation}, the iteration began under "
            f"{began_under}): the others may have counted it out"
        )
    if not proven:
        return Fence.WAIT, "its node cannot prove its lease alive"
    return Fence.GO, ""
