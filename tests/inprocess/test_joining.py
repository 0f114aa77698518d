"""A rank counted out while it lived joins again (``Joining``): it backs off when that repeats soon, and a joiner
withdrawn while it waited joins again too."""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

from elastic_ft.coordination.job import WITHDRAWN, job_store
from elastic_ft.coordination.reports import report_node_gone
from elastic_ft.inprocess.exception import InternalError
from elastic_ft.inprocess.restart import joining as joining_module
from elastic_ft.inprocess.restart.joining import (
    REJOIN_BACKOFF_CAP,
    REJOIN_BACKOFF_FIRST,
    REJOIN_QUIET,
    Joining,
    Withdrawn,
)
from elastic_ft.inprocess.restart.phases import RecoveryClock
from elastic_ft.inprocess.state import State
from elastic_ft.keys import FTRUN_NEXT_RANK
from elastic_ft.runtime.local_board import LocalBoard


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


#: The Joining's barrier and heartbeat timeouts.
_TIMEOUTS = (datetime.timedelta(seconds=5), datetime.timedelta(seconds=30))


def _joining() -> Joining:
    base = dist.HashStore()
    monitor = None  # not used by the back-off
    return Joining(job_store(base), base, None, 0, monitor, RecoveryClock(), *_TIMEOUTS)  # type: ignore[arg-type]


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


class _MonitorProcess:
    """What ``Joining`` tells the monitor process of a new initial rank (the process itself is not needed)."""

    def __init__(self) -> None:
        self.initial_ranks: list[int] = []

    def take_initial_rank(self, initial_rank: int) -> None:
        self.initial_ranks.append(initial_rank)


def test_a_joiner_withdrawn_while_it_waited_is_told_so_and_joins_again_under_a_new_initial_rank(
    clock: _Clock,
) -> None:
    """A report that its node was lost withdraws a joiner that waits for its admission (its node was counted out
    again: cut off from its peers, not from etcd). The process lives: it is no failure, and it joins again as
    a rank counted out does. Raising there made the Wrapper give up, and its agent restart the whole job."""
    base = dist.HashStore()
    job = job_store(base)
    job.set_accepts_joiners()
    base.add(FTRUN_NEXT_RANK, 2)  # the round's counter drew initial ranks 8 and 9 (world 8) before
    board = LocalBoard.create(2, "joining-test")
    monitor = _MonitorProcess()
    joining = Joining(job, base, board, 1, monitor, RecoveryClock(), *_TIMEOUTS)  # type: ignore[arg-type]
    try:
        job.record_wrapped(9, os.getpid())
        job.register_joiner(9)
        assert report_node_gone(base, [9], 8, "node n1 died again") == [9]
        assert job.admission(9) == WITHDRAWN
        assert joining.await_admission(9, 8) == Withdrawn(9)
        new = joining.take_new_initial_rank(State(None, 8, initial_rank=9, initial_world_size=8))
        assert new == 10
        assert job.is_wrapped(10) and job.left(9) is not None and job.left(9)["kind"] == "rejoined"
        assert board.initial_rank(1) == 10 and monitor.initial_ranks == [10]
        assert clock.pauses == []  # its first rejoin: it registers at once
    finally:
        board.close(remove=True)


def test_a_withdrawn_joiner_that_cannot_join_again_fails_as_before() -> None:
    """Without an agent to admit it again (no node board: not under ``ftrun``), a withdrawn admission is an
    internal error, as it always was."""
    base = dist.HashStore()
    job = job_store(base)
    job.set_accepts_joiners()
    joining = Joining(job, base, None, 0, None, RecoveryClock(), *_TIMEOUTS)  # type: ignore[arg-type]
    job.record_wrapped(9, os.getpid())
    job.register_joiner(9)
    job.claim_admission(9, WITHDRAWN)
    with pytest.raises(InternalError, match="initial rank 9 was not admitted: its admission record is 'withdrawn'"):
        joining.await_admission(9, 8)
