"""Hang detection: adaptive timeouts, the monitor's stall verdicts and its CPU evidence, which sockets a restart cuts."""

from __future__ import annotations

import dataclasses
import datetime
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
from elastic_ft.coordination.fault_records import encode_heartbeat
from elastic_ft.coordination.iteration import iteration_store
from elastic_ft.coordination.job import job_store
from elastic_ft.inprocess.hang_detection import (
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
    overdue_for,
    overdue_slack,
    peer_read_period,
    percentile,
    warmup_timeouts,
)
from elastic_ft.inprocess.monitor_process import MonitorConfig, _Iteration, _Monitor, cpu_seconds
from elastic_ft.inprocess.progress_watchdog import ProgressTimestamps, StepClock
from elastic_ft.inprocess.sockets import (
    TcpSocket,
    accepted_connections,
    created_connections,
    gloo_listeners,
    release_connections,
    released_by_peers,
    socket_inodes,
    tcp_sockets,
    unblock_listeners,
)

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
    monkeypatch.setattr("elastic_ft.inprocess.progress_watchdog.time.monotonic", lambda: now[0])
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


def test_a_rank_that_does_not_restart_is_killed_at_the_hard_timeout() -> None:
    assert judge_stall(activity(2.5), TIMEOUTS, 1.0, None, 10.0).action is StallAction.NONE
    assert judge_stall(activity(3.1), TIMEOUTS, 1.0, None, 10.0).action is StallAction.KILL


def test_a_restart_requested_late_still_gets_the_time_between_soft_and_hard_timeout() -> None:
    """Seen in CI's soak: ranks that asked for a restart only at the configured 60 s were killed at once, being
    long past their adaptive hard timeout (17.9 s): the restart never had a chance to reach them."""
    late = activity(60.3)
    assert judge_stall(late, TIMEOUTS, 1.0, None, 0.2).action is StallAction.NONE
    verdict = judge_stall(late, TIMEOUTS, 1.0, None, 1.5)
    assert verdict.action is StallAction.KILL and "1.5 s after its restart request" in verdict.reason


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


def test_messages_after_store_ready_in_the_same_read_are_kept() -> None:
    # Regression: a monitor process that woke late read store_ready and the first iteration
    # together, dropped the iteration, and never judged its rank's stalls.
    from elastic_ft.inprocess.monitor_process import after_store_ready

    iteration = {"type": "iteration", "iteration": 0, "rank": 1, "world_size": 4}
    assert after_store_ready([{"type": "store_ready"}, iteration]) == (False, [iteration])
    assert after_store_ready([{"type": "store_ready"}]) == (False, [])
    assert after_store_ready([]) == (False, None)
    assert after_store_ready([{"type": "stop"}, {"type": "store_ready"}]) == (True, None)


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
        before = cpu_seconds(process.pid, exclude=-1)
        time.sleep(1.0)
        used = cpu_seconds(process.pid, exclude=-1) - before
        assert (used > 0.3) is counted, used
    finally:
        for child in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split():
            os.kill(int(child), signal.SIGKILL)
        process.kill()
        process.wait()


def _detach_in_a_child(stderr: Path | None) -> tuple[int, list[int], str]:
    """Fork, give the child ``stderr`` as fd 2 (None: closed), run ``_detach`` there; returns what it returned,
    the child's descriptors afterwards and what the child then wrote through the returned one."""
    from elastic_ft.inprocess.monitor_process import _detach

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
        job.send_heartbeat(rank, active_at=now - 1.0, waiting=True, next_in=0.5)
    job.set_accepts_joiners()
    job.register_joiner(3)  # admitted into iteration 1, dead since: its heartbeat is 30 s overdue
    job.claim_admission(3, "1")
    job.record_position(3, 1, 3, 4, True)
    job.set(f"{keys.HEARTBEAT}3", encode_heartbeat(now - 31, now - 31, None, False, now - 30))
    config = MonitorConfig(0, 3, 0.05, 0.5, 20.0, 60.0, 90.0, 1.0, 5.0, None, None, 20)
    read_end, write_end = os.pipe()
    monitor = _Monitor(config, ProgressTimestamps(1.5, 3.0), dict, {}, os.getpid(), read_end, 2)
    try:
        monitor.iteration = _Iteration(2, 0, 3, iteration_store(base, 2))
        inactive_for = monitor._peers_inactive_for(job, read_period=0.0)
        assert inactive_for is not None and 0.9 < inactive_for < 5.0
        assert monitor._overdue_peer is None
        assert sorted(peer.rank for peer in monitor._stalled_peers) == [1, 2]
        monitor.iteration = _Iteration(1, 0, 4, iteration_store(base, 1))  # in its iteration, it counts
        monitor._peers_inactive_for(job, read_period=0.0)
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
