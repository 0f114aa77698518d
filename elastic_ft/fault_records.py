"""The records the Wrapper keeps in its store about faults and liveness, and their one codec.

Written by the Wrapper and its monitor process, read by them and by
``elastic-ft status`` (node side, no torch). Everything read is untrusted:
the parsers are total and return only well-formed, finite records, so one
corrupt or forged value never stops a restart or the status view.

* An **interruption** (one JSON object per line under ``interruptions``):
  which rank stopped the iteration, what kind of fault, a message, when.
* A **heartbeat** (``heartbeat/<initial rank>``): when it was sent and when
  the rank was last active (wall clock).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

#: The longest message kept in an interruption record.
MESSAGE_LIMIT = 500


@dataclass(frozen=True)
class Interruption:
    rank: int
    kind: str
    message: str
    time: float | None


def encode_interruption(rank: int, kind: str, message: str, at: float) -> str:
    """One line (newline included) to append under ``interruptions``."""
    return json.dumps({"rank": rank, "kind": kind, "message": message[:MESSAGE_LIMIT], "time": at}) + "\n"


def parse_interruption(line: str) -> Interruption | None:
    """The record on ``line``; None unless it is one (a rank >= 0, a kind, a finite time if any)."""
    try:
        record = json.loads(line)
        rank, kind = record["rank"], record["kind"]
        at = record.get("time")
        message = record.get("message", "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 or not isinstance(kind, str):
        return None
    if not isinstance(message, str):
        return None
    if at is not None and (isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at)):
        return None
    return Interruption(rank, kind, message[:MESSAGE_LIMIT], None if at is None else float(at))


def parse_interruptions(text: str) -> tuple[list[Interruption], list[str]]:
    """The well-formed records of ``text``, and the lines that were not (for a warning)."""
    records, malformed = [], []
    for line in text.splitlines():
        if not line:
            continue
        record = parse_interruption(line)
        if record is None:
            malformed.append(line)
        else:
            records.append(record)
    return records, malformed


def interruption_dict(record: Interruption) -> dict[str, object]:
    return asdict(record)


@dataclass(frozen=True)
class FaultGroup:
    """Interruptions of one kind whose messages differ only in numbers (ports, addresses, pids, ranks)."""

    kind: str
    message: str  # the first one's
    ranks: tuple[int, ...]
    time: float | None

    def describe(self) -> str:
        ranks = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {list(self.ranks)}"
        return f"{self.kind} on {ranks}: {self.message}" if self.message else f"{self.kind} on {ranks}"


#: The kind of a rank's exception that only says a peer went away (its collective's connection
#: broke): the consequence of another rank's fault, reported after the fault itself.
PEER_LOST = "peer_lost"
_PEER_LOST_TEXT = re.compile(
    r"gloo/transport|Connection (closed|reset) by peer|Broken pipe|Socket closed|NCCL communicator was aborted"
)


def fault_kind(error: BaseException) -> str:
    """An exception's fault kind: :data:`PEER_LOST` for a broken collective connection, else its type's name."""
    if isinstance(error, (RuntimeError, OSError)) and _PEER_LOST_TEXT.search(str(error)):
        return PEER_LOST
    return type(error).__name__


_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


def group_faults(records: Iterable[Interruption]) -> list[FaultGroup]:
    """The records grouped by kind and message (numbers masked): causes first, earliest first.

    A fault seen by many ranks (one peer's death breaks every rank's
    collective) is then reported once, with the ranks that saw it, and a
    fault recorded twice for one rank once; broken
    connections (:data:`PEER_LOST`) come after the faults that caused them.
    """
    # One rank's fault recorded twice (its monitor process and its agent both report a dead
    # process): once, with the more detailed message, at the earlier time.
    by_rank: dict[tuple[int, str], Interruption] = {}
    for record in records:
        seen = by_rank.get((record.rank, record.kind))
        if seen is not None:
            times = [t for t in (seen.time, record.time) if t is not None]
            message = max(seen.message, record.message, key=len)
            record = Interruption(record.rank, record.kind, message, min(times) if times else None)
        by_rank[(record.rank, record.kind)] = record
    groups: dict[tuple[str, str], list[Interruption]] = {}
    for record in by_rank.values():
        # Broken connections differ in wording (closed, reset, read error): one group, whatever the text.
        text = "" if record.kind == PEER_LOST else _NUMBERS.sub("N", record.message)
        groups.setdefault((record.kind, text), []).append(record)
    found = []
    for members in groups.values():
        times = [r.time for r in members if r.time is not None]
        ranks = tuple(sorted({r.rank for r in members}))
        found.append(FaultGroup(members[0].kind, members[0].message, ranks, min(times) if times else None))
    return sorted(found, key=lambda g: (g.kind == PEER_LOST, g.time is None, g.time or 0.0, g.ranks))


def restart_reporter(world_size: int, terminated: Iterable[int]) -> int | None:
    """The rank that reports an iteration's restart: the lowest one still in the job (None if none is).

    Every rank computes it alike, so the restart is logged and recorded
    once instead of once per rank.
    """
    gone = set(terminated)
    return next((rank for rank in range(world_size) if rank not in gone), None)


def encode_heartbeat(sent_at: float, active_at: float) -> str:
    return json.dumps({"t": sent_at, "active": active_at})


def parse_heartbeat(text: str) -> tuple[float, float] | None:
    """(sent at, last active at), both finite; None for anything else."""
    try:
        record = json.loads(text)
        values = (record["t"], record["active"])
    except (ValueError, KeyError, TypeError):
        return None
    if any(isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in values):
        return None
    return float(values[0]), float(values[1])
