"""Where a rank's recovery time goes: the moments of one restart, and the phases between them (pure).

The Wrapper marks each moment of a restart on the rank as it passes it
(:meth:`RecoveryClock.mark`); at the rank's first optimizer step in the new
iteration, the ``recovery_phases`` event carries when the recovery began and
each phase between two consecutive moments: its name, its seconds, and the
wall time it ended at. The restart's fault time is
the job's (``restart_decided``'s ``fault_time``): what lies before the first
moment here, the fault's detection and the decision, is measured from it.

The phases, in order (each ends at the moment of its name):

* ``delivered``: the monitor thread started the restart (connections
  released, ``abort`` called) -- from the fault record, this is the
  decision;
* ``unwound``: the main thread left the wrapped function;
* ``released``: the failed iteration's process groups and frames are freed
  (``abort`` again, a garbage collection, the groups retired a restart ago);
* ``finalized``: ``finalize`` and the health check ran;
* ``terminated``: the termination barrier completed (every rank, or a
  report in its place, arrived);
* ``assigned``: the rank assignment (and, for a rank that joins or rejoins,
  its admission);
* ``started``: the next iteration's records and its barrier;
* ``checked``: the ``initialize`` hook and the health check before the
  function;
* ``healed``: peer state healing (nothing to do on an up-to-date rank);
* ``first_step``: the user's set-up inside the function (its process group,
  model wrapping, data loader) up to its first optimizer step.

A process that joins the running world times its admission the same way,
from the moment a restart admitted it (``delivered``) to its first step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

#: The moments of a restart, in the order a rank passes them.
MOMENTS = (
    "delivered",
    "unwound",
    "released",
    "finalized",
    "terminated",
    "assigned",
    "started",
    "checked",
    "healed",
    "first_step",
)


class RecoveryClock:
    """The moments one restart has passed on this rank (wall times)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._marks: dict[str, float] = {}
        self._open = False

    def start(self, delivered_at: float | None = None) -> None:
        """A restart begins on this rank (``delivered_at``: when the monitor thread started it, if known)."""
        self._marks = {"delivered": self._clock() if delivered_at is None else delivered_at}
        self._open = True

    def mark(self, moment: str) -> None:
        """The rank passed ``moment`` (once per restart; later marks of a moment are ignored)."""
        if moment not in MOMENTS:
            raise ValueError(f"unknown recovery moment {moment!r}; expected one of {', '.join(MOMENTS)}")
        if self._open and moment not in self._marks:
            self._marks[moment] = self._clock()

    @property
    def open(self) -> bool:
        """A restart is being timed and has not reached its first step yet."""
        return self._open

    def finish(self) -> dict[str, object] | None:
        """At the first step of the new iteration: the event's fields (each moment's wall time, each phase's
        seconds), or None when no restart was being timed."""
        if not self._open:
            return None
        self.mark("first_step")
        self._open = False
        return phases(self._marks)


def phases(marks: dict[str, float]) -> dict[str, object]:
    """The event's fields: when the recovery began (``delivered``), each phase between two consecutive moments
    passed (in :data:`MOMENTS` order) with the wall time it ended at and its seconds, and the total."""
    passed = [(moment, marks[moment]) for moment in MOMENTS if moment in marks]
    return {
        "began": passed[0][1],
        "phases": [
            {"phase": later, "seconds": round(max(0.0, t1 - t0), 4), "at": t1}
            for (_, t0), (later, t1) in itertools.pairwise(passed)
        ],
        "total": round(passed[-1][1] - passed[0][1], 4),
    }
