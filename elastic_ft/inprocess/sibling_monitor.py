"""Detection of ranks whose whole host went silent, from store heartbeats.

Every monitor process writes a heartbeat for its initial rank into the job's
store every ``heartbeat_interval``. A process that dies is reported by its
own monitor process at once; heartbeats cover the case where the monitor
process is gone too (a lost node). To keep the store load flat, each monitor
reads only the heartbeat of its ring successor, and scans every rank only
once that successor looks silent, so that several silent neighbours are all
found by the one live rank before them.

The decisions are pure functions of the heartbeats read.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def ring_successor(initial_rank: int, initial_world_size: int, skip: Collection[int]) -> int | None:
    """The next initial rank after ``initial_rank`` (cyclically) not in ``skip``; ``None`` if none."""
    for step in range(1, initial_world_size):
        candidate = (initial_rank + step) % initial_world_size
        if candidate not in skip:
            return candidate
    return None


def silent_ranks(
    heartbeats: Mapping[int, float | None],
    now: float,
    watching_since: float,
    timeout: float,
) -> list[int]:
    """The ranks whose last heartbeat (or, if they have none, ``watching_since``) is older than ``timeout``."""
    return sorted(
        rank for rank, beat in heartbeats.items() if now - (beat if beat is not None else watching_since) > timeout
    )
