"""Keep an interrupted iteration's gloo process groups alive for good, so that no restart waits in their destructor.

Freeing a gloo process group joins its worker threads. A thread still
inside a collective of the interrupted iteration normally fails at once on
the released connections (:mod:`elastic_ft.inprocess.sockets`), but gloo
has a race in which an operation posted as its peer's connection closes
waits for the group's timeout (30 minutes by default) with no socket left.
The destructor then blocks in ``std::thread::join``, and, since the last
reference usually goes with the failed iteration's frames (DDP's reducer,
a traceback) on the main thread, it blocks holding the GIL: no other
thread of the rank runs, the restart never reaches it, and the rank is lost
(seen about once in 40 restarts of the DDP + AdamW example).

So the groups an iteration used are never freed once it is interrupted:
:class:`ProcessGroupKeeper` notes every registered group while the
iteration runs (the progress watchdog's thread calls :meth:`observe` every
round; a group is only read, never used), and at a restart takes one
reference to each gloo group that the interpreter never gives back, not
even at exit. What stays behind per restart is the group's threads, its
shut-down sockets and a few small buffers. Groups of an iteration that
completes are forgotten and freed as usual; other backends (NCCL, which is
aborted) are freed as usual.
"""

from __future__ import annotations

import ctypes
import threading

import torch
import torch.distributed as dist

from elastic_ft.inprocess.logs import get_logger

log = get_logger("process_groups")


def _registered_groups() -> list[object]:
    if not dist.is_available():
        return []
    return list(dist.distributed_c10d._world.pg_map)


def _uses_gloo(group: object) -> bool:
    if isinstance(group, getattr(dist, "ProcessGroupGloo", ())):
        return True  # a backend used directly (the healing transfers' groups)
    try:
        backend = group._get_backend(torch.device("cpu"))  # type: ignore[attr-defined]
    except (RuntimeError, AttributeError, ValueError):
        return False
    return isinstance(backend, getattr(dist, "ProcessGroupGloo", ()))


class ProcessGroupKeeper:
    """The process groups seen during the current iteration; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[int, object] = {}
        self._kept: set[int] = set()

    def observe(self) -> None:
        """Note the groups registered now (cheap: one dict copy)."""
        groups = _registered_groups()
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
        """The iteration was interrupted: keep its gloo groups forever; returns how many were newly kept."""
        self.observe()
        with self._lock:
            seen, self._seen = self._seen, {}
            kept = 0
            for key, group in seen.items():
                if key in self._kept or not _uses_gloo(group):
                    continue
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never released: never destroyed
                self._kept.add(key)  # an object that never dies never lends its id to another
                kept += 1
        if kept:
            log.debug("kept %d gloo process group(s) of the interrupted iteration", kept)
        return kept

    def forget(self) -> None:
        """The iteration completed: its groups are freed as usual."""
        with self._lock:
            self._seen.clear()
