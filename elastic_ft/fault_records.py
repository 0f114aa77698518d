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
