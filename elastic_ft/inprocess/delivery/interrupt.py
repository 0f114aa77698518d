"""Raising a restart in the main thread from another thread: the interrupt signal and scheduled exceptions.

A restart reaches a main thread in one of two ways. The interrupt signal
(:class:`InterruptSignal`) breaks it out of a blocking call (``time.sleep``,
a lock wait) and raises at once; an exception scheduled with
``PyThreadState_SetAsyncExc`` is raised at its next bytecode instruction,
but not before a blocking call returns. The monitor thread
(:mod:`elastic_ft.inprocess.delivery.watcher`) uses both. NVIDIA's names
for the helpers (``async_raise``, ``reraise_if_unraisable``, ...) are
re-exported by :mod:`elastic_ft.inprocess.monitor_thread`.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from elastic_ft.etcd import shield
from elastic_ft.inprocess.exception import RankShouldRestart, RestartDelivery

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
_set_async_exc.restype = ctypes.c_int

# The same C function, declared so that None is passed as NULL: "clear the pending exception".
_clear_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)


def _main_thread_ident() -> int:
    ident = threading.main_thread().ident
    if ident is None:  # only before the interpreter started its main thread
        raise RuntimeError("the main thread has no identifier")
    return ident


def raise_in_main_thread(exc_type: type[BaseException]) -> None:
    """Make the main thread raise ``exc_type`` at its next bytecode instruction."""
    if _set_async_exc(_main_thread_ident(), exc_type) != 1:
        raise RuntimeError("could not schedule an asynchronous exception in the main thread")


class _Withdrawn(BaseException):
    """Scheduled in place of a withdrawn exception and caught at once (:func:`clear_main_thread_pending_exception`)."""


def clear_main_thread_pending_exception() -> None:
    """Drop an asynchronous exception scheduled for the main thread but not yet raised.

    Clearing it (``PyThreadState_SetAsyncExc`` with NULL) is not enough on
    CPython 3.11: the interpreter keeps its "asynchronous exception pending"
    flag set until one is raised, and while a profiler or a tracer is active
    (cProfile, coverage, a debugger, ``torch.profiler`` with stacks) the
    next Python function call then loops forever at its entry. So, called
    from the main thread, a :class:`_Withdrawn` takes the dropped
    exception's place and is raised and caught here, which lowers the flag
    on every version. Only the main thread can do that, so only it may call this.
    """
    ident = _main_thread_ident()
    if threading.get_ident() != ident:
        raise RuntimeError("clear_main_thread_pending_exception must be called from the main thread")
    try:
        _set_async_exc(ident, _Withdrawn)  # replaces the pending one, if any
        while True:  # the interpreter checks for it at the loop's jump back
            pass
    except _Withdrawn:
        return
    except BaseException:
        # Something else was raised first (a signal handler's restart): withdraw ours, raise that.
        _clear_async_exc(ident, None)
        raise


def async_raise(tid: int, exc_type: type[BaseException], event: threading.Event | None = None) -> None:
    """Make thread ``tid`` raise ``exc_type`` at its next bytecode instruction (after ``event`` is set, if given).

    Raises:
        RuntimeError: no thread ``tid``, or more than one thread state
            matched (the request is then withdrawn).
    """
    if event is not None:
        event.wait()
    if sys.is_finalizing():
        return
    matched = _set_async_exc(tid, exc_type)
    if matched == 0:
        raise RuntimeError(f"async_raise: no thread with identifier {tid}")
    if matched > 1:
        _clear_async_exc(tid, None)
        raise RuntimeError(f"async_raise: {matched} thread states matched {tid}; withdrawn")


def delayed_async_raise(tid: int, exc_type: type[BaseException]) -> None:
    """:func:`async_raise` from a helper thread, for callers that may not raise themselves (a hook of the interpreter).

    The helper raises only once this call returned: raised into the caller
    while ``Thread.start`` waits for the helper, it would land there instead.
    """
    started = threading.Event()
    helper = threading.Thread(target=async_raise, args=(tid, exc_type, started), name="elastic_ft-async-raise")
    helper.daemon = True
    helper.start()
    started.set()


@contextlib.contextmanager
def reraise_if_unraisable(exc_type: type[BaseException]) -> Iterator[None]:
    """While inside, an ``exc_type`` dropped as unraisable (raised in a ``__del__``) is raised again in the main thread.

    The interpreter only reports an exception raised in a finalizer; a
    restart delivered there would be lost. The previous
    ``sys.unraisablehook`` still runs first.
    """
    previous = sys.unraisablehook

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        previous(unraisable)
        if issubclass(unraisable.exc_type, exc_type) and not sys.is_finalizing():
            delayed_async_raise(_main_thread_ident(), exc_type)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def async_abort_main_thread(msg: str | None = None) -> None:
    """Interrupt the wrapped function from any thread: the main thread raises ``RankShouldRestart(msg)``."""
    exc_type: type[BaseException] = RankShouldRestart
    if msg is not None:
        text = str(msg)

        class _RankShouldRestartWithMessage(RankShouldRestart):
            def __init__(self) -> None:
                super().__init__(text)

        _RankShouldRestartWithMessage.__name__ = _RankShouldRestartWithMessage.__qualname__ = "RankShouldRestart"
        exc_type = _RankShouldRestartWithMessage
    async_raise(_main_thread_ident(), exc_type)


def _in_finalizer(frame: FrameType | None) -> bool:
    """True when ``frame`` runs inside an object's ``__del__``."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


class InterruptSignal:
    """A signal whose handler raises the armed restart in the main thread.

    Installed by the Wrapper (from the main thread) for the duration of a
    call. The monitor thread arms it with the iteration's
    :class:`~elastic_ft.inprocess.exception.RestartDelivery` when a restart
    starts, and disarms it once the main thread took it; unarmed, the
    handler passes the signal on to the handler it replaced, so an
    application's own use of the signal keeps working.
    """

    def __init__(self, signum: signal.Signals) -> None:
        self.signum = signum
        #: The restart being delivered (None: none).
        self.delivery: RestartDelivery | None = None
        self._previous: Callable[[int, FrameType | None], object] | int | None = None

    def install(self) -> None:
        self._previous = signal.signal(self.signum, self._handle)
        shield.set_deferred_raise(self._raise_deferred)

    def uninstall(self) -> None:
        shield.set_deferred_raise(None)
        signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)

    def arm(self, delivery: RestartDelivery) -> None:
        self.delivery = delivery

    def disarm(self) -> None:
        self.delivery = None

    def _due(self, frame: FrameType | None) -> type[RankShouldRestart] | None:
        """The exception to raise, if the armed restart waits to be raised and ``frame`` is a place to raise it:
        not inside a finalizer (a data loader's shutdown, say), where it would be dropped with the cleanup half
        done; the next signal comes soon."""
        delivery = self.delivery
        if delivery is None or delivery.delivered.is_set() or _in_finalizer(frame):
            return None
        return delivery.exception_type

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.delivery is not None:
            # Inside the etcd client the raise waits for the section's end (elastic_ft.etcd.shield).
            exception_type = self._due(frame)
            if exception_type is not None and not shield.active():
                clear_main_thread_pending_exception()  # this raise takes the place of the scheduled one
                raise exception_type()
            return
        if callable(self._previous):
            self._previous(signum, frame)

    def _raise_deferred(self) -> None:
        """At the end of a shielded section: raise the restart its signal found there, if it is still due."""
        exception_type = self._due(sys._getframe(1))
        if exception_type is not None:
            clear_main_thread_pending_exception()
            raise exception_type()

    def send(self) -> None:
        signal.pthread_kill(_main_thread_ident(), self.signum)
