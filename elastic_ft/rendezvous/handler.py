"""``etcdft``: torch's ``RendezvousHandler`` on etcd v3.

This module carries out, against etcd, what ``rules.py`` decides.  A node's
life in the rendezvous:

1. On its first ``next_rendezvous()`` the node grants itself a lease of
   ``lease_ttl`` seconds, refreshed by a daemon thread.  If the agent dies,
   the lease expires and every key the node holds disappears with it.
2. To join the open round ``n`` it puts ``rdzv/round/<n>/join/<node>`` and
   ``rdzv/alive/<node>`` on its lease, in a transaction that fails if round
   ``n`` has closed meanwhile.
3. The earliest joiner closes the round when ``rules.close_verdict`` allows,
   writing ``rdzv/round/<n>/result`` (members in rank order, the
   MASTER_ADDR/PORT of rank 0) in a transaction that fails if the result
   exists or any member's join key changed.  Everyone else learns the result
   from the board: the one key every node watches, which the monitor node
   (the one that follows every rendezvous key) rewrites when what the
   nodes act on changes.
4. Every request is safe to resend: joins and results are guarded by create
   revisions, so a timed-out request with an unknown outcome is simply
   re-evaluated against the watched state.

The store of round ``n`` lives under ``<run>/round/<n>/store/``; closing
round ``n`` deletes the keys of round ``n - 2``, which no live node can use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)

from elastic_ft.etcd.client import EtcdClient, EtcdRequestError, EtcdUnavailableError
from elastic_ft.observability import sink as event_sink
from elastic_ft.rendezvous import model, node_state, rules
from elastic_ft.rendezvous.config import EtcdftSettings, RendezvousConfigError, connect, settings_from_parameters
from elastic_ft.rendezvous.join import JoinCall, NodeParts, StateCell, read_result
from elastic_ft.rendezvous.monitor import MonitorSeat
from elastic_ft.rendezvous.presence import NodePresence
from elastic_ft.rendezvous.views import BoardView, WholeState
from elastic_ft.untrusted import SkipLog

log = logging.getLogger(__name__)

BACKEND_NAME = "etcdft"


def launcher_order(environ: Mapping[str, str]) -> int | None:
    """This node's place in its launcher's order: ``SLURM_PROCID`` under ``srun`` (one ``ftrun`` per node).

    Slurm numbers the tasks in its node order, which follows the network
    topology; new node ranks are given in that order, so neighbours in the
    allocation are neighbours in rank.

    Raises:
        RendezvousConfigError: ``SLURM_PROCID`` is not an integer >= 0.
    """
    text = environ.get("SLURM_PROCID")
    if text is None:
        return None
    if not text.isdigit():
        raise RendezvousConfigError(f"SLURM_PROCID must be an integer >= 0, got {text!r}")
    return int(text)


#: The node's segment label (an NVLink domain, a rack), for a rendezvous with ``segment`` set.
SEGMENT_ENV = "ELASTIC_FT_NODE_SEGMENT"
_SEGMENT_LABEL = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")


def node_segment(environ: Mapping[str, str]) -> str | None:
    """This node's segment label: ``ELASTIC_FT_NODE_SEGMENT``, else the switch above it in Slurm's topology
    (``SLURM_TOPOLOGY_ADDR`` without its last component, the node), else None.

    Raises:
        RendezvousConfigError: a label that is empty, longer than 128 characters, or has characters other
            than letters, digits and ``_.:/-``.
    """
    label = environ.get(SEGMENT_ENV)
    if label is None:
        address = environ.get("SLURM_TOPOLOGY_ADDR", "")
        label = address.rpartition(".")[0] or None
        if label is None:
            return None
    if not _SEGMENT_LABEL.fullmatch(label):
        raise RendezvousConfigError(
            f"{SEGMENT_ENV}={label!r:.200} is not a segment label; expected 1 to 128 letters, digits, '_', '.', "
            "':', '/' or '-'"
        )
    return label


def _node_id() -> str:
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname()) or "host"
    return f"{host}_{os.getpid()}_{secrets.token_hex(3)}"


class EtcdftRendezvousHandler(RendezvousHandler):
    """See the module docstring and ``docs/rendezvous.md``.

    Its collaborators: :class:`~join.JoinCall` (one ``next_rendezvous()``),
    :class:`~presence.NodePresence` (the lease, alive record and probe),
    :class:`~monitor.MonitorSeat`, and the views of ``views.py``; what they
    share is one :class:`~join.NodeParts`.
    """

    def __init__(self, settings: EtcdftSettings, client: EtcdClient | None = None) -> None:
        self.settings = settings
        order = launcher_order(os.environ)  # raises on a malformed one, before anything is started
        segment = node_segment(os.environ) if settings.segment is not None else None
        if settings.segment is not None and segment is None:
            raise RendezvousConfigError(
                f"segment={settings.segment} needs this node's segment label: set {SEGMENT_ENV} (ftrun "
                "--node-segment), or run under Slurm with a topology (SLURM_TOPOLOGY_ADDR)"
            )
        self.node = _node_id()
        addr = settings.local_addr or socket.getfqdn()
        keys = settings.keys
        client = client or connect(settings)
        skipped = SkipLog(log)
        try:
            client.check_connection()
            board = BoardView(client, keys.board, skipped)
        except (EtcdUnavailableError, EtcdRequestError) as exc:
            client.close()
            raise RendezvousConnectionError(
                f"etcdft rendezvous '{settings.run_id}' cannot use etcd at {client.describe_endpoints()}: {exc}"
            ) from exc
        whole = WholeState(client, keys.rdzv, board.view, skipped)
        presence = NodePresence(client, keys, self.node, addr, settings.lease_ttl)
        self._parts = NodeParts(
            settings=settings,
            node=self.node,
            addr=addr,
            keys=keys,
            client=client,
            limits=rules.Limits(
                settings.min_nodes,
                settings.max_nodes,
                settings.last_call_timeout,
                settings.spare_nodes,
                segment=settings.segment,
            ),
            board=board,
            whole=whole,
            presence=presence,
            seat=MonitorSeat(client, keys, self.node, whole, self.hold_until, settings.request_timeout),
            state=StateCell(self.node),
            emit=self._emit,
            skipped=skipped,
            leaving=threading.Event(),
            order=order,
            segment=segment,
        )
        #: What peers and the fence keeper use: this node's lease, alive record, probe and promises.
        self.presence = presence
        self._lock = threading.Lock()
        self._shut_down = False
        self._logged_membership = ""
        #: Seconds the last completed ``next_rendezvous`` call took (the round's duration for this node).
        self.last_round_seconds: float | None = None
        self._own_events: event_sink.EventSink | None = None
        self._events_client: EtcdClient | None = None

    def _emit(self, name: str, **fields: Any) -> None:
        """Record a rendezvous event: through the process's sink (``ftrun`` installs one for the run), else
        this handler's own, into the run's event log (a plain ``torchrun`` job, or several handlers in one
        process, each keeping to its own run)."""
        sink = event_sink.installed()
        if sink is None or sink.run_id != self.settings.run_id:
            if self._own_events is None:
                from elastic_ft.etcd.event_log import EventLog

                # Its own connection: the rendezvous's requests (what benchmarks count) stay its own.
                settings = self.settings
                self._events_client = connect(settings)
                log_ = EventLog(self._events_client, settings.keys, settings.events_kept)
                self._own_events = event_sink.EventSink(settings.run_id, "rendezvous", log_.append).start()
            sink = self._own_events
        sink.emit(name, source="rendezvous", node=self.node, **fields)

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> EtcdftRendezvousHandler:
        return cls(settings_from_parameters(params))

    # ---- RendezvousHandler ----

    def get_backend(self) -> str:
        return BACKEND_NAME

    def get_run_id(self) -> str:
        return self.settings.run_id

    @property
    def use_agent_store(self) -> bool:
        # Workers bootstrap their own TCPStore at MASTER_ADDR/PORT; the
        # agent's store is in etcd and is not a TCPStore they could join.
        return False

    @property
    def client(self) -> EtcdClient:
        return self._parts.client

    @property
    def requests(self) -> int:
        """etcd requests this node has sent so far (for benchmarks)."""
        return self._parts.client.requests

    @property
    def watch_events(self) -> int:
        """Watch events this node has received so far: the board's, and those of every key while it monitors
        or closes a round (for benchmarks)."""
        return self._parts.board.view.events_received + self._parts.whole.events_received

    @property
    def late_place(self) -> int | None:
        """The group rank this node took as a hot spare that joined a running round (None: a member)."""
        return self._parts.state.value.late_place

    @property
    def is_monitor(self) -> bool:
        return self._parts.seat.held

    def next_rendezvous(self) -> RendezvousInfo:
        with self._lock:
            if self._shut_down:
                raise RendezvousStateError(f"the etcdft handler of node {self.node} has been shut down")
            start = time.monotonic()
            try:
                info = JoinCall(self._parts).run()
                self.last_round_seconds = time.monotonic() - start
                return info
            except (EtcdUnavailableError, EtcdRequestError) as exc:
                raise RendezvousConnectionError(
                    f"etcdft rendezvous '{self.settings.run_id}' lost etcd at "
                    f"{self._parts.client.describe_endpoints()}: {exc}"
                ) from exc

    def hold_until(self) -> float:
        """Before when no member counts as dead here: this node's promises, and the quiet window after it
        announced itself again."""
        return max(self.presence.held_until, self._parts.state.value.quiet_until)

    def revoke(self, node: str, lease: int, reason: str) -> None:
        """End ``node``'s lease, so every node sees it dead through its watch at once (idempotent)."""
        self.presence.revoke(node, lease, reason)
        self._emit("node_revoked", round=self._parts.state.value.member_round, lost=node, reason=reason)

    def accept_late_joins(self, accept: bool = True) -> None:
        """Let this node join a running round (``ftrun``'s agent starts its workers as joiners), or no more."""
        self._parts.limits = dataclasses.replace(self._parts.limits, late_joins=accept)

    def _board(self, *, campaign: bool) -> node_state.BoardLook:
        """The board to act on (see :func:`node_state.look_at_board`); takes over as monitor when it says so."""
        parts = self._parts
        session = parts.presence.live_session()
        may_take_over = campaign and session is not None
        current, _ = parts.board.snapshot()
        with parts.state.lock:
            parts.state.value, look = node_state.look_at_board(
                parts.state.value, current, parts.board.last, may_take_over=may_take_over
            )
        if look.take_over and session is not None:
            parts.seat.campaign(session, parts.limits)
            current, _ = parts.board.snapshot()
            if current is not None:
                with parts.state.lock:
                    parts.state.value, look = node_state.look_at_board(
                        parts.state.value, current, parts.board.last, may_take_over=False
                    )
        return look

    # ---- what the agent polls ----

    def is_closed(self) -> bool:
        """Closed by ``set_closed()``, or every node of the last round left it (see ``rules.job_finished``)."""
        look = self._board(campaign=False)
        if look.board is None or look.vanished:
            return rules.job_finished(self._parts.whole.snapshot()[0])  # no monitor: read the state once
        return look.board.finished

    def set_closed(self) -> None:
        try:
            self._parts.client.put(self._parts.keys.closed, b'{"closed": true}')
        except (EtcdUnavailableError, EtcdRequestError) as exc:
            raise RendezvousConnectionError(f"cannot close rendezvous '{self.settings.run_id}': {exc}") from exc

    def num_nodes_waiting(self) -> int:
        return rules.waiting_count(self.membership_change())

    def membership_change(self) -> rules.MembershipChange:
        """What changed around this node's round, from the monitor's board.

        Also keeps this member announced: when its own alive key is gone
        (its lease ran out: etcd was frozen or unreachable for a whole
        ``lease_ttl``, which ends every node's lease at once), it opens a new
        session and puts the key again, and for the next ``lease_ttl``
        reports no member dead, giving the others the same time to
        re-announce themselves. Sends requests only then, and to take over
        as monitor when the board's monitor is gone.
        """
        state = self._parts.state
        look = self._board(campaign=state.value.member_round is not None)
        live = self.presence.live_session() is not None
        lost = None if self._shut_down else node_state.lost_announcement(state.value, live, look.board)
        if lost is not None:
            self._announce_again(lost)
            look = self._board(campaign=False)
        change, reason = node_state.membership(state.value, look, time.monotonic(), self.presence.held_until)
        if reason != self._logged_membership and (change.dead or look.vanished or self._logged_membership):
            self._logged_membership = reason
            log.info("node %s, round %s of '%s': %s", self.node, state.value.member_round, self.settings.run_id, reason)
        return change

    def _announce_again(self, why: str) -> None:
        parts = self._parts
        with self._lock:
            session = self.presence.session
            if session is not None and node_state.announcement_lost_its_lease(parts.state.value, session.id):
                session.expired.set()  # the key it carried is gone: so is its lease
            session = parts.ensure_session()
            parts.client.put(parts.keys.alive(self.node), self.presence.alive_record(), session.id)
            parts.state.apply(node_state.announced, session.id, time.monotonic(), self.settings.lease_ttl)
        log.warning(
            "node %s: its etcd lease is gone (%s: revoked by a member that confirmed it lost, or ended by etcd after "
            "%g s without a refresh: its link to etcd was cut, or etcd was frozen or without a leader); announced "
            "again on a new lease, and no member counts as dead for the next %g s",
            self.node,
            why,
            self.settings.lease_ttl,
            self.settings.lease_ttl,
        )

    @property
    def segment(self) -> str | None:
        """This node's segment label (with a segment size set; None otherwise)."""
        return self._parts.segment

    @property
    def member_of(self) -> model.RoundResult | None:
        """The round this node belongs to (None before its first rendezvous); its members are read once, when
        first asked for (a node learns only its own place when the round closes)."""
        state = self._parts.state.value
        if state.member_round is None:
            return None
        if state.member_of is not None and state.member_of.round == state.member_round:
            return state.member_of
        result = read_result(self._parts, state.member_round)
        self._parts.state.apply(node_state.members_read, result)
        return result

    def round_store_prefix(self, number: int) -> str:
        return self._parts.keys.round_store(number)

    def shutdown(self) -> bool:
        """Leave the rendezvous for good.

        Marks this node as having left its round cleanly (so the other
        members do not treat its departure as a failure), revokes its lease
        (deleting its alive and join keys at once), and stops the watch and
        the etcd connection.  Returns False if etcd could not be reached; the
        lease then expires on its own after ``lease_ttl``.
        """
        parts = self._parts
        parts.leaving.set()  # a next_rendezvous() holding the lock (a standby waits there for long) ends now
        parts.board.view.nudge()
        live = parts.whole.live
        if live is not None:
            live.nudge()
        with self._lock:
            if self._shut_down:
                return True
            ok = True
            try:
                member_round = parts.state.value.member_round
                if member_round is not None:
                    parts.client.put(parts.keys.left(member_round, self.node), b'{"reason": "shutdown"}')
                    self._emit("node_left", round=member_round)
                    # Its board must say it left before the board goes with its lease.
                    parts.seat.wait_published(lambda b: self.node in b.left)
            except (EtcdUnavailableError, EtcdRequestError) as exc:
                log.warning("etcdft shutdown of node %s incomplete: %s", self.node, exc)
                ok = False
            self._shut_down = True
            parts.seat.close()  # before the lease goes: a monitor must not publish after it
            try:
                self.presence.close(revoke=ok)  # etcd just failed: its lease expires on its own
            except (EtcdUnavailableError, EtcdRequestError) as exc:
                log.warning("etcdft shutdown of node %s: its lease expires on its own: %s", self.node, exc)
                ok = False
            if self._own_events is not None:
                self._own_events.close(timeout=self.settings.request_timeout)  # its last events, bounded
                if self._events_client is not None:
                    self._events_client.close()
            parts.whole.stop()
            parts.board.view.stop()
            parts.client.close()
            return ok
