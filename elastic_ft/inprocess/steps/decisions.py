"""What may happen at a rank's step boundary (pure): where a planned restart lands, and whether a step may commit.

Two decisions the Wrapper takes in the optimizer's pre-step hook and before
an ``atomic()`` section, each a function of plain values with its reason:

* :func:`planned_restart_step`: a planned restart (admitting joiners) lands
  at a step boundary every rank reaches; the first active rank to see the
  plan proposes one far enough ahead for every rank's monitor thread to
  learn of the plan first;
* :func:`fence_verdict`: a step commits only under the etcd lease the
  iteration began under, proven alive (:mod:`elastic_ft.runtime.local_board`);
* :func:`training_step`: whether an optimizer step is a step of training,
  which the Wrapper counts (healing compares the counts), or one that only
  builds the optimizer's state, as ``torch.distributed.checkpoint`` does
  before it loads a checkpoint into an optimizer that never stepped.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from typing import Any

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


def _is_zero(value: Any) -> bool:
    try:
        return bool(value == 0)
    except (TypeError, RuntimeError):  # a tensor of more than one element, or a value that cannot say
        return False


def training_step(has_state: bool, param_groups: Iterable[Mapping[str, Any]]) -> tuple[bool, str]:
    """Whether an optimizer step about to run is a training step, and why not when it is not.

    ``has_state``: the optimizer holds per-parameter state already;
    ``param_groups``: its groups. A step of an optimizer with no state yet
    whose every group has a learning rate of 0 changes no parameter: it only
    builds the state (``torch.distributed.checkpoint``'s
    ``_init_optim_state`` does that before loading a checkpoint, with zero
    gradients). Every other step counts, a first step with lr 0 of a
    warm-up schedule included once the optimizer holds state.
    """
    if has_state:
        return True, ""
    rates = [group["lr"] for group in param_groups if "lr" in group]
    if rates and all(_is_zero(rate) for rate in rates):
        return False, "a step with lr 0 of an optimizer with no state yet only builds its state"
    return True, ""
