"""An agent's probes of the other members: when a local rank stays blocked, ask every member's agent whether
it is there (``rendezvous/liveness.py``), and end the lease of one confirmed lost, so every node sees it dead
at once instead of after its lease runs out."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from elastic_ft.etcd.client import EtcdRequestError, EtcdUnavailableError
from elastic_ft.rendezvous.handler import EtcdftRendezvousHandler
from elastic_ft.rendezvous.liveness import (
    Answer,
    Detection,
    bounds_for,
    judge,
    peers_reachable,
    probe_targets,
    should_probe,
)
from elastic_ft.rendezvous.probe import probe_all
from elastic_ft.runtime.local_board import LocalBoard

log = logging.getLogger(__name__)


class MemberProbes:
    """Probes the other members from its own thread, at most one round at a time; ``on_lost(node)`` hears of
    each node it confirmed lost (after revoking its lease)."""

    def __init__(self, handler: EtcdftRendezvousHandler, board: LocalBoard, on_lost: Callable[[str], None]) -> None:
        self._handler = handler
        self._board = board
        self._on_lost = on_lost
        self._detection = Detection()
        self._last_probe: float | None = None  # time.monotonic() of the last round of probes
        self._probing: threading.Thread | None = None
        self._verdicts: dict[str, str] = {}  # the state (lost, alive) last logged per node
        self._answer_times: dict[str, collections.deque[float]] = {}  # recent answer times per node

    def probe_soon(self) -> None:
        """The node may have been counted out (``FenceKeeper``): probe the others now; they decide when its
        joiners may ask."""
        self._last_probe = None

    def watch(self) -> None:
        """Probe the other members when a local rank stays blocked.

        See :mod:`elastic_ft.rendezvous.liveness`: a probe refused or left
        unanswered confirms a member lost, and its lease is revoked at once
        (every node that confirms it may do so), instead of waiting for it
        to expire. A node that lost its own lease probes too, until it
        reaches every other member again.
        """
        board = self._board
        now = time.monotonic()
        since = None if self._last_probe is None else now - self._last_probe
        stalled = board.stalled_for(now)
        if not board.may_join():
            stalled = max(stalled or 0.0, self._detection.suspect_after)
        if (self._probing is not None and self._probing.is_alive()) or not should_probe(
            stalled, since, self._detection
        ):
            return
        self._last_probe = now
        self._probing = threading.Thread(
            target=self._probe_members, args=(board,), name="elastic_ft-probes", daemon=True
        )
        self._probing.start()

    def _probe_members(self, board: LocalBoard) -> None:
        try:
            alive = self._handler.presence.alive_nodes()
            targets = probe_targets(alive, alive, self._handler.node)
            detections = {node: bounds_for(self._answer_times.get(node, ()), self._detection) for node in targets}
            answers = probe_all({node: alive[node][1] for node in targets}, detections)
            for node, (answer, seconds) in answers.items():
                if answer is Answer.ANSWERED:
                    self._answer_times.setdefault(node, collections.deque(maxlen=8)).append(seconds)
            held_for = self._handler.hold_until() - time.monotonic()
            for verdict in judge(answers, self._handler.node, held_for):
                if self._verdicts.get(verdict.node) != verdict.state:
                    self._verdicts[verdict.node] = verdict.state
                    (log.warning if verdict.lost else log.info)("probe of node %s: %s", verdict.node, verdict.reason)
                if verdict.lost:
                    self._handler.revoke(verdict.node, alive[verdict.node][0], verdict.reason)
                    self._on_lost(verdict.node)
            if not board.may_join() and peers_reachable(answers):
                log.info("node %s reaches every other member again: its new workers may join", self._handler.node)
                board.set_may_join(True)
        except EtcdUnavailableError as error:  # etcd away: the process's outage record says so once
            log.debug("could not probe the other nodes: %s", error)
        except EtcdRequestError as error:
            log.warning("could not probe the other nodes: %s", error)
