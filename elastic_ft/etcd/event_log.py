"""The run's event log in etcd: the last events, readable from any machine during and after the job.

Two streams, each bounded on its own: ``main`` (everything but progress)
and ``progress`` (the ranks' sampled steps, by far the most numerous), so
a long job's progress never pushes its faults out. In each stream
(:class:`elastic_ft.keys.RunKeys`), ``events/<stream>/next`` holds the
number the next event takes, and the event numbered ``seq`` is stored at
``events/<stream>/ring/<seq % capacity>``: a stream never holds more than
``capacity`` keys (the oldest are overwritten). Writers that disagree on
the capacity still bound it by the largest.

An append is one transaction guarded by the counter's revision, so
concurrent writers get distinct numbers. It is applied exactly once: each
event carries a unique id, and when etcd's answer is lost the writer reads
the slot it tried before trying again, in the same call or in a later one
with the same ``event_id`` (a sender that waits out an etcd outage).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from elastic_ft.config_fields import EVENTS_KEPT_DEFAULT, MAX_EVENTS_KEPT
from elastic_ft.etcd.client import Compare, EtcdClient, get_op, key_missing, key_modified_at, put_op
from elastic_ft.etcd.kv import EtcdUnavailableError, KeyValue
from elastic_ft.keys import EVENTS_MAIN, EVENTS_PROGRESS, RunKeys, count_suffix, parse_count
from elastic_ft.observability.events import JobEvent
from elastic_ft.untrusted import MalformedRecord

#: The settings' default and bound (``events_kept``), spelled once in elastic_ft.config_fields.
DEFAULT_CAPACITY, MAX_CAPACITY = EVENTS_KEPT_DEFAULT, MAX_EVENTS_KEPT


@dataclass
class EventLogRead:
    """What :meth:`EventLog.read` found: events in log order, and the keys it skipped with why."""

    events: list[JobEvent]
    malformed: list[dict[str, str]] = field(default_factory=list)
    revision: int = 0


class EventLog:
    """The bounded event log of one run."""

    def __init__(self, client: EtcdClient, keys: RunKeys, capacity: int = DEFAULT_CAPACITY) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"event log capacity={capacity!r}; expected a whole number from 1 to {MAX_CAPACITY}")
        self.client = client
        self.keys = keys
        self.capacity = capacity
        #: The last append that may have committed without an answer: its event id and the number it tried.
        self._unanswered: tuple[str, int] | None = None

    def append(self, event: JobEvent, event_id: str | None = None) -> int:
        """Store ``event`` in its stream; returns its sequence number there. Raises the client's errors.

        A transaction that loses the race for a number (or a resend of one
        that had committed) answers with the counter and the slot it tried,
        so the next attempt needs no read of its own. ``event_id``: the same
        for every call that sends the same event (a new one by default).
        """
        stream = EVENTS_PROGRESS if event.name == "progress" else EVENTS_MAIN
        counter_key = self.keys.events_next(stream)
        event_id = event_id or uuid.uuid4().hex
        unanswered = self._unanswered
        if unanswered is not None and unanswered[0] == event_id and self._holds(unanswered[1], stream, event_id):
            self._unanswered = None
            return unanswered[1]  # an earlier call's send committed, its answer was lost
        counter, _ = self.client.get(counter_key)
        while True:
            seq, guard = self._next_number(counter_key, counter)
            self._unanswered = (event_id, seq)
            slot_key = self.keys.event_slot(seq % self.capacity, stream)
            document = {**event.to_document(), "seq": seq, "id": event_id}
            ops = [put_op(counter_key, str(seq + 1).encode()), put_op(slot_key, json.dumps(document).encode())]
            try:
                result = self.client.txn([guard], ops, [get_op(counter_key), get_op(slot_key)])
            except EtcdUnavailableError:
                if self._holds(seq, stream, event_id):  # raises if etcd is still unreachable
                    return seq  # the answer was lost, but it committed
                counter, _ = self.client.get(counter_key)
                continue
            self._unanswered = None
            if result.succeeded:
                return seq
            now, slot = result.ranges
            if slot and _event_id(slot[0].value) == event_id:
                return seq  # a resend of a transaction that had committed
            counter = now[0] if now else None  # another writer took the number: take the next

    @staticmethod
    def _next_number(counter_key: str, counter: KeyValue | None) -> tuple[int, Compare]:
        if counter is None:
            return 0, key_missing(counter_key)
        parsed = parse_count(counter.value.decode(errors="replace"))
        if parsed is None:
            raise MalformedRecord(f"{counter_key} holds {counter.value!r:.40}; expected a count")
        return parsed, key_modified_at(counter_key, counter.mod_revision)

    def _holds(self, seq: int, stream: str, event_id: str) -> bool:
        slot, _ = self.client.get(self.keys.event_slot(seq % self.capacity, stream))
        return slot is not None and _event_id(slot.value) == event_id

    def read(self, after: int | None = None, stream: str = EVENTS_MAIN) -> EventLogRead:
        """One stream's stored events in log order (those numbered above ``after`` only, when given).

        With ``after``, the counter is read first: when nothing was logged
        since, that one small read is all (what a follower polling the log
        mostly sends).
        """
        if after is not None:
            counter, revision = self.client.get(self.keys.events_next(stream))
            logged = parse_count(counter.value.decode(errors="replace")) if counter is not None else 0
            if logged is not None and logged <= after + 1:
                return EventLogRead([], [], revision)
        ring = self.keys.events_ring(stream)
        kvs, revision = self.client.get_prefix(ring)
        events, malformed = [], []
        for kv in kvs:
            if count_suffix(kv.key, ring) is None:
                malformed.append({"key": kv.key, "reason": "not an event slot"})
                continue
            try:
                event = JobEvent.from_json(kv.value)
            except MalformedRecord as error:
                malformed.append({"key": kv.key, "reason": str(error)[:300]})
                continue
            if event.seq is None or (event.name == "progress") != (stream == EVENTS_PROGRESS):
                malformed.append({"key": kv.key, "reason": f"not an event of the {stream} stream with its number"})
                continue
            if after is None or event.seq > after:
                events.append(event)
        events.sort(key=lambda event: event.seq or 0)
        return EventLogRead(events, malformed, revision)

    def read_all(self) -> EventLogRead:
        """Both streams, merged in the order the events happened (their wall times)."""
        main, progress = self.read(), self.read(stream=EVENTS_PROGRESS)
        merged = sorted(main.events + progress.events, key=lambda event: event.time)
        return EventLogRead(merged, main.malformed + progress.malformed, max(main.revision, progress.revision))


def _event_id(raw: bytes) -> str | None:
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return document.get("id") if isinstance(document, dict) else None
