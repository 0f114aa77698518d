"""The node's fence on its local board, kept current from a thread of its own.

The workers read the fence before every optimizer step
(:mod:`elastic_ft.runtime.local_board`). It must stay current whatever the agent's
loop is doing, and that loop waits on etcd while etcd is away. Every
:data:`PERIOD` the keeper reads the node's lease proof (no I/O), asks the
other members for their promises when the proof is about to run out
(:mod:`elastic_ft.rendezvous.fencing`; in a helper thread), and writes the
fence and its generation. It also answers the members that ask (the probe
port's vouch), binding the node by the promises it gives, and keeps the
roster of the other nodes' probe addresses, read from etcd while etcd
answers, for the moment it does not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from elastic_ft.etcd.kv import EtcdRequestError, EtcdUnavailableError
from elastic_ft.rendezvous import fencing
from elastic_ft.rendezvous.handler import EtcdftRendezvousHandler
from elastic_ft.rendezvous.probe import ask_all
from elastic_ft.runtime.local_board import LocalBoard

log = logging.getLogger(__name__)

#: How often the fence is written: a worker waits at most this long for a fence that could go up again.
PERIOD = 0.05
#: How often the roster of the other nodes' probe addresses is read while etcd answers.
ROSTER_EVERY = 2.0
#: How long one member may take to answer a vouch request.
ASK_BOUND = 1.0


class FenceKeeper:
    """Keeps ``board``'s fence for ``handler``'s node; ``on_new_generation()`` runs when the node may have been
    counted out (its workers restart, and its new workers wait to reach the other members)."""

    def __init__(
        self, handler: EtcdftRendezvousHandler, board: LocalBoard, on_new_generation: Callable[[], None]
    ) -> None:
        self._handler = handler
        self._board = board
        self._on_new_generation = on_new_generation
        #: How long a promise lasts: the lease's TTL, the time a lease proof lasts.
        self.period = float(handler.settings.lease_ttl)
        self._lock = threading.Lock()
        #: Each member's latest promise end (``time.monotonic()``, from when it was asked), and the members whose
        #: last answer said they reach etcd.
        self._promised: dict[str, float] = {}
        self._reaching: set[str] = set()
        self._roster: dict[str, tuple[str, int] | None] = {}
        self._roster_read_at: float | None = None
        self._last_asked: float | None = None
        #: One helper thread each, so that a roster read hanging on an etcd that just went away delays no ask.
        self._helpers: dict[str, threading.Thread] = {}
        self._lease = 0
        self.generation = 0
        #: The fence ran out since the node's lease was last proven: a new lease may follow a count-out.
        self._lapsed = False
        self._valid_until = 0.0
        #: Until when the lease held at the last tick was proven alive (a new lease before then: it was revoked).
        self._proof = 0.0
        self._reason = ""
        self._promising = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic_ft-fence", daemon=True)

    def start(self) -> FenceKeeper:
        self._handler.presence.set_vouch(self.answer)
        self.tick(time.monotonic())  # the workers start under a fence already written
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(2.0)

    # ---- what the node answers ----

    def answer(self) -> fencing.Vouch:
        """A member asks whether this node reaches etcd: say so, or promise to count nobody out for a period."""
        now = time.monotonic()
        _, own = self._handler.presence.lease_proof()
        vouch, bound_until = fencing.answer(self._handler.node, own, self.period, now)
        if bound_until > now:
            self._handler.presence.hold(bound_until)
            if not self._promising:
                self._promising = True
                log.warning(
                    "node %s cannot reach etcd either: it promises the members that ask to count nobody "
                    "out while etcd is away",
                    self._handler.node,
                )
        elif self._promising:
            self._promising = False
            log.info("node %s reaches etcd again: it promises no more", self._handler.node)
        return vouch

    # ---- the fence ----

    def _run(self) -> None:
        while not self._stop.wait(PERIOD):
            try:
                self.tick(time.monotonic())
            except Exception:
                log.exception("keeping the fence failed")

    def tick(self, now: float) -> None:
        lease, own = self._handler.presence.lease_proof()
        if own > now or not self._roster:
            self._refresh_roster(now)
        with self._lock:
            promised = dict(self._promised)
            reaching = frozenset(self._reaching)
            members = frozenset(self._roster)
        all_promised = bool(members) and all(promised.get(node, 0.0) > now for node in members)
        if fencing.should_ask(own, self._last_asked, all_promised, self.period, now) and members:
            self._ask(now)
        decision = fencing.fence(own, promised, reaching, members, now)
        if self._valid_until <= now:
            self._lapsed = True
        if lease and lease != self._lease:
            revoked = bool(self._lease) and self._proof > now
            generation, why = fencing.next_generation(self.generation, True, self._lapsed, revoked)
            if self._lease:
                log.warning(
                    "node %s holds a new etcd lease: %s (fence generation %d)", self._handler.node, why, generation
                )
            bumped = generation != self.generation and self.generation > 0
            self._lease, self.generation = lease, generation
            if bumped:
                self._board.set_may_join(False)
                self._on_new_generation()
        if own > now:
            self._lapsed = False  # proven now: whatever follows starts from here
        self._proof = own
        self._valid_until = decision.valid_until
        self._board.set_fence(decision.valid_until, self.generation)
        if decision.reason != self._reason:
            if self._reason or decision.valid_until <= now:
                level = logging.WARNING if decision.valid_until <= now or decision.vouched else logging.INFO
                log.log(level, "node %s fence: %s", self._handler.node, decision.reason)
            self._reason = decision.reason

    def _busy(self, job: str) -> bool:
        helper = self._helpers.get(job)
        return helper is not None and helper.is_alive()

    def _refresh_roster(self, now: float) -> None:
        """Read the other nodes' probe addresses (in a helper thread), at most every :data:`ROSTER_EVERY`."""
        if self._busy("roster") or (self._roster_read_at is not None and now - self._roster_read_at < ROSTER_EVERY):
            return
        self._roster_read_at = now

        def read() -> None:
            try:
                alive = self._handler.presence.alive_nodes()
            except (EtcdUnavailableError, EtcdRequestError):
                return  # kept as it was: what the next outage's asks go by
            roster = {node: address for node, (_, address) in alive.items() if node != self._handler.node}
            with self._lock:
                self._roster = roster

        self._start_helper("roster", read)

    def _ask(self, now: float) -> None:
        """Ask every other member for a vouch (in a helper thread); each answer is kept with when it was asked."""
        if self._busy("ask"):
            return
        self._last_asked = now
        with self._lock:
            roster = dict(self._roster)

        def ask() -> None:
            asked_at = time.monotonic()
            answers = ask_all(roster, ASK_BOUND)
            with self._lock:
                for node, vouch in answers.items():
                    if vouch is None or vouch.node != node:
                        continue  # no answer (or another node's): what it promised before still holds
                    if vouch.proven:
                        self._reaching.add(node)
                    else:
                        self._reaching.discard(node)
                        self._promised[node] = max(self._promised.get(node, 0.0), asked_at + vouch.promise)

        self._start_helper("ask", ask)

    def _start_helper(self, job: str, target: Callable[[], None]) -> None:
        helper = threading.Thread(target=target, name=f"elastic_ft-fence-{job}", daemon=True)
        self._helpers[job] = helper
        helper.start()
