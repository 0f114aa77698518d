"""A process's event emitter: torch's elastic events and the run's event log in etcd.

:func:`emit` is what the rendezvous, the agent and the Wrapper call. It
never blocks and never raises: the event is queued, and one background
thread hands it to torch's ``events.record`` (so ``--event-log-handler``
receives it) and appends it to the run's :class:`~elastic_ft.etcd.event_log.EventLog`.
Keeping etcd I/O off the caller's thread matters on the worker side, where
the main thread may be interrupted by a restart at any moment; for the same
reason the queue is a ``collections.deque`` (its ``append`` takes no lock an
asynchronous exception could leave held), which the thread polls every
:data:`POLL` seconds. While etcd is away the thread keeps the events and
sends them, in order and each once, when it answers again (a backoff between
tries); a full queue drops events (counted and logged once), rather than
slowing training.

Each process has at most one sink (:func:`install`); without one,
:func:`emit` does nothing. The worker side installs one from the
``ELASTIC_FT_EVENTS`` hand-off (:class:`EventsHandoff`) that ``ftrun``'s
agent puts in its workers' environment.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic_ft.observability.events import JobEvent
from elastic_ft.runtime.waits import aligned_instant
from elastic_ft.untrusted import MalformedRecord

log = logging.getLogger(__name__)

EVENTS_ENV = "ELASTIC_FT_EVENTS"
_QUEUE_SIZE = 10_000
#: Seconds between two looks of the sending thread at the queue.
POLL = 0.05
#: The longest pause between two tries to store an event while etcd does not answer.
_RETRY_CAP = 1.0


@dataclass(frozen=True)
class EventsHandoff:
    """What a worker needs to record events: the run's keys, its node, torch's event destination, the sampling."""

    etcd_prefix: str
    run_id: str
    node: str
    capacity: int
    destination: str = "null"
    progress_interval: float = 5.0

    def to_env(self) -> dict[str, str]:
        return {EVENTS_ENV: json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> EventsHandoff | None:
        text = environ.get(EVENTS_ENV)
        if not text:
            return None
        try:
            document = json.loads(text)
            handoff = cls(**document)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{EVENTS_ENV}={text!r:.300} is not a valid events hand-off: {error}") from None
        texts = (handoff.etcd_prefix, handoff.run_id, handoff.node, handoff.destination)
        if not all(isinstance(value, str) for value in texts):
            raise ValueError(f"{EVENTS_ENV}={text!r:.300}: etcd_prefix, run_id, node and destination are strings")
        if isinstance(handoff.capacity, bool) or not isinstance(handoff.capacity, int) or handoff.capacity < 1:
            raise ValueError(f"{EVENTS_ENV}: capacity={handoff.capacity!r}; expected a positive whole number")
        interval = handoff.progress_interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < 1e6:
            raise ValueError(f"{EVENTS_ENV}: progress_interval={interval!r}; expected positive seconds")
        return handoff


class EventSink:
    """Sends events to torch's ``destination`` handler and to ``append`` (the run's event log), in a thread.

    Args:
        run_id: the run every event belongs to.
        source: ``rendezvous``, ``agent`` or ``worker``: the default source of emitted events.
        append: stores one event (``EventLog.append(event, event_id)``: the same id for every try of the same
            event, so that it is stored once), or ``None`` for torch's events only. A ``ConnectionError`` (etcd
            away) keeps the event to try again; any other error drops it.
        destination: the torch events handler (``--event-log-handler``); an unknown one is logged once.
        node: the default node of emitted events.
    """

    def __init__(
        self,
        run_id: str,
        source: str,
        append: Callable[[JobEvent, str], object] | None,
        destination: str = "null",
        node: str | None = None,
    ) -> None:
        self.run_id = run_id
        self.source = source
        self.node = node
        self._append = append
        #: The event whose store failed on etcd's absence, its id, and when to try it again (``time.monotonic()``).
        self._retry: tuple[JobEvent, str] | None = None
        self._retry_at = 0.0
        self._retry_pause = POLL
        self._close_by = 0.0
        self._destination = destination
        self._queue: deque[JobEvent] = deque()
        self._sending = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic_ft-events", daemon=True)
        self._started = False
        self._start_lock = threading.Lock()
        self._warned: set[str] = set()
        self.dropped = 0
        self.sent = 0
        self._progress: tuple[Callable[[], dict[str, Any] | None], float, bool] | None = None
        self._last_progress: dict[str, Any] | None = None

    def emit(self, name: str, **fields: Any) -> None:
        """Queue one event; ``fields`` are ``node``, ``round``, ``iteration``, ``rank``, ``source``, ``at`` (when
        it happened, if earlier than now: a ``time.time()``), the rest data."""
        try:
            event = self._event(name, fields)
        except MalformedRecord as error:
            self._warn_once("invalid", "dropping an invalid event %s: %s", name, error)
            return
        if len(self._queue) >= _QUEUE_SIZE:
            self.dropped += 1
            self._warn_once("full", "the event queue is full (%d): dropping events", _QUEUE_SIZE)
            return
        self._queue.append(event)

    def _event(self, name: str, fields: dict[str, Any]) -> JobEvent:
        where = {key: fields.pop(key) for key in ("node", "round", "iteration", "rank", "source") if key in fields}
        at = fields.pop("at", None)
        return JobEvent(
            name=name,
            time=time.time() if at is None else at,
            run_id=self.run_id,
            source=where.pop("source", self.source),
            node=where.pop("node", self.node),
            data=fields,
            **where,
        )

    def sample_progress(
        self, probe: Callable[[], dict[str, Any] | None], interval: float, *, aligned: bool = False
    ) -> None:
        """Every ``interval`` s, emit a ``progress`` event from ``probe()`` (event fields) when it changed.

        ``aligned``: at the wall clock's multiples of ``interval``, the same instants on every rank, so that a
        node relay stores its host's samples in one transaction. Not without a relay: the ranks' appends of one
        instant would race for the log's counter, each loser sending again.
        """
        self._progress = (probe, interval, aligned)

    def start(self) -> EventSink:
        """Start the sending thread (:func:`install` does); events emitted before wait for it."""
        with self._start_lock:
            if not self._started:
                self._started = True
                self._thread.start()
        return self

    def _run(self) -> None:
        next_sample = time.monotonic()
        while True:
            stopping = self._stop.wait(POLL)
            self._sending = True
            try:
                self._flush()
            finally:
                self._sending = False
            progress = self._progress
            if stopping:
                if progress is not None:
                    self._progress = None
                    self._sample(progress[0])  # the last step reached, for the timeline
                if (self._queue or self._retry is not None) and time.monotonic() < self._close_by:
                    continue  # what is left goes out while close() waits for it
                return
            if progress is not None and time.monotonic() >= next_sample:
                probe, interval, aligned = progress
                now = time.time()
                next_sample = time.monotonic() + (aligned_instant(now, interval) - now if aligned else interval)
                self._sample(probe)

    def _sample(self, probe: Callable[[], dict[str, Any] | None]) -> None:
        try:
            fields = probe()
        except Exception as error:  # noqa: BLE001 - a probe's failure must not stop the sender
            self._warn_once("probe", "the progress probe failed: %r", error)
            return
        if fields is None or fields == self._last_progress:
            return
        self._last_progress = dict(fields)
        try:
            self._queue.append(self._event("progress", dict(fields)))
        except MalformedRecord as error:
            self._warn_once("probe-invalid", "the progress probe gave an invalid event: %s", error)
        self._flush()

    def _flush(self) -> None:
        """Send the queued events in order; stop at one that etcd's absence holds back (tried again later)."""
        if self._retry is not None:
            if time.monotonic() < self._retry_at:
                return
            event, event_id = self._retry
            if not self._store(event, event_id):
                return
        while self._queue:
            event = self._queue.popleft()
            self._record(event)
            if not self._store(event, uuid.uuid4().hex):
                return

    def _record(self, event: JobEvent) -> None:
        try:
            from torch.distributed.elastic import events as torch_events

            torch_events.record(event.to_torch(), self._destination)
        except KeyError:
            self._warn_once(
                "destination", "no torch events handler named %r: events go to etcd only", self._destination
            )
        except Exception as error:  # noqa: BLE001 - a user's handler must not stop the sender
            self._warn_once("torch", "torch's events handler %r failed: %r", self._destination, error)

    def _store(self, event: JobEvent, event_id: str) -> bool:
        """Store ``event`` in the run's log; False when etcd's absence holds it back (kept to try again)."""
        if self._append is not None:
            try:
                self._append(event, event_id)
            except ConnectionError:  # etcd away: the event waits for it (the outage is logged by the client)
                self._retry = (event, event_id)
                self._retry_at = time.monotonic() + self._retry_pause * (0.5 + random.random() / 2)
                self._retry_pause = min(_RETRY_CAP, self._retry_pause * 2)
                return False
            except Exception as error:  # noqa: BLE001 - a refusal or a bad record: the job goes on, the event is lost
                self.dropped += 1
                self._warn_once(
                    "etcd", "could not store event %s in etcd (later failures are not logged): %s", event.name, error
                )
        self._retry, self._retry_pause = None, POLL
        self.sent += 1
        return True

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

    def close(self, timeout: float = 5.0) -> bool:
        """Send what is queued and a last progress sample (at most ``timeout`` s), then stop the thread.

        Returns False if events were left unsent.
        """
        if not self._started:
            return True
        self._close_by = time.monotonic() + timeout
        self._stop.set()
        self._thread.join(timeout)
        self._progress = None
        return not self._queue and self._retry is None


_sink: EventSink | None = None
_sink_lock = threading.Lock()


def install(sink: EventSink | None) -> EventSink | None:
    """Make ``sink`` this process's emitter (``None`` removes it); returns the one it replaces."""
    global _sink
    if sink is not None:
        sink.start()
    with _sink_lock:
        previous, _sink = _sink, sink
    return previous


def installed() -> EventSink | None:
    return _sink


def emit(name: str, **fields: Any) -> None:
    """Record an event with this process's sink; nothing without one. Never raises, never blocks."""
    sink = _sink
    if sink is not None:
        sink.emit(name, **fields)
