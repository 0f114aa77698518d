"""The wait primitives: poll's deadline and growing pause, Backoff's jittered doubling, pause's no-op for 0."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from elastic_ft.runtime.waits import Backoff, aligned_instant, pause, poll


def test_poll_returns_once_the_predicate_holds_and_false_at_its_deadline() -> None:
    calls = []
    assert poll(lambda: calls.append(1) or len(calls) >= 3, 5.0)
    assert len(calls) == 3
    started = time.monotonic()
    assert not poll(lambda: False, 0.2, interval_max=0.05)
    assert 0.19 < time.monotonic() - started < 1.0


def test_poll_pauses_grow_to_the_interval_named() -> None:
    stamps: list[float] = []
    poll(lambda: stamps.append(time.monotonic()) or len(stamps) >= 8, None, interval_max=0.02, interval_first=0.001)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert gaps[0] < 0.015 and max(gaps) < 0.1 and gaps[-1] >= 0.015


def test_backoff_doubles_within_its_jitter_up_to_its_cap_and_resets() -> None:
    backoff = Backoff(first=0.1, cap=0.8, rng=random.Random(0))
    pauses = [backoff.next() for _ in range(6)]
    for pause_, ceiling in zip(pauses, [0.1, 0.2, 0.4, 0.8, 0.8, 0.8], strict=True):
        assert ceiling / 2 <= pause_ <= ceiling
    backoff.reset()
    assert backoff.next() <= 0.1
    with pytest.raises(ValueError, match="0 < first <= cap"):
        Backoff(first=1.0, cap=0.5)


def test_a_backoff_pause_keeps_to_the_callers_limit_and_pause_of_nothing_returns_at_once() -> None:
    started = time.monotonic()
    Backoff(first=2.0, cap=2.0).pause(limit=0.05)
    pause(0)
    pause(-1)
    assert time.monotonic() - started < 0.5


def test_aligned_instants_are_the_wall_clocks_multiples_half_a_period_away_at_least() -> None:
    # Wherever a process starts, its next instant is a multiple of the period, and never under half a period
    # away (two actions in one instant) nor over one and a half.
    for now in (100.0, 100.2, 100.5, 100.7, 100.99):
        due = aligned_instant(now, 1.0)
        assert due == round(due) and 0.5 <= due - now <= 1.5, (now, due)
    assert aligned_instant(12.3, 5.0) == 15.0
    assert aligned_instant(13.0, 5.0) == 20.0  # 2 s away is under half the period
