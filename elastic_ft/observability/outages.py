"""etcd's outages as the job saw them, from its events (pure): what ``status``, the live view and the timeline show.

Every process that talks to etcd records, once each, when it stopped
reaching etcd (``etcd_unavailable``) and when it reached it again
(``etcd_available``, with how long it was away): agents, rendezvous
handlers, ranks and their monitor processes alike
(:mod:`elastic_ft.etcd.outage`). The job's outages are those spans, merged
where they overlap, each with who saw it: the processes that waited on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from elastic_ft.observability.events import JobEvent


@dataclass(frozen=True)
class Outage:
    """One stretch of time during which some process of the job could not reach etcd."""

    start: float
    #: None: some process had not reached etcd again by the last event.
    end: float | None
    #: Who waited on it: ``node <name>`` for an agent or a rendezvous, ``rank <r>`` for a rank or its monitor.
    seen_by: tuple[str, ...]

    def seconds(self, now: float) -> float:
        return (self.end if self.end is not None else now) - self.start


def _who(event: JobEvent) -> str:
    if event.rank is not None and event.source == "worker":
        return f"rank {event.rank}"
    return f"node {event.node or '?'}"


def outages(events: list[JobEvent]) -> list[Outage]:
    """The job's etcd outages, in time order, from its events (any order; other events are ignored)."""
    spans: list[tuple[float, float | None, str]] = []
    open_since: dict[tuple[str, str | None, int | None], float] = {}
    for event in sorted(events, key=lambda e: e.time):
        key = (event.source, event.node, event.rank)
        if event.name == "etcd_unavailable":
            open_since.setdefault(key, event.time)
        elif event.name == "etcd_available":
            since = event.data.get("since")
            start = open_since.pop(key, None)
            if start is None and isinstance(since, int | float) and not isinstance(since, bool):
                start = float(since)  # its start was overwritten in the log's ring: the end says when
            if start is not None:
                spans.append((start, event.time, _who(event)))
    for (source, node, rank), start in open_since.items():
        who = f"rank {rank}" if rank is not None and source == "worker" else f"node {node or '?'}"
        spans.append((start, None, who))
    merged: list[Outage] = []
    for start, end, who in sorted(spans, key=lambda span: span[0]):
        last = merged[-1] if merged else None
        if last is not None and (last.end is None or start <= last.end):
            joined_end = None if last.end is None or end is None else max(last.end, end)
            merged[-1] = Outage(last.start, joined_end, tuple(sorted({*last.seen_by, who})))
        else:
            merged.append(Outage(start, end, (who,)))
    return merged


def describe_outage(outage: dict[str, Any]) -> str:
    """``14:02:05 to 14:02:28 (23.2 s), waited on by 2 node process(es) and 4 rank(s)``, from the record
    ``elastic-ft status`` keeps of an outage (start, end, seconds, seen_by)."""
    start = time.strftime("%H:%M:%S", time.localtime(outage["start"]))
    end = "now (still going on)" if outage["end"] is None else time.strftime("%H:%M:%S", time.localtime(outage["end"]))
    nodes = sum(who.startswith("node ") for who in outage["seen_by"])
    ranks = len(outage["seen_by"]) - nodes
    return f"{start} to {end} ({outage['seconds']:.1f} s), waited on by {nodes} node process(es) and {ranks} rank(s)"
