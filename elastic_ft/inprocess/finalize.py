"""Finalize: bring a rank back to a restartable state after a fault.

Runs on every surviving rank after the wrapped function unwound and
``abort`` ran, before the health check: release global state, wait for
asynchronous work the function left behind. An exception from it makes this
rank leave the job (the Wrapper re-raises it there); the other ranks restart
without it.
"""

from __future__ import annotations

import abc
import datetime
import threading
from collections.abc import Callable
from typing import Any

from elastic_ft.inprocess.exception import TimeoutError
from elastic_ft.inprocess.state import State


class Finalize(abc.ABC):
    """Base class of the ``finalize`` argument; compose several with :class:`elastic_ft.Compose`."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Clean up after a fault; return ``state`` unchanged, raise if this rank cannot go on."""


class ThreadedFinalize(Finalize):
    """Run ``fn(*args, **kwargs)`` in a thread; raise if it takes longer than ``timeout`` or raises.

    For cleanup that may block (joining an asynchronous checkpoint writer,
    draining a queue): a cleanup that never returns then makes this rank
    leave the job after ``timeout`` instead of stalling the restart of
    every rank.

    Raises:
        TimeoutError: ``fn`` still ran after ``timeout`` (the thread is a
            daemon and is left behind).
        Exception: what ``fn`` raised, re-raised.
    """

    def __init__(
        self,
        timeout: datetime.timedelta,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | None = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(timeout, datetime.timedelta) or timeout <= datetime.timedelta(0):
            raise ValueError(f"ThreadedFinalize timeout must be a positive datetime.timedelta, got {timeout!r}")
        if not callable(fn):
            raise TypeError(f"ThreadedFinalize fn must be callable, got {fn!r}")
        self.timeout = timeout
        self.fn = fn
        self.args = tuple(args or ())
        self.kwargs = dict(kwargs or {})

    def __call__(self, state: State) -> State:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.fn(*self.args, **self.kwargs)
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                errors.append(error)

        worker = threading.Thread(
            target=run, name=f"{type(self).__name__}-{getattr(self.fn, '__name__', 'fn')}", daemon=True
        )
        worker.start()
        worker.join(self.timeout.total_seconds())
        if worker.is_alive():
            raise TimeoutError(f"finalize {self.fn!r} did not return within {self.timeout.total_seconds():g} s")
        if errors:
            raise errors[0]
        return state
