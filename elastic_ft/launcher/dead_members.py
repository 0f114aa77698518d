"""The deaths of member nodes an agent absorbs: noted from the board or from its own probes, judged against
its own lease (``rendezvous/fencing.py``), and reported in the round's store so that in-process restart
goes on without their ranks."""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Iterable
from typing import Any

from elastic_ft.coordination.job import job_store
from elastic_ft.coordination.reports import report_node_gone
from elastic_ft.keys import FTRUN_NODES
from elastic_ft.launcher.records import NodeRecord
from elastic_ft.observability.sink import emit
from elastic_ft.rendezvous.fencing import death_verdict
from elastic_ft.rendezvous.handler import EtcdftRendezvousHandler
from elastic_ft.rendezvous.rules import MembershipChange
from elastic_ft.untrusted import MalformedRecord, decode

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Death:
    """A member's lease seen ended, not yet absorbed: when, under which lease of this node's, whether this agent's
    probes confirmed it, and why it waits (logged when that changes)."""

    seen_at: float
    lease: int
    confirmed: bool
    waits_because: str = ""


class DeadMembers:
    """The member deaths one set of workers has seen (the agent starts a new one with its workers)."""

    def __init__(self, handler: EtcdftRendezvousHandler) -> None:
        self._handler = handler
        #: Nodes whose lease this agent's probes revoked (they confirmed them lost), from the probe thread.
        self._revoked: queue.SimpleQueue[str] = queue.SimpleQueue()
        #: The nodes the board listed dead at the last look.
        self._seen: set[str] = set()
        #: Deaths noted, not yet absorbed or dropped.
        self._pending: dict[str, _Death] = {}
        #: Nodes absorbed once; those of them whose ranks could not be reported (lost).
        self._handled: set[str] = set()
        self._lost: set[str] = set()
        #: The ranks reported dead.
        self._ranks_reported: set[int] = set()

    def revoked(self, node: str) -> None:
        """This agent's probes confirmed ``node`` lost and ended its lease (any thread)."""
        self._revoked.put(node)

    def _note(self, change: MembershipChange) -> None:
        """Add to the deaths to absorb: the nodes the board lists dead that it did not list at the last look,
        and those this agent revoked since, unless they left cleanly (one probed while it shut down).

        The board lists a revoked node dead, but maybe not for long: one that
        still reaches etcd (cut off from its peers only) announces itself
        again at once (``EtcdftRendezvousHandler.membership_change``), and a
        loop that reads the board a moment later finds it alive. The agent
        that confirmed the loss absorbs it, whatever the board says by then.
        Each death is noted once, so a node that dies, rejoins and dies again
        is absorbed again.
        """
        now = time.monotonic()
        lease, _ = self._handler.presence.lease_proof()
        while not self._revoked.empty():
            node = self._revoked.get_nowait()
            if node not in change.left:
                self._pending[node] = _Death(now, lease, confirmed=True)
        for node in set(change.dead) - self._seen:
            self._pending.setdefault(node, _Death(now, lease, confirmed=False))
        self._seen = set(change.dead)

    def absorb(self, store: Any, change: MembershipChange) -> tuple[str, ...]:
        """Report the ranks of member nodes that died, so in-process restart goes on without them.

        A lease that ended is a death only if this node's own lease was alive
        then (:func:`~elastic_ft.rendezvous.fencing.death_verdict`): when etcd
        was away for everybody, every lease ended at once, and nobody is
        counted out. Returns the dead nodes it could not absorb: their ranks
        are unknown, or some of them never entered the Wrapper, so the others
        would wait for them at its initial barrier. A death stays pending
        until it is absorbed or dropped (etcd may fail midway).
        """
        self._note(change)
        now = time.monotonic()
        for node, death in sorted(self._pending.items()):
            if node == self._handler.node:
                del self._pending[node]
                continue
            own = None if death.confirmed else self._handler.presence.lease_proven_since(death.lease, death.seen_at)
            verdict, reason = death_verdict(
                confirmed_here=death.confirmed, own_lease=own, hold_until=self._handler.hold_until(), now=now
            )
            if verdict == "wait":
                if death.waits_because != reason:
                    death.waits_because = reason
                    log.info("node %s lost its lease; not counted out yet: %s", node, reason)
                continue
            if verdict == "drop":
                log.warning("node %s lost its lease, and is not counted out: %s", node, reason)
            else:
                self._absorb(store, node, listed=node in change.dead)
            del self._pending[node]
        return tuple(sorted(self._lost))

    def _absorb(self, store: Any, node: str, listed: bool) -> None:
        """Absorb the death of ``node`` (``listed``: the board lists it dead; else only this agent revoked it)."""
        if node in self._handled:
            self._absorb_again(store, node)
            return
        key = FTRUN_NODES + node
        if not store.check([key]):
            if listed:  # a member; one this agent revoked runs no workers in its round (a spare, say)
                log.warning("node %s died before publishing its ranks", node)
                self._lost.add(node)
                self._handled.add(node)
            return
        try:
            record = decode(key, store.get(key), NodeRecord.from_json)
        except MalformedRecord as error:
            log.warning("node %s died and its record is unreadable: %s", node, error)
            self._lost.add(node)
            self._handled.add(node)
            return
        job = job_store(store)
        # A respawned process not yet in the Wrapper (rank above the world) was never counted on.
        wrapped = all(job.is_wrapped(rank) for rank in record.global_ranks if rank < record.world_size)
        self._handled.add(node)
        if not wrapped:
            log.warning("node %s died before all its workers entered elastic_ft.Wrapper", node)
            self._lost.add(node)
            return
        self._report_node(store, node, record, "died")

    def _absorb_again(self, store: Any, node: str) -> None:
        """A node absorbed before died again: report it if ranks it runs now were admitted since (it rejoined).

        Its joiners still waiting for a place are left alone otherwise: a
        node cut off from its peers but not from etcd is revoked again and
        again while it announces itself again, and each report would send
        its waiting processes back to join again. With ranks to report, its
        joiners are withdrawn with them, so that no restart admits one that
        died with the node; one that lives joins again under a new initial
        rank (:class:`~elastic_ft.inprocess.restart.joining.Withdrawn`).
        """
        key = FTRUN_NODES + node
        try:
            record = decode(key, store.get(key), NodeRecord.from_json) if store.check([key]) else None
        except MalformedRecord as error:
            log.warning("node %s died again and its record is unreadable: %s", node, error)
            return
        if record is None:
            return
        job = job_store(store)
        active = [
            rank
            for rank in record.global_ranks
            if rank not in self._ranks_reported and job.position(rank) is not None and job.left(rank) is None
        ]
        if active:
            self._report_node(store, node, record, "died again")

    def _report_node(self, store: Any, node: str, record: NodeRecord, what: str) -> None:
        reported = report_node_gone(store, record.global_ranks, record.world_size, f"node {node} {what}")
        self._ranks_reported.update(record.global_ranks)
        # Every surviving agent absorbs the death and one records it; the Wrappers' restart report warns.
        log.info("node %s %s; reported its rank(s) %s terminated", node, what, reported)
        if self._reports_deaths({*self._seen, node}):
            emit(
                "node_died",
                source="agent",
                node=node,
                round=None if self._handler.member_of is None else self._handler.member_of.round,
                ranks=list(record.global_ranks),
                reporter=self._handler.node,
            )

    def _reports_deaths(self, dead: Iterable[str]) -> bool:
        """Whether this node is the round's first member still alive: the one that reports member deaths."""
        member_of = self._handler.member_of
        if member_of is None:
            return True
        alive = [m.node for m in member_of.members if m.node not in dead]
        return not alive or alive[0] == self._handler.node
