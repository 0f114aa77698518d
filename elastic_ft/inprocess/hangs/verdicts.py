"""Hang detection: timeouts that follow the job's step times, and the monitor process's verdict on a stall.

Both are pure: :func:`adaptive_timeouts` turns the step intervals a rank
observed into its soft and hard timeouts; :func:`judge_stall` turns what the
monitor process sees of its rank (and, through the store, of the other
ranks) into an action with its reason.

**Timeouts.** A training job's steps take about the same time, so a rank
that makes no progress for many step times is hung. The soft timeout is
``multiplier`` times a high ``percentile`` of the recent step intervals, no
less than ``soft_floor``; the hard timeout is ``hard_multiplier`` times that.
The Wrapper's ``soft_timeout`` and ``hard_timeout`` are the ceilings, and
apply alone while there are too few samples, and inside sections marked
long (``CallWrapper.long_section()``, ``CallWrapper.atomic()``, typically a
checkpoint). The first ``warmup_steps`` steps of each iteration (process
groups, data loaders, compilation) are not sampled, and step times say
nothing of them: an iteration's warm-up is bounded by the warm-ups before
it instead. Once this process has timed one (from the iteration's start to
its first sampled step, less the long sections), the soft timeout of a
warm-up is ``warmup_multiplier`` times the longest, no less than the
adaptive soft timeout (:func:`warmup_timeouts`); before that, the ceilings.
A hang in the first steps after a restart then costs seconds, not the
configured minute.

**Stalls.** A rank is *active* when its main thread executes Python code
(the automatic heartbeat), reports a step, burns CPU (its main thread or
its data loader workers: a long computation in C is work, not a hang; the
rank's other threads are machinery, gloo's and gRPC's, whose CPU use says
nothing of its progress), or is
resending data the network lost (a lossy link retransmits for seconds:
slow, not hung; a hung peer's kernel still acknowledges what it receives,
so waiting for it never looks like this; the monitor process asks the
kernel about each of the rank's connections by address, over ``sock_diag``
netlink, a few microseconds a question). The configured
``soft_timeout`` and ``hard_timeout`` keep their plain meaning (no progress
for that long restarts, kills, whatever the rank does). A rank none of
whose Python threads ran for the adaptive soft timeout (the GIL held, or
the process stopped), without progress, is **killed**, busy or not: no
restart can reach it (a computation that holds the GIL that long belongs in
a long section). While an iteration warms up (its first steps, when the
configured timeouts apply), a process that is stopped, or holds the GIL
without using CPU, for the delivery bound (the job's adaptive hard
timeout, kept across iterations) is killed all the same: no warm-up looks
like that. Once a rank has been inactive for the adaptive soft
timeout:

1. a process that is stopped (SIGSTOP), or whose GIL has been held so long
   that none of its threads could run, cannot take part in an in-process
   restart: it is **killed** at once, and the others go on without it;
2. if another rank was active within the soft timeout, the job is not hung:
   this rank waits for a slow peer (**no action** yet);
3. otherwise the rank asks for a **restart** of every rank, once per
   iteration; a rank that still makes no progress at the hard timeout is
   **killed**, once the restart had the time between the two timeouts to
   reach it, and at least the delivery bound (a restart asked for late, at
   the configured soft timeout, finds the rank long past its adaptive hard
   one; a fast job's half second between the two is less than a request
   takes through the store on a busy host); a restart that reached the
   process but not yet its main thread, blocked in C code, gets the
   delivery bound from then on, the time releasing its connections needs.

**Fresh enough evidence.** Ranks learn of each other's activity from
heartbeats, sent every ``heartbeat_interval`` (1 s by default) to keep the
store's load low. That is too coarse for rule 2 when the soft timeout is
about as short: a peer busy in a long computation would look inactive for up
to two intervals. So a rank that is active but has made no progress for half
its soft timeout heartbeats every quarter of it (:func:`heartbeat_period`),
at once, not after the period its last heartbeat promised, and a rank near
its soft timeout re-reads its peers as often (:func:`peer_read_period`):
the evidence is then at most half a soft timeout old when it is judged.
Only ranks in a slow step pay for this. Each heartbeat says when the next
is due; a peer whose heartbeat is later than that by more than
:func:`overdue_slack` (a busy peer on a saturated host, its monitor
process starved of CPU) is *unknown*, not inactive, and holds the restart
until it reports or is late by the adaptive hard timeout (then its silence
is its own: it is dead or frozen, and its last activity stands). Only a
peer whose last heartbeat said it was active within a soft timeout holds it
so (:func:`overdue_for`): one already inactive that long hides nothing.

**Stall notices.** A peer that steps says so at its next heartbeat, a
second later: a rank that stopped while the peer still stepped, then spent
its soft timeout waiting for the peer's slow step, would find the peer's
last heartbeat older than that, and restart a healthy job. So a heartbeat
sent while its rank is active (within :func:`stall_notice_after`) promises
a *stall notice*: the monitor beats again as soon as its rank has been
inactive that long, not only when the next beat is due; and until that
notice or the next beat could have come (:func:`notice_pending`), the
peer's activity is not known, and holds a verdict. In a hang every rank
turns inactive and sends its notice within a quarter of its soft timeout,
well before the others' soft timeouts end: the verdict costs nothing more.

**One look for the job.** Rules 2 and 3 and the culprit depend on the
peers only through extremes (the latest active, the most overdue, the
earliest stopped), so one rank's look at every peer serves every stalled
rank: :func:`select_evidence` keeps the few heartbeats that decide, which
the other ranks read instead of every peer's.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import heapq
import math
from collections.abc import Mapping, Sequence

from elastic_ft.coordination.fault_records import Heartbeat


@dataclasses.dataclass(frozen=True)
class AdaptiveTimeouts:
    """How the soft and hard timeouts follow the step times (see the module docstring).

    Args:
        multiplier: soft timeout = ``multiplier`` x the ``percentile`` of step intervals.
        percentile: which percentile of the recent step intervals (0-100).
        soft_floor: the shortest soft timeout.
        hard_multiplier: hard timeout = ``hard_multiplier`` x the soft timeout.
        warmup_steps: steps at the start of each iteration that are not sampled.
        warmup_multiplier: a warm-up's soft timeout = ``warmup_multiplier`` x the longest earlier warm-up.
        min_samples: samples needed before the timeouts adapt.
        window: how many recent step intervals are kept.
        delivery_floor: the shortest time a restart has to reach a main thread blocked in C code (a store wait,
            gloo's connect loop) before the rank is terminated; the adaptive hard timeout when longer. Not tied
            to ``soft_floor``: what ends such a call is the connection release, whatever the step time.
    """

    multiplier: float = 10.0
    percentile: float = 99.0
    soft_floor: datetime.timedelta = datetime.timedelta(seconds=0.5)
    hard_multiplier: float = 2.0
    warmup_steps: int = 3
    min_samples: int = 8
    window: int = 256
    warmup_multiplier: float = 4.0
    delivery_floor: datetime.timedelta = datetime.timedelta(seconds=3)

    def __post_init__(self) -> None:
        for name in ("multiplier", "hard_multiplier", "warmup_multiplier"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 1:
                raise ValueError(f"AdaptiveTimeouts {name} must be a number >= 1, got {value!r}")
        if isinstance(self.percentile, bool) or not isinstance(self.percentile, int | float):
            raise TypeError(f"AdaptiveTimeouts percentile must be a number, got {self.percentile!r}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"AdaptiveTimeouts percentile must be in (0, 100], got {self.percentile!r}")
        for name in ("soft_floor", "delivery_floor"):
            value = getattr(self, name)
            if not isinstance(value, datetime.timedelta) or value <= datetime.timedelta(0):
                raise ValueError(f"AdaptiveTimeouts {name} must be a positive timedelta, got {value!r}")
        for name, minimum in (("warmup_steps", 0), ("min_samples", 1), ("window", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"AdaptiveTimeouts {name} must be an integer >= {minimum}, got {value!r}")
        if self.min_samples > self.window:
            raise ValueError(f"AdaptiveTimeouts min_samples={self.min_samples} exceeds window={self.window}")


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of non-empty ``samples``."""
    ordered = sorted(samples)
    index = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[index]


def adaptive_timeouts(
    samples: Sequence[float], config: AdaptiveTimeouts | None, soft_ceiling: float, hard_ceiling: float
) -> tuple[float, float]:
    """(soft, hard) timeouts in seconds from the step intervals ``samples``; the ceilings without enough samples."""
    if config is None or len(samples) < config.min_samples:
        return soft_ceiling, hard_ceiling
    typical = percentile(samples, config.percentile)
    soft = min(soft_ceiling, max(config.soft_floor.total_seconds(), config.multiplier * typical))
    hard = min(hard_ceiling, max(soft, config.hard_multiplier * soft))
    return soft, hard


def warmup_timeouts(
    warmups: Sequence[float],
    samples: Sequence[float],
    config: AdaptiveTimeouts | None,
    soft_ceiling: float,
    hard_ceiling: float,
) -> tuple[float, float] | None:
    """(soft, hard) timeouts in seconds for an iteration's warm-up; None while the ceilings apply.

    ``warmups`` are the durations of this process's earlier warm-ups. Both
    a timed warm-up and enough step samples are needed: the step times give
    the floor, so a warm-up is never judged more strictly than a step.
    """
    if config is None or not warmups or len(samples) < config.min_samples:
        return None
    adapted_soft, _ = adaptive_timeouts(samples, config, soft_ceiling, hard_ceiling)
    soft = min(soft_ceiling, max(adapted_soft, config.warmup_multiplier * max(warmups)))
    hard = min(hard_ceiling, max(soft, config.hard_multiplier * soft))
    return soft, hard


class StallAction(enum.Enum):
    NONE = "none"
    RESTART = "restart"
    KILL = "kill"


@dataclasses.dataclass(frozen=True)
class StallVerdict:
    action: StallAction
    reason: str = ""
    #: Why a rank without progress for its soft timeout is not acted on, in a word that stays the same
    #: while the cause does (``busy: CPU``, ``peer active``): the monitor logs the reason when it changes.
    waits_because: str = ""


@dataclasses.dataclass(frozen=True)
class RankActivity:
    """What the monitor process sees of its rank, in seconds ago."""

    progress_age: float  # since the main thread ran Python code or reported a step
    cpu_idle_for: float  # since its main thread (or its data loader workers) last used CPU
    stopped: bool  # the process is stopped (SIGSTOP, or traced)
    threads_silent_for: float  # since any of its Python threads last ran (the GIL held throughout)
    restart_pending_for: float = 0.0  # since a restart started that the main thread has not taken (0: none)
    #: Since the rank last resent data the network lost on a TCP connection (a lossy link retransmitting is
    #: slow, not hung: :mod:`elastic_ft.inprocess.hangs.resends`).
    network_idle_for: float = math.inf

    @property
    def inactive_for(self) -> float:
        return min(self.progress_age, self.cpu_idle_for, self.network_idle_for)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """The timeouts in effect, in seconds: adaptive (``soft``, ``hard``) and configured (the limits)."""

    soft: float
    hard: float
    soft_limit: float
    hard_limit: float
    #: How long a restart may take to reach the main thread: the adaptive hard timeout of the job's
    #: steps, kept across iterations, at least twice the adaptive floor (3 s by default).
    delivery: float = math.inf
    #: ``soft`` and ``hard`` bound a warm-up (:func:`warmup_timeouts`), not steps.
    warming_up: bool = False

    def describe_soft(self) -> str:
        """The adaptive soft timeout, for a verdict's reason."""
        return f"{'warm-up' if self.warming_up else 'adaptive'} soft timeout {self.soft:.1f} s"


def heartbeat_period(rank: RankActivity, soft: float, interval: float) -> float:
    """Seconds until the next heartbeat: a quarter of ``soft`` while the rank works without progress."""
    working_without_progress = rank.progress_age >= soft / 2 and rank.cpu_idle_for < soft / 4
    return min(interval, soft / 4) if working_without_progress else interval


def stall_notice_after(soft: float) -> float:
    """How long a rank whose last heartbeat said it was active may be inactive before its monitor beats again,
    a stall notice (a quarter of ``soft``; see the module docstring); a heartbeat sent while the rank was inactive
    for less promises that notice."""
    return soft / 4


def notice_pending(beat: Heartbeat, now: float, soft: float) -> bool:
    """Whether a peer's stall notice may still come: its last heartbeat promised one, and neither its next
    heartbeat is due nor the slack a late one gets (:func:`overdue_slack`) has passed. Until then the peer
    may be at work, however long ago the heartbeat said it was active; past it, a late heartbeat is
    :func:`overdue_for`'s."""
    return beat.notice and beat.due_at is not None and now <= beat.due_at + overdue_slack(soft)


def overdue_slack(soft: float) -> float:
    """How late a peer's heartbeat may come before what it said of the peer's activity no longer counts (a
    quarter of ``soft``): a busy peer on a saturated host may send late, and its last heartbeat must not then
    read as inactivity (see the module docstring)."""
    return soft / 4


def overdue_for(sent_at: float, active_at: float, due_at: float | None, now: float, soft: float) -> float | None:
    """How late a peer's heartbeat is, when that lateness may hide activity that matters; else None.

    Late by more than :func:`overdue_slack`, and its last heartbeat said the
    peer was active less than ``soft`` before it was sent: a busy peer on a
    saturated host, whose next heartbeat may well say it is still at work.
    A peer whose last heartbeat already said it was inactive for ``soft``
    (blocked in a collective, as the others) hides nothing by being late: on
    a saturated host some peer's heartbeat is nearly always a little late,
    and counting those deferred a hang's verdict for a minute in the soak.
    """
    if due_at is None:
        return None
    late = now - due_at
    if late <= overdue_slack(soft) or sent_at - active_at >= soft:
        return None
    return late


def peer_read_period(soft: float, interval: float) -> float:
    """How stale the peers' heartbeats read by a rank at its soft timeout may be, at most (see the module docstring)."""
    return min(interval, soft / 4)


def judge_stall(
    rank: RankActivity,
    timeouts: Timeouts,
    gil_held_limit: float,
    peers_inactive_for: float | None,
    restart_requested_for: float | None,
    peer_overdue_for: float | None = None,
    peer_notice_pending: bool = False,
) -> StallVerdict:
    """What the monitor process does about its rank now (see the module docstring).

    The configured limits keep their plain meaning, whatever the rank does:
    no progress for ``soft_limit`` restarts, for ``hard_limit`` kills. The
    adaptive timeouts act on ranks that are *inactive* (no progress and no CPU).

    Args:
        rank: the rank's activity.
        timeouts: the timeouts in effect.
        gil_held_limit: silence of every Python thread beyond which the GIL is held for good.
        peers_inactive_for: seconds since any other rank was last active; ``None`` if not known.
        restart_requested_for: seconds since this rank asked for a restart in this iteration (None: it did not).
        peer_overdue_for: how late the latest heartbeat of the most overdue peer is, past its promise, when
            by more than :func:`overdue_slack` (None: every peer's is on time): that peer's activity is not
            known, until it is late by the adaptive hard timeout.
        peer_notice_pending: a peer's stall notice may still come (:func:`notice_pending`): its activity since
            its last heartbeat is not known.
    """
    return (
        _wedged(rank, timeouts)
        or _past_a_configured_limit(rank, timeouts, restart_requested_for)
        or _adaptive_verdict(
            rank,
            timeouts,
            gil_held_limit,
            peers_inactive_for,
            restart_requested_for,
            peer_overdue_for,
            peer_notice_pending,
        )
    )


def _wedged(rank: RankActivity, timeouts: Timeouts) -> StallVerdict | None:
    """A kill that no timeout waits for: a restart that cannot reach the main thread, or a frozen process."""
    if rank.restart_pending_for >= timeouts.delivery and rank.progress_age >= timeouts.delivery:
        # Released connections and the interrupt signal did not bring the main thread back to Python: it is
        # wedged in C code (a gloo operation that missed its peer's closed connection, a connect to a dead
        # peer). Only a new process can take its place.
        return StallVerdict(
            StallAction.KILL,
            f"a restart has not reached the main thread for {rank.restart_pending_for:.1f} s (blocked in C code; "
            f"the job's steps give {timeouts.delivery:.1f} s)",
        )
    frozen = rank.stopped or rank.threads_silent_for >= timeouts.delivery
    if frozen and min(rank.progress_age, rank.cpu_idle_for) >= timeouts.delivery and timeouts.soft > timeouts.delivery:
        # The configured ceilings hold while an iteration warms up (process groups, compilation, a
        # checkpoint), but no warm-up leaves a process stopped, or with the GIL held and no CPU used: a
        # restart's first steps must not give such a hang the configured soft timeout (60 s) to cost.
        state = "the process is stopped" if rank.stopped else "the GIL is held without CPU use"
        return StallVerdict(
            StallAction.KILL,
            f"no Python thread ran for {rank.threads_silent_for:.1f} s and no progress for "
            f"{rank.progress_age:.1f} s ({state}; the job's steps give {timeouts.delivery:.1f} s)",
        )
    return None


def _past_a_configured_limit(
    rank: RankActivity, timeouts: Timeouts, restart_requested_for: float | None
) -> StallVerdict | None:
    """The configured soft and hard timeouts, with their plain meaning whatever the rank does."""
    if rank.progress_age >= timeouts.hard_limit:
        return StallVerdict(StallAction.KILL, f"no progress for {rank.progress_age:.1f} s (hard_timeout)")
    if rank.progress_age >= timeouts.soft_limit and restart_requested_for is None:
        return StallVerdict(StallAction.RESTART, f"no progress for {rank.progress_age:.1f} s (soft_timeout)")
    return None


def _adaptive_verdict(
    rank: RankActivity,
    timeouts: Timeouts,
    gil_held_limit: float,
    peers_inactive_for: float | None,
    restart_requested_for: float | None,
    peer_overdue_for: float | None,
    peer_notice_pending: bool,
) -> StallVerdict:
    """The adaptive timeouts, for a rank without progress: act on it only if it is inactive and every peer's
    activity says it does not wait for a slow peer."""
    if rank.progress_age >= timeouts.soft and rank.threads_silent_for >= timeouts.soft:
        # Not even the rank's own threads ran: whatever its CPU use, nothing can
        # restart it (a gloo destructor spinning under the GIL was seen here).
        state = "the process is stopped" if rank.stopped else "the GIL is held"
        return StallVerdict(
            StallAction.KILL,
            f"no Python thread ran for {rank.threads_silent_for:.1f} s ({state}) "
            f"and no progress for {rank.progress_age:.1f} s",
        )
    if rank.inactive_for < timeouts.soft:
        if rank.progress_age < timeouts.soft:
            return StallVerdict(StallAction.NONE)
        what = "CPU" if rank.cpu_idle_for <= rank.network_idle_for else "network resends"
        return StallVerdict(
            StallAction.NONE,
            f"no progress for {rank.progress_age:.1f} s, but busy ({what} {rank.inactive_for:.1f} s ago; "
            f"{timeouts.describe_soft()}): slow, not hung",
            f"busy: {what}",
        )
    if rank.stopped:
        return StallVerdict(
            StallAction.KILL, f"the process is stopped and made no progress for {rank.progress_age:.1f} s"
        )
    if rank.threads_silent_for > gil_held_limit:
        return StallVerdict(
            StallAction.KILL,
            f"no Python thread ran for {rank.threads_silent_for:.1f} s (the GIL is held) "
            f"and no progress for {rank.progress_age:.1f} s",
        )
    if restart_requested_for is not None:
        if rank.restart_pending_for > 0:
            # The restart reached the process and is on its way to the main thread (signals, then every
            # connection released, which a frozen peer's connections need): the delivery bound decides (_wedged).
            return StallVerdict(StallAction.NONE)
        # The restart gets the time between the soft and the hard timeout to reach the rank, however late it was
        # asked for (at the configured soft timeout, the rank is long past its adaptive hard one), and at least
        # the delivery bound: the request goes through the store to every rank's monitor thread before the
        # restart starts here, which the hard timeout of fast steps (half a second past the soft one) does not
        # leave time for on a busy host.
        reach = max(timeouts.hard - timeouts.soft, timeouts.delivery)
        if rank.inactive_for >= timeouts.hard and restart_requested_for >= reach:
            return StallVerdict(
                StallAction.KILL,
                f"inactive for {rank.inactive_for:.1f} s, {restart_requested_for:.1f} s after its restart request "
                f"({'warm-up ' if timeouts.warming_up else ''}hard {timeouts.hard:.1f} s; the restart gets "
                f"{reach:.1f} s to reach it)",
            )
        return StallVerdict(StallAction.NONE)
    return _peers_verdict(rank, timeouts, peers_inactive_for, peer_overdue_for, peer_notice_pending)


def _peers_verdict(
    rank: RankActivity,
    timeouts: Timeouts,
    peers_inactive_for: float | None,
    peer_overdue_for: float | None,
    peer_notice_pending: bool,
) -> StallVerdict:
    """An inactive rank with no restart asked for: a restart, unless its peers' activity says it may wait for a
    slow peer, or is not known yet."""
    if peers_inactive_for is not None and peers_inactive_for < timeouts.soft:
        return StallVerdict(
            StallAction.NONE,
            f"inactive for {rank.inactive_for:.1f} s ({timeouts.describe_soft()}), but another rank was active "
            f"{peers_inactive_for:.1f} s ago: it waits for a slow peer",
            "peer active",
        )
    if peer_notice_pending:
        return StallVerdict(
            StallAction.NONE,
            f"inactive for {rank.inactive_for:.1f} s ({timeouts.describe_soft()}), but a peer was active at its "
            "last heartbeat and its stall notice may still come: its activity is not known yet",
            "peer unheard",
        )
    if peer_overdue_for is not None and peer_overdue_for < timeouts.hard:
        # No news is not news of inactivity: a busy peer on a saturated host may heartbeat late. Later than
        # the adaptive hard timeout, the silence is the peer's (dead or frozen) and its last activity stands.
        return StallVerdict(
            StallAction.NONE,
            f"inactive for {rank.inactive_for:.1f} s ({timeouts.describe_soft()}), but a peer's heartbeat is "
            f"{peer_overdue_for:.1f} s overdue: its activity is not known yet",
            "peer overdue",
        )
    return StallVerdict(StallAction.RESTART, f"inactive for {rank.inactive_for:.1f} s ({timeouts.describe_soft()})")


@dataclasses.dataclass(frozen=True)
class StalledRank:
    """What a heartbeat (or the monitor process, for its own rank) says of a rank in a hung iteration."""

    rank: int  # the rank's initial rank
    active_at: float  # when it was last active (wall clock)
    waiting: bool | None  # its main thread, blocked, waits for other ranks (None: it was not blocked)


def hang_culprit(ranks: Sequence[StalledRank]) -> tuple[StalledRank, str]:
    """The rank a hang is blamed on, and why (pure; ``ranks`` not empty).

    The rank whose progress stopped first, not the one whose timer expired
    first: the ranks not known to wait in a collective come first (blocked
    elsewhere, or with no thread left to say: stopped, or the GIL held),
    since the others wait for them; then the one last active earliest.
    """
    if not ranks:
        raise ValueError("hang_culprit needs at least one rank")
    outside = [rank for rank in ranks if rank.waiting is not True]
    candidates = outside or list(ranks)
    culprit = min(candidates, key=lambda rank: (rank.active_at, rank.rank))
    waiting = sorted(rank.rank for rank in ranks if rank.waiting)
    if outside and waiting:
        why = f"it is blocked outside any collective, and initial rank(s) {waiting} wait for it in one"
    else:
        why = "its progress stopped first"
    return culprit, why


#: How many ranks of each extreme a judge's look keeps (:func:`select_evidence`).
EVIDENCE_KEPT = 4


def select_evidence(beats: Mapping[int, Heartbeat], soft: float, keep: int = EVIDENCE_KEPT) -> dict[int, Heartbeat]:
    """The heartbeats among ``beats`` (by initial rank) that decide every stalled rank's verdict and the hang's
    culprit: at most ``5 * keep`` of them, however many ranks.

    A rank's verdict depends on its peers only through extremes: the latest
    active one (was anyone active within the soft timeout), the most
    overdue heartbeat that may hide activity (:func:`overdue_for`, whose
    lateness grows with the reader's clock but whose order does not), the
    latest promised stall notice (:func:`notice_pending`: if any is pending
    at the reader's clock, the one due last is), and
    the culprit (:func:`hang_culprit`: the earliest active of the ranks
    blocked outside a collective, else of all). A reader leaves out its own
    rank and those it reported silent: ``keep`` of each extreme give it the
    same answer as every heartbeat would while it leaves out fewer than
    ``keep`` of them. What is lost is only the list of the ranks that wait
    in a collective, which the culprit's reason names.
    """
    ranks = list(beats)

    def stopped_first(rank: int) -> tuple[float, int]:
        return beats[rank].active_at, rank

    outside = [rank for rank in ranks if beats[rank].waiting is not True]
    may_hide = [
        rank for rank in ranks if beats[rank].due_at is not None and beats[rank].sent_at - beats[rank].active_at < soft
    ]
    noticing = [rank for rank in ranks if beats[rank].notice and beats[rank].due_at is not None]
    chosen = {
        *heapq.nlargest(keep, ranks, key=lambda rank: (beats[rank].active_at, -rank)),
        *heapq.nsmallest(keep, ranks, key=stopped_first),
        *heapq.nsmallest(keep, outside, key=stopped_first),
        *heapq.nsmallest(keep, may_hide, key=lambda rank: (beats[rank].due_at, rank)),
        *heapq.nlargest(keep, noticing, key=lambda rank: (beats[rank].due_at, -rank)),
    }
    return {rank: beats[rank] for rank in sorted(chosen)}
