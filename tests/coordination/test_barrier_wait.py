"""A barrier's wait on its watch (``_await_watch`` over the etcd store's ``KeyWatch``): the value the watch brings
ends it with no read; a watch that may have missed the key costs one read; a broken watch falls back to reading."""

from __future__ import annotations

import threading
import time

from elastic_ft.coordination.barriers import _await_watch
from elastic_ft.etcd.store import KeyWatch


class Looks:
    """A ``look`` that reads ``KeyWatch.must_read`` as the barrier does, counting the reads it makes."""

    def __init__(self, watch: KeyWatch, present_after: int | None = None) -> None:
        self.watch, self.reads, self.present_after = watch, 0, present_after

    def __call__(self) -> bool:
        if not self.watch.must_read():
            return False
        self.reads += 1
        return self.present_after is not None and self.reads >= self.present_after


def test_the_watchs_value_ends_the_wait_without_a_read() -> None:
    watch = KeyWatch()
    look = Looks(watch)
    threading.Timer(0.2, watch.saw, args=(b"result",)).start()
    started = time.monotonic()
    assert _await_watch(watch, look, 5.0) == (True, b"result")
    assert look.reads == 0 and time.monotonic() - started < 1.0


def test_a_watch_that_may_have_missed_the_key_costs_one_read_not_a_poll() -> None:
    watch = KeyWatch()
    watch.missed_maybe()  # created after etcd's revision moved past the caller's read
    look = Looks(watch)
    threading.Timer(0.5, watch.saw, args=(b"late",)).start()
    assert _await_watch(watch, look, 5.0) == (True, b"late")
    assert look.reads == 1  # polling every 50 ms slice would have read about 10 times


def test_a_read_that_finds_the_key_ends_the_wait() -> None:
    watch = KeyWatch()
    watch.missed_maybe()
    look = Looks(watch, present_after=1)
    assert _await_watch(watch, look, 5.0) == (True, None)


def test_a_broken_watch_falls_back_to_reading_every_slice_and_the_limit_holds() -> None:
    watch = KeyWatch()
    watch.lost()
    look = Looks(watch)
    started = time.monotonic()
    assert _await_watch(watch, look, 0.5) == (False, None)
    assert 0.45 < time.monotonic() - started < 2.0
    assert 5 <= look.reads <= 12  # one read per 50 ms slice
    look = Looks(watch, present_after=3)
    assert _await_watch(watch, look, 5.0) == (True, None) and look.reads == 3
