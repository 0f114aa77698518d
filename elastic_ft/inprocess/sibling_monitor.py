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
    reachable_since: float | None = None,
) -> list[int]:
    """The ranks whose last heartbeat (or, if they have none, ``watching_since``) is older than ``timeout``.

    ``reachable_since``: the end of the store's last outage as this process
    saw it (etcd away): no heartbeat could get through before, so silence
    counts from then at the earliest.
    """

    def silent_since(beat: float | None) -> float:
        since = beat if beat is not None else watching_since
        return since if reachable_since is None else max(since, reachable_since)

    return sorted(rank for rank, beat in heartbeats.items() if now - silent_since(beat) > timeout)


def nobody_left(
    members: Collection[int],
    gone: Collection[int],
    heartbeats: Mapping[int, float | None],
    now: float,
    watching_since: float,
    timeout: float,
    reachable_since: float | None = None,
) -> str | None:
    """Why no member of the running world is left to restart it; None while one may be.

    A joiner waits for a restart that a live member of the world runs; when
    every member died or stopped at once, nobody runs it. ``members``: the
    world's initial ranks (the initial world and the joiners admitted into
    it); ``gone``: those recorded as gone (they left the job, or the
    iteration they were last in recorded them terminated); ``heartbeats``:
    the others' last heartbeats (as in :func:`silent_ranks`). The rest are
    live unless silent for ``timeout``, the bound after which a monitor
    reports a silent rank gone.
    """
    if not members:
        return None
    others = {rank: heartbeats.get(rank) for rank in members if rank not in gone}
    silent = silent_ranks(others, now, watching_since, timeout, reachable_since)
    if len(silent) < len(others):
        return None
    parts = [f"initial ranks {sorted(gone)} are gone"] if gone else []
    if silent:
        parts.append(f"initial ranks {silent} sent no heartbeat for {timeout:g} s")
    return " and ".join(parts)
