"""The monitor thread: turns a fault recorded anywhere in the job into a restart here.

One thread per restart iteration polls the iteration's outcome in the
store. When some rank recorded an interruption, it waits ``last_call_wait``
so that concurrent faults on other ranks get recorded too, then, holding the
lock of ``CallWrapper.atomic()`` (so it never starts while the main thread is
inside an atomic block):

1. calls ``abort`` to unblock the main thread (by default it destroys the
   process groups, which makes collectives with this rank fail on the
   peers);
2. raises :class:`~elastic_ft.exception.RankShouldRestart` asynchronously
   in the main thread, and raises it again every ``interval`` until the
   main thread acknowledges it, in case the wrapped function swallowed it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from elastic_ft.exception import RankShouldRestart
from elastic_ft.inprocess_logging import get_logger
from elastic_ft.state import State
from elastic_ft.store import COMPLETED, StoreMixin

log = get_logger("monitor_thread")

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
_set_async_exc.restype = ctypes.c_int

# The same C function, declared so that None is passed as NULL: "clear the pending exception".
_clear_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)


def raise_in_main_thread(exc_type: type[BaseException]) -> None:
    """Make the main thread raise ``exc_type`` at its next bytecode instruction."""
    ident = threading.main_thread().ident
    assert ident is not None
    if _set_async_exc(ident, exc_type) != 1:
        raise RuntimeError("could not schedule an asynchronous exception in the main thread")


def clear_main_thread_pending_exception() -> None:
    """Drop an asynchronous exception scheduled for the main thread but not yet raised."""
    ident = threading.main_thread().ident
    assert ident is not None
    _clear_async_exc(ident, None)


class MonitorThread(threading.Thread):
    """Watches one restart iteration; see the module docstring.

    Args:
        store: the iteration's store view.
        state: this rank's state, handed to ``abort``.
        abort: callable unblocking the main thread, or ``None``.
        interval: seconds between two polls of the store, and between two
            raises of an unacknowledged restart.
        last_call_wait: seconds to wait for concurrent faults.
        atomic_lock: the lock of ``CallWrapper.atomic()``.
    """

    def __init__(
        self,
        store: StoreMixin,
        state: State,
        abort: Callable[[State], object] | None,
        interval: float,
        last_call_wait: float,
        atomic_lock: threading.RLock,
    ) -> None:
        super().__init__(name=f"elastic_ft-monitor-thread-{state.rank}", daemon=True)
        self.store = store
        self.state = state
        self.abort = abort
        self.interval = interval
        self.last_call_wait = last_call_wait
        self.atomic_lock = atomic_lock
        self._wake = threading.Event()
        self._stop_requested = threading.Event()
        self._acknowledged = threading.Event()
        self._raise_lock = threading.Lock()
        self.restart_started = threading.Event()

    def wake(self) -> None:
        """Poll now instead of at the end of the interval (a local fault was just recorded)."""
        self._wake.set()

    def run(self) -> None:
        try:
            while not self._stop_requested.is_set():
                self._wake.wait(self.interval)
                self._wake.clear()
                if self._stop_requested.is_set():
                    return
                outcome = self.store.outcome()
                if outcome == COMPLETED:
                    return
                if outcome is not None:
                    self._restart()
                    return
        except Exception:
            if not self._stop_requested.is_set():
                log.exception("rank %s: monitor thread failed", self.state.rank)

    def _restart(self) -> None:
        if self._stop_requested.wait(self.last_call_wait):
            return
        records = self.store.interruptions()
        log.info("rank %s: restarting after interruptions %s", self.state.rank, records)
        with self.atomic_lock:
            if self._stop_requested.is_set():
                return
            self.restart_started.set()
            if self.abort is not None:
                try:
                    self.abort(self.state)
                except Exception:
                    log.exception("rank %s: abort failed", self.state.rank)
            unacknowledged = False
            while True:
                with self._raise_lock:
                    if self._acknowledged.is_set() or self._stop_requested.is_set():
                        return
                    raise_in_main_thread(RankShouldRestart)
                if self._acknowledged.wait(self.interval):
                    return
                if not unacknowledged:
                    log.warning(
                        "rank %s: restart not acknowledged yet (main thread blocked in C code, or the wrapped "
                        "function swallowed RankShouldRestart); raising it again every %g s",
                        self.state.rank,
                        self.interval,
                    )
                unacknowledged = True

    def acknowledge(self) -> None:
        """Called by the main thread once it caught the restart exception."""
        self._close(self._acknowledged)

    def stop(self) -> None:
        """Stop watching: the iteration ended without a restart, or the rank leaves."""
        self._close(self._stop_requested)

    def _close(self, event: threading.Event) -> None:
        # A restart exception already scheduled may hit the main thread anywhere in
        # here; retry until the flag is set under the raise lock and nothing is pending.
        while True:
            try:
                with self._raise_lock:
                    event.set()
                    self._wake.set()
                    clear_main_thread_pending_exception()
                self.join()
                clear_main_thread_pending_exception()
                return
            except RankShouldRestart:
                continue
