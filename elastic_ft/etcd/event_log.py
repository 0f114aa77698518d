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
concurrent writers get distinct numbers. The transaction reads the
counter back, so a writer's next append needs no read of its own (a node
relay, its host's only writer, appends with one request); a writer that
another overtook meanwhile loses the race once and learns the counter from
the refusal. It is applied exactly once: each
event carries a unique id, and when etcd's answer is lost the writer reads
the slot it tried before trying again, in the same call or in a later one
with the same ``event_id`` (a sender that waits out an etcd outage).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from elastic_ft.config_fields import EVENTS_KEPT_DEFAULT, MAX_EVENTS_KEPT
from elastic_ft.etcd.client import Compare, EtcdClient, get_op, key_missing, key_modified_at, put_op
from elastic_ft.etcd.kv import EtcdUnavailableError, KeyValue
from elastic_ft.keys import EVENTS_MAIN, EVENTS_PROGRESS, RunKeys, count_suffix, parse_count
from elastic_ft.observability.events import JobEvent
from elastic_ft.untrusted import MalformedRecord, json_object

#: The settings' default and bound (``events_kept``), spelled once in elastic_ft.config_fields.
DEFAULT_CAPACITY, MAX_CAPACITY = EVENTS_KEPT_DEFAULT, MAX_EVENTS_KEPT
#: The most events one :meth:`EventLog.append_many` stores (a transaction's slots, within etcd's 128 operations).
APPEND_BATCH = 64


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
        #: Each stream's counter as this writer last saw it (the guard of its next append).
        self._counters: dict[str, KeyValue | None] = {}

    def append(self, event: JobEvent, event_id: str | None = None) -> int:
        """Store ``event`` in its stream; returns its sequence number there. Raises the client's errors.

        A transaction that loses the race for a number (or a resend of one
        that had committed) answers with the counter and the slot it tried,
        so the next attempt needs no read of its own. ``event_id``: the same
        for every call that sends the same event (a new one by default).
        """
        return self.append_many([(event, event_id or uuid.uuid4().hex)])[0]

    def append_many(self, batch: Sequence[tuple[JobEvent, str]]) -> list[int]:
        """Store events of one stream, each with its ``event_id``, in one transaction (consecutive numbers): what a
        node relay sends for its host's events of the moment, and :meth:`append` for one. Raises the client's
        errors.

        A transaction whose answer was lost is found committed by its first
        slot holding its first event's id, in this call or in a later one
        for the same first event.
        """
        if not 0 < len(batch) <= min(self.capacity, APPEND_BATCH):
            raise ValueError(f"append_many takes 1 to {min(self.capacity, APPEND_BATCH)} events, got {len(batch)}")
        streams = {EVENTS_PROGRESS if event.name == "progress" else EVENTS_MAIN for event, _ in batch}
        if len(streams) != 1:
            raise ValueError("append_many takes the events of one stream")
        (stream,) = streams
        counter_key, first_id = self.keys.events_next(stream), batch[0][1]
        unanswered = self._unanswered
        if unanswered is not None and unanswered[0] == first_id and self._holds(unanswered[1], stream, first_id):
            self._unanswered = None
            return list(range(unanswered[1], unanswered[1] + len(batch)))  # an earlier call's send committed
        counter = self._counters[stream] if stream in self._counters else self.client.get(counter_key)[0]
        while True:
            try:
                first, guard = self._next_number(counter_key, counter)
            except MalformedRecord:
                self._counters.pop(stream, None)  # read again next time: the record may be repaired
                raise
            self._unanswered = (first_id, first)
            numbers = list(range(first, first + len(batch)))
            ops = [put_op(counter_key, str(first + len(batch)).encode())]
            for seq, (event, event_id) in zip(numbers, batch, strict=True):
                document = {**event.to_document(), "seq": seq, "id": event_id}
                ops.append(put_op(self.keys.event_slot(seq % self.capacity, stream), json.dumps(document).encode()))
            ops.append(get_op(counter_key))  # the counter as this append leaves it: the next one's guard
            first_slot = self.keys.event_slot(first % self.capacity, stream)
            try:
                result = self.client.txn([guard], ops, [get_op(counter_key), get_op(first_slot)])
            except EtcdUnavailableError:
                self._counters.pop(stream, None)
                if self._holds(first, stream, first_id):  # raises if etcd is still unreachable
                    return numbers  # the answer was lost, but it committed
                counter, _ = self.client.get(counter_key)
                continue
            self._unanswered = None
            if result.succeeded:
                after = result.ranges[-1]
                if after:
                    self._counters[stream] = after[0]
                return numbers
            now, slot = result.ranges
            if slot and _event_id(slot[0].value) == first_id:
                return numbers  # a resend of a transaction that had committed
            counter = now[0] if now else None  # another writer took the numbers: take the next
            self._counters[stream] = counter

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
        found: list[tuple[JobEvent, str | None]] = []
        malformed = []
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
                found.append((event, _event_id(kv.value)))
        found.sort(key=lambda pair: pair[0].seq or 0)
        # An event sent through a node relay that stalled after it committed, and sent again by its writer, is
        # stored twice under one id (elastic_ft.etcd.node_relay); readers keep the first.
        seen: set[str] = set()
        events = []
        for event, event_id in found:
            if event_id is not None:
                if event_id in seen:
                    continue
                seen.add(event_id)
            events.append(event)
        return EventLogRead(events, malformed, revision)

    def read_all(self) -> EventLogRead:
        """Both streams, merged in the order the events happened (their wall times)."""
        main, progress = self.read(), self.read(stream=EVENTS_PROGRESS)
        merged = sorted(main.events + progress.events, key=lambda event: event.time)
        return EventLogRead(merged, main.malformed + progress.malformed, max(main.revision, progress.revision))


def _event_id(raw: bytes) -> str | None:
    document = json_object(raw)
    return None if document is None else document.get("id")
