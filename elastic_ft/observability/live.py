"""``elastic-ft status --watch``: a live view of a run, redrawn from etcd every few seconds (the ``rich`` library).

:func:`render_live` is pure: it lays out what :func:`elastic_ft.launcher.status.collect_status`
collected, and the run's latest events, as ``rich`` tables. :func:`watch`
reads both and redraws until interrupted (or ``refreshes`` times, for tests
and scripts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from elastic_ft.observability.events import JobEvent, one_line
from elastic_ft.observability.outages import describe_outage
from elastic_ft.runtime.waits import pause

RECENT_EVENTS = 12


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{int(seconds * 1000) % 1000:03d}"


def last_steps(events: list[JobEvent]) -> dict[int, int]:
    """Each rank's latest known optimizer step, from the events that carry one."""
    steps: dict[int, int] = {}
    for event in events:
        step = event.data.get("step")
        if event.rank is not None and isinstance(step, int) and not isinstance(step, bool):
            steps[event.rank] = step
    return steps


def render_live(status: dict[str, Any], events: list[JobEvent]) -> Any:
    """The view as one ``rich`` renderable."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    state = "[red]closed[/red]" if status["closed"] else "[green]open[/green]"
    round_text = (
        "no round completed yet"
        if status["round"] is None
        else (f"round {status['round']}, {len(status['members'])} member(s), MASTER {status['master']}")
    )
    parts: list[Any] = [
        Text.from_markup(
            f"[bold]run {status['run']}[/bold]: {state}; {round_text}; "
            f"in-process restarts {status['in_process_restarts'] or 0}, "
            f"process-level restarts {status['process_restarts']}"
        )
    ]
    if status["members"]:
        parts.append(_nodes_table(status["members"]))
    if status["workers"]:
        parts.append(_ranks_table(status["workers"], last_steps(events)))
    restart = status.get("restart_in_progress")
    if restart is not None:
        lines = [f"iteration {restart['iteration']} interrupted at {_clock(restart['interrupted_at'])}"]
        lines += [
            f"  by rank {r['initial_rank']} ({r['kind']}): {one_line(r['message'], 100)}"
            for r in restart["interruptions"]
        ]
        lines.append(f"  waiting for ranks: {restart['waiting_for'] or 'none'}")
        parts.append(Panel("\n".join(lines), title="restart in progress", border_style="yellow"))
    reserve = [w["rank"] for w in status["workers"] if w.get("mode") == "reserve"]
    parts.append(
        Text(
            f"spare nodes {status['spare_nodes']}; active world size {status['active_world_size'] or '-'}; "
            f"reserve ranks {reserve or 'none'}; respawned workers {status['respawns']}; "
            f"terminated ranks {status['terminated_ranks'] or 'none'}; "
            f"next round {status['next_round']}: {len(status['joined_next_round'])} node(s) joined"
        )
    )
    for outage in status.get("etcd_outages", []):
        color = "red" if outage["end"] is None else "yellow"
        parts.append(Text(f"etcd outage: {describe_outage(outage)}", style=color))
    parts.append(_events_table(events))
    for entry in status["malformed"][:5]:
        parts.append(Text(f"malformed, ignored: {entry['key']}: {entry['reason']}", style="yellow"))
    return Group(*parts)


def _nodes_table(members: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    nodes = Table(title="nodes", title_justify="left", expand=False)
    for column in ("rank", "state", "host", "pid", "node"):
        nodes.add_column(column)
    for m in members:
        color = {"alive": "green", "dead": "red", "left": "yellow"}.get(m["state"], "white")
        role = " (hot spare, joined late)" if m.get("late") else ""
        nodes.add_row(
            str(m["rank"]), f"[{color}]{m['state']}[/{color}]", m["host"] or "-", str(m["pid"] or "-"), m["node"] + role
        )
    return nodes


def _ranks_table(workers: list[dict[str, Any]], steps: dict[int, int]) -> Any:
    from rich.table import Table

    table = Table(title="ranks", title_justify="left")
    for column in ("rank", "state", "mode", "iteration (rank)", "step", "pid", "node"):
        table.add_column(column)
    for w in workers:
        iteration = "-" if w["iteration"] is None else f"{w['iteration']} ({w['rank_in_iteration']})"
        color = "green" if w["state"] == "running" else ("white" if w["state"].startswith("succeeded") else "red")
        table.add_row(
            str(w["rank"]),
            f"[{color}]{w['state']}[/{color}]",
            w.get("mode") or "-",
            iteration,
            str(steps.get(w["rank"], "-")),
            str(w["pid"]),
            w["node"],
        )
    return table


def _events_table(events: list[JobEvent]) -> Any:
    from rich.table import Table

    recent = Table(title="recent events", title_justify="left")
    for column in ("time", "source", "event"):
        recent.add_column(column)
    alarming = ("fault_detected", "node_died", "gave_up", "escalated", "etcd_unavailable")
    for event in [e for e in events if e.name != "progress"][-RECENT_EVENTS:]:
        color = "red" if event.name in alarming else "white"
        recent.add_row(_clock(event.time), event.source, f"[{color}]{one_line(event.describe(), 150)}[/{color}]")
    return recent


def watch(
    read: Callable[[], tuple[dict[str, Any], list[JobEvent]]],
    interval: float,
    refreshes: int | None = None,
    console: Any = None,
) -> None:
    """Redraw ``render_live(*read())`` every ``interval`` s, until Ctrl-C (or ``refreshes`` draws)."""
    from rich.live import Live

    drawn = 0
    with Live(render_live(*read()), console=console, refresh_per_second=4, screen=False) as live:
        drawn += 1
        while refreshes is None or drawn < refreshes:
            pause(interval)
            live.update(render_live(*read()))
            drawn += 1
