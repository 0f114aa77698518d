"""The store protocol of growing the world: registration, admission exactly once, withdrawal, reserve ranks."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from elastic_ft.coordination.iteration import iteration_store
from elastic_ft.coordination.job import WITHDRAWN, admit_joiners, job_store, joined_ranks
from elastic_ft.coordination.reports import report_node_gone, report_process_gone
from elastic_ft.coordination.termination import TerminationResult
from elastic_ft.keys import COMPLETION_BARRIER, ITERATION_BARRIER, TERMINATION_BARRIER

NO_WAIT = datetime.timedelta(0)


def test_the_last_arrival_admits_each_registered_joiner_once() -> None:
    base = dist.HashStore()
    job = job_store(base)
    job.register_joiner(7)
    assert admit_joiners(job, 1) == []  # the world does not accept joiners (a Tree, say)
    job.set_accepts_joiners()
    job.register_joiner(5)
    job.register_joiner(7)  # a repeated registration is one joiner
    job.register_joiner(8)
    for rank in (5, 7):  # their monitor processes report them active
        job.liveness.send_heartbeat(rank)
    job.liveness.send_heartbeat(8, active_at=time.time() - 60)  # stopped or hung for a minute: not admitted
    iteration = iteration_store(base, 0)
    iteration.record_terminated([1])
    iteration.arrive_and_wait(TERMINATION_BARRIER, [0, 1], 3, NO_WAIT)
    assert iteration.termination_result() is None
    iteration.arrive_and_wait(TERMINATION_BARRIER, [2], 3, NO_WAIT)  # the last arrival
    result = TerminationResult.from_json(iteration.termination_result(), 3)
    assert result == TerminationResult(3, (1,), (7, 5))
    assert (job.admission(7), job.admission(5), job.admission(8)) == ("1", "1", None)
    assert admit_joiners(job, 2) == []  # admitted already: never twice
    job.liveness.send_heartbeat(8)  # active again: the next restart takes it
    assert admit_joiners(job, 2) == [8]


def test_joined_ranks_are_the_admitted_joiners_whose_activity_a_hung_iteration_is_judged_by() -> None:
    # A monitor reads the heartbeats of the initial world and of these: a joiner hung in an iteration was
    # unseen before, and a rank waiting for it blamed a member of the initial world.
    base = dist.HashStore()
    job = job_store(base)
    job.set_accepts_joiners()
    for rank in (8, 9, 10):
        job.register_joiner(rank)
        job.liveness.send_heartbeat(rank)
    assert joined_ranks(job) == []  # waiting to join: their activity says nothing of the iteration's
    assert admit_joiners(job, 3) == [8, 9, 10]
    job.claim_admission(11, WITHDRAWN)
    job.register_joiner(11)
    job.register_joiner(12)  # registered, not admitted yet
    assert joined_ranks(job) == [8, 9, 10]


def test_a_result_published_for_a_lost_last_arriver_keeps_its_admissions_and_makes_none() -> None:
    """The last arriver admitted joiner 5, then died before it published: the rank publishing in its place
    includes 5 (it was told it joins) and admits nobody new (joiner 6, ready meanwhile, waits for the next
    restart), so no admission can miss the result that holds."""
    from elastic_ft.coordination.job import admitted_joiners

    base = dist.HashStore()
    job = job_store(base)
    job.set_accepts_joiners()
    for rank in (5, 6):
        job.register_joiner(rank)
        job.liveness.send_heartbeat(rank)
    assert job.claim_admission(5, "4") == "4"  # what the lost last arriver of iteration 3 did
    assert admitted_joiners(job, 4) == [5]
    iteration = iteration_store(base, 3)
    result = TerminationResult.from_json(
        iteration.barriers.rules.barrier_result(TERMINATION_BARRIER, 2, admit=False), 2
    )
    assert result.joined == (5,)
    assert job.admission(6) is None


def test_a_joiner_that_dies_before_admission_is_withdrawn_and_never_admitted() -> None:
    base = dist.HashStore()
    job = job_store(base)
    job.set_accepts_joiners()
    job.record_wrapped(9, 1234)
    job.register_joiner(9)
    assert report_process_gone(base, 9, 4, "terminated", "pid 1234: signal SIGKILL")
    assert job.admission(9) == WITHDRAWN
    assert admit_joiners(job, 3) == []
    assert not job.barriers.has_arrived(
        "exit_barrier", 9
    )  # joiners are not counted by the initial world's exit barrier


def test_a_dead_nodes_unplaced_joiner_is_withdrawn_before_its_report_can_complete_a_restart(monkeypatch) -> None:
    """Seen in the soak: a node was killed while its respawned worker waited to join. Its active rank's report
    completed the restart (the last arrival admits joiners) before the joiner was withdrawn, and the next
    iteration waited for a process that was gone. Here the report's arrival completes the termination barrier
    at once, as a last arrival would."""
    base = dist.HashStore()
    job = job_store(base)
    job.set_accepts_joiners()
    for rank in (0, 1, 2):
        job.record_wrapped(rank, 100 + rank)
        job.record_position(rank, iteration=0, rank=rank, world_size=3, active=True)
    job.record_wrapped(7, 107)  # node B's respawned worker: ready, not admitted
    job.register_joiner(7)
    job.liveness.send_heartbeat(7)
    iteration = iteration_store(base, 0)
    iteration.arrive_and_wait(TERMINATION_BARRIER, [0, 1], 3, NO_WAIT)  # the survivors wait for rank 2
    # Node B held initial ranks 2 (active) and 7 (the joiner), in the order its record lists them.
    assert sorted(report_node_gone(base, [2, 7], 3, "node B died")) == [2, 7]
    result = TerminationResult.from_json(iteration.termination_result(), 3)
    assert result.terminated == (2,) and result.joined == ()
    assert job.admission(7) == WITHDRAWN


def test_a_reserve_rank_that_dies_does_not_interrupt_the_iteration() -> None:
    base = dist.HashStore()
    job = job_store(base)
    job.record_wrapped(5, 99)
    job.record_position(5, iteration=1, rank=4, world_size=6, active=False)
    assert report_process_gone(base, 5, 6, "node_died", "node C died")
    iteration = iteration_store(base, 1)
    assert iteration.outcome() is None and iteration.interruptions() == []
    assert iteration.terminated_ranks() == [4]  # the next restart drops it
    assert all(
        iteration.barriers.has_arrived(name, 4) for name in (ITERATION_BARRIER, TERMINATION_BARRIER, COMPLETION_BARRIER)
    )
    # An active rank's death interrupts, as before.
    job.record_wrapped(0, 98)
    job.record_position(0, iteration=1, rank=0, world_size=6, active=True)
    report_process_gone(base, 0, 6, "terminated", "pid 98")
    assert iteration.outcome() == "interrupted"


def test_a_job_that_finished_releases_waiting_joiners() -> None:
    job = job_store(dist.HashStore())
    assert not job.finished()
    job.mark_finished()
    assert job.finished()


def test_joiners_admitted_but_dead_before_their_place_are_stood_in_for_at_the_iteration_barrier() -> None:
    """Seen in the soak: a restart admitted node D's two joiners to iteration 60, then node D was killed
    before they arrived at its barrier. Their places in the iteration come from a rank assignment they
    never ran; the survivors, once all of them arrived, take the places missing as theirs and report them
    gone, instead of waiting out the 120 s barrier timeout."""
    import threading

    base = dist.HashStore()
    job = job_store(base)
    job.set_accepts_joiners()
    for rank in (8, 9):
        job.record_wrapped(rank, 200 + rank)
        job.register_joiner(rank)
        assert job.claim_admission(rank, "5") == "5"  # iteration 4's last arriver admitted them
    iteration = iteration_store(base, 5)
    waits: dict[int, float] = {}

    def survivor(rank: int) -> None:
        start = time.monotonic()
        iteration.arrive_and_wait(ITERATION_BARRIER, [rank], 5, datetime.timedelta(seconds=30))
        waits[rank] = time.monotonic() - start

    threads = [threading.Thread(target=survivor, args=(rank,)) for rank in (0, 1, 2)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    assert waits == {}  # nobody stands in for a joiner not known lost
    assert report_node_gone(base, [8, 9], 4, "node D died") == [8, 9]
    assert iteration.lost_ranks() == [8, 9]
    for thread in threads:
        thread.join(10)
    assert sorted(waits) == [0, 1, 2] and max(waits.values()) < 5
    assert iteration.terminated_ranks() == [3, 4]  # the places the survivors did not take
    assert iteration.outcome() == "interrupted"  # the next restart goes on without them
    assert job.admission(8) == "5"  # admitted it was: not withdrawn after the fact


def test_a_lost_joiner_is_not_stood_in_for_while_a_live_rank_is_still_on_its_way() -> None:
    base = dist.HashStore()
    iteration = iteration_store(base, 2)
    iteration.record_lost(6)
    iteration.arrive_and_wait(ITERATION_BARRIER, [0], 3, NO_WAIT)  # ranks 1 (live, slow) and 2 (lost) missing
    assert not iteration.barriers.rules.stand_in_for_lost(ITERATION_BARRIER, 3)
    assert iteration.terminated_ranks() == []
    iteration.arrive_and_wait(ITERATION_BARRIER, [1], 3, NO_WAIT)
    iteration.barriers.rules.stand_in_for_lost(ITERATION_BARRIER, 3)
    assert iteration.terminated_ranks() == [2]
    assert iteration.barriers.has_arrived(ITERATION_BARRIER, 2)


def test_a_rank_killed_after_its_restart_counted_on_it_is_stood_in_for_in_the_next_iteration() -> None:
    """Seen in the soak: a planned restart (admitting a joiner) completed its termination barrier with
    rank 1 in; rank 1 was SIGKILLed before it took its place in the next iteration. Its report went to
    the iteration it was last in, whose result was out already; the next iteration's barrier waited for it."""
    import threading

    base = dist.HashStore()
    job = job_store(base)
    for rank in range(4):
        job.record_wrapped(rank, 300 + rank)
        job.record_position(rank, iteration=3, rank=rank, world_size=4, active=True)
    done = iteration_store(base, 3)
    done.arrive_and_wait(TERMINATION_BARRIER, [0, 1, 2, 3], 4, NO_WAIT)  # the restart: the next world has all 4
    assert TerminationResult.from_json(done.termination_result(), 4).terminated == ()
    following = iteration_store(base, 4)
    waits: dict[int, float] = {}

    def survivor(rank: int) -> None:
        start = time.monotonic()
        following.arrive_and_wait(ITERATION_BARRIER, [rank], 4, datetime.timedelta(seconds=30))
        waits[rank] = time.monotonic() - start

    threads = [threading.Thread(target=survivor, args=(rank,)) for rank in (0, 2, 3)]
    for thread in threads:
        thread.start()
    assert report_process_gone(base, 1, 4, "terminated", "pid 301: signal SIGKILL")  # into iteration 3's records
    for thread in threads:
        thread.join(10)
    assert sorted(waits) == [0, 2, 3] and max(waits.values()) < 5
    assert following.terminated_ranks() == [1] and following.outcome() == "interrupted"


def test_a_rank_the_restart_counted_out_is_not_expected_in_the_next_iteration() -> None:
    base = dist.HashStore()
    job = job_store(base)
    job.record_wrapped(1, 301)
    job.record_position(1, iteration=3, rank=1, world_size=2, active=True)
    iteration = iteration_store(base, 3)
    assert report_process_gone(base, 1, 2, "terminated", "pid 301")  # reported before the restart decided
    iteration.arrive_and_wait(TERMINATION_BARRIER, [0], 2, NO_WAIT)
    assert TerminationResult.from_json(iteration.termination_result(), 2).terminated == (1,)
    following = iteration_store(base, 4)
    following.arrive_and_wait(ITERATION_BARRIER, [0], 1, NO_WAIT)
    assert (
        following.barriers.rules._terminated_after_the_decision() == []
    )  # not expected there: nothing to stand in for
    assert not following.barriers.rules.stand_in_for_lost(ITERATION_BARRIER, 2)
    assert following.terminated_ranks() == []
