"""Goodput: of a job's wall time, how much trained, and where the rest went (pure, from the job's events).

The wall time runs from the job's first event to its end: the last
``job_finished``, or, for a job still running, ``now``. It is cut into
stretches when nobody trains, each second counted once (a stretch that
overlaps an earlier one counts from where that one ended):

* **waiting for nodes**: from the first node's arrival to the close of the
  first rendezvous round;
* **start-up**: from that close to the job's first optimizer step (imports,
  process groups, the script's set-up, a checkpoint read);
* **in-process recovery**: each in-process restart, from its first fault
  (``restart_decided``'s ``fault_time``) to the first step after it of the
  last rank to take one, by phase: ``detection`` (the fault to the
  restart's delivery on that rank), then the phases of its
  ``recovery_phases`` event (:mod:`elastic_ft.inprocess.restart.phases`);
* **process restarts**: each escalation, from the fault before it (the last
  one since an in-process restart was decided) to the
  first step of the new processes, by phase: ``detection`` (to the
  escalation), ``waiting for nodes`` (to the next round's close),
  ``start-up`` (to the first step);
* **shutdown**: from the end of training (the last rank whose function
  returned) to the job's end.

What is left trained. Of it, **redone**: the steps a restart took the job
back over (the highest step the events show before the fault, less the step
it resumed from: a checkpoint read, not a peer's state), at the job's step
time. The effective training time ratio (ETTR) is the training not
redone over the wall time. The parts add up to the wall time by
construction; each is measured from the events that bound it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from elastic_ft.observability.events import JobEvent, one_line
from elastic_ft.untrusted import MalformedRecord

#: The parts of the wall time, in the order the report prints them.
PARTS = ("training", "redone", "recovery", "process_restarts", "waiting_for_nodes", "start_up", "shutdown")
PART_TITLES = {
    "training": "training",
    "redone": "steps redone",
    "recovery": "in-process recovery",
    "process_restarts": "process restarts",
    "waiting_for_nodes": "waiting for nodes",
    "start_up": "start-up",
    "shutdown": "shutdown",
}


@dataclass(frozen=True)
class Stretch:
    """A stretch of wall time when the job did not train: its part, and for a restart its fault's kind and cause,
    with its phases as ``(phase, start, end)`` (clipped, like the stretch, to what no earlier stretch counted)."""

    part: str
    start: float
    end: float
    kind: str = ""
    cause: str = ""
    phases: tuple[tuple[str, float, float], ...] = ()
    redone_steps: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Goodput:
    """What :func:`goodput` found. ``parts`` are seconds by :data:`PARTS` and sum to ``wall``."""

    run_id: str
    start: float
    end: float
    finished: bool
    parts: dict[str, float]
    stretches: list[Stretch] = field(default_factory=list)
    redone_steps: int = 0
    step_seconds: float | None = None

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def ettr(self) -> float:
        """The effective training time ratio: training not redone, over the wall time (0 for no wall time)."""
        return self.parts["training"] / self.wall if self.wall > 0 else 0.0

    def by_kind(self, part: str) -> dict[str, tuple[int, float]]:
        """``part``'s stretches by fault kind: how many, and their seconds."""
        found: dict[str, tuple[int, float]] = {}
        for stretch in self.stretches:
            if stretch.part == part:
                count, seconds = found.get(stretch.kind, (0, 0.0))
                found[stretch.kind] = (count + 1, seconds + stretch.seconds)
        return found

    def by_phase(self, part: str) -> dict[str, float]:
        """``part``'s seconds by phase, in the order phases first appear."""
        found: dict[str, float] = {}
        for stretch in self.stretches:
            if stretch.part == part:
                for phase, start, end in stretch.phases:
                    found[phase] = found.get(phase, 0.0) + end - start
        return found

    def costliest(self, count: int = 5) -> list[Stretch]:
        restarts = [s for s in self.stretches if s.part in ("recovery", "process_restarts")]
        return sorted(restarts, key=lambda s: s.seconds, reverse=True)[:count]

    def to_document(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "start": self.start,
            "end": self.end,
            "finished": self.finished,
            "wall_seconds": round(self.wall, 3),
            "ettr": round(self.ettr, 4),
            "parts": {part: round(seconds, 3) for part, seconds in self.parts.items()},
            "redone_steps": self.redone_steps,
            "step_seconds": self.step_seconds,
            "recovery_by_kind": {
                k: {"count": n, "seconds": round(s, 3)} for k, (n, s) in self.by_kind("recovery").items()
            },
            "recovery_by_phase": {p: round(s, 3) for p, s in self.by_phase("recovery").items()},
            "process_restarts_by_phase": {p: round(s, 3) for p, s in self.by_phase("process_restarts").items()},
            "costliest": [
                {"part": s.part, "start": s.start, "seconds": round(s.seconds, 3), "kind": s.kind, "cause": s.cause}
                for s in self.costliest()
            ],
        }


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _step(event: JobEvent) -> int | None:
    step = event.data.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def goodput(events: Iterable[JobEvent], now: float | None = None) -> Goodput:
    """A run's goodput from its events (any order). ``now``: the end of a job still running (default: its last
    event). Linear in the events but for a sort (the metrics endpoint computes it at every scrape).

    Raises:
        MalformedRecord: there are no events, or they belong to several runs.
    """
    ordered = sorted(events, key=lambda event: event.time)
    if not ordered:
        raise MalformedRecord("no events to report on")
    runs = {event.run_id for event in ordered}
    if len(runs) > 1:
        raise MalformedRecord(f"the events belong to {len(runs)} runs ({', '.join(sorted(runs)[:5])}); expected one")
    index = _Index(ordered)
    start = ordered[0].time
    finished_at = index.times("job_finished")
    end = max(finished_at) if finished_at else max(ordered[-1].time, now if now is not None else start)
    step_seconds = _step_seconds(ordered)
    raw = [*_opening(index, start), *_recoveries(index, end), *_process_restarts(index, end)]
    completed = index.times("completed")
    if finished_at and completed:
        raw.append(Stretch("shutdown", max(completed), end))
    stretches = _counted_once(raw, start, end)
    parts = dict.fromkeys(PARTS, 0.0)
    for stretch in stretches:
        parts[stretch.part] += stretch.seconds
    trained = max(0.0, (end - start) - sum(parts.values()))
    redone_steps = sum(stretch.redone_steps for stretch in stretches)
    parts["redone"] = min(trained, redone_steps * step_seconds) if step_seconds is not None else 0.0
    parts["training"] = trained - parts["redone"]
    return Goodput(runs.pop(), start, end, bool(finished_at), parts, stretches, redone_steps, step_seconds)


class _Index:
    """The events by name, in time order, and the highest step seen by any time: each question a bisection."""

    def __init__(self, ordered: list[JobEvent]) -> None:
        self.by_name: dict[str, list[JobEvent]] = {}
        for event in ordered:
            self.by_name.setdefault(event.name, []).append(event)
        self._times = {name: [e.time for e in found] for name, found in self.by_name.items()}
        self._step_times: list[float] = []
        self._highest: list[int] = []
        for event in ordered:
            step = _step(event)
            if step is not None:
                self._step_times.append(event.time)
                self._highest.append(max(step, self._highest[-1]) if self._highest else step)

    def times(self, name: str) -> list[float]:
        return self._times.get(name, [])

    def first_after(self, name: str, after: float) -> JobEvent | None:
        """The first ``name`` event at ``after`` or later."""
        at = bisect.bisect_left(self.times(name), after)
        found = self.by_name.get(name, [])
        return found[at] if at < len(found) else None

    def last_before(self, name: str, before: float) -> JobEvent | None:
        """The last ``name`` event before ``before``."""
        at = bisect.bisect_left(self.times(name), before)
        return self.by_name[name][at - 1] if at > 0 else None

    def highest_step(self, by: float) -> int | None:
        """The highest step any event showed by ``by``."""
        at = bisect.bisect_right(self._step_times, by)
        return self._highest[at - 1] if at > 0 else None


def _opening(index: _Index, start: float) -> list[Stretch]:
    """Waiting for the first round's nodes, then the start-up to the first step (a process's ``first_step``)."""
    closed = index.first_after("round_closed", start)
    from_ = start if closed is None else closed.time
    first = index.first_after("first_step", from_)
    found = []
    if closed is not None:
        found.append(Stretch("waiting_for_nodes", start, closed.time))
    if first is not None:
        found.append(Stretch("start_up", from_, first.time))
    return found


def _recoveries(index: _Index, end: float) -> list[Stretch]:
    """Each in-process restart, from its first fault to the last rank's first step after it."""
    decided: dict[int, JobEvent] = {}
    for event in index.by_name.get("restart_decided", []):
        if event.iteration is not None:
            decided.setdefault(event.iteration, event)
    firsts: dict[int | None, list[JobEvent]] = {}
    for event in index.by_name.get("recovery_phases", []):
        firsts.setdefault(event.iteration, []).append(event)
    starts: dict[int | None, float] = {}
    for event in index.by_name.get("iteration_started", []):
        starts[event.iteration] = max(event.time, starts.get(event.iteration, event.time))
    found = []
    for iteration, event in sorted(decided.items()):
        fault = _number(event.data.get("fault_time"))
        fault = event.time if fault is None or fault > event.time else fault
        mine = firsts.get(iteration + 1, [])
        last = max(mine, key=_first_step_at, default=None)
        # Without a first step timed (a function that takes no optimizer step), the next iteration's start.
        resumed = _first_step_at(last) if last is not None else starts.get(iteration + 1, end)
        before = index.highest_step(fault)
        after = [s - 1 for e in mine if (s := _step(e)) is not None]
        redone = max(0, before - min(after)) if before is not None and after else 0
        phases = _phases_of(last, fault)
        found.append(Stretch("recovery", fault, resumed, _kind(event), _cause(event), phases, redone))
    return found


def _timed_phases(event: JobEvent) -> list[tuple[str, float]]:
    """A ``recovery_phases`` event's phases: each name with the wall time it ended at, in order."""
    timed = []
    for phase in event.data.get("phases", []):
        at = _number(phase.get("at")) if isinstance(phase, dict) else None
        name = phase.get("phase") if isinstance(phase, dict) else None
        if at is not None and isinstance(name, str):
            timed.append((name, at))
    return timed


def _first_step_at(event: JobEvent) -> float:
    """When the rank of a ``recovery_phases`` event took its first step: its last phase's end, or the event's."""
    timed = _timed_phases(event)
    began = _number(event.data.get("began"))
    if timed and (began is None or began <= timed[-1][1]) and timed[-1][1] <= event.time:
        return timed[-1][1]
    return event.time


def _phases_of(last: JobEvent | None, fault: float) -> tuple[tuple[str, float, float], ...]:
    """The restart's phases on the last rank to step: detection (the fault to its delivery), then its own,
    each from where the one before ended: they tile the stretch."""
    if last is None:
        return ()
    phases: list[tuple[str, float, float]] = []
    began = _number(last.data.get("began"))
    cursor = fault
    if began is not None and began >= fault:
        phases.append(("detection", fault, began))
        cursor = began
    for name, at in _timed_phases(last):
        if at >= cursor:
            phases.append((name, cursor, at))
            cursor = at
    return tuple(phases)


def _process_restarts(index: _Index, end: float) -> list[Stretch]:
    """Each escalation, from the fault before it to the new processes' first step."""
    found = []
    seen: set[int | None] = set()
    for event in index.by_name.get("escalated", []):
        if event.round in seen:
            continue
        seen.add(event.round)
        # Its fault: the last one since the last in-process restart decided (which covers those before it).
        decided = index.last_before("restart_decided", event.time)
        fault = index.last_before("fault_detected", event.time)
        if fault is not None and decided is not None and fault.time <= decided.time:
            fault = None
        start = fault.time if fault is not None else event.time
        closed = index.first_after("round_closed", event.time)
        first = index.first_after("first_step", closed.time if closed is not None else event.time)
        resumed = first.time if first is not None else end
        phases = [("detection", start, event.time)]
        if closed is not None and closed.time <= resumed:
            phases += [("waiting for nodes", event.time, closed.time), ("start-up", closed.time, resumed)]
        else:
            phases.append(("start-up", event.time, resumed))
        before = index.highest_step(start)
        after = None if first is None or (step := _step(first)) is None else step - 1
        redone = max(0, before - after) if before is not None and after is not None else 0
        kind = str(fault.data.get("kind", "unknown")) if fault is not None else "unknown"
        cause = str(event.data.get("reason", ""))
        found.append(Stretch("process_restarts", start, resumed, kind, cause, tuple(phases), redone))
    return found


def _kind(event: JobEvent) -> str:
    return str(event.data.get("kind", "unknown"))


def _cause(event: JobEvent) -> str:
    faults = event.data.get("faults")
    if isinstance(faults, list) and faults and isinstance(faults[0], dict):
        first = faults[0]
        ranks = first.get("ranks")
        where = f"rank(s) {ranks}: " if isinstance(ranks, list) and ranks else ""
        return one_line(f"{where}{first.get('message', '')}", 200)
    return ""


def _counted_once(stretches: list[Stretch], start: float, end: float) -> list[Stretch]:
    """``stretches`` within [start, end], in time order, each clipped to begin where the previous one ended."""
    counted: list[Stretch] = []
    cursor = start
    for stretch in sorted(stretches, key=lambda s: (s.start, s.end)):
        lo, hi = max(stretch.start, cursor), min(stretch.end, end)
        if hi <= lo:
            continue
        phases = tuple((name, max(a, lo), min(b, hi)) for name, a, b in stretch.phases if min(b, hi) > max(a, lo))
        counted.append(Stretch(stretch.part, lo, hi, stretch.kind, stretch.cause, phases, stretch.redone_steps))
        cursor = hi
    return counted


#: The events that carry a rank's step count as it stepped: ``iteration_started``'s is its count before, a
#: ``progress`` sample at step 0 comes before the first step, and ``completed`` after the script's epilogue.
_STEPPED = ("first_step", "recovery_phases", "progress")


def _step_seconds(ordered: list[JobEvent]) -> float | None:
    """The job's seconds per step: over every rank's iterations, the seconds from its first stepped count to its
    last, over the steps between them (long stretches weigh in by their length, not as one sample each)."""
    spans: dict[tuple[int, int | None], tuple[float, int, float, int]] = {}
    for event in ordered:
        step = _step(event)
        if event.name not in _STEPPED or event.rank is None or not step:
            continue
        key = (event.rank, event.iteration)
        first = spans.get(key)
        spans[key] = (event.time, step, event.time, step) if first is None else (*first[:2], event.time, step)
    seconds = sum(t1 - t0 for t0, s0, t1, s1 in spans.values() if s1 > s0)
    steps = sum(s1 - s0 for _, s0, _, s1 in spans.values() if s1 > s0)
    return seconds / steps if steps else None


#: The width of a costliest fault's line in the report.
_LINE = 160


def report_lines(found: Goodput) -> list[str]:
    """The report ``elastic-ft report`` prints."""
    state = "finished" if found.finished else "running"
    lines = [
        f"run {found.run_id}: {found.wall:.1f} s of wall time ({state}); ETTR {100 * found.ettr:.1f} %",
        "",
        f"{'part':<34}{'seconds':>10}{'share':>9}",
    ]

    def row(title: str, seconds: float) -> str:
        share = 100 * seconds / found.wall if found.wall > 0 else 0.0
        return f"{title:<34}{seconds:>10.2f}{share:>8.1f}%"

    for part in PARTS:
        title = PART_TITLES[part]
        if part == "redone":
            title += f" ({found.redone_steps} steps)"
        elif part in ("recovery", "process_restarts"):
            title += f" ({sum(n for n, _ in found.by_kind(part).values())})"
        lines.append(row(title, found.parts[part]))
        if part in ("recovery", "process_restarts"):
            for kind, (count, seconds) in sorted(found.by_kind(part).items(), key=lambda item: -item[1][1]):
                lines.append(row(f"  {kind} ({count})", seconds))
            phases = found.by_phase(part)
            if phases:
                lines.append("  by phase:")
                lines.extend(row(f"    {phase}", seconds) for phase, seconds in phases.items())
    lines.append(row("total", sum(found.parts.values())))
    costliest = found.costliest()
    if costliest:
        lines += ["", "costliest faults:"]
        for number, stretch in enumerate(costliest, 1):
            offset = stretch.start - found.start
            head = f"  {number}. {stretch.seconds:6.2f} s at +{offset:.1f} s  {stretch.kind}"
            cause = f": {stretch.cause}" if stretch.cause else ""
            lines.append(head + one_line(cause, max(_LINE - len(head), 20)))
    return lines
