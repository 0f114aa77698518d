"""One ``next_rendezvous()`` call: look at the rendezvous, take the action ``rules`` decides, until this node
holds a place in a round or the call's bound ends.

What a call shares with the node's other duties (its identity, its etcd
connection, views and presence, its :class:`~node_state.NodeState`) is a
:class:`NodeParts`, built once by the handler.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic_ft.etcd.client import (
    EtcdClient,
    EtcdLeaseNotFoundError,
    EtcdUnavailableError,
    delete_op,
    delete_prefix_op,
    key_created_at,
    key_missing,
    put_op,
)
from elastic_ft.etcd.outage import bounded, grace
from elastic_ft.etcd.session import Session
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.keys import RunKeys
from elastic_ft.rendezvous import model, node_state, rules
from elastic_ft.rendezvous.config import EtcdftSettings
from elastic_ft.rendezvous.monitor import MonitorSeat
from elastic_ft.rendezvous.presence import NodePresence
from elastic_ft.rendezvous.views import BoardView, WholeState
from elastic_ft.runtime.net import free_port
from elastic_ft.runtime.waits import Backoff
from elastic_ft.untrusted import MalformedRecord, SkipLog

log = logging.getLogger(__name__)


class StateCell:
    """The node's :class:`~node_state.NodeState`, replaced only through its transitions (the agent's thread and
    ``next_rendezvous()`` may both step it)."""

    def __init__(self, node: str) -> None:
        self.value = node_state.NodeState(node)
        self.lock = threading.Lock()

    def apply(self, transition: Callable[..., node_state.NodeState], *args: Any) -> node_state.NodeState:
        with self.lock:
            self.value = transition(self.value, *args)
            return self.value


@dataclasses.dataclass(eq=False)
class NodeParts:
    """What a node's join calls and its duties as a member share."""

    settings: EtcdftSettings
    node: str
    addr: str
    keys: RunKeys
    client: EtcdClient
    limits: rules.Limits
    board: BoardView
    whole: WholeState
    presence: NodePresence
    seat: MonitorSeat
    state: StateCell
    emit: Callable[..., None]
    skipped: SkipLog
    #: Set by shutdown() before it takes the handler's lock: a call waiting (a standby) ends at once.
    leaving: threading.Event
    #: This node's place in its launcher's order (``SLURM_PROCID``), which new ranks follow; None: none.
    order: int | None = None
    #: This node's segment label, with a segment size set (:func:`elastic_ft.rendezvous.rules.segment_layout`).
    segment: str | None = None
    #: The close verdict last logged, so that each is logged once, when it changes.
    logged_verdict: tuple[int, rules.CloseVerdict] | None = None

    def ensure_session(self) -> Session:
        """A live session; a new one drops whatever join key the old one carried."""
        session, new = self.presence.ensure_session()
        if new:
            self.state.apply(node_state.new_session)
        return session


def read_result(parts: NodeParts, number: int) -> model.RoundResult:
    """Closed round ``number``'s result, read from etcd."""
    kv, _ = parts.client.get(parts.keys.result(number))
    if kv is None:
        raise RendezvousStateError(f"round {number} of '{parts.settings.run_id}' has no result in etcd")
    try:
        return model.RoundResult.from_json(kv.value)
    except MalformedRecord as exc:
        raise RendezvousStateError(f"the result of round {number} in etcd is malformed: {exc}") from exc


def round_info(parts: NodeParts, number: int, rank: int, size: int, addr: str, port: int) -> RendezvousInfo:
    """Torch's view of this node's place: rank ``rank`` of ``size`` in round ``number``, with its store."""
    timeout = timedelta(seconds=parts.settings.store_timeout)
    store = EtcdStore(parts.client, parts.keys.round_store(number), timeout)
    return RendezvousInfo(store, rank, size, RendezvousStoreInfo(addr, port))


class JoinCall:
    """One ``next_rendezvous()``: :meth:`run` joins the next round within ``join_timeout``."""

    def __init__(self, parts: NodeParts) -> None:
        self._parts = parts
        settings = parts.settings
        #: When the call fails with RendezvousTimeoutError (``time.monotonic()``; a standby's moves on).
        self._deadline = time.monotonic() + settings.join_timeout
        self._session: Session | None = None
        #: The round this call has joined.
        self._joined: int | None = None
        #: This call closes its round: it follows the whole state (``rules.next_action``).
        self._leading = False
        #: The round whose last call started, and since when.
        self._last_call: tuple[int, float | None] = (-1, None)

    def run(self) -> RendezvousInfo:
        """Join the next round within ``join_timeout``; an etcd outage is waited out within it too."""
        parts = self._parts
        backoff = Backoff()
        unreachable_since: float | None = None  # etcd has not answered this call's looks since then
        try:
            while True:
                if parts.leaving.is_set():
                    raise RendezvousClosedError(
                        f"the etcdft handler of node {parts.node} was shut down while it waited"
                    )
                now = time.monotonic()
                if now >= self._deadline and unreachable_since is not None:
                    raise RendezvousTimeoutError(timeout_message(parts, -1, unreachable_for=now - unreachable_since))
                try:
                    with bounded(self._deadline - now, f"join_timeout ({parts.settings.join_timeout:g} s)"):
                        info = self._look()
                except EtcdUnavailableError:
                    # Waited out within join_timeout; the process's outage record logs the outage once.
                    unreachable_since = unreachable_since or time.monotonic()
                    backoff.pause(max(0.0, self._deadline - time.monotonic()))
                    continue
                unreachable_since = None
                backoff.reset()
                if info is not None:
                    return info
        finally:
            if self._leading:
                parts.whole.release()

    def _look(self) -> RendezvousInfo | None:
        """One look at the rendezvous, and the action it calls for: the round's info once this node is in one,
        else None."""
        parts = self._parts
        if self._session is None or self._session.expired.is_set():
            self._session = parts.ensure_session()
            self._joined = None
        session = self._session
        board, board_version = parts.board.snapshot()
        if board is None:
            parts.seat.campaign(session, parts.limits)
            board, board_version = parts.board.snapshot()
        if board is not None and parts.state.value.board_gone_seen:
            parts.state.apply(node_state.board_seen)
        state = parts.state.value
        now = time.monotonic()
        wake: Any = parts.board.view
        version = board_version
        if self._leading:
            whole, version = parts.whole.snapshot()
            wake = parts.whole.live
            number = whole.open_round
            since = self._last_call[1] if self._last_call[0] == number else None
            since = rules.last_call_started(whole, number, parts.limits, now, since)
            self._last_call = (number, since)
            action = rules.next_action(whole, parts.node, session.id, self._joined, parts.limits, now, since)
        elif board is None:
            action = rules.Wait(-1, rules.CloseVerdict.WAIT_FOR_MIN, None, False, "no rendezvous monitor yet")
        else:
            action = rules.follower_action(board, parts.node, self._joined, state.member_round, parts.limits)
            if isinstance(action, rules.Lead):
                self._leading = True
                parts.whole.follow()
                parts.emit("round_opened", round=action.number, at=state.joined_at)
                return None
        self._log_verdict(action)
        if isinstance(action, rules.Done):
            return self._completed(action)
        if isinstance(action, rules.Ranked):
            info = self._ranked(board, action.number, session.id)
            if info is None:
                self._joined = None  # the round closed without this node (beyond its capacity)
            return info
        if isinstance(action, rules.Closed):
            last = whole.last_closed if self._leading else (board.last if board is not None else None)
            if last is None or last.round != state.member_round:
                # A spare (or late node) the job finished without: nothing failed.
                raise RendezvousGracefulExitError(
                    f"the rendezvous '{parts.settings.run_id}' was closed while node {parts.node} waited to join"
                )
            raise RendezvousClosedError(f"the rendezvous '{parts.settings.run_id}' is closed")
        if isinstance(action, rules.Wait) and action.standby:
            self._deadline = max(self._deadline, now + parts.settings.join_timeout)
        if now >= self._deadline:
            # The call's own bound has ended: its last requests get one request_timeout of their own.
            with grace(parts.settings.request_timeout, "the timed-out join's withdrawal"):
                message = timeout_message(parts, action.number)
                self._withdraw()
            raise RendezvousTimeoutError(message)
        return self._take(action, session, version, wake, now)

    def _take(
        self, action: rules.Action, session: Session, version: int, wake: Any, now: float
    ) -> RendezvousInfo | None:
        """Take a join, a close or a wait that :meth:`_look` decided on: the round's info when a late join
        ranked this node at once, else None."""
        if isinstance(action, rules.JoinLate | rules.JoinRound):
            try:
                if isinstance(action, rules.JoinLate):
                    return self._join_late(action, session.id, version, wake)
                if self._join(action.number, session.id, version, wake):
                    self._joined = action.number
            except EtcdLeaseNotFoundError as exc:
                # The lease ran out before this node could use it (an overloaded host or etcd).
                log.warning("node %s: %s; joining again on a new lease", self._parts.node, exc)
                session.expired.set()
        elif isinstance(action, rules.CloseRound):
            self._close(action, version)
        else:
            until = action.until if isinstance(action, rules.Wait) and action.until is not None else self._deadline
            # Wake up at least once a second: a deadline or a last call may pass with no change to see.
            wake.wait_for_change(version, min(until, self._deadline, now + 1.0) - now)
        return None

    def _log_verdict(self, action: rules.Action) -> None:
        """Log the close verdict of the round this node waits in, each time it changes, with its reason."""
        if not isinstance(action, rules.Wait | rules.CloseRound) or action.number < 0:
            return
        verdict = action.verdict if isinstance(action, rules.Wait) else rules.CloseVerdict.CLOSE
        parts = self._parts
        if parts.logged_verdict == (action.number, verdict):
            return
        parts.logged_verdict = (action.number, verdict)
        log.info("round %d of '%s': %s (%s)", action.number, parts.settings.run_id, verdict.value, action.reason)

    def _join(self, number: int, lease: int, version: int, wake: Any) -> bool:
        parts = self._parts
        keys = parts.keys
        join = model.join_value(parts.addr, free_port(parts.addr), parts.limits.late_joins, parts.order, parts.segment)
        alive = parts.presence.alive_record()
        # The alive key rides in the join transaction: one revision, one watch
        # event batch for the monitor, instead of two.
        ops = [put_op(keys.join(number, parts.node), join, lease), put_op(keys.alive(parts.node), alive, lease)]
        held = parts.state.value.joined_round
        if held is not None and held != number:
            ops.append(delete_op(keys.join(held, parts.node)))
        guards = [key_missing(keys.result(number)), key_missing(keys.closed)]
        at = time.time()
        result = parts.client.txn(guards, ops)
        if result.succeeded:
            parts.state.apply(node_state.joined, number, lease, at)
            if self._leading and parts.whole.live is not None:
                parts.whole.live.wait_for_revision(result.revision, parts.settings.request_timeout)
            parts.emit("node_joined", round=number, host=parts.addr)
        else:
            wake.wait_for_change(version, parts.settings.request_timeout)
        return result.succeeded

    def _master_of(self, number: int) -> tuple[str, int]:
        """MASTER_ADDR/PORT of closed round ``number``: from the board, else from its result."""
        board = self._parts.board.last
        if board is not None and board.last is not None and board.last.round == number:
            return board.last.master_addr, board.last.master_port
        result = read_result(self._parts, number)
        return result.master_addr, result.master_port

    def _join_late(self, action: rules.JoinLate, lease: int, version: int, wake: Any) -> RendezvousInfo | None:
        """Take place ``action.place`` in the running round; its info on success, None if another node won it."""
        parts = self._parts
        keys, number, node = parts.keys, action.number, parts.node
        master = self._master_of(number)
        alive = parts.presence.alive_record()
        late = model.LateMember(node, lease, action.place)
        ops = [
            put_op(keys.slot(number, action.place), json.dumps({"node": node}).encode(), lease),
            put_op(keys.late(number, node), late.to_json()),
            put_op(keys.alive(node), alive, lease),
        ]
        held = parts.state.value.joined_round
        if held is not None:
            ops.append(delete_op(keys.join(held, node)))
        guards = [
            key_missing(keys.slot(number, action.place)),
            key_missing(keys.late(number, node)),
            key_missing(keys.result(number + 1)),
            key_missing(keys.closed),
        ]
        outcome = parts.client.txn(guards, ops)
        if not outcome.succeeded:
            wake.wait_for_change(version, parts.settings.request_timeout)
            return None
        parts.state.apply(node_state.joined_late, number, action.place, lease)
        parts.emit("node_joined", round=number, host=parts.addr, role="hot_spare", place=action.place)
        log.info(
            "node %s joined running round %d of '%s' as a hot spare (group rank %d)",
            node,
            number,
            parts.settings.run_id,
            action.place,
        )
        return round_info(parts, number, action.place, action.place + 1, *master)

    def _close(self, action: rules.CloseRound, version: int) -> None:
        parts = self._parts
        keys = parts.keys
        number = action.number
        members = action.members
        leader = members[0]
        result = model.RoundResult(
            number, tuple(model.Member(j.node, j.lease) for j in members), leader.addr, leader.port, action.active
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
        outcome = parts.client.txn(guards, ops)
        live = parts.whole.live
        if outcome.succeeded:
            log.info("closed round %d of '%s' with %d node(s)", number, parts.settings.run_id, len(members))
            parts.emit("round_closed", round=number, members=[j.node for j in members], reason=action.reason)
            if live is not None:
                live.wait_for_revision(outcome.revision, parts.settings.request_timeout)
        elif live is not None:
            live.wait_for_change(version, parts.settings.request_timeout)

    def _completed(self, done: rules.Done) -> RendezvousInfo:
        result = done.result
        self._parts.state.apply(node_state.ranked, result.round, result)
        return self._placed(result.round, done.rank, len(result.members), result.master_addr, result.master_port)

    def _ranked(self, board: model.Board | None, number: int, lease: int) -> RendezvousInfo | None:
        """This node's place in closed round ``number``, read from its chunk of the ranks; None if not a member."""
        parts = self._parts
        last = board.last if board is not None else None
        if last is None or last.round != number:
            raise RuntimeError(f"round {number} is not the board's last closed round")
        key = parts.keys.rank_chunk(number, rules.chunk_of(parts.node, last.chunks))
        kv, _ = parts.client.get(key)
        placement = None
        if kv is not None:
            try:
                placement = model.placement_from_chunk(kv.value, number, parts.node)
            except MalformedRecord as exc:
                parts.skipped.skip(exc.at(key), "a malformed rank placement")
        if placement is None or placement.lease != lease or placement.rank >= last.size:
            log.info("round %d of '%s' closed without node %s", number, parts.settings.run_id, parts.node)
            return None
        parts.state.apply(node_state.ranked, number)
        return self._placed(number, placement.rank, last.size, last.master_addr, last.master_port)

    def _placed(self, number: int, rank: int, size: int, addr: str, port: int) -> RendezvousInfo:
        parts = self._parts
        log.info("node %s is rank %d of %d in round %d of '%s'", parts.node, rank, size, number, parts.settings.run_id)
        return round_info(parts, number, rank, size, addr, port)

    def _withdraw(self) -> None:
        """Take back this node's join key, so a timed-out node is not counted."""
        parts = self._parts
        held = parts.state.value.joined_round
        if held is None:
            return
        try:
            parts.client.delete(parts.keys.join(held, parts.node))
        except EtcdUnavailableError:
            log.warning("could not withdraw node %s from round %d", parts.node, held)
        parts.state.apply(node_state.withdrawn)


def timeout_message(parts: NodeParts, number: int, unreachable_for: float | None = None) -> str:
    """Why ``next_rendezvous()`` timed out: who joined round ``number`` (-1: the open one), or, with
    ``unreachable_for``, that etcd did not answer for that long."""
    settings, client = parts.settings, parts.client
    if unreachable_for is not None:
        return (
            f"the rendezvous '{settings.run_id}' timed out after {settings.join_timeout:g} s "
            f"(join_timeout): etcd at {client.describe_endpoints()} was unreachable for the last "
            f"{unreachable_for:.1f} s"
        )
    silent = parts.whole.disconnected_for()
    if silent > 0:  # what this node last saw of the rendezvous, before its watch broke
        unreachable = f"; etcd at {client.describe_endpoints()} has not answered for the last {silent:.1f} s"
    else:
        unreachable = ""
        try:
            client.check_connection()  # a frozen etcd breaks no watch: ask it
        except EtcdUnavailableError:
            unreachable = f"; etcd at {client.describe_endpoints()} does not answer (frozen, or cut off)"
    state, _ = parts.whole.snapshot()  # read once, if this node does not follow every key
    number = state.open_round if number < 0 else number
    joined = len(state.round(number).joins)
    pending = rules.pending_members(state, number)
    message = (
        f"the rendezvous '{settings.run_id}' timed out after {settings.join_timeout:g} s "
        f"waiting for round {number}: {joined} node(s) joined, at least {settings.min_nodes} needed "
        f"(min_nodes={settings.min_nodes}, max_nodes={settings.max_nodes})"
    )
    if pending:
        message += (
            f"; {len(pending)} member(s) of round {number - 1} are still running and have not re-joined: "
            + ", ".join(m.node for m in pending)
        )
    return message + unreachable
