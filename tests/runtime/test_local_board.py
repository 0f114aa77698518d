"""The local board: what the agent writes, a worker in another process reads, and the reverse."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ft.runtime.local_board import LOCAL_BOARD_ENV, LocalBoard


@pytest.fixture
def board():
    created = LocalBoard.create(3, "node/A 1")
    yield created
    created.close(remove=True)


def test_a_new_board_is_fenced_open_to_joiners_and_has_no_stall(board: LocalBoard) -> None:
    assert "/" not in Path(board.path).name and " " not in Path(board.path).name
    assert not board.fence_valid()
    assert board.generation() == 0
    assert board.may_join()
    assert board.stalled_for() is None


def test_the_fence_holds_until_its_time_and_carries_its_generation(board: LocalBoard) -> None:
    now = time.monotonic()
    board.set_fence(now + 5.0, 2)
    assert board.fence_valid(now) and board.fence_left(now) == pytest.approx(5.0)
    assert not board.fence_valid(now + 5.0)
    assert board.generation() == 2
    board.set_fence(0.0, 2)  # the lease is gone
    assert not board.fence_valid()


def test_the_longest_stall_of_any_rank_counts(board: LocalBoard) -> None:
    board.set_in_collective(0, 100.0)
    board.set_at_barrier(2, 98.5)
    assert board.stalled_for(now=101.0) == pytest.approx(2.5)
    board.clear_stalls(2)
    assert board.stalled_for(now=101.0) == pytest.approx(1.0)
    board.set_in_collective(0, None)
    assert board.stalled_for() is None


def test_a_rank_outside_the_board_is_refused_by_value(board: LocalBoard) -> None:
    with pytest.raises(ValueError, match="local rank 3 is outside the board's 3 ranks"):
        board.set_in_collective(3, 1.0)
    with pytest.raises(ValueError, match="local rank -1"):
        board.set_at_barrier(-1, 1.0)


@pytest.mark.parametrize("ranks", [0, -1, 4097])
def test_a_board_of_a_bad_size_is_refused(ranks: int) -> None:
    with pytest.raises(ValueError, match=f"got {ranks}"):
        LocalBoard.create(ranks, "x")


@pytest.mark.integration
def test_a_worker_process_sees_what_the_agent_writes_and_the_agent_sees_its_stall(board: LocalBoard) -> None:
    board.set_fence(time.monotonic() + 30.0, 4)
    board.set_may_join(False)
    code = (
        "import time\n"
        "from elastic_ft.runtime.local_board import LocalBoard\n"
        "b = LocalBoard.from_env()\n"
        "print(b.ranks, b.generation(), b.fence_valid(), b.may_join(), flush=True)\n"
        "b.set_in_collective(1, time.monotonic() - 7.0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **board.to_env()},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.split() == ["3", "4", "True", "False"]
    assert board.stalled_for() == pytest.approx(7.0, abs=1.0)


def test_no_variable_means_no_board_and_a_bad_one_is_named() -> None:
    assert LocalBoard.from_env({}) is None
    with pytest.raises(ValueError, match=f"{LOCAL_BOARD_ENV}='/nonexistent/board' cannot be opened"):
        LocalBoard.from_env({LOCAL_BOARD_ENV: "/nonexistent/board"})


def test_a_file_that_is_not_a_board_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd"
    path.write_bytes(b"\0" * 41)
    with pytest.raises(ValueError, match=r"is not a local board \(41 bytes\)"):
        LocalBoard.from_env({LOCAL_BOARD_ENV: str(path)})


def test_close_removes_the_file_only_when_asked(tmp_path: Path) -> None:
    board = LocalBoard.create(1, "x")
    board.close()
    assert os.path.exists(board.path)
    again = LocalBoard.from_env(board.to_env())
    assert again is not None and again.ranks == 1
    again.close(remove=True)
    assert not os.path.exists(board.path)
