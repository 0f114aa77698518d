"""A rank counted out again soon after it rejoined backs off before it registers (``Joining``)."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from elastic_ft.coordination.job import job_store
from elastic_ft.inprocess.restart import joining as joining_module
from elastic_ft.inprocess.restart.joining import REJOIN_BACKOFF_CAP, REJOIN_BACKOFF_FIRST, REJOIN_QUIET, Joining
from elastic_ft.inprocess.restart.phases import RecoveryClock


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(joining_module.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(joining_module, "pause", clock.pause)
    return clock


def _joining() -> Joining:
    base = dist.HashStore()
    monitor = None  # not used by the back-off
    return Joining(job_store(base), base, None, 0, monitor, RecoveryClock(), datetime.timedelta(seconds=5))  # type: ignore[arg-type]


def test_rejoins_in_quick_succession_back_off_up_to_the_cap_and_start_over_after_a_quiet_spell(clock: _Clock) -> None:
    joining = _joining()
    joining._pause_if_rejoined_lately(6)
    assert clock.pauses == []  # the first rejoin registers at once
    for _ in range(6):
        clock.now += 1.0  # counted out again a second later: its link to the peers is still down
        joining._pause_if_rejoined_lately(7)
    ceilings = [min(REJOIN_BACKOFF_CAP, REJOIN_BACKOFF_FIRST * 2**n) for n in range(6)]
    assert all(ceiling / 2 <= pause <= ceiling for pause, ceiling in zip(clock.pauses, ceilings, strict=True))
    assert max(clock.pauses) <= REJOIN_BACKOFF_CAP
    clock.now += REJOIN_QUIET + 1.0  # trained a while in between: the next rejoin is a new story
    joining._pause_if_rejoined_lately(8)
    assert len(clock.pauses) == 6
    clock.now += 1.0
    joining._pause_if_rejoined_lately(9)
    assert REJOIN_BACKOFF_FIRST / 2 <= clock.pauses[-1] <= REJOIN_BACKOFF_FIRST
