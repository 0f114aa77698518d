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
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
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
    EtcdLeaseNotFoundError,
    EtcdRequestError,
    EtcdUnavailableError,
    delete_op,
    delete_prefix_op,
    key_created_at,
    key_missing,
    put_op,
)
from elastic_ft.etcd.kv import KeyValue
from elastic_ft.etcd.outage import bounded, grace
from elastic_ft.etcd.session import Session
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.etcd.view import PrefixView
from elastic_ft.observability import sink as event_sink
from elastic_ft.rendezvous import model, node_state, rules
from elastic_ft.rendezvous.config import EtcdftSettings, connect, settings_from_parameters
from elastic_ft.rendezvous.fencing import Vouch
from elastic_ft.rendezvous.monitor import Monitor
from elastic_ft.rendezvous.probe import ProbeServer, parse_address
from elastic_ft.runtime.net import free_port
from elastic_ft.runtime.waits import Backoff
from elastic_ft.untrusted import MalformedRecord, SkipLog

log = logging.getLogger(__name__)

BACKEND_NAME = "etcdft"


def _node_id() -> str:
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname()) or "host"
    return f"{host}_{os.getpid()}_{secrets.token_hex(3)}"


@dataclasses.dataclass
class _JoinAttempt:
    """What one ``next_rendezvous()`` call has done so far, from one look to the next."""

    #: When the call fails with RendezvousTimeoutError (``time.monotonic()``; a standby's moves on).
    deadline: float
    session: Session | None = None
    #: The round this call has joined.
    joined: int | None = None
    #: This call closes its round: it follows the whole state (``rules.next_action``).
    leading: bool = False
    #: The round whose last call started, and since when.
    last_call: tuple[int, float | None] = (-1, None)


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
        self._last_board: model.Board | None = None  # the last board written (set by the board view)
        self._skipped = SkipLog(log)
        try:
            self._client.check_connection()
            self._board_view: PrefixView[model.Board | None, model.Board | None] = PrefixView(
                self._client, self._keys.board, self._parse_board, _latest
            )
        except (EtcdUnavailableError, EtcdRequestError) as exc:
            self._client.close()
            raise RendezvousConnectionError(
                f"etcdft rendezvous '{settings.run_id}' cannot use etcd at {self._client.describe_endpoints()}: {exc}"
            ) from exc
        self._view = WholeState(self._client, self._keys.rdzv, self._board_view)
        self._lock = threading.Lock()
        self._monitor_lock = threading.Lock()
        self._monitor: Monitor | None = None
        self._session: Session | None = None
        #: The node's own rendezvous history, replaced only through node_state's transitions (``_apply``).
        self._state = node_state.NodeState(self.node)
        self._state_lock = threading.Lock()
        self._shut_down = False
        #: Set by shutdown() before it takes the lock: a next_rendezvous() waiting (a standby) ends at once.
        self._leaving = threading.Event()
        self._logged_verdict: tuple[int, rules.CloseVerdict] | None = None
        self._logged_membership = ""
        #: Seconds the last completed ``next_rendezvous`` call took (the round's duration for this node).
        self.last_round_seconds: float | None = None
        self._own_events: event_sink.EventSink | None = None
        self._events_client: EtcdClient | None = None
        #: Where peers probe this node's agent (started with its first alive record), and what it answers a
        #: member that asks for a vouch (``set_vouch``).
        self._probe: ProbeServer | None = None
        self._vouch: Callable[[], Vouch] | None = None
        #: No member counts as dead before this (``time.monotonic()``): the end of the promises this node gave
        #: (``rendezvous/fencing.py``).
        self._held_until = 0.0

    def _parse_board(self, relative: str, raw: KeyValue) -> model.Board | None:
        if relative:
            return None  # another key that happens to start with the board's name
        try:
            board = model.Board.from_json(raw.value)
        except MalformedRecord as exc:
            self._skipped.skip(exc.at(self._keys.board), "a malformed rendezvous board")
            return None
        # Every board written, in order, even one deleted in the same watch batch: a monitor that left
        # writes one last board saying so just before its lease (and the board) goes.
        self._last_board = board
        return board

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

    @property
    def watch_events(self) -> int:
        """Watch events this node has received so far: the board's, and those of every key while it monitors
        or closes a round (for benchmarks)."""
        return self._board_view.events_received + self._view.events_received

    def _apply(self, transition: Callable[..., node_state.NodeState], *args: Any) -> node_state.NodeState:
        """Replace the node's state by ``transition(state, *args)`` (the agent's thread and
        ``next_rendezvous()`` may both step it)."""
        with self._state_lock:
            self._state = transition(self._state, *args)
            return self._state

    @property
    def late_place(self) -> int | None:
        """The group rank this node took as a hot spare that joined a running round (None: a member)."""
        return self._state.late_place

    @property
    def is_monitor(self) -> bool:
        monitor = self._monitor
        return monitor is not None and not monitor.ended.is_set()

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
        """Join the next round within ``join_timeout``; an etcd outage is waited out within it too."""
        settings = self.settings
        attempt = _JoinAttempt(deadline=time.monotonic() + settings.join_timeout)
        backoff = Backoff()
        unreachable_since: float | None = None  # etcd has not answered this call's looks since then
        try:
            while True:
                if self._leaving.is_set():
                    raise RendezvousClosedError(f"the etcdft handler of node {self.node} was shut down while it waited")
                now = time.monotonic()
                if now >= attempt.deadline and unreachable_since is not None:
                    raise RendezvousTimeoutError(self._timeout_message(-1, unreachable_for=now - unreachable_since))
                try:
                    with bounded(attempt.deadline - now, f"join_timeout ({settings.join_timeout:g} s)"):
                        info = self._look(attempt)
                except EtcdUnavailableError:
                    # Waited out within join_timeout; the process's outage record logs the outage once.
                    unreachable_since = unreachable_since or time.monotonic()
                    backoff.pause(max(0.0, attempt.deadline - time.monotonic()))
                    continue
                unreachable_since = None
                backoff.reset()
                if info is not None:
                    return info
        finally:
            if attempt.leading:
                self._view.release()

    def _look(self, attempt: _JoinAttempt) -> RendezvousInfo | None:
        """One look at the rendezvous, and the action it calls for: the round's info once this node is in one,
        else None (``attempt`` holds what the next look starts from)."""
        settings = self.settings
        if attempt.session is None or attempt.session.expired.is_set():
            attempt.session = self._ensure_session()
            attempt.joined = None
        session = attempt.session
        board, board_version = self._board_view.snapshot()
        if board is None:
            self._campaign(session)
            board, board_version = self._board_view.snapshot()
        if board is not None and self._state.board_gone_seen:
            self._apply(node_state.board_seen)
        now = time.monotonic()
        wake: Any = self._board_view
        version = board_version
        if attempt.leading:
            state, version = self._snapshot()
            wake = self._view.live
            number = state.open_round
            since = attempt.last_call[1] if attempt.last_call[0] == number else None
            since = rules.last_call_started(state, number, self._limits, now, since)
            attempt.last_call = (number, since)
            action = rules.next_action(state, self.node, session.id, attempt.joined, self._limits, now, since)
        elif board is None:
            action = rules.Wait(-1, rules.CloseVerdict.WAIT_FOR_MIN, None, False, "no rendezvous monitor yet")
        else:
            action = rules.follower_action(board, self.node, attempt.joined, self._state.member_round, self._limits)
            if isinstance(action, rules.Lead):
                attempt.leading = True
                self._view.follow()
                self._emit("round_opened", round=action.number, at=self._state.joined_at)
                return None
        self._log_verdict(action)
        if isinstance(action, rules.Done):
            return self._completed(action)
        if isinstance(action, rules.Ranked):
            info = self._ranked(board, action.number, session.id)
            if info is None:
                attempt.joined = None  # the round closed without this node (beyond its capacity)
            return info
        if isinstance(action, rules.Closed):
            last = state.last_closed if attempt.leading else (board.last if board is not None else None)
            if last is None or last.round != self._state.member_round:
                # A spare (or late node) the job finished without: nothing failed.
                raise RendezvousGracefulExitError(
                    f"the rendezvous '{settings.run_id}' was closed while node {self.node} waited to join"
                )
            raise RendezvousClosedError(f"the rendezvous '{settings.run_id}' is closed")
        if isinstance(action, rules.Wait) and action.standby:
            attempt.deadline = max(attempt.deadline, now + settings.join_timeout)
        if now >= attempt.deadline:
            # The call's own bound has ended: its last requests get one request_timeout of their own.
            with grace(settings.request_timeout, "the timed-out join's withdrawal"):
                message = self._timeout_message(action.number)
                self._withdraw()
            raise RendezvousTimeoutError(message)
        return self._take(action, attempt, session, version, wake, now)

    def _take(
        self, action: rules.Action, attempt: _JoinAttempt, session: Session, version: int, wake: Any, now: float
    ) -> RendezvousInfo | None:
        """Take a join, a close or a wait that :meth:`_look` decided on: the round's info when a late join
        ranked this node at once, else None."""
        if isinstance(action, rules.JoinLate | rules.JoinRound):
            try:
                if isinstance(action, rules.JoinLate):
                    return self._join_late(action, session.id, version, wake)
                if self._join(action.number, session.id, version, wake, attempt.leading):
                    attempt.joined = action.number
            except EtcdLeaseNotFoundError as exc:
                # The lease ran out before this node could use it (an overloaded host or etcd).
                log.warning("node %s: %s; joining again on a new lease", self.node, exc)
                session.expired.set()
        elif isinstance(action, rules.CloseRound):
            self._close(action, version)
        else:
            until = action.until if isinstance(action, rules.Wait) and action.until is not None else attempt.deadline
            # Wake up at least once a second: a deadline or a last call may pass with no change to see.
            wake.wait_for_change(version, min(until, attempt.deadline, now + 1.0) - now)
        return None

    def _log_verdict(self, action: rules.Action) -> None:
        """Log the close verdict of the round this node waits in, each time it changes, with its reason."""
        if not isinstance(action, rules.Wait | rules.CloseRound) or action.number < 0:
            return
        verdict = action.verdict if isinstance(action, rules.Wait) else rules.CloseVerdict.CLOSE
        if self._logged_verdict == (action.number, verdict):
            return
        self._logged_verdict = (action.number, verdict)
        log.info("round %d of '%s': %s (%s)", action.number, self.settings.run_id, verdict.value, action.reason)

    def _snapshot(self) -> tuple[model.RendezvousState, int]:
        """The whole state; warns once for each malformed key it left out."""
        state, version = self._view.snapshot()
        for key, reason in state.malformed.items():
            self._skipped.skip(MalformedRecord(reason, f"{self._keys.rdzv}{key}"), "a malformed rendezvous key")
        return state, version

    def _alive_record(self) -> bytes:
        """This node's ``alive`` value: its host, its agent's pid, and where peers probe it (see ``probe.py``)."""
        if self._probe is None:
            self._probe = ProbeServer(self._addr, self._vouch).start()
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "probe": self._probe.address}).encode()

    def lease_proof(self) -> tuple[int, float]:
        """This node's lease, and until when (``time.monotonic()``) it is proven alive; (0, 0) without one (see
        ``local_board``)."""
        session = self._session
        return (0, 0.0) if session is None else (session.id, session.valid_until())

    def lease_proven_since(self, lease: int, since: float) -> bool | None:
        """Whether etcd has answered, since ``since``, that this node's lease ``lease`` is alive (True) or gone
        (False: also when the node holds another one now); None while it has not answered (a refresh goes out
        at once)."""
        session = self._session
        if session is None or session.id != lease or session.expired.is_set():
            return False
        if session.proven_at >= since:
            return True
        session.refresh_soon()
        return None

    def set_vouch(self, vouch: Callable[[], Vouch]) -> None:
        """What this node answers a member that asks whether it reaches etcd (``rendezvous/fencing.py``)."""
        self._vouch = vouch
        if self._probe is not None:
            self._probe.vouch = vouch

    def hold(self, until: float) -> None:
        """Count no member dead before ``until`` (``time.monotonic()``): this node promised so."""
        self._held_until = max(self._held_until, until)

    def hold_until(self) -> float:
        """Before when no member counts as dead here: this node's promises, and the quiet window after it
        announced itself again."""
        return max(self._held_until, self._state.quiet_until)

    def alive_nodes(self) -> dict[str, tuple[int, tuple[str, int] | None]]:
        """Every node holding an alive key: its lease and probe address (one range read)."""
        prefix = self._keys.alive("")
        kvs, _ = self._client.get_prefix(prefix)
        found = {}
        for kv in kvs:
            try:
                record = json.loads(kv.value)
            except (ValueError, RecursionError):
                record = None
            address = parse_address(record.get("probe")) if isinstance(record, dict) else None
            found[kv.key[len(prefix) :]] = (kv.lease, address)
        return found

    def revoke(self, node: str, lease: int, reason: str) -> None:
        """End ``node``'s lease, so every node sees it dead through its watch at once (idempotent)."""
        self._client.revoke_lease(lease)
        log.warning("node %s revoked the lease of node %s: %s", self.node, node, reason)
        self._emit("node_revoked", round=self._state.member_round, lost=node, reason=reason)

    def _ensure_session(self) -> Session:
        """Hold a live session; the node's alive key goes on its lease when it joins."""
        if self._session is not None and not self._session.expired.is_set():
            return self._session
        if self._session is not None:
            self._session.close(revoke=False)
        session = Session(self._client, self.settings.lease_ttl)
        self._session = session
        self._apply(node_state.new_session)
        return session

    # ---- the monitor ----

    def _campaign(self, session: Session) -> None:
        """Become the monitor if there is none: create ``rdzv/monitor`` on this node's lease, then follow every key."""
        with self._monitor_lock:
            if self._shut_down or (self._monitor is not None and not self._monitor.ended.is_set()):
                return
            if self._monitor is not None:
                self._retire_monitor()
            mark = json.dumps({"node": self.node}).encode()
            try:
                outcome = self._client.txn(
                    [key_missing(self._keys.monitor)], [put_op(self._keys.monitor, mark, session.id)]
                )
            except EtcdLeaseNotFoundError:
                session.expired.set()  # the next look opens a new session
                return
            if not outcome.succeeded:
                return
            view = self._view.follow()
            view.wait_for_revision(outcome.revision, self.settings.request_timeout)
            self._monitor = Monitor(
                self._client,
                self._keys,
                self._limits,
                self.node,
                session.id,
                outcome.revision,
                view,
                self.hold_until,
            ).start()
            monitor = self._monitor
        log.info("node %s is the rendezvous monitor of '%s'", self.node, self.settings.run_id)
        monitor.wait_published(lambda _board: True, self.settings.request_timeout)

    def _retire_monitor(self) -> None:
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
            self._view.release()

    def _board(self, *, campaign: bool) -> node_state.BoardLook:
        """The board to act on (see :func:`node_state.look_at_board`); takes over as monitor when it says so."""
        session = self._session
        may_take_over = campaign and session is not None and not session.expired.is_set()
        current, _ = self._board_view.snapshot()
        with self._state_lock:
            self._state, look = node_state.look_at_board(
                self._state, current, self._last_board, may_take_over=may_take_over
            )
        if look.take_over and session is not None:
            self._campaign(session)
            current, _ = self._board_view.snapshot()
            if current is not None:
                with self._state_lock:
                    self._state, look = node_state.look_at_board(
                        self._state, current, self._last_board, may_take_over=False
                    )
        return look

    # ---- joining and closing ----

    def _join(self, number: int, lease: int, version: int, wake: Any, leading: bool) -> bool:
        keys = self._keys
        join = model.join_value(self._addr, free_port(self._addr), self._limits.late_joins)
        alive = self._alive_record()
        # The alive key rides in the join transaction: one revision, one watch
        # event batch for the monitor, instead of two.
        ops = [put_op(keys.join(number, self.node), join, lease), put_op(keys.alive(self.node), alive, lease)]
        held = self._state.joined_round
        if held is not None and held != number:
            ops.append(delete_op(keys.join(held, self.node)))
        guards = [key_missing(keys.result(number)), key_missing(keys.closed)]
        at = time.time()
        result = self._client.txn(guards, ops)
        if result.succeeded:
            self._apply(node_state.joined, number, lease, at)
            if leading and self._view.live is not None:
                self._view.live.wait_for_revision(result.revision, self.settings.request_timeout)
            self._emit("node_joined", round=number, host=self._addr)
        else:
            wake.wait_for_change(version, self.settings.request_timeout)
        return result.succeeded

    def accept_late_joins(self, accept: bool = True) -> None:
        """Let this node join a running round (``ftrun``'s agent starts its workers as joiners), or no more."""
        self._limits = dataclasses.replace(self._limits, late_joins=accept)

    def _master_of(self, number: int) -> tuple[str, int]:
        """MASTER_ADDR/PORT of closed round ``number``: from the board, else from its result."""
        board = self._last_board
        if board is not None and board.last is not None and board.last.round == number:
            return board.last.master_addr, board.last.master_port
        result = self._read_result(number)
        return result.master_addr, result.master_port

    def _join_late(self, action: rules.JoinLate, lease: int, version: int, wake: Any) -> RendezvousInfo | None:
        """Take place ``action.place`` in the running round; its info on success, None if another node won it."""
        keys, number = self._keys, action.number
        master = self._master_of(number)
        alive = self._alive_record()
        late = model.LateMember(self.node, lease, action.place)
        ops = [
            put_op(keys.slot(number, action.place), json.dumps({"node": self.node}).encode(), lease),
            put_op(keys.late(number, self.node), late.to_json()),
            put_op(keys.alive(self.node), alive, lease),
        ]
        held = self._state.joined_round
        if held is not None:
            ops.append(delete_op(keys.join(held, self.node)))
        guards = [
            key_missing(keys.slot(number, action.place)),
            key_missing(keys.late(number, self.node)),
            key_missing(keys.result(number + 1)),
            key_missing(keys.closed),
        ]
        outcome = self._client.txn(guards, ops)
        if not outcome.succeeded:
            wake.wait_for_change(version, self.settings.request_timeout)
            return None
        self._apply(node_state.joined_late, number, action.place, lease)
        self._emit("node_joined", round=number, host=self._addr, role="hot_spare", place=action.place)
        log.info(
            "node %s joined running round %d of '%s' as a hot spare (group rank %d)",
            self.node,
            number,
            self.settings.run_id,
            action.place,
        )
        store = EtcdStore(self._client, self.round_store_prefix(number), timedelta(seconds=self.settings.store_timeout))
        return RendezvousInfo(store, action.place, action.place + 1, RendezvousStoreInfo(*master))

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
        chunks = rules.chunk_count(len(members))
        split: list[dict[str, model.Placement]] = [{} for _ in range(chunks)]
        for rank, join in enumerate(members):
            split[rules.chunk_of(join.node, chunks)][join.node] = model.Placement(rank, join.lease)
        ops = [put_op(keys.result(number), result.to_json())]
        ops += [put_op(keys.rank_chunk(number, c), model.chunk_json(number, part)) for c, part in enumerate(split)]
        if number >= 2:
            ops += [delete_prefix_op(keys.rdzv_round(number - 2)), delete_prefix_op(keys.round_data(number - 2))]
        outcome = self._client.txn(guards, ops)
        live = self._view.live
        if outcome.succeeded:
            log.info("closed round %d of '%s' with %d node(s)", number, self.settings.run_id, len(members))
            self._emit("round_closed", round=number, members=[j.node for j in members], reason=action.reason)
            if live is not None:
                live.wait_for_revision(outcome.revision, self.settings.request_timeout)
        elif live is not None:
            live.wait_for_change(version, self.settings.request_timeout)

    def _completed(self, done: rules.Done) -> RendezvousInfo:
        result = done.result
        self._apply(node_state.ranked, result.round, result)
        return self._round_info(result.round, done.rank, len(result.members), result.master_addr, result.master_port)

    def _ranked(self, board: model.Board | None, number: int, lease: int) -> RendezvousInfo | None:
        """This node's place in closed round ``number``, read from its chunk of the ranks; None if not a member."""
        last = board.last if board is not None else None
        if last is None or last.round != number:
            raise RuntimeError(f"round {number} is not the board's last closed round")
        key = self._keys.rank_chunk(number, rules.chunk_of(self.node, last.chunks))
        kv, _ = self._client.get(key)
        placement = None
        if kv is not None:
            try:
                placement = model.placement_from_chunk(kv.value, number, self.node)
            except MalformedRecord as exc:
                self._skipped.skip(exc.at(key), "a malformed rank placement")
        if placement is None or placement.lease != lease or placement.rank >= last.size:
            log.info("round %d of '%s' closed without node %s", number, self.settings.run_id, self.node)
            return None
        self._apply(node_state.ranked, number)
        return self._round_info(number, placement.rank, last.size, last.master_addr, last.master_port)

    def _round_info(self, number: int, rank: int, size: int, addr: str, port: int) -> RendezvousInfo:
        store = EtcdStore(self._client, self.round_store_prefix(number), timedelta(seconds=self.settings.store_timeout))
        log.info("node %s is rank %d of %d in round %d of '%s'", self.node, rank, size, number, self.settings.run_id)
        return RendezvousInfo(store, rank, size, RendezvousStoreInfo(addr, port))

    def _withdraw(self) -> None:
        """Take back this node's join key, so a timed-out node is not counted."""
        held = self._state.joined_round
        if held is None:
            return
        try:
            self._client.delete(self._keys.join(held, self.node))
        except EtcdUnavailableError:
            log.warning("could not withdraw node %s from round %d", self.node, held)
        self._apply(node_state.withdrawn)

    def _timeout_message(self, number: int, unreachable_for: float | None = None) -> str:
        """Why ``next_rendezvous()`` timed out: who joined round ``number`` (-1: the open one), or, with
        ``unreachable_for``, that etcd did not answer for that long."""
        if unreachable_for is not None:
            return (
                f"the rendezvous '{self.settings.run_id}' timed out after {self.settings.join_timeout:g} s "
                f"(join_timeout): etcd at {self._client.describe_endpoints()} was unreachable for the last "
                f"{unreachable_for:.1f} s"
            )
        silent = self._view.disconnected_for()
        if silent > 0:  # what this node last saw of the rendezvous, before its watch broke
            unreachable = f"; etcd at {self._client.describe_endpoints()} has not answered for the last {silent:.1f} s"
        else:
            unreachable = ""
            try:
                self._client.check_connection()  # a frozen etcd breaks no watch: ask it
            except EtcdUnavailableError:
                unreachable = f"; etcd at {self._client.describe_endpoints()} does not answer (frozen, or cut off)"
        state, _ = self._view.snapshot()  # read once, if this node does not follow every key
        number = state.open_round if number < 0 else number
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
        return message + unreachable

    # ---- what the agent polls ----

    def is_closed(self) -> bool:
        """Closed by ``set_closed()``, or every node of the last round left it (see ``rules.job_finished``)."""
        look = self._board(campaign=False)
        if look.board is None or look.vanished:
            return rules.job_finished(self._view.snapshot()[0])  # no monitor: read the state once
        return look.board.finished

    def set_closed(self) -> None:
        try:
            self._client.put(self._keys.closed, b'{"closed": true}')
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
        look = self._board(campaign=self._state.member_round is not None)
        session = self._session
        live = session is not None and not session.expired.is_set()
        lost = None if self._shut_down else node_state.lost_announcement(self._state, live, look.board)
        if lost is not None:
            self._announce_again(lost)
            look = self._board(campaign=False)
        change, reason = node_state.membership(self._state, look, time.monotonic(), self._held_until)
        if reason != self._logged_membership and (change.dead or look.vanished or self._logged_membership):
            self._logged_membership = reason
            log.info("node %s, round %s of '%s': %s", self.node, self._state.member_round, self.settings.run_id, reason)
        return change

    def _announce_again(self, why: str) -> None:
        with self._lock:
            session = self._session
            if session is not None and node_state.announcement_lost_its_lease(self._state, session.id):
                session.expired.set()  # the key it carried is gone: so is its lease
            session = self._ensure_session()
            self._client.put(self._keys.alive(self.node), self._alive_record(), session.id)
            self._apply(node_state.announced, session.id, time.monotonic(), self.settings.lease_ttl)
        log.warning(
            "node %s: its etcd lease is gone (%s: revoked by a member that confirmed it lost, or ended by etcd after "
            "%g s without a refresh: its link to etcd was cut, or etcd was frozen or without a leader); announced "
            "again on a new lease, and no member counts as dead for the next %g s",
            self.node,
            why,
            self.settings.lease_ttl,
            self.settings.lease_ttl,
        )

    def _read_result(self, number: int) -> model.RoundResult:
        kv, _ = self._client.get(self._keys.result(number))
        if kv is None:
            raise RendezvousStateError(f"round {number} of '{self.settings.run_id}' has no result in etcd")
        try:
            return model.RoundResult.from_json(kv.value)
        except MalformedRecord as exc:
            raise RendezvousStateError(f"the result of round {number} in etcd is malformed: {exc}") from exc

    @property
    def member_of(self) -> model.RoundResult | None:
        """The round this node belongs to (None before its first rendezvous); its members are read once, when
        first asked for (a node learns only its own place when the round closes)."""
        state = self._state
        if state.member_round is None:
            return None
        if state.member_of is not None and state.member_of.round == state.member_round:
            return state.member_of
        result = self._read_result(state.member_round)
        self._apply(node_state.members_read, result)
        return result

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
        self._leaving.set()  # a next_rendezvous() holding the lock (a standby waits there for long) ends now
        self._board_view.nudge()
        live = self._view.live
        if live is not None:
            live.nudge()
        with self._lock:
            if self._shut_down:
                return True
            ok = True
            try:
                member_round = self._state.member_round
                if member_round is not None:
                    self._client.put(self._keys.left(member_round, self.node), b'{"reason": "shutdown"}')
                    self._emit("node_left", round=member_round)
                    monitor = self._monitor
                    if monitor is not None:  # its board must say it left before the board goes with its lease
                        monitor.wait_published(lambda b: self.node in b.left, self.settings.request_timeout)
            except (EtcdUnavailableError, EtcdRequestError) as exc:
                log.warning("etcdft shutdown of node %s incomplete: %s", self.node, exc)
                ok = False
            self._shut_down = True
            with self._monitor_lock:  # before the lease goes: a monitor must not publish after it
                self._retire_monitor()
            if self._session is not None:
                try:
                    self._session.close(revoke=ok)  # etcd just failed: its lease expires on its own
                except (EtcdUnavailableError, EtcdRequestError) as exc:
                    log.warning("etcdft shutdown of node %s: its lease expires on its own: %s", self.node, exc)
                    ok = False
            if self._own_events is not None:
                self._own_events.close(timeout=self.settings.request_timeout)  # its last events, bounded
                if self._events_client is not None:
                    self._events_client.close()
            self._view.stop()
            self._board_view.stop()
            self._client.close()
            if self._probe is not None:
                self._probe.stop()
            return ok


def _latest(boards: Iterable[model.Board | None]) -> model.Board | None:
    """The board view's state: the board, or None when there is none (or it is malformed)."""
    return next((b for b in boards if b is not None), None)


class WholeState:
    """The whole rendezvous state: live while this node follows every key (it monitors, or closes a round),
    else read on demand with one range read (a timeout's message, a look without a monitor)."""

    def __init__(self, client: EtcdClient, prefix: str, board_view: PrefixView[Any, Any]) -> None:
        self._client = client
        self._prefix = prefix
        self._board_view = board_view
        self.live: PrefixView[model.Fact, model.RendezvousState] | None = None
        self._users = 0
        self._events_before = 0  # received by live views since stopped
        self._lock = threading.Lock()

    def follow(self) -> PrefixView[model.Fact, model.RendezvousState]:
        """Start (or share) the live view of every key; pair with :meth:`release`."""
        with self._lock:
            if self.live is None:
                self.live = PrefixView(self._client, self._prefix, model.parse_key, model.build_state)
            self._users += 1
            return self.live

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users <= 0 and self.live is not None:
                self._stop_live()

    def snapshot(self) -> tuple[model.RendezvousState, int]:
        live = self.live
        if live is not None:
            return live.snapshot()
        kvs, revision = self._client.get_prefix(self._prefix)
        return model.parse_state({kv.key[len(self._prefix) :]: kv for kv in kvs}), -revision

    def disconnected_for(self) -> float:
        live = self.live
        return max(self._board_view.disconnected_for(), live.disconnected_for() if live is not None else 0.0)

    @property
    def events_received(self) -> int:
        """Watch events every live view of this node received."""
        live = self.live
        return self._events_before + (live.events_received if live is not None else 0)

    def _stop_live(self) -> None:
        if self.live is not None:
            self.live.stop()
            self._events_before += self.live.events_received
            self.live, self._users = None, 0

    def stop(self) -> None:
        with self._lock:
            self._stop_live()
