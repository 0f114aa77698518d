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
   from the watch.
4. Every request is safe to resend: joins and results are guarded by create
   revisions, so a timed-out request with an unknown outcome is simply
   re-evaluated against the watched state.

The store of round ``n`` lives under ``<run>/round/<n>/store/``; closing
round ``n`` deletes the keys of round ``n - 2``, which no live node can use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic_ft.etcd.client import (
    EtcdClient,
    EtcdRequestError,
    EtcdUnavailableError,
    delete_op,
    delete_prefix_op,
    key_created_at,
    key_missing,
    put_op,
)
from elastic_ft.etcd.session import Session
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.etcd.view import PrefixView
from elastic_ft.net import free_port
from elastic_ft.observability import sink as event_sink
from elastic_ft.rendezvous import model, rules
from elastic_ft.rendezvous.config import EtcdftSettings, connect, settings_from_parameters

log = logging.getLogger(__name__)

BACKEND_NAME = "etcdft"


def _node_id() -> str:
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname()) or "host"
    return f"{host}_{os.getpid()}_{secrets.token_hex(3)}"


class EtcdftRendezvousHandler(RendezvousHandler):
    """See the module docstring and ``docs/rendezvous.md``."""

    def __init__(self, settings: EtcdftSettings, client: EtcdClient | None = None) -> None:
        self.settings = settings
        self.node = _node_id()
        self._addr = settings.local_addr or socket.getfqdn()
        self._limits = rules.Limits(
            settings.min_nodes, settings.max_nodes, settings.last_call_timeout, settings.spare_nodes
        )
        self._keys = settings.keys
        self._client = client or connect(settings)
        try:
            self._client.check_connection()
            self._view: PrefixView[model.Fact, model.RendezvousState] = PrefixView(
                self._client, self._keys.rdzv, model.parse_key, model.build_state
            )
        except (EtcdUnavailableError, EtcdRequestError) as exc:
            self._client.close()
            raise RendezvousConnectionError(
                f"etcdft rendezvous '{settings.run_id}' cannot use etcd at {self._client.describe_endpoints()}: {exc}"
            ) from exc
        self._lock = threading.Lock()
        self._session: Session | None = None
        self._joined_round: int | None = None
        self._member_of: model.RoundResult | None = None
        #: The group rank this node took as a hot spare that joined a running round (None: a member).
        self.late_place: int | None = None
        self._shut_down = False
        self._logged_verdict: tuple[int, rules.CloseVerdict] | None = None
        self._warned_malformed: Mapping[str, str] = {}
        self._announced_with: int | None = None  # the session whose lease this member's alive key is on
        self._outage_grace_until = 0.0
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
                log_ = EventLog(self._events_client, self._keys, settings.events_kept)
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
        return self._client

    @property
    def requests(self) -> int:
        """etcd requests this node has sent so far (for benchmarks)."""
        return self._client.requests

    def next_rendezvous(self) -> RendezvousInfo:
        with self._lock:
            if self._shut_down:
                raise RendezvousStateError(f"the etcdft handler of node {self.node} has been shut down")
            start = time.monotonic()
            try:
                info = self._next_rendezvous()
                self.last_round_seconds = time.monotonic() - start
                return info
            except (EtcdUnavailableError, EtcdRequestError) as exc:
                raise RendezvousConnectionError(
                    f"etcdft rendezvous '{self.settings.run_id}' lost etcd at "
                    f"{self._client.describe_endpoints()}: {exc}"
                ) from exc

    def _next_rendezvous(self) -> RendezvousInfo:
        settings = self.settings
        deadline = time.monotonic() + settings.join_timeout
        session = self._ensure_session()
        joined: int | None = None  # the round this call has joined
        last_call: tuple[int, float | None] = (-1, None)
        while True:
            if session.expired.is_set():
                session = self._ensure_session()
                joined = None
            if self._view.disconnected_for() > settings.connect_timeout:
                raise EtcdUnavailableError(
                    f"the watch on etcd has been down for more than {settings.connect_timeout:g} s"
                )
            # Waiting sends nothing: a frozen etcd would go unnoticed until the lease ran out.
            self._client.ensure_reachable()
            state, version = self._snapshot()
            now = time.monotonic()
            number = state.open_round
            since = last_call[1] if last_call[0] == number else None
            since = rules.last_call_started(state, number, self._limits, now, since)
            last_call = (number, since)
            action = rules.next_action(state, self.node, session.id, joined, self._limits, now, since)
            self._log_verdict(action)
            if isinstance(action, rules.Done):
                return self._completed(action)
            if isinstance(action, rules.Closed):
                last = state.last_closed
                if last is None or last.rank_of(self.node) is None:
                    # A spare (or late node) the job finished without: nothing failed.
                    raise RendezvousGracefulExitError(
                        f"the rendezvous '{settings.run_id}' was closed while node {self.node} waited to join"
                    )
                raise RendezvousClosedError(f"the rendezvous '{settings.run_id}' is closed")
            if isinstance(action, rules.Wait) and action.standby:
                deadline = max(deadline, now + settings.join_timeout)
            if now >= deadline:
                self._withdraw()
                raise RendezvousTimeoutError(self._timeout_message(state, number))
            if isinstance(action, rules.JoinLate):
                info = self._join_late(action, state, session.id, version)
                if info is not None:
                    return info
            elif isinstance(action, rules.JoinRound):
                if self._join(action.number, session.id, version):
                    joined = action.number
            elif isinstance(action, rules.CloseRound):
                self._close(action, version)
            else:
                until = action.until if action.until is not None else deadline
                # Wake up at least once a second to notice a lost connection.
                self._view.wait_for_change(version, min(until, deadline, now + 1.0) - now)

    def _log_verdict(self, action: rules.Action) -> None:
        """Log the close verdict of the round this node waits in, each time it changes, with its reason."""
        if not isinstance(action, rules.Wait | rules.CloseRound):
            return
        verdict = action.verdict if isinstance(action, rules.Wait) else rules.CloseVerdict.CLOSE
        if self._logged_verdict == (action.number, verdict):
            return
        self._logged_verdict = (action.number, verdict)
        log.info("round %d of '%s': %s (%s)", action.number, self.settings.run_id, verdict.value, action.reason)

    def _snapshot(self) -> tuple[model.RendezvousState, int]:
        """The view's state; warns once for each malformed key it left out."""
        state, version = self._view.snapshot()
        if state.malformed != self._warned_malformed:
            for key, reason in state.malformed.items():
                if self._warned_malformed.get(key) != reason:
                    log.warning("ignoring malformed etcd key %s%s: %s", self._keys.rdzv, key, reason)
            self._warned_malformed = state.malformed
        return state, version

    def _ensure_session(self) -> Session:
        """Hold a live session; the node's alive key goes on its lease when it joins."""
        if self._session is not None and not self._session.expired.is_set():
            return self._session
        if self._session is not None:
            self._session.close(revoke=False)
        session = Session(self._client, self.settings.lease_ttl)
        self._session = session
        self._joined_round = None
        return session

    def _join(self, number: int, lease: int, version: int) -> bool:
        keys = self._keys
        join = model.join_value(self._addr, free_port(self._addr))
        alive = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        # The alive key rides in the join transaction: one revision, one watch
        # event batch for every other node, instead of two.
        ops = [put_op(keys.join(number, self.node), join, lease), put_op(keys.alive(self.node), alive, lease)]
        if self._joined_round is not None and self._joined_round != number:
            ops.append(delete_op(keys.join(self._joined_round, self.node)))
        guards = [key_missing(keys.result(number)), key_missing(keys.closed)]
        result = self._client.txn(guards, ops)
        if result.succeeded:
            self._joined_round = number
            self._announced_with = lease
            self._view.wait_for_revision(result.revision, self.settings.request_timeout)
            joins = self._snapshot()[0].round(number).joins
            if self.node in joins and min(joins, key=lambda n: joins[n].create_revision) == self.node:
                self._emit("round_opened", round=number)  # the round's first join
            self._emit("node_joined", round=number, host=self._addr)
        else:
            self._view.wait_for_change(version, self.settings.request_timeout)
        return result.succeeded

    def accept_late_joins(self) -> None:
        """Let this node join a running round as a hot spare (``ftrun``'s agent starts its workers as joiners)."""
        self._limits = dataclasses.replace(self._limits, late_joins=True)

    def _join_late(
        self, action: rules.JoinLate, state: model.RendezvousState, lease: int, version: int
    ) -> RendezvousInfo | None:
        """Take place ``action.place`` in the running round; its info on success, None if another node won it."""
        keys, number, result = self._keys, action.number, state.round(action.number).result
        if result is None:
            raise RuntimeError(f"round {number} has no result to join late")
        alive = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        late = model.LateMember(self.node, lease, action.place)
        ops = [
            put_op(keys.slot(number, action.place), json.dumps({"node": self.node}).encode(), lease),
            put_op(keys.late(number, self.node), late.to_json()),
            put_op(keys.alive(self.node), alive, lease),
        ]
        if self._joined_round is not None:
            ops.append(delete_op(keys.join(self._joined_round, self.node)))
        guards = [
            key_missing(keys.slot(number, action.place)),
            key_missing(keys.late(number, self.node)),
            key_missing(keys.result(number + 1)),
            key_missing(keys.closed),
        ]
        outcome = self._client.txn(guards, ops)
        if not outcome.succeeded:
            self._view.wait_for_change(version, self.settings.request_timeout)
            return None
        self._joined_round = None
        self._announced_with = lease
        self._view.wait_for_revision(outcome.revision, self.settings.request_timeout)
        self.late_place = action.place
        self._member_of = result
        self._emit("node_joined", round=number, host=self._addr, role="hot_spare", place=action.place)
        log.info(
            "node %s joined running round %d of '%s' as a hot spare (group rank %d)",
            self.node,
            number,
            self.settings.run_id,
            action.place,
        )
        store = EtcdStore(self._client, self.round_store_prefix(number), timedelta(seconds=self.settings.store_timeout))
        return RendezvousInfo(
            store, action.place, action.place + 1, RendezvousStoreInfo(result.master_addr, result.master_port)
        )

    def _close(self, action: rules.CloseRound, version: int) -> None:
        keys = self._keys
        number = action.number
        members = action.members
        leader = members[0]
        result = model.RoundResult(
            number, tuple(model.Member(j.node, j.lease) for j in members), leader.addr, leader.port
        )
        guards = [key_missing(keys.result(number))]
        if len(members) <= rules.MAX_CHECKED_MEMBERS:
            guards += [key_created_at(keys.join(number, j.node), j.create_revision) for j in members]
        ops = [put_op(keys.result(number), result.to_json())]
        if number >= 2:
            ops += [delete_prefix_op(keys.rdzv_round(number - 2)), delete_prefix_op(keys.round_data(number - 2))]
        outcome = self._client.txn(guards, ops)
        if outcome.succeeded:
            log.info("closed round %d of '%s' with %d node(s)", number, self.settings.run_id, len(members))
            self._emit("round_closed", round=number, members=[j.node for j in members], reason=action.reason)
            self._view.wait_for_revision(outcome.revision, self.settings.request_timeout)
        else:
            self._view.wait_for_change(version, self.settings.request_timeout)

    def _completed(self, done: rules.Done) -> RendezvousInfo:
        result = done.result
        self._member_of = result
        self.late_place = None
        store = EtcdStore(
            self._client,
            self.round_store_prefix(result.round),
            timedelta(seconds=self.settings.store_timeout),
        )
        log.info(
            "node %s is rank %d of %d in round %d of '%s'",
            self.node,
            done.rank,
            len(result.members),
            result.round,
            self.settings.run_id,
        )
        return RendezvousInfo(
            store, done.rank, len(result.members), RendezvousStoreInfo(result.master_addr, result.master_port)
        )

    def _withdraw(self) -> None:
        """Take back this node's join key, so a timed-out node is not counted."""
        if self._joined_round is None:
            return
        try:
            self._client.delete(self._keys.join(self._joined_round, self.node))
        except EtcdUnavailableError:
            log.warning("could not withdraw node %s from round %d", self.node, self._joined_round)
        self._joined_round = None

    def _timeout_message(self, state: model.RendezvousState, number: int) -> str:
        joined = len(state.round(number).joins)
        pending = rules.pending_members(state, number)
        message = (
            f"the rendezvous '{self.settings.run_id}' timed out after {self.settings.join_timeout:g} s "
            f"waiting for round {number}: {joined} node(s) joined, at least {self.settings.min_nodes} needed "
            f"(min_nodes={self.settings.min_nodes}, max_nodes={self.settings.max_nodes})"
        )
        if pending:
            message += (
                f"; {len(pending)} member(s) of round {number - 1} are still running and have not re-joined: "
                + ", ".join(m.node for m in pending)
            )
        return message

    def is_closed(self) -> bool:
        """Closed by ``set_closed()``, or every node of the last round left it (see ``rules.job_finished``)."""
        return rules.job_finished(self._snapshot()[0])

    def set_closed(self) -> None:
        try:
            self._client.put(self._keys.closed, b'{"closed": true}')
        except (EtcdUnavailableError, EtcdRequestError) as exc:
            raise RendezvousConnectionError(f"cannot close rendezvous '{self.settings.run_id}': {exc}") from exc

    def num_nodes_waiting(self) -> int:
        state, _ = self._snapshot()
        return rules.num_nodes_waiting(state, self._member_of, self._limits)

    def membership_change(self) -> rules.MembershipChange:
        """What changed around this node's round, from the watch-fed view.

        Also keeps this member announced: when its own alive key is gone
        (its lease ran out: etcd was frozen or unreachable for a whole
        ``lease_ttl``, which ends every node's lease at once), it opens a new
        session and puts the key again, and for the next ``lease_ttl``
        reports no member dead, giving the others the same time to
        re-announce themselves. Sends requests only then.
        """
        state, _ = self._snapshot()
        if self._member_of is not None and not self._shut_down and self._lost_own_announcement(state):
            self._announce_again()
            state, _ = self._snapshot()
        change = rules.membership_change(state, self._member_of, self._limits)
        if change.dead and time.monotonic() < self._outage_grace_until:
            return dataclasses.replace(change, dead=())
        return change

    def _lost_own_announcement(self, state: model.RendezvousState) -> bool:
        session = self._session
        if session is None or session.expired.is_set():
            return True
        return state.alive.get(self.node) not in (None, session.id) or (
            self.node not in state.alive and self._announced_with == session.id
        )

    def _announce_again(self) -> None:
        with self._lock:
            if self._session is not None and self._announced_with == self._session.id:
                self._session.expired.set()  # the key it carried is gone: so is its lease
            session = self._ensure_session()
            value = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
            revision = self._client.put(self._keys.alive(self.node), value, session.id)
            self._announced_with = session.id
            self._outage_grace_until = time.monotonic() + self.settings.lease_ttl
        log.warning(
            "node %s: its etcd lease ran out (etcd unreachable or frozen for %g s?); announced again on a new "
            "lease, and no member counts as dead for the next %g s",
            self.node,
            self.settings.lease_ttl,
            self.settings.lease_ttl,
        )
        self._view.wait_for_revision(revision, self.settings.request_timeout)

    @property
    def member_of(self) -> model.RoundResult | None:
        """The round this node belongs to (None before its first rendezvous)."""
        return self._member_of

    def round_store_prefix(self, number: int) -> str:
        return self._keys.round_store(number)

    def shutdown(self) -> bool:
        """Leave the rendezvous for good.

        Marks this node as having left its round cleanly (so the other
        members do not treat its departure as a failure), revokes its lease
        (deleting its alive and join keys at once), and stops the watch and
        the etcd connection.  Returns False if etcd could not be reached; the
        lease then expires on its own after ``lease_ttl``.
        """
        with self._lock:
            if self._shut_down:
                return True
            self._shut_down = True
            ok = True
            try:
                if self._member_of is not None:
                    self._client.put(self._keys.left(self._member_of.round, self.node), b'{"reason": "shutdown"}')
                    self._emit("node_left", round=self._member_of.round)
                if self._session is not None:
                    self._session.close(revoke=True)
            except (EtcdUnavailableError, EtcdRequestError) as exc:
                log.warning("etcdft shutdown of node %s incomplete: %s", self.node, exc)
                ok = False
            if self._own_events is not None:
                self._own_events.close(timeout=self.settings.request_timeout)  # its last events, bounded
                if self._events_client is not None:
                    self._events_client.close()
            self._view.stop()
            self._client.close()
            return ok
