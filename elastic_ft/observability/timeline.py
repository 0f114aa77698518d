"""``elastic-ft timeline``: a picture of a job over time, drawn from its events.

:func:`build_timeline` is pure: it reads the events (in log order) into
what the picture shows. :func:`draw` renders it with matplotlib (the
``timeline`` extra) into two panels sharing the time axis:

* top: the active world size (a step line from each iteration's start,
  broken while a restart is under way: nobody trains then), faults (red
  crosses, labelled by rank and kind; a rank's broken connection,
  ``peer_lost``, the consequence of a fault elsewhere, a small grey cross), the
  stretches when nobody trained, shaded by part as ``elastic-ft report``
  counts them (:mod:`elastic_ft.observability.goodput`: in-process recovery,
  process restarts, waiting for nodes, start-up, shutdown; the ETTR in the
  title), process-level restarts (purple lines), rendezvous rounds (grey dashes), spare
  activations (green triangles) and respawned workers (blue diamonds);
  etcd's outages are shaded blue in both panels (the ranks train on);
* bottom: each rank's optimizer steps (from its iteration starts, its
  sampled progress, its faults and its healing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic_ft.coordination.fault_records import PEER_LOST
from elastic_ft.observability.events import JobEvent
from elastic_ft.observability.goodput import PART_TITLES, goodput
from elastic_ft.observability.outages import outages
from elastic_ft.untrusted import MalformedRecord

#: The shade of each part of the wall time when nobody trained.
LOST_COLORS = {
    "recovery": "orange",
    "process_restarts": "purple",
    "waiting_for_nodes": "grey",
    "start_up": "khaki",
    "shutdown": "silver",
}


class TimelineUnavailable(RuntimeError):
    """matplotlib, which draws the picture, is not installed."""


@dataclass(frozen=True)
class Mark:
    time: float
    label: str
    rank: int | None = None


@dataclass(frozen=True)
class Span:
    start: float
    end: float | None  # None: not resumed by the last event
    label: str


@dataclass
class Timeline:
    run_id: str
    start: float
    end: float
    world: list[tuple[float, int]] = field(default_factory=list)
    faults: list[Mark] = field(default_factory=list)
    broken: list[Mark] = field(default_factory=list)  # peer_lost: a rank's collective broken by a fault elsewhere
    restarts: list[Span] = field(default_factory=list)
    escalations: list[Mark] = field(default_factory=list)
    rounds: list[Mark] = field(default_factory=list)
    activations: list[Mark] = field(default_factory=list)
    respawns: list[Mark] = field(default_factory=list)
    progress: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    etcd_outages: list[Span] = field(default_factory=list)
    #: When nobody trained, by part (``Span.label``), as the goodput report counts it.
    lost: list[Span] = field(default_factory=list)
    ettr: float | None = None

    def counts(self) -> dict[str, int]:
        """How many of each thing the picture shows (what ``elastic-ft timeline`` prints, and tests check)."""
        return {
            "faults": len(self.faults),
            "broken_connections": len(self.broken),
            "restarts": len(self.restarts),
            "escalations": len(self.escalations),
            "rounds": len(self.rounds),
            "activations": len(self.activations),
            "respawns": len(self.respawns),
            "ranks": len(self.progress),
            "world_changes": len(self.world),
            "etcd_outages": len(self.etcd_outages),
            "lost_stretches": len(self.lost),
        }


def build_timeline(events: list[JobEvent]) -> Timeline:
    """What the picture shows, from a run's events in log order.

    Raises:
        MalformedRecord: there are no events, or they belong to several runs.
    """
    if not events:
        raise MalformedRecord("no events to draw")
    runs = {event.run_id for event in events}
    if len(runs) > 1:
        raise MalformedRecord(f"the events belong to {len(runs)} runs ({', '.join(sorted(runs)[:5])}); expected one")
    times = [event.time for event in events]
    timeline = Timeline(events[0].run_id, min(times), max(times))
    started: set[int] = set()
    restarts: dict[int, float] = {}  # restart of iteration i: its first fault's time
    # In the order things happened: each process sends its own events, so log order may differ.
    ordered = sorted(events, key=lambda e: e.time)
    for event in ordered:
        _add(timeline, event, started, restarts)
    for iteration, fault_time in sorted(restarts.items()):
        # Until the first rank starts a later iteration (the report itself may come after that).
        resumed = [
            e.time
            for e in ordered
            if e.name == "iteration_started" and (e.iteration or 0) > iteration and e.time >= fault_time
        ]
        timeline.restarts.append(Span(fault_time, min(resumed) if resumed else None, f"iteration {iteration}"))
    for outage in outages(events):
        timeline.etcd_outages.append(Span(outage.start, outage.end, f"etcd away ({len(outage.seen_by)} waited)"))
    found = goodput(events)
    timeline.lost = [Span(stretch.start, stretch.end, stretch.part) for stretch in found.stretches]
    timeline.ettr = found.ettr
    return timeline


def _add(timeline: Timeline, event: JobEvent, started: set[int], restarts: dict[int, float]) -> None:
    data, name, rank = event.data, event.name, event.rank
    step = data.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and rank is not None:
        timeline.progress.setdefault(rank, []).append((event.time, step))
    if name == "iteration_started":
        iteration = event.iteration or 0
        size = data.get("active_world_size")
        if iteration not in started and isinstance(size, int):
            started.add(iteration)
            if not timeline.world or timeline.world[-1][1] != size:
                timeline.world.append((event.time, size))
    elif name == "fault_detected" and data.get("kind") == PEER_LOST:  # the consequence of a fault elsewhere
        timeline.broken.append(Mark(event.time, f"r{rank} peer lost", rank))
    elif name == "fault_detected":
        timeline.faults.append(Mark(event.time, f"r{rank} {data.get('kind', '?')}", rank))
    elif name == "node_died":
        timeline.faults.append(Mark(event.time, f"{event.node} died", None))
    elif name == "restart_decided" and event.iteration is not None:
        fault_time = data.get("fault_time")
        at = float(fault_time) if isinstance(fault_time, (int, float)) and not isinstance(fault_time, bool) else None
        restarts.setdefault(event.iteration, at if at is not None else event.time)
    elif name == "escalated":
        timeline.escalations.append(Mark(event.time, f"process restart (round {event.round})"))
    elif name == "round_closed":
        members = data.get("members")
        count = len(members) if isinstance(members, list) else "?"
        timeline.rounds.append(Mark(event.time, f"round {event.round}: {count} node(s)"))
    elif name == "spare_activated":
        timeline.activations.append(Mark(event.time, f"r{rank} active", rank))
    elif name == "respawned":
        timeline.respawns.append(Mark(event.time, f"r{rank} respawned", rank))


def draw(timeline: Timeline, path: str, title: str | None = None) -> dict[str, int]:
    """Render ``timeline`` as a PNG at ``path``; returns :meth:`Timeline.counts`.

    Raises:
        TimelineUnavailable: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise TimelineUnavailable("elastic-ft timeline needs matplotlib: pip install 'elastic-ft[timeline]'") from None
    t0 = timeline.start
    end = max(timeline.end - t0, 1e-3)
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 6.5), height_ratios=(1, 1.3))
    ettr = "" if timeline.ettr is None else f" (ETTR {100 * timeline.ettr:.1f} %)"
    figure.suptitle((title or f"run {timeline.run_id}") + ettr, fontsize=11)
    _draw_world(top, timeline, t0, end)
    _draw_progress(bottom, timeline, t0)
    for axis in (top, bottom):
        for span in timeline.lost:
            axis.axvspan(
                span.start - t0, (span.end or timeline.end) - t0, color=LOST_COLORS[span.label], alpha=0.3, lw=0
            )
        for span in timeline.etcd_outages:
            axis.axvspan(
                span.start - t0,
                (span.end if span.end is not None else timeline.end) - t0,
                color="tab:blue",
                alpha=0.12,
                lw=0,
            )
        for mark in timeline.escalations:
            axis.axvline(mark.time - t0, color="purple", lw=1.5)
        for mark in timeline.rounds:
            axis.axvline(mark.time - t0, color="grey", lw=0.8, ls="--")
        axis.grid(alpha=0.3)
    bottom.set_xlabel("seconds since the first event")
    bottom.set_xlim(0, end * 1.02)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return timeline.counts()


def _draw_world(axis: Any, timeline: Timeline, t0: float, end: float) -> None:
    top = max((size for _, size in timeline.world), default=1)
    if timeline.world:
        for xs, ys in _world_segments(timeline, t0, end):
            axis.step(xs, ys, where="post", color="black", lw=2)
    axis.set_ylim(0, top + 1.8)
    axis.set_ylabel("active ranks")
    for row, mark in enumerate(timeline.faults):
        axis.plot(mark.time - t0, top + 0.6, "x", color="red", ms=9, mew=2)
        axis.annotate(
            mark.label,
            (mark.time - t0, top + 0.6),
            xytext=(4, 4 + 9 * (row % 3)),
            textcoords="offset points",
            fontsize=7,
            color="red",
        )
    for mark in timeline.broken:
        axis.plot(mark.time - t0, top + 0.25, "x", color="grey", ms=5, mew=1)
    for row, mark in enumerate(timeline.activations):
        axis.plot(mark.time - t0, 0.4, "^", color="green", ms=8)
        axis.annotate(
            mark.label,
            (mark.time - t0, 0.4),
            xytext=(5, 9 * (row % 2)),
            textcoords="offset points",
            fontsize=7,
            color="green",
        )
    for mark in timeline.respawns:
        axis.plot(mark.time - t0, 0.9, "D", color="tab:blue", ms=6)
        axis.annotate(mark.label, (mark.time - t0, 0.9), xytext=(4, 2), textcoords="offset points", fontsize=7)
    for mark in timeline.rounds:
        axis.annotate(
            mark.label, (mark.time - t0, 0.1), xytext=(2, 0), textcoords="offset points", fontsize=7, color="grey"
        )
    handles = [
        axis.plot([], [], color="black", lw=2, label="active world size")[0],
        axis.plot([], [], "x", color="red", mew=2, label="fault")[0],
        axis.plot([], [], "x", color="grey", label="broken connection (peer_lost)")[0],
        *(
            axis.fill_between([], [], color=color, alpha=0.3, label=PART_TITLES[part])
            for part, color in LOST_COLORS.items()
        ),
        axis.fill_between([], [], color="tab:blue", alpha=0.12, label="etcd unreachable"),
        axis.plot([], [], color="purple", label="process-level restart")[0],
        axis.plot([], [], "^", color="green", label="spare activated")[0],
        axis.plot([], [], "D", color="tab:blue", label="respawned")[0],
    ]
    axis.legend(handles=handles, loc="upper left", fontsize=7, ncol=4)


def _world_segments(timeline: Timeline, t0: float, end: float) -> list[tuple[list[float], list[int]]]:
    """The active world size as step segments, cut where a restart is under way (nobody trains then)."""
    cuts = sorted((span.start, span.end if span.end is not None else timeline.end) for span in timeline.restarts)
    points = [(t, size) for t, size in timeline.world]
    segments: list[tuple[list[float], list[int]]] = []
    bounds = [timeline.world[0][0], *[edge for cut in cuts for edge in cut], timeline.end]
    for start, stop in zip(bounds[::2], bounds[1::2], strict=False):
        if stop <= start:
            continue
        size = next((s for t, s in reversed(points) if t <= start + 1e-9), points[0][1])
        xs, ys = [start - t0], [size]
        for t, s in points:
            if start < t < stop:
                xs.append(t - t0)
                ys.append(s)
        xs.append(min(stop, t0 + end) - t0)
        ys.append(ys[-1])
        segments.append((xs, ys))
    return segments


def _draw_progress(axis: Any, timeline: Timeline, t0: float) -> None:
    for rank in sorted(timeline.progress):
        points = sorted(timeline.progress[rank])
        axis.plot(
            [t - t0 for t, _ in points], [step for _, step in points], marker=".", ms=3, lw=1.2, label=f"rank {rank}"
        )
    for mark in timeline.faults:
        axis.axvline(mark.time - t0, color="red", lw=0.8, alpha=0.6)
    axis.set_ylabel("optimizer steps")
    if timeline.progress:
        axis.legend(loc="upper left", fontsize=7, ncol=min(8, len(timeline.progress)))
