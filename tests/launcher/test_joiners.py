"""The agent's decisions about its node's new processes (pure): respawn or not, and when to ask for admission."""

from __future__ import annotations

from elastic_ft.launcher.joiners import admission_due, reserve_only, respawn_refusal


def test_a_dead_worker_is_respawned_within_its_budget_while_the_world_can_grow() -> None:
    assert respawn_refusal(1, 0, 3, job_finished=False, accepts_joiners=True) is None
    used_up = respawn_refusal(1, 3, 3, job_finished=False, accepts_joiners=True)
    assert used_up is not None and "respawn.per_rank=3" in used_up and "last 3 new process(es)" in used_up
    for finished, accepts in ((True, True), (False, False)):
        refusal = respawn_refusal(1, 0, 3, job_finished=finished, accepts_joiners=accepts)
        assert refusal is not None and "cannot grow" in refusal


def test_admission_is_asked_at_once_when_every_joiner_is_ready_else_after_the_batch_wait() -> None:
    assert admission_due([], [4], 0.0, 10.0, 2.0)[0] is False
    assert admission_due([4, 5], [4, 5], 10.0, 10.0, 2.0) == (True, "joiner(s) [4, 5] ready")
    due, why = admission_due([4], [4, 5], 10.0, 11.0, 2.0)
    assert not due and "[5] are nearly ready" in why  # one restart for both, not one each
    due, why = admission_due([4], [4, 5], 10.0, 12.5, 2.0)
    assert due and "[5] still starting after 2 s" in why


def test_ready_joiners_wait_as_reserve_ranks_when_the_world_is_at_its_largest() -> None:
    assert reserve_only(4, 4) and reserve_only(5, 4)
    assert not reserve_only(3, 4) and not reserve_only(None, 4) and not reserve_only(4, None)
