"""Hang detection: adaptive timeouts, the monitor's stall verdicts and its CPU evidence, which sockets a restart cuts."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.fault_records import (
    Heartbeat,
    PeerLook,
    encode_heartbeat,
    encode_peer_look,
    parse_peer_look,
)
from elastic_ft.coordination.iteration import iteration_store
from elastic_ft.coordination.job import job_store
from elastic_ft.inprocess.delivery.connections import (
    TcpSocket,
    accepted_connections,
    created_connections,
    established_connections,
    gloo_listeners,
    release_connections,
    released_by_peers,
    socket_inodes,
    tcp_sockets,
    unblock_listeners,
)
from elastic_ft.inprocess.hangs.heartbeats import ProgressTimestamps, StepClock
from elastic_ft.inprocess.hangs.monitor import (
    MonitorConfig,
    MonitorProcess,
    _Iteration,
    _Monitor,
    aligned_check,
    beat_due,
    cpu_seconds,
)
from elastic_ft.inprocess.hangs.verdicts import (
    EVIDENCE_KEPT,
    AdaptiveTimeouts,
    RankActivity,
    StallAction,
    StalledRank,
    StallVerdict,
    Timeouts,
    adaptive_timeouts,
    hang_culprit,
    heartbeat_period,
    judge_stall,
    notice_pending,
    overdue_for,
    overdue_slack,
    peer_read_period,
    percentile,
    select_evidence,
    stall_notice_after,
    warmup_timeouts,
)
from elastic_ft.runtime.waits import aligned_instant, poll

CONFIG = AdaptiveTimeouts()


def test_percentile_is_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 99) == 99.0
    assert percentile(samples, 100) == 100.0
    assert percentile([5.0], 50) == 5.0


def test_timeouts_follow_step_times_between_floor_and_ceiling() -> None:
    fast = [0.03] * 100
    assert adaptive_timeouts(fast, CONFIG, 60, 90) == (0.5, 1.0)  # 10 x 30 ms is under the 0.5 s floor
    assert adaptive_timeouts([0.08] * 100, CONFIG, 60, 90) == pytest.approx((0.8, 1.6))  # 10 step times
    slow = [2.0] * 100
    assert adaptive_timeouts(slow, CONFIG, 60, 90) == (20.0, 40.0)
    very_slow = [10.0] * 100
    assert adaptive_timeouts(very_slow, CONFIG, 60, 90) == (60, 90)  # the configured values are the ceiling


def test_one_outlier_does_not_move_the_high_percentile_much() -> None:
    samples = [0.1] * 199 + [30.0]  # one 30 s checkpoint that was not marked long
    soft, _ = adaptive_timeouts(samples, CONFIG, 60, 90)
    assert soft == pytest.approx(1.0)


def test_too_few_samples_or_no_adaptation_keep_the_configured_timeouts() -> None:
    assert adaptive_timeouts([0.05] * (CONFIG.min_samples - 1), CONFIG, 60, 90) == (60, 90)
    assert adaptive_timeouts([0.05] * 100, None, 60, 90) == (60, 90)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("multiplier", 0.5),
        ("multiplier", math.inf),
        ("percentile", 0),
        ("percentile", 101),
        ("soft_floor", datetime.timedelta(0)),
        ("delivery_floor", datetime.timedelta(seconds=-1)),
        ("delivery_floor", 3.0),
        ("warmup_steps", -1),
        ("warmup_multiplier", 0.5),
        ("warmup_multiplier", math.nan),
        ("min_samples", 0),
        ("window", 4),
    ],
)
def test_bad_adaptive_settings_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        AdaptiveTimeouts(**{field: value})  # type: ignore[arg-type]


def stepped_clock(
    monkeypatch: pytest.MonkeyPatch, config: AdaptiveTimeouts
) -> tuple[StepClock, ProgressTimestamps, Callable[[int, float], None], Callable[[float], None]]:
    """A StepClock on a fake monotonic clock: the clock, its timestamps, ``steps(count, seconds)`` and
    ``advance(seconds)``."""
    now = [100.0]
    monkeypatch.setattr("elastic_ft.inprocess.hangs.heartbeats.time.monotonic", lambda: now[0])
    timestamps = ProgressTimestamps(60, 90)
    clock = StepClock(timestamps, config, 60, 90)

    def advance(seconds: float) -> None:
        now[0] += seconds

    def steps(count: int, seconds: float) -> None:
        for _ in range(count):
            advance(seconds)
            clock.step()

    return clock, timestamps, steps, advance


def test_the_restarts_delivery_bound_keeps_its_floor_whatever_the_step_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short steps give short hang timeouts, but a restart still has AdaptiveTimeouts.delivery_floor (3 s) to reach
    a main thread blocked in C code (a store wait that a peer's restart leaves unanswered) before the rank is
    terminated; longer steps lengthen it with the adaptive hard timeout."""
    clock, timestamps, steps, _ = stepped_clock(monkeypatch, AdaptiveTimeouts(warmup_steps=0, min_samples=4))
    assert timestamps.delivery_bound() == 3.0
    clock.start_iteration()
    steps(8, 0.02)
    assert timestamps.timeouts() == pytest.approx((0.5, 1.0)) and timestamps.delivery_bound() == 3.0
    steps(256, 0.5)
    assert timestamps.timeouts() == pytest.approx((5.0, 10.0)) and timestamps.delivery_bound() == pytest.approx(10.0)
    _, timestamps, _, _ = stepped_clock(monkeypatch, AdaptiveTimeouts(delivery_floor=datetime.timedelta(seconds=8)))
    assert timestamps.delivery_bound() == 8.0


def test_step_clock_warms_up_per_iteration_and_skips_long_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, timestamps, steps, advance = stepped_clock(monkeypatch, AdaptiveTimeouts(warmup_steps=2, min_samples=4))
    clock.start_iteration()
    steps(2, 5.0)  # warm-up (compilation): not sampled
    assert not clock.samples and timestamps.timeouts() == (60, 90)
    steps(5, 0.05)
    assert list(clock.samples) == pytest.approx([0.05] * 5)
    assert timestamps.timeouts() == pytest.approx((0.5, 1.0))
    clock.enter_long_section()
    assert timestamps.timeouts() == (60, 90)  # a checkpoint may take long
    advance(30)
    clock.exit_long_section()
    steps(1, 0.05)  # the step after the section closes no interval
    assert len(clock.samples) == 5 and timestamps.timeouts() == pytest.approx((0.5, 1.0))
    # After a restart: warm-up again, bounded by the first one (10.05 s: two 5 s steps and a 0.05 s one).
    assert list(clock.warmups) == pytest.approx([10.05])
    clock.start_iteration()
    assert timestamps.timeouts() == pytest.approx((4 * 10.05, 8 * 10.05)) and timestamps.warming_up()
    steps(3, 0.05)
    assert timestamps.timeouts() == pytest.approx((0.5, 1.0)) and not timestamps.warming_up()
    assert list(clock.warmups) == pytest.approx([10.05, 0.15])


def test_a_warm_up_is_bounded_by_the_earlier_ones_less_their_long_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, timestamps, steps, advance = stepped_clock(monkeypatch, AdaptiveTimeouts(warmup_steps=1, min_samples=2))
    clock.start_iteration()
    advance(0.5)
    clock.enter_long_section()  # a checkpoint loaded in the warm-up: the ceilings, and not timed
    advance(30)
    clock.exit_long_section()
    assert timestamps.timeouts() == (60, 90) and not timestamps.warming_up()  # nothing learned yet
    steps(2, 0.1)  # the warm-up ends at the second step: 0.5 + 0.2 s outside the section
    steps(2, 0.1)
    assert list(clock.warmups) == pytest.approx([0.7])
    clock.start_iteration()
    assert timestamps.timeouts() == pytest.approx((2.8, 5.6)) and timestamps.warming_up()
    clock.enter_long_section()
    assert timestamps.timeouts() == (60, 90) and not timestamps.warming_up()
    clock.exit_long_section()  # still warming up: back to the learned bound
    assert timestamps.timeouts() == pytest.approx((2.8, 5.6)) and timestamps.warming_up()
    # A reserve rank waits as long as it must: the ceilings, and its wait is no warm-up.
    clock.start_iteration(active=False)
    assert timestamps.timeouts() == (60, 90) and not timestamps.warming_up()
    steps(3, 0.1)
    assert list(clock.warmups) == pytest.approx([0.7])


def test_warmup_timeouts_need_a_timed_warm_up_and_step_samples_and_respect_floor_and_ceilings() -> None:
    config = AdaptiveTimeouts(min_samples=2)
    assert warmup_timeouts([], [0.1, 0.1], config, 60, 90) is None
    assert warmup_timeouts([1.0], [0.1], config, 60, 90) is None
    assert warmup_timeouts([1.0], [0.1, 0.1], None, 60, 90) is None
    assert warmup_timeouts([1.0, 0.2], [0.1, 0.1], config, 60, 90) == (4.0, 8.0)  # the longest warm-up
    assert warmup_timeouts([0.01], [0.1, 0.1], config, 60, 90) == (1.0, 2.0)  # a step's soft timeout at least
    assert warmup_timeouts([100.0], [0.1, 0.1], config, 60, 90) == (60, 90)  # never past the ceilings


TIMEOUTS = Timeouts(soft=1.5, hard=3.0, soft_limit=60, hard_limit=90)


def activity(
    progress: float, cpu_idle: float | None = None, stopped: bool = False, silent: float = 0.1
) -> RankActivity:
    return RankActivity(progress, progress if cpu_idle is None else cpu_idle, stopped, silent)


def test_an_active_rank_is_left_alone() -> None:
    assert judge_stall(activity(0.5), TIMEOUTS, 1.0, None, None).action is StallAction.NONE


def test_a_busy_rank_is_slow_not_hung() -> None:
    # No Python progress for 10 s, but the rank burns CPU: a long computation in C.
    verdict = judge_stall(activity(10, cpu_idle=0.1), TIMEOUTS, 1.0, 20.0, None)
    assert verdict.action is StallAction.NONE


def test_a_rank_waiting_on_a_busy_peer_waits() -> None:
    verdict = judge_stall(activity(5), TIMEOUTS, 1.0, peers_inactive_for=0.4, restart_requested_for=None)
    assert verdict.action is StallAction.NONE and "another rank was active" in verdict.reason
    assert verdict.waits_because == "peer active"


def test_a_peer_whose_heartbeat_is_overdue_is_not_taken_for_inactive() -> None:
    """No news is not news of inactivity: a peer whose heartbeat is late (a busy peer on a saturated host) holds
    the verdict, until it is late by the adaptive hard timeout (a dead or frozen peer: its silence is its own);
    with every heartbeat on time an idle job restarts."""
    verdict = judge_stall(
        activity(5), TIMEOUTS, 1.0, peers_inactive_for=3.0, restart_requested_for=None, peer_overdue_for=0.4
    )
    assert verdict.action is StallAction.NONE and verdict.waits_because == "peer overdue"
    assert "0.4 s overdue" in verdict.reason
    on_time = judge_stall(activity(5), TIMEOUTS, 1.0, peers_inactive_for=3.0, restart_requested_for=None)
    assert on_time.action is StallAction.RESTART
    silent = judge_stall(
        activity(5), TIMEOUTS, 1.0, peers_inactive_for=3.0, restart_requested_for=None, peer_overdue_for=TIMEOUTS.hard
    )
    assert silent.action is StallAction.RESTART and "inactive for" in silent.reason
    configured = judge_stall(activity(61), TIMEOUTS, 1.0, 3.0, None, peer_overdue_for=1.0)
    assert configured.action is StallAction.RESTART and "soft_timeout" in configured.reason
    assert overdue_slack(0.5) == 0.125


def test_a_peer_whose_stall_notice_may_still_come_is_not_taken_for_inactive() -> None:
    verdict = judge_stall(activity(5), TIMEOUTS, 1.0, 3.0, None, peer_notice_pending=True)
    assert verdict.action is StallAction.NONE and verdict.waits_because == "peer unheard"
    assert "stall notice may still come" in verdict.reason
    # The configured limits still apply, and a stopped rank is still killed.
    assert judge_stall(activity(61), TIMEOUTS, 1.0, 3.0, None, peer_notice_pending=True).action is StallAction.RESTART
    stopped = judge_stall(activity(5, stopped=True), TIMEOUTS, 1.0, 3.0, None, peer_notice_pending=True)
    assert stopped.action is StallAction.KILL


def test_a_stall_notice_is_pending_until_the_next_heartbeat_could_have_come() -> None:
    soft, now = 0.5, 1000.0
    promising = Heartbeat(now - 0.9, now - 0.9, due_at=now + 0.1, notice=True)
    assert stall_notice_after(soft) == 0.125
    assert notice_pending(promising, now, soft)
    assert notice_pending(promising, now + 0.1 + overdue_slack(soft), soft)
    # Past the slack a late heartbeat is overdue_for's (held only until the adaptive hard timeout).
    assert not notice_pending(promising, now + 0.11 + overdue_slack(soft), soft)
    assert not notice_pending(dataclasses.replace(promising, notice=False), now, soft)
    assert not notice_pending(dataclasses.replace(promising, due_at=None), now, soft)


def _monitor_beats(activity_at: Callable[[float], RankActivity], soft: float, start: float, until: float) -> list:
    """The heartbeats a monitor loop waking every 0.1 s sends from ``start`` to ``until``, its rank's activity at
    each instant ``activity_at(now)`` (monitor_process._watch's choice of when and what)."""
    interval, tick = 1.0, 0.1
    last = next_due = -math.inf
    promised = False
    beats, now = [], start
    while now < until:
        rank = activity_at(now)
        notice_after = stall_notice_after(soft)
        if beat_due(
            now, last, next_due, heartbeat_period(rank, soft, interval), promised and rank.inactive_for >= notice_after
        ):
            last, next_due = now, aligned_instant(now, heartbeat_period(rank, soft, interval))
            promised = rank.inactive_for < notice_after
            beats.append(Heartbeat(now, now - rank.inactive_for, None, False, next_due, promised))
        now = round(now + tick, 6)
    return beats


def _verdicts(peer: Callable[[float], RankActivity], soft: float, phase: float, until: float) -> list:
    """(time, verdict) of a rank that stopped at ``phase`` (inactive since: blocked in a collective) at each
    look at its one peer (at the aligned look instants, seeing the beats sent 50 ms before or earlier)."""
    beats = _monitor_beats(peer, soft, phase - 3.0, until)
    timeouts = Timeouts(soft, 2 * soft, 60, 90)
    read_period, now, found = peer_read_period(soft, 1.0), phase, []
    while now < until:
        now = aligned_check(now, read_period)
        beat = max((b for b in beats if b.sent_at + 0.05 <= now), key=lambda b: b.sent_at)
        waiting = RankActivity(now - phase, now - phase, False, 0.0)
        late = overdue_for(beat.sent_at, beat.active_at, beat.due_at, now, soft)
        pending = notice_pending(beat, now, soft)
        found.append((now, judge_stall(waiting, timeouts, 1.0, now - beat.active_at, None, late, pending)))
    return found


@pytest.mark.parametrize("soft", [0.5, 1.0, 2.0])
def test_a_peer_whose_slow_step_begins_after_a_rank_stopped_is_seen_busy(soft: float) -> None:
    """A rank stops (it waits for its peer in a collective); its peer still steps for up to its soft timeout,
    then starts a long computation (CPU busy, no progress). The peer's last regular heartbeat may be older
    than the waiting rank's soft timeout when that ends: CI saw a 4 s step restart the job, its step begun
    0.3 s after the others stopped. Whatever the phases, the waiting rank must not restart the job."""
    for phase in (10.0, 10.2, 10.45, 10.7, 10.95):
        for delay in (0.0, 0.1 * soft, 0.3 * soft, 0.6 * soft, 0.9 * soft):

            def slow_peer(now: float, start: float = phase + delay) -> RankActivity:
                return RankActivity(max(0.0, now - start), 0.0, False, 0.0)

            for now, verdict in _verdicts(slow_peer, soft, phase, phase + 3 * soft):
                assert verdict.action is StallAction.NONE, (phase, delay, round(now - phase, 3), verdict)


@pytest.mark.parametrize("soft", [0.5, 1.0, 2.0])
def test_stall_notices_cost_a_hang_verdict_nothing(soft: float) -> None:
    """The peer stops too (a hang): the verdict comes at the first look a soft timeout after the last rank
    stopped, as without notices (the peer's notice comes a quarter of that after it stopped), never at the
    peer's next regular heartbeat."""
    for phase in (10.0, 10.2, 10.45, 10.7, 10.95):
        for delay in (0.0, 0.1 * soft, 0.3 * soft, 0.6 * soft):

            def hung_peer(now: float, start: float = phase + delay) -> RankActivity:
                idle = max(0.0, now - start)
                return RankActivity(idle, idle, False, 0.0)

            verdicts = _verdicts(hung_peer, soft, phase, phase + 3 * soft)
            first = next(now for now, verdict in verdicts if verdict.action is StallAction.RESTART)
            assert first - phase <= delay + soft + peer_read_period(soft, 1.0) + 1e-6, (phase, delay, first)


def test_why_a_rank_without_progress_is_left_alone_is_named_in_a_stable_word() -> None:
    # The monitor logs the reason when this word changes: once per cause, not once per check.
    busy = judge_stall(activity(10, cpu_idle=0.1), TIMEOUTS, 1.0, None, None)
    assert busy.waits_because == "busy: CPU" and "no progress for 10.0 s, but busy (CPU 0.1 s ago" in busy.reason
    resending = dataclasses.replace(activity(10), network_idle_for=0.2)
    assert judge_stall(resending, TIMEOUTS, 1.0, None, None).waits_because == "busy: network resends"
    # Progress within the soft timeout needs no reason.
    assert judge_stall(activity(1.0, cpu_idle=0.1), TIMEOUTS, 1.0, None, None) == StallVerdict(StallAction.NONE)


def test_an_idle_job_restarts() -> None:
    verdict = judge_stall(activity(2), TIMEOUTS, 1.0, peers_inactive_for=2.0, restart_requested_for=None)
    assert verdict.action is StallAction.RESTART and "adaptive soft timeout 1.5 s" in verdict.reason
    warming = dataclasses.replace(TIMEOUTS, warming_up=True)
    verdict = judge_stall(activity(2), warming, 1.0, peers_inactive_for=2.0, restart_requested_for=None)
    assert verdict.action is StallAction.RESTART and "warm-up soft timeout 1.5 s" in verdict.reason


@pytest.mark.parametrize(
    ("rank", "reason"),
    [(activity(2, stopped=True), "stopped"), (activity(2, silent=1.6), "GIL is held")],
)
def test_a_stopped_or_gil_holding_rank_is_killed_at_the_soft_timeout(rank: RankActivity, reason: str) -> None:
    verdict = judge_stall(rank, TIMEOUTS, 1.0, peers_inactive_for=0.1, restart_requested_for=None)
    assert verdict.action is StallAction.KILL and reason in verdict.reason


def test_a_busy_rank_holding_the_gil_is_killed_at_the_soft_timeout() -> None:
    # Seen here: a gloo destructor spinning at 100 % of a core under the GIL. CPU use alone
    # must not make it "work": none of its threads can run, so no restart reaches it.
    spinning = activity(1.6, cpu_idle=0.0, silent=1.6)
    verdict = judge_stall(spinning, TIMEOUTS, 1.0, peers_inactive_for=0.1, restart_requested_for=None)
    assert verdict.action is StallAction.KILL and "GIL is held" in verdict.reason
    # The same silence for less than the soft timeout is left alone while the rank is busy.
    assert judge_stall(activity(1.6, cpu_idle=0.0, silent=1.2), TIMEOUTS, 1.0, 0.1, None).action is StallAction.NONE


def test_while_an_iteration_warms_up_a_stopped_or_frozen_rank_is_killed_at_the_delivery_bound() -> None:
    """Seen in the soak: a GIL-held hang in the first steps after a restart, when the configured 60 s apply,
    cost a minute. A stopped process, or one with the GIL held and no CPU used, is no warm-up."""
    warming = Timeouts(soft=60, hard=90, soft_limit=60, hard_limit=90, delivery=3.0)
    for rank, state in [
        (RankActivity(3.1, 3.1, True, 3.1), "the process is stopped"),
        (RankActivity(3.1, 3.1, False, 3.1), "the GIL is held without CPU use"),
    ]:
        verdict = judge_stall(rank, warming, 1.0, peers_inactive_for=0.1, restart_requested_for=None)
        assert verdict.action is StallAction.KILL and state in verdict.reason, verdict
        assert (
            judge_stall(
                dataclasses.replace(rank, progress_age=2.9, cpu_idle_for=2.9, threads_silent_for=2.9),
                warming,
                1.0,
                0.1,
                None,
            ).action
            is StallAction.NONE
        )
    # Warm-up work is left to the ceilings: GIL held but busy (compiling, unpickling), or threads running.
    busy = RankActivity(10.0, 0.0, False, 10.0)
    assert judge_stall(busy, warming, 1.0, 0.1, None).action is StallAction.NONE
    waiting = RankActivity(10.0, 10.0, False, 0.1)
    assert judge_stall(waiting, warming, 1.0, 0.1, None).action is StallAction.NONE


def test_a_restart_that_cannot_reach_the_main_thread_kills_the_rank_at_its_bound() -> None:
    # Wedged in C code after a restart started (gloo missed its peer's closed connection), and busy:
    # no timeout on inactivity would act before the configured 60 s.
    timeouts = Timeouts(soft=1.5, hard=3.0, soft_limit=60, hard_limit=90, delivery=1.5)
    wedged = RankActivity(1.6, 0.0, False, 0.1, restart_pending_for=1.6)
    verdict = judge_stall(wedged, timeouts, 1.0, peers_inactive_for=0.1, restart_requested_for=None)
    assert verdict.action is StallAction.KILL and "has not reached the main thread for 1.6 s" in verdict.reason
    # Not yet at the bound; or the main thread runs Python code (a finalizer, a swallowed restart): left alone.
    early = RankActivity(1.4, 0.0, False, 0.1, restart_pending_for=1.4)
    assert judge_stall(early, timeouts, 1.0, 0.1, None).action is StallAction.NONE
    running = RankActivity(0.05, 0.0, False, 0.1, restart_pending_for=10.0)
    assert judge_stall(running, timeouts, 1.0, 0.1, None).action is StallAction.NONE
    # Without a pending restart the same blocked rank is a slow one.
    busy = RankActivity(1.6, 0.0, False, 0.1)
    assert judge_stall(busy, timeouts, 1.0, 0.1, None).action is StallAction.NONE


def test_a_hang_is_blamed_on_the_rank_outside_any_collective() -> None:
    # Rank 1 sleeps in Python; ranks 0 and 2 wait for it in an all-reduce, the slot of rank 0's last
    # activity even a little earlier (the watchdog's resolution).
    ranks = [StalledRank(0, 99.95, True), StalledRank(1, 100.0, False), StalledRank(2, 100.02, True)]
    culprit, why = hang_culprit(ranks)
    assert culprit.rank == 1 and "outside any collective" in why and "[0, 2]" in why
    # Whoever's monitor asks, with the same heartbeats: the same culprit.
    assert hang_culprit(list(reversed(ranks)))[0].rank == 1


def test_a_hang_inside_collectives_is_blamed_on_the_rank_that_stopped_first() -> None:
    ranks = [StalledRank(0, 100.3, True), StalledRank(1, 100.1, True), StalledRank(2, 100.2, True)]
    culprit, why = hang_culprit(ranks)
    assert culprit.rank == 1 and why == "its progress stopped first"
    # A stopped rank's threads never said where they were (None): the others wait for it in a collective.
    stopped = [StalledRank(0, 99.9, True), StalledRank(3, 100.0, None), StalledRank(5, 99.95, True)]
    assert hang_culprit(stopped)[0].rank == 3
    assert hang_culprit([StalledRank(4, 7.0, None)])[0].rank == 4
    with pytest.raises(ValueError):
        hang_culprit([])


#: The timeouts with a delivery bound shorter than the time between the soft and the hard timeout.
QUICK_DELIVERY = dataclasses.replace(TIMEOUTS, delivery=1.0)


def test_a_rank_that_does_not_restart_is_killed_at_the_hard_timeout() -> None:
    assert judge_stall(activity(2.5), QUICK_DELIVERY, 1.0, None, 10.0).action is StallAction.NONE
    assert judge_stall(activity(3.1), QUICK_DELIVERY, 1.0, None, 10.0).action is StallAction.KILL


def test_a_restart_requested_late_still_gets_the_time_between_soft_and_hard_timeout() -> None:
    """Seen in CI's soak: ranks that asked for a restart only at the configured 60 s were killed at once, being
    long past their adaptive hard timeout (17.9 s): the restart never had a chance to reach them."""
    late = activity(60.3)
    assert judge_stall(late, QUICK_DELIVERY, 1.0, None, 0.2).action is StallAction.NONE
    verdict = judge_stall(late, QUICK_DELIVERY, 1.0, None, 1.5)
    assert verdict.action is StallAction.KILL and "1.5 s after its restart request" in verdict.reason
    assert "the restart gets 1.5 s to reach it" in verdict.reason


def test_a_requested_restart_gets_the_delivery_bound_to_reach_the_main_thread_not_the_hard_timeout() -> None:
    """Seen in full runs' fault matrix (a node SIGSTOPped, fast steps: soft 0.5 s, hard 1.0 s): survivors
    blocked in gloo asked for a restart and were killed 0.5 s later, one as its main thread unwound to take
    the restart (its connections were released 0.47 s after the request), others before the request, through
    the store, had started the restart in their process."""
    timeouts = Timeouts(soft=0.5, hard=1.0, soft_limit=60, hard_limit=90, delivery=3.0)
    # Not started in the process yet: the delivery bound from the request on.
    assert judge_stall(activity(1.4), timeouts, 1.0, None, 0.5).action is StallAction.NONE
    assert judge_stall(activity(3.3), timeouts, 1.0, None, 2.9).action is StallAction.NONE
    verdict = judge_stall(activity(3.5), timeouts, 1.0, None, 3.0)
    assert verdict.action is StallAction.KILL and "the restart gets 3.0 s to reach it" in verdict.reason
    # Started, on its way to the main thread: the delivery bound from its start on (_wedged).
    on_its_way = dataclasses.replace(activity(4.0), restart_pending_for=2.0)
    assert judge_stall(on_its_way, timeouts, 1.0, None, 3.5).action is StallAction.NONE
    wedged = dataclasses.replace(activity(4.0), restart_pending_for=3.1)
    verdict = judge_stall(wedged, timeouts, 1.0, None, 3.5)
    assert verdict.action is StallAction.KILL and "has not reached the main thread for 3.1 s" in verdict.reason


def test_taking_a_restart_is_progress() -> None:
    """The main thread takes a restart in Python code: the monitor process never reads a taken restart with the
    progress from before the main thread blocked."""
    timestamps = ProgressTimestamps(soft=0.5, hard=1.0)
    timestamps.set_restart_pending(True)
    time.sleep(0.2)
    assert timestamps.age() >= 0.2 and timestamps.restart_pending_for() >= 0.2
    timestamps.set_restart_pending(False)
    assert timestamps.age() < 0.1 and timestamps.restart_pending_for() == 0.0


def test_the_configured_limits_keep_their_meaning_even_for_a_busy_rank() -> None:
    busy = activity(61, cpu_idle=0.0)
    assert judge_stall(busy, TIMEOUTS, 1.0, 0.0, None).action is StallAction.RESTART
    busy = activity(91, cpu_idle=0.0)
    assert judge_stall(busy, TIMEOUTS, 1.0, 0.0, 10.0).action is StallAction.KILL


def sock(inode: int, local: int, remote: int, state: str) -> TcpSocket:
    return TcpSocket(inode, inode + 100, local, remote, state)


@pytest.mark.parametrize("soft", [0.5, 1.0, 1.5, 3.0, 40.0])
def test_a_waiting_rank_sees_a_busy_peer_within_its_soft_timeout(soft: float) -> None:
    # A peer starts a long computation at t=0 (no progress from then on, CPU busy); its monitor process looks
    # every 0.1 s and sends a heartbeat once the shorter of the period it promised and the one the activity asks
    # for now has passed (monitor_process._watch). A rank waiting for it since t=0 reaches its soft timeout at
    # t=soft and reads its peers' heartbeats at most peer_read_period ago. Whatever the phases, the activity
    # it sees must be < soft old, or the busy peer would be taken for a hung job (CI saw a 4 s step restart
    # the job).
    interval, tick = 1.0, 0.1
    for first_beat in (0.0, 0.05, 0.3, 0.99):
        beats, last, promised = [first_beat - interval], first_beat - interval, interval
        t = first_beat - interval
        while t <= soft:
            t = round(t + tick, 6)
            busy = RankActivity(progress_age=max(0.0, t), cpu_idle_for=0.0, stopped=False, threads_silent_for=0.0)
            period = heartbeat_period(busy, soft, interval)
            if t >= last + min(period, promised):
                beats.append(t)
                last, promised = t, period
        latest_read = soft - peer_read_period(soft, interval)
        seen = max(beat for beat in beats if beat <= latest_read)
        assert soft - seen < soft, (soft, first_beat, beats)


def test_only_listeners_bound_to_one_address_since_the_baseline_are_taken_for_gloo_s() -> None:
    sockets = [
        TcpSocket(1, 101, 4000, 0, "0A", "127.0.0.1"),  # a gloo device: new, one address
        TcpSocket(2, 102, 4001, 0, "0A", "0.0.0.0"),  # a TCPStore: every address
        TcpSocket(3, 103, 4002, 0, "0A", "::"),
        TcpSocket(4, 104, 4003, 0, "0A", "10.0.0.7"),  # in the baseline: the process's own
        TcpSocket(5, 105, 4004, 4000, "01", "127.0.0.1"),  # a connection, not a listener
    ]
    assert [s.inode for s in gloo_listeners(sockets, frozenset({4}))] == [1]


def test_a_listener_waiting_for_a_peer_gets_a_connection_that_ends() -> None:
    # What a gloo listener sees: a connection that writes the 8-byte sequence number of the pair it
    # is for, once per rank, then closes.
    baseline = frozenset(s.inode for s in tcp_sockets())
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        (found,) = gloo_listeners(tcp_sockets(), baseline)
        assert (found.local_host, found.local_port) == listener.getsockname()
        assert unblock_listeners([found], range(3)) == 3
        numbers = []
        for _ in range(3):
            connection, _ = listener.accept()
            with connection:
                numbers.append(struct.unpack("=Q", connection.recv(8))[0])
                assert connection.recv(1) == b""  # then it ends
        assert numbers == [0, 1, 2]


def test_only_ranks_working_without_progress_heartbeat_faster() -> None:
    stepping = RankActivity(progress_age=0.01, cpu_idle_for=0.0, stopped=False, threads_silent_for=0.0)
    hung = RankActivity(progress_age=5.0, cpu_idle_for=5.0, stopped=False, threads_silent_for=0.0)
    busy = RankActivity(progress_age=5.0, cpu_idle_for=0.0, stopped=False, threads_silent_for=0.0)
    assert heartbeat_period(stepping, 2.0, 1.0) == 1.0
    assert heartbeat_period(hung, 2.0, 1.0) == 1.0
    assert heartbeat_period(busy, 2.0, 1.0) == 0.5
    assert heartbeat_period(busy, 40.0, 1.0) == 1.0  # the regular interval is fresh enough for long timeouts


def test_only_connections_accepted_on_new_listeners_are_cut() -> None:
    sockets = [
        sock(1, 2379, 0, "0A"),  # the store's listener: existed at entry
        sock(2, 2379, 50001, "01"),  # a store client accepted after entry: spared (old listener)
        sock(3, 41000, 0, "0A"),  # the process group's listener
        sock(4, 41000, 50002, "01"),  # a peer connected to it: cut
        sock(5, 50003, 42000, "01"),  # this rank connected to a peer's listener: the peer cuts it
        sock(6, 50004, 443, "01"),  # an HTTP client: spared
        sock(7, 41000, 50005, "06"),  # TIME_WAIT: nothing to cut
        sock(8, 41000, 50006, "08"),  # accepted, and the peer shut its side: cut
        sock(9, 50007, 43000, "08"),  # this rank connected, and the peer released it: cut (a write may block)
    ]
    assert [s.inode for s in accepted_connections(sockets, frozenset({1}))] == [4, 8]
    assert [s.inode for s in released_by_peers(sockets, frozenset({1}))] == [4, 8, 9]
    # When the restart stays blocked (a frozen peer cuts nothing), what this rank initiated goes too; what the
    # store it hosts accepted (its monitor process, its peers) stays.
    assert [s.inode for s in created_connections(sockets, frozenset({1}))] == [4, 8, 5, 6, 9]


def test_a_write_blocked_on_a_peer_that_released_the_connection_ends_at_the_release() -> None:
    """A real pair of sockets: the peer shuts its side without reading; this side's blocked write ends only when
    release_connections cuts this side too (it is in CLOSE_WAIT, not established)."""
    baseline = socket_inodes()
    listener = socket.create_server(("127.0.0.1", 0))
    writer = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()
    listener.close()  # the peer's side is an accepted socket of a closed listener: only our side is cut
    failure: list[OSError] = []

    def write_forever() -> None:
        try:
            while True:
                writer.sendall(b"x" * 65536)
        except OSError as error:
            failure.append(error)

    thread = threading.Thread(target=write_forever, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)  # the write fills both buffers and blocks
        peer.shutdown(socket.SHUT_RDWR)
        thread.join(0.5)
        assert thread.is_alive(), "the peer's release alone ended the write"
        assert release_connections(baseline) == 1
        thread.join(5)
        assert not thread.is_alive() and isinstance(failure[0], BrokenPipeError)
    finally:
        for end in (writer, peer):
            end.close()


def test_established_connections_count_what_the_function_opened_and_its_peers_still_hold() -> None:
    baseline = socket_inodes()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        assert established_connections(baseline) == 2  # both ends are this process's
        accepted.close()  # the peer closed its end: ours is in CLOSE_WAIT, no read or write can wait on it
        assert poll(lambda: established_connections(baseline) == 0, timeout=5)
        assert established_connections(socket_inodes()) == 0  # what existed at the baseline never counts
    finally:
        client.close()
        listener.close()


@pytest.mark.parametrize(("still_open", "reported"), [(0, True), (1, False)])
def test_a_main_thread_blocked_with_no_connection_left_is_reported_out_of_reach(
    still_open: int, reported: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A gloo send in flight when its connection failed holds the main thread with nothing left to release:
    the monitor thread says so (the monitor process then replaces the process); a connection still open may
    yet end the wait, and nothing is said."""
    from elastic_ft.inprocess.delivery.watcher import OUT_OF_REACH, MonitorThread
    from elastic_ft.inprocess.exception import RestartDelivery
    from elastic_ft.inprocess.state import State

    class Blocked:  # the main thread's side of the iteration, as the monitor thread sees it
        atomic_lock = threading.RLock()
        delivery = RestartDelivery()
        interrupt = None

        def release_and_abort(self) -> None:
            pass

        def release_everything(self) -> int:
            return 0

        def connections_open(self) -> int | None:
            return still_open

        def restart_pending(self, pending: bool) -> None:
            pass

    monitor = MonitorThread(
        store=None,  # type: ignore[arg-type]  # the report reads no store
        state=State(rank=3, world_size=4),
        side=Blocked(),
        interval=0.05,
        last_call_wait=0.0,
    )
    with caplog.at_level("WARNING", logger="elastic_ft.inprocess.monitor_thread"):
        monitor._report_out_of_reach()
    assert (OUT_OF_REACH in caplog.text) is reported
    if reported:
        assert "rank 3" in caplog.text and "test_a_main_thread_blocked" in caplog.text  # where it is blocked


def test_messages_after_store_ready_in_the_same_read_are_kept() -> None:
    # Regression: a monitor process that woke late read store_ready and the first iteration
    # together, dropped the iteration, and never judged its rank's stalls.
    from elastic_ft.inprocess.hangs.monitor import after_store_ready

    iteration = {"type": "iteration", "iteration": 0, "rank": 1, "world_size": 4}
    assert after_store_ready([{"type": "store_ready"}, iteration]) == (False, [iteration])
    assert after_store_ready([{"type": "store_ready"}]) == (False, [])
    assert after_store_ready([]) == (False, None)
    assert after_store_ready([{"type": "stop"}, {"type": "store_ready"}]) == (True, None)


def _spun(pid: int) -> float:
    """CPU seconds used by every thread of ``pid`` and by its children, whoever spins among them."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    total = 0.0
    for each in (pid, *map(int, children)):
        fields = Path(f"/proc/{each}/stat").read_text().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@pytest.mark.integration  # starts a process
@pytest.mark.parametrize(("spinner", "counted"), [("main", True), ("helper", False), ("worker", True)])
def test_cpu_seconds_count_the_main_thread_and_its_workers_not_other_threads(spinner: str, counted: bool) -> None:
    # A gloo transport thread spinning under a rank blocked in a collective is no work of the rank's; the main
    # thread's computation and its data loader workers' are.
    code = {
        "main": "while True: pass",
        "helper": "import threading, time\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\n"
        "time.sleep(60)",
        "worker": "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "time.sleep(60)",
    }[spinner]
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)  # started, and its spinner running
        before, spun_before = cpu_seconds(process.pid, exclude=-1), _spun(process.pid)
        # Sized by the CPU the spinner got, not by the clock: on a loaded host a second gives it a fraction of one.
        deadline = time.monotonic() + 30
        while _spun(process.pid) - spun_before < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        spun = _spun(process.pid) - spun_before
        used = cpu_seconds(process.pid, exclude=-1) - before
        assert spun >= 0.6, f"the spinner got {spun:.2f} s of CPU in 30 s"
        assert (used > 0.4) is counted, (used, spun)
    finally:
        for child in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split():
            os.kill(int(child), signal.SIGKILL)
        process.kill()
        process.wait()


@pytest.mark.integration  # starts processes
def test_a_computing_rank_starved_of_cpu_is_still_seen_working() -> None:
    # On a saturated host a rank in a long computation may get almost no CPU for a while: its main thread is
    # runnable, not waiting, and a slow step must not read as a hang. Here it shares one core, at the lowest
    # priority, with three spinners: under 1% of a core, under the CPU share that counts as work.
    from elastic_ft.inprocess.hangs.monitor import BUSY_CPU_SHARE, _CpuMeter, process_is_stopped

    pinned = "import os\nos.sched_setaffinity(0, {0})\nos.nice(%d)\nwhile True: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", pinned % 0]) for _ in range(3)]
    # Its own process group, as it is stopped below (see TestBed.popen), in pytest's session: a session of its
    # own would be an autogroup of its own too, and the scheduler would share the core between the groups.
    rank = subprocess.Popen([sys.executable, "-c", pinned % 19], process_group=0)
    try:
        time.sleep(1.0)  # all started and spinning
        meter = _CpuMeter(rank.pid)
        time.sleep(0.5)
        before, now = meter._used, time.monotonic()
        meter.sample(now)
        assert (meter._used - before) / 0.5 < BUSY_CPU_SHARE  # starved: its CPU time alone says idle
        assert meter.busy_at == now  # runnable: working
        rank.send_signal(signal.SIGSTOP)  # stopped: not runnable, and no CPU
        assert poll(lambda: process_is_stopped(rank.pid), 10.0)  # once scheduled, however starved
        meter.sample(time.monotonic())
        assert meter.busy_at == now
    finally:
        for process in (*spinners, rank):
            process.kill()
            process.wait()


def _detach_in_a_child(stderr: Path | None) -> tuple[int, list[int], str]:
    """Fork, give the child ``stderr`` as fd 2 (None: closed), run ``_detach`` there; returns what it returned,
    the child's descriptors afterwards and what the child then wrote through the returned one."""
    from elastic_ft.inprocess.hangs.monitor import _detach

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if stderr is None:
                os.close(2)
            else:
                os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
                os.write(2, b"the rank's line\n")
            returned = _detach(keep=write_end)
            if returned >= 0:
                os.write(returned, b"the monitor's header\n")
            open_fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
            os.write(write_end, f"{returned} {','.join(map(str, open_fds))}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        returned, open_fds = answer.read().split()
    os.waitpid(pid, 0)
    written = stderr.read_text() if stderr is not None else ""
    return int(returned), [int(fd) for fd in open_fds.split(",")], written


@pytest.mark.integration  # forks
def test_the_monitor_process_writes_at_the_ranks_own_stderr_offset_and_keeps_no_other_descriptor(
    tmp_path: Path,
) -> None:
    returned, open_fds, written = _detach_in_a_child(tmp_path / "rank.log")
    assert returned > 2
    assert written == "the rank's line\nthe monitor's header\n"
    # 0-2 (/dev/null now), the kept pipe, the rank's stderr, and the one listing /proc/self/fd.
    assert len(open_fds) == 6 and {0, 1, 2, returned} <= set(open_fds), open_fds


@pytest.mark.integration  # forks
def test_a_rank_without_stderr_still_gets_a_monitor_process() -> None:
    returned, open_fds, _ = _detach_in_a_child(None)
    assert returned == -1
    assert len(open_fds) == 5 and {0, 1, 2} <= set(open_fds), open_fds


def test_a_joiner_gone_before_this_iteration_neither_holds_nor_takes_the_blame() -> None:
    """A joiner that died is not counted by the exit barrier, so its last heartbeat stays, ever more overdue:
    read as a peer of a later iteration, it would hold every hang's restart (peer overdue) until the
    configured soft timeout. Only the peers that started this iteration count."""
    base = dist.HashStore()
    job = job_store(base)
    now = time.time()
    for rank in range(3):  # the initial world, in iteration 2, waiting in a collective for a second now
        job.record_position(rank, 2, rank, 3, True)
        job.liveness.send_heartbeat(rank, active_at=now - 1.0, waiting=True, next_in=0.5)
    job.set_accepts_joiners()
    job.register_joiner(3)  # admitted into iteration 1, dead since: its heartbeat is 30 s overdue
    job.claim_admission(3, "1")
    job.record_position(3, 1, 3, 4, True)
    job.store.set(f"{keys.HEARTBEAT}3", encode_heartbeat(now - 31, now - 31, None, False, now - 30))
    config = MonitorConfig(0, 3, 0.05, 0.5, 20.0, 60.0, 90.0, 1.0, 5.0, None, None, 20)
    read_end, write_end = os.pipe()
    monitor = _Monitor(config, ProgressTimestamps(1.5, 3.0), dict, {}, os.getpid(), read_end, 2)
    try:
        monitor.iteration = _Iteration(2, 0, 3, iteration_store(base, 2))
        idle = RankActivity(progress_age=2.0, cpu_idle_for=2.0, stopped=False, threads_silent_for=0.1)
        inactive_for = monitor._peers_inactive_for(job, 0.0, idle)
        assert inactive_for is not None and 0.9 < inactive_for < 5.0
        assert monitor._overdue_peer is None
        assert sorted(peer.rank for peer in monitor._stalled_peers) == [1, 2]
        monitor.iteration = _Iteration(1, 0, 4, iteration_store(base, 1))  # in its iteration, it counts
        monitor._peers_inactive_for(job, 0.0, idle)
        assert monitor._overdue_peer is not None and monitor._overdue_peer[0] == 3
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        if monitor.pidfd is not None:
            os.close(monitor.pidfd)


def test_a_late_heartbeat_holds_a_verdict_only_if_its_peer_was_recently_active() -> None:
    """Seen in the soak: on a saturated host some peer's heartbeat was nearly always 0.3 to 0.5 s late, and
    each held the verdict on a hung rank ("its activity is not known yet") for over a minute, although every
    one of those peers had said it was blocked for seconds."""
    soft, now = 1.2, 1000.0
    due = now - 0.5  # late by 0.5 s, past the slack (0.3 s)
    assert overdue_for(sent_at=now - 1.0, active_at=now - 1.1, due_at=due, now=now, soft=soft) == 0.5  # was busy
    assert overdue_for(sent_at=now - 1.0, active_at=now - 9.0, due_at=due, now=now, soft=soft) is None  # blocked
    assert overdue_for(sent_at=now - 1.0, active_at=now - 1.1, due_at=now - 0.2, now=now, soft=soft) is None
    assert overdue_for(sent_at=now - 1.0, active_at=now - 1.1, due_at=None, now=now, soft=soft) is None


def _beats(start: float, periods: Callable[[float], float], until: float, tick: float = 0.1) -> list[float]:
    """When a monitor loop waking every ``tick`` s from ``start`` heartbeats, with the period ``periods(now)``."""
    last = next_due = -math.inf
    sent = []
    now = start
    while now < until:
        period = periods(now)
        if beat_due(now, last, next_due, period):
            last, next_due = now, aligned_instant(now, period)
            sent.append(now)
        now = round(now + tick, 6)
    return sent


@pytest.mark.parametrize("start", [10.0, 10.3, 10.5, 10.6, 10.9])
def test_every_monitor_heartbeats_at_the_same_instants_whatever_its_phase(start: float) -> None:
    # A host's heartbeats of one second arrive together, so that its node relay writes them in one request:
    # after its first beat, a monitor beats at the whole seconds of the wall clock (its loop's tick late at most).
    sent = _beats(start, lambda _: 1.0, until=30.0)
    assert all(b - a <= 1.5 + 1e-9 for a, b in itertools.pairwise(sent)), sent
    assert [round(t % 1.0, 6) for t in sent[2:]] == [0.0] * len(sent[2:]), sent


def test_a_shorter_period_takes_effect_at_its_own_instants() -> None:
    # A rank that works without progress heartbeats four times a second, at the quarter seconds.
    sent = _beats(10.6, lambda now: 1.0 if now < 15.0 else 0.25, until=20.0)
    later = [t for t in sent if t > 15.3]
    # At the first tick of the loop past each quarter second: never a tick or more after it.
    assert len(later) >= 4 * 4 and all(round(t % 0.25, 6) < 0.1 for t in later), later


def test_a_wall_clock_set_back_makes_a_heartbeat_due_at_once() -> None:
    assert beat_due(100.0, last=200.0, next_due=201.0, period=1.0)
    assert not beat_due(200.5, last=200.0, next_due=201.0, period=1.0)
    assert beat_due(0.0, last=-math.inf, next_due=-math.inf, period=1.0)


def _look_from(beats: dict[int, Heartbeat], skip: set[int], now: float, soft: float) -> tuple:
    """What a look decides by, from ``beats`` less ``skip``: the latest activity, the most overdue heartbeat
    that may hide activity, and the culprit with a waiting rank of the reader's own."""
    kept = {rank: beat for rank, beat in beats.items() if rank not in skip}
    latest = max((beat.active_at for beat in kept.values()), default=None)
    lates = [overdue_for(beat.sent_at, beat.active_at, beat.due_at, now, soft) for beat in kept.values()]
    overdue = max((late for late in lates if late is not None), default=None)
    pending = any(notice_pending(beat, now, soft) for beat in kept.values())
    me = StalledRank(-1, now - 1000.0, True)
    culprit = hang_culprit([me, *(StalledRank(rank, beat.active_at, beat.waiting) for rank, beat in kept.items())])
    return latest, overdue, pending, culprit[0].rank


def test_the_judges_evidence_decides_each_look_as_every_heartbeat_would() -> None:
    """A stalled rank reads a few heartbeats the judge picked, not every peer's: for any reader that leaves out
    fewer than EVIDENCE_KEPT ranks (its own, those it reported silent), the latest activity, the most overdue
    heartbeat, whether a stall notice may still come and the culprit are the same as from every heartbeat."""
    import random

    chooser = random.Random(49)
    soft, now = 2.0, 10_000.0
    for trial in range(300):
        count = chooser.randint(1, 300)
        beats = {}
        for rank in range(count):
            active_at = now - chooser.choice([chooser.uniform(0, 40), 5.0])  # ties too
            sent_at = max(active_at, now - chooser.uniform(0, 3))
            due_at = chooser.choice([None, sent_at + chooser.uniform(0, 2)])
            notice = due_at is not None and sent_at - active_at < stall_notice_after(soft) and chooser.random() < 0.3
            beats[rank] = Heartbeat(sent_at, active_at, chooser.choice([True, False, None]), False, due_at, notice)
        evidence = select_evidence(beats, soft)
        assert len(evidence) <= 5 * EVIDENCE_KEPT
        assert all(evidence[rank] is beats[rank] for rank in evidence)
        skip = set(chooser.sample(range(count), min(count, chooser.randint(0, EVIDENCE_KEPT - 1))))
        later = now + chooser.uniform(0, 1)  # a reader reads the look a little after the judge wrote it
        assert _look_from(evidence, skip, later, soft) == _look_from(beats, skip, later, soft), trial


def test_a_peer_look_reads_back_and_anything_malformed_reads_as_none() -> None:
    beats = {3: Heartbeat(10.0, 9.0, True, False, 11.0), 12: Heartbeat(10.0, 2.0, None, False, None)}
    look = PeerLook(4, 0, 10.5, beats)
    assert parse_peer_look(encode_peer_look(look)) == look
    assert parse_peer_look(encode_peer_look(PeerLook(4, 0))) == PeerLook(4, 0)
    good = '{"iteration": 4, "judge": 0, "read_at": 1.0, "beats": {"3": {"t": 1.0, "active": 1.0}}}'
    assert parse_peer_look(good) is not None
    for bad in (
        "nope",
        "[]",
        good.replace('"iteration": 4', '"iteration": -1'),
        good.replace('"judge": 0', '"judge": true'),
        good.replace('"read_at": 1.0', '"read_at": "soon"'),
        good.replace('"read_at": 1.0', '"read_at": NaN'),
        good.replace('"3"', '"three"'),
        good.replace('"3"', '"\u00b2"'),
        good.replace('"t": 1.0', '"t": Infinity'),
        good.replace('{"t": 1.0, "active": 1.0}', "[]"),
        good.replace('"3": {"t": 1.0, "active": 1.0}', ", ".join(f'"{r}": {{"t": 1, "active": 1}}' for r in range(65))),
    ):
        assert parse_peer_look(bad) is None, bad


def test_a_stalled_rank_reads_the_judges_look_else_its_activity_else_every_peer() -> None:
    """The look a monitor judges by: the judge's fresh look (its few heartbeats); a late look while the judge's
    rank was active within the soft timeout (that activity alone: the rank waits); a late look of an inactive
    judge, or none for this iteration (every peer, as before a judge existed)."""
    base = dist.HashStore()
    job = job_store(base)
    now = time.time()
    for rank in range(40):  # iteration 2, everyone waiting in a collective for 10 s but rank 7, stopped first
        job.record_position(rank, 2, rank, 40, True)
        job.liveness.send_heartbeat(rank, active_at=now - (12.0 if rank == 7 else 10.0), waiting=rank != 7, next_in=1.0)
    idle = RankActivity(progress_age=10.0, cpu_idle_for=10.0, stopped=False, threads_silent_for=0.1)
    read_end, write_end = os.pipe()
    made: list[_Monitor] = []

    def monitor(rank: int) -> _Monitor:
        config = MonitorConfig(rank, 40, 0.05, 0.5, 20.0, 60.0, 90.0, 1.0, 5.0, None, None, 20)
        made.append(_Monitor(config, ProgressTimestamps(1.5, 3.0), dict, {}, os.getpid(), read_end, 2))
        made[-1].iteration = _Iteration(2, rank, 40, iteration_store(base, 2))
        return made[-1]

    try:
        reader = monitor(5)
        assert reader.culprit(job, idle)[0].rank == 7
        assert len(reader._stalled_peers) == 39  # no judge yet: every peer
        judge = monitor(0)
        judge.timestamps.set_waiting(True)
        assert judge.culprit(job, idle)[0].rank == 7
        look, _ = job.liveness.peer_look(None)
        assert look is not None and look.judge == 0 and look.iteration == 2 and 0 in look.beats
        assert len(look.beats) <= 4 * EVIDENCE_KEPT
        reader = monitor(5)
        inactive_for = reader._peers_inactive_for(job, 0.0, idle)
        assert inactive_for is not None and 9.5 < inactive_for < 12.0
        assert reader.culprit(job, idle)[0].rank == 7 and len(reader._stalled_peers) < 39
        # A late look: the judge's rank works again (its heartbeat says so), and that alone decides.
        job.liveness.publish_peer_look(dataclasses.replace(look, read_at=now - 30.0))
        job.liveness.send_heartbeat(0, active_at=time.time(), waiting=None, next_in=1.0)
        reader = monitor(5)
        assert reader._peers_inactive_for(job, 0.0, idle) < 1.0
        assert [peer.rank for peer in reader._stalled_peers] == [0]
        # A late look of an inactive judge (its monitor starved or dead): every peer.
        job.liveness.send_heartbeat(0, active_at=now - 10.0, waiting=True, next_in=1.0)
        reader = monitor(5)
        assert reader.culprit(job, idle)[0].rank == 7 and len(reader._stalled_peers) == 39
        # Another iteration's look says nothing of this one: every peer.
        job.liveness.publish_peer_look(dataclasses.replace(look, iteration=1, read_at=time.time()))
        reader = monitor(5)
        assert reader.culprit(job, idle)[0].rank == 7 and len(reader._stalled_peers) == 39
    finally:
        for each in made:
            if each.pidfd is not None:
                os.close(each.pidfd)
        for fd in (read_end, write_end):
            os.close(fd)


def test_the_judges_work_for_the_others_never_holds_its_own_verdict_while_etcd_is_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The iteration's rank 0 announces itself and, from half its soft timeout, looks for the others; with etcd
    unreachable both fail, and its own verdict (a stopped or wedged rank killed) is still reached, the
    announcement retried at the next pass."""
    from elastic_ft.inprocess.hangs import monitor as monitor_process

    def unreachable(*_: object) -> None:
        raise ConnectionError("etcd at 127.0.0.1:2379 is unreachable")

    verdicts: list[StallVerdict] = []

    def judged(*args: object) -> StallVerdict:
        verdicts.append(judge_stall(*args))  # type: ignore[arg-type]
        return verdicts[-1]

    monkeypatch.setattr(monitor_process, "judge_stall", judged)
    base = dist.HashStore()
    job = job_store(base)
    job.liveness.publish_peer_look = unreachable  # type: ignore[method-assign]
    job.liveness.peer_records = unreachable  # type: ignore[method-assign]
    config = MonitorConfig(0, 2, 0.05, 0.5, 20.0, 60.0, 90.0, 1.0, 5.0, None, None, 20)
    read_end, write_end = os.pipe()
    monitor = _Monitor(config, ProgressTimestamps(1.5, 3.0), dict, {}, os.getpid(), read_end, 2)
    try:
        iteration = _Iteration(0, 0, 2, iteration_store(base, 0))
        monitor.iteration = iteration
        half = RankActivity(progress_age=1.0, cpu_idle_for=1.0, stopped=False, threads_silent_for=0.1)
        for _ in range(2):
            assert monitor._judge(base, job, iteration, half, Timeouts(1.5, 3.0, 60.0, 90.0)) is False
            assert not iteration.announced
        assert [verdict.action for verdict in verdicts] == [StallAction.NONE, StallAction.NONE]
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        if monitor.pidfd is not None:
            os.close(monitor.pidfd)


@pytest.mark.integration
def test_a_monitor_process_that_ends_before_its_rank_stops_it_is_reported_at_once() -> None:
    """Killed under its rank, the monitor is reported (pid, how, initial rank) within moments; one the rank
    stopped is not."""
    config = MonitorConfig(3, 4, 0.05, 0.5, 20.0, 60.0, 90.0, 1.0, 5.0, None, None, 20)
    lost: list[tuple[int, str, int]] = []
    reported = threading.Event()

    def on_lost(pid: int, how: str, initial_rank: int) -> None:
        lost.append((pid, how, initial_rank))
        reported.set()

    killed = MonitorProcess(config, ProgressTimestamps(1.5, 3.0), dict, {}, on_lost=on_lost)
    killed.take_initial_rank(7)  # a rejoined rank: reported under its new initial rank
    time.sleep(0.2)
    os.kill(killed.pid, signal.SIGKILL)
    assert reported.wait(5.0), "the monitor's death went unnoticed"
    assert lost == [(killed.pid, "signal SIGKILL", 7)]
    stopped = MonitorProcess(config, ProgressTimestamps(1.5, 3.0), dict, {}, on_lost=on_lost)
    stopped.stop()
    time.sleep(0.5)  # its watcher saw it end
    assert len(lost) == 1
    with pytest.raises(ChildProcessError):  # reaped, both
        os.waitpid(killed.pid, os.WNOHANG)
    with pytest.raises(ChildProcessError):
        os.waitpid(stopped.pid, os.WNOHANG)
