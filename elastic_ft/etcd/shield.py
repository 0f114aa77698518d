"""Sections of library code that an asynchronous restart must not cut: the etcd client's.

The Wrapper unwinds the wrapped function by raising ``RankShouldRestart``
in the main thread from a signal handler (or ``PyThreadState_SetAsyncExc``),
at whatever bytecode the thread runs. Raised right after a Python-level
lock was taken and before the ``with`` block that releases it is entered
(``threading.Condition.__enter__`` is Python code around the C acquire),
the exception leaves the lock held for good. In gRPC's call state or a
queue of the etcd client, that stops every later request or watch of the
process: seen as a spare rank that never saw its barrier complete
("termination_barrier: 6 of 6 ranks arrived"), its watch's create request
stuck behind a gRPC lock no thread would release.

Code between :func:`shield` enter and exit is never cut: the restart's
signal handler sees :func:`active` and returns without raising, and the
exit of the outermost section calls the hook the Wrapper installed
(:func:`set_deferred_raise`), which raises the restart there, at a point
that holds no lock. Only the main thread's depth counts (restarts are
raised only there). Long blocking waits inside a section (a store ``get``
on a key that never comes) wait in short shielded slices, so a restart
still ends them within one slice.

Torch-free and worker-free: the etcd adapter (both sides) imports it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])

_depth = 0  # the main thread's shielded sections, nested
_deferred_raise: Callable[[], None] | None = None


def active() -> bool:
    """The main thread is inside a shielded section (read by the restart's signal handler and monitor thread)."""
    return _depth > 0


def set_deferred_raise(hook: Callable[[], None] | None) -> None:
    """Install what the outermost section's exit calls: raises a restart the signal handler deferred (or not)."""
    global _deferred_raise
    _deferred_raise = hook


@contextmanager
def shield() -> Iterator[None]:
    """A section no asynchronous restart cuts (on the main thread; elsewhere a no-op)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        hook = _deferred_raise
        if _depth == 0 and hook is not None:
            hook()


def shielded(fn: F) -> F:
    """``fn`` runs as a shielded section (see :func:`shield`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with shield():
            return fn(*args, **kwargs)

    return cast(F, wrapper)
