"""Free an interrupted iteration's gloo process groups safely: one restart later, and never holding the GIL.

Freeing a gloo process group joins its worker threads. A thread still
inside a collective of the interrupted iteration normally fails at once on
the released connections (:mod:`elastic_ft.inprocess.delivery.connections`), but a
send gloo was writing when its connection failed waits for the group's
timeout (30 minutes by default) with no socket left (gloo fails every
other operation of the connection, not that one); the destructor then
waits that long in ``std::thread::join``.

torch's Python binding of a process group releases the GIL around that
destructor when the *Python* object drops the last reference. The danger is
another last holder: DDP's reducer (a C++ object whose destructor keeps the
GIL) or a frame of the failed function freed on the main thread. A
destructor that blocks there blocks the whole rank, and the restart never
reaches it (seen about once in 40 restarts of the DDP + AdamW example when
groups were freed as usual).

So :class:`ProcessGroupKeeper` notes every registered group while the
iteration runs (the progress watchdog's thread calls :meth:`observe` every
round; a group is only read, never used), and when the iteration is
interrupted it takes a reference to each gloo group (:meth:`retire`). Then
no frame, reducer or registry ever holds the last reference: the keeper
does. At the next restart, after the collector has freed the failed
iteration's frames and everything the function left in reference cycles,
:meth:`release` drops the references taken one restart earlier on a helper
thread, where the destructor runs without the GIL: a group whose worker
thread is stuck in the race only holds that thread until gloo's timeout,
while the rank goes on. Holding one restart's groups longer than needed
covers a DDP model kept across one iteration. A rank therefore holds at
most two iterations' groups (threads, sockets, buffers), whatever the
number of restarts. When the call ends, the groups still held are never
freed (:meth:`ProcessGroupKeeper.keep_until_exit`): a destructor running
while the interpreter exits aborts the process. Groups of an iteration
that completes are freed as usual; other backends (NCCL, which is
aborted) are freed as usual.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time

import torch
import torch.distributed as dist

from elastic_ft.inprocess.restart.logs import get_logger
from elastic_ft.runtime.torch_compat import forget_group_numbers, group_backend, registered_groups

log = get_logger("process_groups")

#: A helper thread still freeing groups after this long is reported: a gloo worker thread waits out its timeout.
_SLOW_RELEASE = 5.0
#: How long the end of a call waits for the helpers still freeing groups.
_EXIT_WAIT = 5.0


def _uses_gloo(group: object) -> bool:
    if isinstance(group, getattr(dist, "ProcessGroupGloo", ())):
        return True  # a backend used directly (the healing transfers' groups)
    try:
        backend = group_backend(group, torch.device("cpu"))
    except (RuntimeError, AttributeError, ValueError):
        return False
    return isinstance(backend, getattr(dist, "ProcessGroupGloo", ()))


def _free(groups: list[object], done: threading.Event) -> None:
    """Drop the last references to ``groups`` (on a helper thread: their destructors release the GIL)."""
    groups.clear()
    done.set()


class ProcessGroupKeeper:
    """The process groups of the current iteration, and those of interrupted ones until they are freed.

    See the module docstring.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[int, object] = {}
        #: Gloo groups of the last interrupted iteration, freed at the next restart.
        self._retired: dict[int, object] = {}
        #: Gloo groups retired before the last restart: freed by the next :meth:`release`.
        self._due: list[object] = []
        self._releases: list[_Release] = []

    def observe(self) -> None:
        """Note the groups registered now (cheap: one dict copy)."""
        groups = registered_groups()
        with self._lock:
            for group in groups:
                self._seen.setdefault(id(group), group)

    def track(self, group: object) -> None:
        """Note a group the process group registry does not know (one created directly from a backend)."""
        with self._lock:
            self._seen.setdefault(id(group), group)

    def untrack(self, group: object) -> None:
        """``group`` finished its work: it may be freed as usual."""
        with self._lock:
            if self._seen.get(id(group)) is group:
                del self._seen[id(group)]

    def retire(self) -> int:
        """The iteration was interrupted: hold its gloo groups until a later :meth:`release`; returns how many.

        Idempotent within one restart (the monitor thread and the main thread
        both call it).
        """
        self.observe()
        with self._lock:
            seen, self._seen = self._seen, {}
            kept = 0
            for key, group in seen.items():
                if key not in self._retired and _uses_gloo(group):
                    self._retired[key] = group
                    kept += 1
        if kept:
            log.debug("holding %d gloo process group(s) of the interrupted iteration", kept)
        return kept

    def release(self) -> None:
        """A restart, after the collector ran: free the groups retired one restart ago (see the module docstring).

        The groups retired in this restart become due for the next one.
        """
        with self._lock:
            due, self._due = self._due, list(self._retired.values())
            self._retired = {}
        self._free(due)

    def keep_until_exit(self) -> None:
        """The call ends: never free the groups still held, and let the helpers freeing earlier ones finish.

        The process usually exits next. A destructor running on a helper
        thread while the interpreter exits aborts the process ("terminate
        called without an active exception"), and one run by the
        interpreter's own clean-up could block the exit; so the groups still
        held (at most two iterations') get a reference the interpreter
        never gives back, and the helpers already started get a bounded
        wait.
        """
        with self._lock:
            held = [*self._due, *self._retired.values()]
            self._due, self._retired = [], {}
        for group in held:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
        deadline = time.monotonic() + _EXIT_WAIT
        for release in self._releases:
            release.done.wait(max(0.0, deadline - time.monotonic()))
        self._report_slow_releases()

    def unregister(self) -> None:
        """The function unwound from an interrupted iteration: destroy the process groups it left registered, and
        forget the number an ``init_process_group`` interrupted before it registered its group took.

        The Wrapper's own step, whatever ``abort`` the user gave: the next
        iteration's ``init_process_group`` starts from an empty registry. The
        gloo groups retired stay held here until a later :meth:`release`.
        """
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        forget_group_numbers()

    def forget(self) -> None:
        """The iteration completed: its groups are freed as usual."""
        with self._lock:
            self._seen.clear()

    @property
    def held(self) -> int:
        """Gloo groups this keeper holds now (retired, not yet freed)."""
        with self._lock:
            return len(self._retired) + len(self._due)

    def _free(self, groups: list[object]) -> None:
        self._report_slow_releases()
        if not groups:
            return
        done = threading.Event()
        helper = threading.Thread(target=_free, args=(groups, done), name="elastic_ft-free-groups", daemon=True)
        helper.start()
        self._releases.append(_Release(done, time.monotonic()))

    def _report_slow_releases(self) -> None:
        """Forget finished helpers; warn once about each one still in a destructor (a gloo thread in the race)."""
        now = time.monotonic()
        running = [release for release in self._releases if not release.done.is_set()]
        for release in running:
            if not release.reported and now - release.started > _SLOW_RELEASE:
                release.reported = True
                log.warning(
                    "freeing an earlier iteration's process groups has taken %.0f s: a gloo worker thread waits out "
                    "its timeout (it holds that group's threads until then; the rank goes on)",
                    now - release.started,
                )
        self._releases = running


@dataclasses.dataclass
class _Release:
    done: threading.Event
    started: float
    reported: bool = False
