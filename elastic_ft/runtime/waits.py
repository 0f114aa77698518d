"""Waiting, one way: the package's pause, its polling loop, and its backoff between tries.

A thread that another thread can wake waits on a ``threading.Condition`` or
``Event``. What is left comes here:

* :func:`poll`: a wait for something no event announces (a key in a store
  without a watch, a process's exit, a flag another process writes in shared
  memory): a predicate called with a pause that grows up to a named interval,
  until it holds or the deadline passes;
* :class:`Backoff`: the pauses between tries of a call that failed because
  its peer was away (etcd), doubling and jittered, with :meth:`Backoff.pause`;
* :func:`aligned_instant`: when a periodic action of many processes is
  next due, the same instants on every host's wall clock, so that a node's
  relay carries its host's actions of one instant in one request;
* :func:`pause`: the one sleep. The main thread of a rank waits in it, in
  short slices, wherever the Wrapper's restart must reach it: a restart is
  raised asynchronously, and raised inside a lock-based wait
  (``Event.wait``) it can leave the lock held; a sleep holds none.

Nothing here imports the rest of the package.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

#: The first pause of a poll, and the default longest one.
POLL_FIRST = 0.0005
POLL_MAX = 0.02

#: The first pause of a backoff, and the longest: a caller is back within about a second of its peer's return.
BACKOFF_FIRST = 0.05
BACKOFF_CAP = 1.0


def aligned_instant(now: float, period: float) -> float:
    """The next multiple of ``period`` on the wall clock, between half a period and one and a half after ``now``.

    Processes that schedule a periodic action by it (the monitors' heartbeats, the ranks' progress samples) act
    at the same instants, within their loops' periods, wherever they started; the half period of margin keeps
    two actions from landing in one instant.
    """
    return math.floor(now / period + 1.5) * period


def pause(seconds: float) -> None:
    """Sleep ``seconds`` (nothing for ``seconds <= 0``): the package's one sleep, interruptible by a signal's
    handler and by an asynchronous exception at its end, holding no lock."""
    if seconds > 0:
        time.sleep(seconds)


def poll(
    predicate: Callable[[], bool],
    timeout: float | None,
    interval_max: float = POLL_MAX,
    interval_first: float = POLL_FIRST,
) -> bool:
    """Call ``predicate`` with a pause that doubles from ``interval_first`` to ``interval_max`` until it is true;
    False once ``timeout`` seconds passed (``None``: no deadline, for a wait something else ends: a restart, a
    process's death)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    interval = min(interval_first, interval_max)
    while not predicate():
        if deadline is None:
            pause(interval)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            pause(min(interval, left))
        interval = min(interval * 2, interval_max)
    return True


class Backoff:
    """Pauses that double from ``first`` up to ``cap``, each drawn from its upper half ("equal jitter").

    The jitter spreads the retries of many processes that lost their peer at
    the same moment, so that its return is not met by all of them at once;
    the fixed half keeps a retry from coming at once after a failure.
    """

    def __init__(
        self, first: float = BACKOFF_FIRST, cap: float = BACKOFF_CAP, rng: random.Random | None = None
    ) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"Backoff needs 0 < first <= cap, got first={first}, cap={cap}")
        self.first, self.cap = first, cap
        self._ceiling = first
        self._rng = rng or random.Random()

    def next(self) -> float:
        """The next pause, in seconds."""
        ceiling = self._ceiling
        self._ceiling = min(self.cap, ceiling * 2)
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)

    def pause(self, limit: float | None = None) -> None:
        """Pause for the next pause, no longer than ``limit`` seconds (a caller's deadline)."""
        pause(self.next() if limit is None else min(self.next(), limit))

    def reset(self) -> None:
        self._ceiling = self.first
