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

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from elastic_ft.untrusted import is_count, json_object

#: The longest message kept in an interruption record.
MESSAGE_LIMIT = 500
#: The longest traceback kept in an interruption record (its end: the innermost frames and the error).
TRACEBACK_LIMIT = 6000
#: The longest origin (``file:line in function``) kept.
ORIGIN_LIMIT = 500


@dataclass(frozen=True)
class Interruption:
    """Why a rank interrupted an iteration.

    ``step``: the optimizer steps the rank's state had taken (``CallWrapper.step``);
    ``origin`` and ``traceback``: where an exception was raised (the innermost
    frame, ``file:line in function``) and its formatted traceback; None for
    faults that are not exceptions (a dead process, a hang).
    """

    rank: int
    kind: str
    message: str
    time: float | None
    step: int | None = None
    origin: str | None = None
    traceback: str | None = None


def encode_interruption(
    rank: int,
    kind: str,
    message: str,
    at: float,
    *,
    step: int | None = None,
    origin: str | None = None,
    traceback: str | None = None,
) -> str:
    """One line (newline included) to append under ``interruptions``."""
    record: dict[str, object] = {"rank": rank, "kind": kind, "message": message[:MESSAGE_LIMIT], "time": at}
    if step is not None:
        record["step"] = step
    if origin is not None:
        record["origin"] = origin[:ORIGIN_LIMIT]
    if traceback is not None:
        record["traceback"] = traceback[-TRACEBACK_LIMIT:]
    return json.dumps(record) + "\n"


def parse_interruption(line: str) -> Interruption | None:
    """The record on ``line``; None unless it is one (a rank >= 0, a kind, a finite time if any, a step >= 0 if
    any, text origin and traceback if any)."""
    record = json_object(line)
    if record is None:
        return None
    try:
        rank, kind = record["rank"], record["kind"]
        at = record.get("time")
        message = record.get("message", "")
        step, origin, traceback = record.get("step"), record.get("origin"), record.get("traceback")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    if not is_count(rank) or not isinstance(kind, str):
        return None
    if not isinstance(message, str):
        return None
    if at is not None and (isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at)):
        return None
    if (step is not None and not is_count(step)) or any(
        value is not None and not isinstance(value, str) for value in (origin, traceback)
    ):
        return None
    return Interruption(
        rank,
        kind,
        message[:MESSAGE_LIMIT],
        None if at is None else float(at),
        step,
        None if origin is None else origin[:ORIGIN_LIMIT],
        None if traceback is None else traceback[-TRACEBACK_LIMIT:],
    )


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


@dataclass(frozen=True)
class FaultGroup:
    """Interruptions of one kind whose messages differ only in numbers (ports, addresses, pids, ranks)."""

    kind: str
    message: str  # the first one's
    ranks: tuple[int, ...]
    time: float | None
    #: The first member's traceback, for an exception.
    traceback: str | None = None

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
    """An exception's fault kind: :data:`PEER_LOST` for a broken collective connection, else its type's name.

    The exception's causes count too: an error raised ``from`` a broken
    connection (a peer-to-peer state transfer whose gloo group lost its
    peer) says only that a peer went away, like the connection's own error.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (RuntimeError, OSError)) and _PEER_LOST_TEXT.search(str(cause)):
            return PEER_LOST
        seen.add(id(cause))
        cause = cause.__cause__
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
            record = dataclasses.replace(
                seen if seen.traceback else record, message=message, time=min(times) if times else None
            )
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
        traceback = next((r.traceback for r in members if r.traceback), None)
        found.append(FaultGroup(members[0].kind, members[0].message, ranks, min(times) if times else None, traceback))
    return sorted(found, key=lambda g: (g.kind == PEER_LOST, g.time is None, g.time or 0.0, g.ranks))


#: Interruptions that ask for a restart without a fault: admitting joiners (``respawn.rejoin: at_once``).
NOT_FAULTS = ("admit_joiners",)


@dataclass(frozen=True)
class FaultHistory:
    """The faults of the iterations so far, as the give-up rule counts them (see :func:`next_history`).

    ``signature``: the last fault's cause when it was an exception (its type,
    where it was raised, and the step), else None; ``repeats``: how many
    iterations in a row ended on that same signature with no progress in
    between; ``stalled``: how many iterations in a row ended on a fault
    without progress (fewer than the Wrapper's ``min_progress_steps``
    steps). Published in every termination barrier's result, so
    every rank reads the same counts.
    """

    signature: str | None = None
    repeats: int = 0
    stalled: int = 0

    def to_dict(self) -> dict[str, object]:
        return {"signature": self.signature, "repeats": self.repeats, "stalled": self.stalled}

    @classmethod
    def from_dict(cls, record: object) -> FaultHistory | None:
        """The history in ``record`` (untrusted); None unless it is one."""
        if not isinstance(record, dict):
            return None
        signature, repeats, stalled = record.get("signature"), record.get("repeats"), record.get("stalled")
        if signature is not None and (not isinstance(signature, str) or len(signature) > 2 * ORIGIN_LIMIT):
            return None
        if not is_count(repeats) or not is_count(stalled):
            return None
        return cls(signature, repeats, stalled)


def fault_signature(record: Interruption) -> str | None:
    """What makes two exceptions the same fault: the type, where it was raised, and the step; None for others."""
    if record.origin is None or record.kind == PEER_LOST:
        return None
    step = "?" if record.step is None else record.step
    return f"{record.kind} raised at {record.origin}, step {step}"


def next_history(previous: FaultHistory, records: Iterable[Interruption], progressed: bool) -> FaultHistory:
    """The history after an iteration that ended on ``records`` (pure).

    ``progressed``: active rank 0 made the Wrapper's ``min_progress_steps`` steps (optimizer steps, or pings) in the
    iteration before the fault. Interruptions that are not faults
    (:data:`NOT_FAULTS`) and broken connections alone (the consequence of a
    fault recorded elsewhere) leave the history as it was, but for progress:
    an iteration that stepped (a joiner's admission, planned at a step
    boundary) ends every run of faults "in a row". The cause is the earliest
    exception among the iteration's faults, if exceptions alone ended it:
    beside a lost node, a dead process or a hang (faults with no origin), an
    exception may be their consequence (a store wait for the dead rank, a
    transfer to a host cut off from its peers, which comes back and is lost
    again at the same step), so it identifies no bug that repeats; the
    iteration counts as one without progress.
    """
    faults = [r for r in records if r.kind not in NOT_FAULTS and r.kind != PEER_LOST]
    if not faults:
        return FaultHistory(previous.signature, 0, 0) if progressed else previous
    exceptions = sorted(
        (r for r in faults if fault_signature(r) is not None),
        key=lambda r: (r.time is None, r.time or 0.0, r.rank),
    )
    signature = fault_signature(exceptions[0]) if exceptions and len(exceptions) == len(faults) else None
    if signature is None:
        repeats = 0
    elif signature == previous.signature and not progressed:
        repeats = previous.repeats + 1
    else:
        repeats = 1
    return FaultHistory(signature, repeats, 0 if progressed else previous.stalled + 1)


@dataclass(frozen=True)
class GiveUp:
    """In-process restart stops: why, and whether the job ends with it (``fatal``: the same fault repeats, so a
    process restart would meet it again) or a process-level restart may still help (no progress)."""

    reason: str
    fatal: bool


def give_up(history: FaultHistory, max_identical_faults: int | None, max_stalled: int | None) -> GiveUp | None:
    """Whether in-process restart stops here, and why; None to go on (pure; a limit of None is no limit)."""
    if max_identical_faults is not None and history.signature is not None and history.repeats >= max_identical_faults:
        return GiveUp(
            f"the same fault ended {history.repeats} iterations in a row with no progress in between "
            f"(max_identical_faults={max_identical_faults}): {history.signature}",
            fatal=True,
        )
    if max_stalled is not None and history.stalled >= max_stalled:
        return GiveUp(
            f"{history.stalled} iterations in a row ended on a fault without progress "
            f"(max_restarts_without_progress={max_stalled})",
            fatal=False,
        )
    return None


def restart_cause(faults: Sequence[FaultGroup]) -> FaultGroup | None:
    """The fault a restart's report shows the traceback of: the first exception that is not a broken
    connection (a ``peer_lost`` is the consequence of another rank's fault); None when no exception caused it
    (a hang, a dead process)."""
    return next((group for group in faults if group.traceback and group.kind != PEER_LOST), None)


def restart_reporter(world_size: int, terminated: Iterable[int]) -> int | None:
    """The rank that reports an iteration's restart: the lowest one still in the job (None if none is).

    Every rank computes it alike, so the restart is logged and recorded
    once instead of once per rank.
    """
    gone = set(terminated)
    return next((rank for rank in range(world_size) if rank not in gone), None)


@dataclass(frozen=True)
class Heartbeat:
    """A rank's heartbeat: when it was sent and when the rank was last active (wall clock), whether its main
    thread, blocked in C code, waits for other ranks (``waiting``; None: it was not blocked), whether the
    rank is a reserve rank (a spare, not running the function), and when its next heartbeat is due (``due_at``,
    wall clock; None: no promise). Past that, what the heartbeat says of the rank's activity is out of date.
    ``notice``: the rank was active when it was sent, and the next heartbeat comes as soon as it stops being
    (a stall notice, :func:`~elastic_ft.inprocess.hangs.verdicts.notice_pending`), not only when due."""

    sent_at: float
    active_at: float
    waiting: bool | None = None
    reserve: bool = False
    due_at: float | None = None
    notice: bool = False


def encode_heartbeat(
    sent_at: float,
    active_at: float,
    waiting: bool | None = None,
    reserve: bool = False,
    due_at: float | None = None,
    notice: bool = False,
) -> str:
    return json.dumps(_heartbeat_fields(sent_at, active_at, waiting, reserve, due_at, notice))


def _heartbeat_fields(
    sent_at: float, active_at: float, waiting: bool | None, reserve: bool, due_at: float | None, notice: bool
) -> dict[str, object]:
    record: dict[str, object] = {"t": sent_at, "active": active_at}
    if waiting is not None:
        record["waiting"] = waiting
    if reserve:
        record["reserve"] = True
    if due_at is not None:
        record["due"] = due_at
    if notice:
        record["notice"] = True
    return record


def parse_heartbeat_record(text: str) -> Heartbeat | None:
    """The heartbeat in ``text``, with finite times; None for anything else (untrusted)."""
    return _heartbeat_from(json_object(text))


def _heartbeat_from(record: object) -> Heartbeat | None:
    """The heartbeat a decoded record holds; None for anything else (untrusted)."""
    try:
        due = record.get("due")  # type: ignore[attr-defined]
        values = (record["t"], record["active"], *(() if due is None else (due,)))  # type: ignore[index]
        waiting, reserve = record.get("waiting"), record.get("reserve", False)  # type: ignore[attr-defined]
        notice = record.get("notice", False)  # type: ignore[attr-defined]
    except (KeyError, TypeError, AttributeError):
        return None
    if any(isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in values):
        return None
    if (waiting is not None and not isinstance(waiting, bool)) or not all(
        isinstance(b, bool) for b in (reserve, notice)
    ):
        return None
    due_at = None if due is None else float(due)
    return Heartbeat(float(values[0]), float(values[1]), waiting, reserve, due_at, notice)


@dataclass(frozen=True)
class PeerLook:
    """The hang judge's last look at the peers of an iteration, as the other stalled ranks read it.

    ``judge``: the initial rank whose monitor process looks (the iteration's
    rank 0). ``read_at``: when it read every peer's records (wall clock; None:
    it announced itself and has not looked yet). ``beats``: the heartbeats,
    by initial rank, that decide every other rank's verdict and the hang's
    culprit (``hangs.verdicts.select_evidence``), its own rank's activity
    among them.
    """

    iteration: int
    judge: int
    read_at: float | None = None
    beats: dict[int, Heartbeat] = dataclasses.field(default_factory=dict)


def encode_peer_look(look: PeerLook) -> str:
    beats = {
        str(rank): _heartbeat_fields(beat.sent_at, beat.active_at, beat.waiting, beat.reserve, beat.due_at, beat.notice)
        for rank, beat in look.beats.items()
    }
    return json.dumps({"iteration": look.iteration, "judge": look.judge, "read_at": look.read_at, "beats": beats})


#: The most heartbeats a look may carry: a judge sends a handful (``select_evidence``).
_LOOK_BEATS_MAX = 64


def parse_peer_look(text: str) -> PeerLook | None:
    """The look in ``text``; None for anything else (untrusted: counts, finite times, well-formed heartbeats)."""
    record = json_object(text)
    if record is None:
        return None
    try:
        iteration, judge, read_at, beats = record["iteration"], record["judge"], record["read_at"], record["beats"]
    except (ValueError, RecursionError, KeyError, TypeError):
        return None
    if not is_count(iteration) or not is_count(judge) or not isinstance(beats, dict) or len(beats) > _LOOK_BEATS_MAX:
        return None
    if read_at is not None and (
        isinstance(read_at, bool) or not isinstance(read_at, int | float) or not math.isfinite(read_at)
    ):
        return None
    parsed: dict[int, Heartbeat] = {}
    for rank, fields in beats.items():
        beat = _heartbeat_from(fields)
        if not (rank.isascii() and rank.isdigit()) or beat is None:
            return None
        parsed[int(rank)] = beat
    return PeerLook(iteration, judge, None if read_at is None else float(read_at), parsed)


def parse_heartbeat(text: str) -> tuple[float, float] | None:
    """(sent at, last active at), both finite; None for anything else."""
    record = parse_heartbeat_record(text)
    return None if record is None else (record.sent_at, record.active_at)
