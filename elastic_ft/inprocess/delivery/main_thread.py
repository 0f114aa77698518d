"""What the main thread does, seen from another thread: whether it executes bytecode, and where it is.

A :class:`MainThreadProbe` asks the interpreter, through
``Py_AddPendingCall``, to have the main thread post a semaphore: the
interpreter runs pending calls only between bytecode instructions of the
main thread, so an unanswered probe means the main thread is stuck in C
code. The pending call is libc's ``sem_post``, not a Python callback: an
asynchronous restart exception delivered inside a Python callback would be
swallowed by ctypes. A probe is never freed, since a pending call may still
point to it.
"""

from __future__ import annotations

import ctypes
import sys
import threading

_libc = ctypes.CDLL(None, use_errno=True)
_SEM_T_SIZE = 64  # larger than sem_t on every Linux ABI

_add_pending_call = ctypes.pythonapi.Py_AddPendingCall
_add_pending_call.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
_add_pending_call.restype = ctypes.c_int
# The pending call is libc's sem_post itself: it returns 0 and runs no Python code,
# so an asynchronous exception can never be raised inside it and lost.
_SEM_POST = ctypes.cast(_libc.sem_post, ctypes.c_void_p)


class MainThreadProbe:
    """A semaphore that the main thread posts, via a pending call, when it executes bytecode."""

    def __init__(self) -> None:
        self._semaphore = ctypes.create_string_buffer(_SEM_T_SIZE)
        if _libc.sem_init(self._semaphore, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self.pending = False

    def schedule(self) -> bool:
        self.pending = _add_pending_call(_SEM_POST, ctypes.addressof(self._semaphore)) == 0
        return self.pending

    def answered(self) -> bool:
        """True once the scheduled call ran; consumes the answer."""
        if self.pending and _libc.sem_trywait(self._semaphore) == 0:
            self.pending = False
        return not self.pending


_probe: MainThreadProbe | None = None


def main_thread_probe() -> MainThreadProbe:
    """The process's one probe; never freed, since a pending call may still point to it."""
    global _probe
    if _probe is None:
        _probe = MainThreadProbe()
    return _probe


#: Probes of their own (:func:`separate_probe`), kept for the same reason.
_separate: list[MainThreadProbe] = []


def separate_probe() -> MainThreadProbe:
    """A probe of its own, for a watchdog that must not take the answers of the process's one probe (the
    Wrapper's heartbeat); never freed either."""
    probe = MainThreadProbe()
    _separate.append(probe)
    return probe


def main_thread_stack(limit: int = 8) -> str:
    """Where the main thread is, innermost call last (read from another thread; for logs)."""
    ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    frames: list[str] = []
    while frame is not None and len(frames) < limit:
        frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(frames) or "unknown"


#: Modules whose frames on the main thread's stack mean it waits for other ranks: a collective, DDP's
#: backward (its all-reduces), a process group being built.
_COLLECTIVE_MODULES = ("torch.distributed", "torch.nn.parallel", "torch.autograd")


def main_thread_waits_for_peers() -> bool:
    """Whether the main thread blocks in a collective, DDP's backward or a process group's set-up.

    Read from another thread while the main thread is blocked in C code:
    its innermost Python frame made the call that blocks (a ``time.sleep``
    in a model's ``forward`` under DDP is the user's frame, not DDP's).
    """
    ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    return isinstance(module, str) and module.startswith(_COLLECTIVE_MODULES)
