"""The file of a job's events that ``ftrun --record`` writes at the job's end and ``elastic-ft timeline --events``
reads, after an embedded etcd is gone: one JSON event a line (:class:`~elastic_ft.observability.events.JobEvent`'s
codec, which stays pure)."""

from __future__ import annotations

from elastic_ft.observability.events import JobEvent
from elastic_ft.untrusted import MalformedRecord


def read_events_file(path: str) -> list[JobEvent]:
    """Events saved by ``ftrun --record`` (one JSON event a line), in the order they happened.

    Raises:
        MalformedRecord: the file is empty, or a line is not an event (its number is named).
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as file:
        lines = file.read().splitlines()
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(JobEvent.from_json(line))
        except MalformedRecord as error:
            raise MalformedRecord(f"{path}:{number}: {error}") from None
    if not events:
        raise MalformedRecord(f"{path} holds no events (expected one JSON event a line, as ftrun --record writes)")
    return sorted(events, key=lambda event: event.time)


def write_events_file(path: str, events: list[JobEvent]) -> None:
    """One JSON event a line (what :func:`read_events_file` reads)."""
    with open(path, "w", encoding="utf-8") as file:
        file.writelines(event.to_json() + "\n" for event in events)
