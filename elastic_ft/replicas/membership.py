"""A rank's side of the replica groups' records in etcd: its own record, the quorums it follows, the proposals.

One watch-fed view (:class:`~elastic_ft.etcd.view.PrefixView`) of the
job's ``replicas/`` prefix answers "which quorum is the latest" from memory:
while membership is unchanged, a step asks etcd nothing. Rank 0 of every
replica group proposes the next quorum when the records change (a
compare-and-create of its id: the first proposal wins, the others read it);
the rule is :func:`~elastic_ft.replicas.quorum.next_quorum`, and its reason
is logged when it changes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from elastic_ft.etcd.client import EtcdClient, key_missing, put_op
from elastic_ft.etcd.kv import EtcdLeaseNotFoundError, EtcdRequestError, EtcdUnavailableError, KeyValue
from elastic_ft.etcd.view import PrefixView
from elastic_ft.keys import RunKeys, parse_quorum_key, parse_replica_member_key, suffix
from elastic_ft.replicas.quorum import MemberRecord, Quorum, QuorumDecision, next_quorum
from elastic_ft.runtime.waits import Backoff
from elastic_ft.untrusted import MalformedRecord, SkipLog

log = logging.getLogger(__name__)

#: The quorums a view keeps (the latest last): a few, for the logs and the status of a job.
KEPT_QUORUMS = 16


class LeaseLost(RuntimeError):
    """A rank's record could not be written: its lease is gone and no new one came."""


@dataclass(frozen=True)
class ReplicaState:
    """The replica groups as a rank sees them: every member's record and the quorums, latest last."""

    members: tuple[MemberRecord, ...]
    quorums: tuple[Quorum, ...]

    @property
    def latest(self) -> Quorum | None:
        return self.quorums[-1] if self.quorums else None


def _build(facts: Iterable[MemberRecord | Quorum]) -> ReplicaState:
    members: list[MemberRecord] = []
    quorums: list[Quorum] = []
    for fact in facts:
        if isinstance(fact, MemberRecord):
            members.append(fact)
        else:
            quorums.append(fact)
    quorums.sort(key=lambda quorum: quorum.id)
    return ReplicaState(tuple(members), tuple(quorums[-KEPT_QUORUMS:]))


class ReplicaMembership:
    """This rank's record, the job's quorums, and (on a group's rank 0) the proposals of the next quorum.

    Args:
        client: the etcd connection.
        keys: the job's keys.
        record: this rank's record, as first published.
        lease: the lease its record lives on (the rank's sentinel's).
        min_replicas: the fewest replica groups a quorum may have.
        grace: seconds a quorum holds a pending change: a failure some of its groups have not seen yet (after
            it, they are left out), or a group whose records are gone while no collective failed.
    """

    def __init__(
        self, client: EtcdClient, keys: RunKeys, record: MemberRecord, lease: int, min_replicas: int, grace: float
    ) -> None:
        self._client = client
        self._keys = keys
        self.record = record
        self._lease = lease
        self._min_replicas = min_replicas
        self._grace = grace
        self._skips = SkipLog(log)
        self._view: PrefixView[MemberRecord | Quorum, ReplicaState] | None = None
        self._proposer: threading.Thread | None = None
        self._stopped = threading.Event()
        self._lease_changed = threading.Condition(threading.RLock())
        self._last_reason = ""
        self._holding_since: tuple[int, float] | None = None

    def start(self) -> None:
        """Publish this rank's record, follow the prefix, and (on rank 0 of a group) start proposing."""
        self.publish(self.record)
        self._view = PrefixView(self._client, self._keys.replicas.prefix, self._parse, _build)
        if self.record.group_rank == 0:
            self._proposer = threading.Thread(target=self._propose_forever, name="elastic_ft-quorum", daemon=True)
            self._proposer.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._view is not None:
            self._view.stop()
        if self._proposer is not None:
            self._proposer.join(timeout=10)

    def publish(self, record: MemberRecord, lease: int | None = None) -> None:
        """Write this rank's record (on ``lease``, a new sentinel's, when given), retrying while etcd is away.

        Raises:
            LeaseLost: etcd no longer has the lease, and no new one came within ``grace`` seconds (the sentinel,
                which takes a new one when etcd lost the last, may be gone).
        """
        key = self._keys.replicas.member(record.replica, record.group_rank)
        backoff = Backoff()
        with self._lease_changed:  # the main thread's record and the sentinel's new lease, one at a time
            if lease is not None:
                self._lease = lease
                self._lease_changed.notify_all()
            self.record = record
            while True:
                try:
                    self._client.put(key, record.encode(), lease=self._lease)
                    return
                except EtcdUnavailableError:
                    backoff.pause()
                except EtcdLeaseNotFoundError:
                    if not self._lease_changed.wait_for(
                        functools.partial(self._lease_is_not, self._lease), self._grace
                    ):
                        raise LeaseLost(f"lease {self._lease:x} is gone and no new one came") from None

    def _lease_is_not(self, stale: int) -> bool:
        return self._lease != stale

    def republish(self, lease: int) -> None:
        """The record again, on ``lease``: the last lease was lost, and the record with it."""
        with self._lease_changed:
            record = self.record
        log.warning("replica %s rank %d: lease lost; publishing again", record.replica, record.group_rank)
        self.publish(record, lease)

    def state(self) -> tuple[ReplicaState, int]:
        """The replica groups as last seen, and the view's version (which every change advances)."""
        return self._followed().snapshot()

    def wait_for_change(self, version: int, timeout: float) -> None:
        self._followed().wait_for_change(version, timeout)

    def _followed(self) -> PrefixView[MemberRecord | Quorum, ReplicaState]:
        if self._view is None:
            raise RuntimeError("ReplicaMembership: start() it before asking for the replica groups")
        return self._view

    def _parse(self, relative: str, kv: KeyValue) -> MemberRecord | Quorum | None:
        try:
            member = suffix(relative, "members/")
            if member is not None:
                place = parse_replica_member_key(member)
                return None if place is None else MemberRecord.decode(place[0], place[1], kv.value)
            quorum = suffix(relative, "quorum/")
            if quorum is not None and parse_quorum_key(quorum) is not None:
                return Quorum.decode(kv.value)
        except MalformedRecord as error:
            self._skips.skip(error.at(kv.key), "a replica record")
        return None

    def decide(self, state: ReplicaState) -> QuorumDecision:
        """The next quorum given ``state`` (pure but for the grace's clock: a quorum may hold a pending change for
        ``grace`` seconds, counted from the first decision that held it)."""
        current = state.latest
        now = time.monotonic()
        held = self._holding_since
        grace_over = held is not None and current is not None and held[0] == current.id and now - held[1] >= self._grace
        decision = next_quorum(current, state.members, self._min_replicas, grace_over)
        if not decision.holding:
            self._holding_since = None
        elif current is not None and (held is None or held[0] != current.id):
            self._holding_since = (current.id, now)
        return decision

    def propose(self) -> QuorumDecision:
        """Decide from the view; write the quorum if it is new (one compare-and-create: a quorum is never
        overwritten, and the first of concurrent proposals wins). Logs the reason when it changes."""
        state, _ = self.state()
        decision = self.decide(state)
        if decision.reason != self._last_reason:
            log.info("replica %s: %s", self.record.replica, decision.reason)
            self._last_reason = decision.reason
        if decision.changed and decision.quorum is not None:
            key = self._keys.replicas.quorum(decision.quorum.id)
            self._client.txn([key_missing(key)], [put_op(key, decision.quorum.encode())])
        return decision

    def _propose_forever(self) -> None:
        backoff = Backoff()
        version = -1
        while not self._stopped.is_set():
            _, seen = self.state()
            try:
                decision = self.propose()
            except (EtcdUnavailableError, EtcdRequestError) as error:
                log.debug("proposing a quorum: %s; retrying", error)
                backoff.pause()
                continue
            backoff.reset()
            if seen == version and not decision.changed:
                # Nothing new since the last look: wait for a change (or for a failure's grace to end).
                self.wait_for_change(seen, self._grace / 4 if decision.holding else 1.0)
            version = seen
