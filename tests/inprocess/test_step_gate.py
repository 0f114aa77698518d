"""The step boundary's decisions (pure): where a planned restart lands, and whether a step may commit."""

from __future__ import annotations

import torch

from elastic_ft.inprocess.steps.decisions import (
    MIN_LEAD_STEPS,
    UNKNOWN_STEP_LEAD,
    Fence,
    fence_verdict,
    planned_restart_step,
    training_step,
)


def test_a_planned_restart_lands_its_lead_of_typical_steps_ahead() -> None:
    assert planned_restart_step(10, 0.02, 0.2) == 20  # 0.2 s of 20 ms steps
    assert planned_restart_step(10, 0.5, 0.2) == 10 + MIN_LEAD_STEPS  # long steps: the next-but-one
    assert planned_restart_step(10, None, 0.2) == 10 + UNKNOWN_STEP_LEAD  # no step timed yet
    assert planned_restart_step(0, 0.0, 0.2) == 200  # a step time of 0 counts as 1 ms


def test_a_step_commits_under_the_lease_the_iteration_began_under_proven_alive() -> None:
    assert fence_verdict(True, 3, 3) == (Fence.GO, "")
    verdict, why = fence_verdict(False, 3, 3)
    assert verdict is Fence.WAIT and "cannot prove its lease alive" in why
    for proven in (True, False):  # a new lease: the others may have counted the node out, proven or not
        verdict, why = fence_verdict(proven, 4, 3)
        assert verdict is Fence.FENCED and "generation 4, the iteration began under 3" in why


def test_a_step_that_only_builds_the_optimizers_state_is_not_a_training_step() -> None:
    counted, why = training_step(False, [{"lr": 0.0}, {"lr": torch.tensor(0.0)}])
    assert not counted and "lr 0" in why  # DCP's _init_optim_state: float or tensor lr set to 0
    assert training_step(True, [{"lr": 0.0}]) == (True, "")  # a warm-up step once the state exists counts
    assert training_step(False, [{"lr": 0.0}, {"lr": 0.1}]) == (True, "")  # one group learns
    assert training_step(False, [{"momentum": 0.9}]) == (True, "")  # an optimizer without lr: always counts
    assert training_step(False, [{"lr": torch.tensor([0.0, 0.0])}]) == (True, "")  # a rate it cannot read
