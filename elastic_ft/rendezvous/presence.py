"""A node's presence in the rendezvous: its session (the lease every key it holds rides on), the alive record
its peers read, the probe server that answers them, and the promises it gave (``rendezvous/fencing.py``)."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.session import Session
from elastic_ft.keys import RunKeys
from elastic_ft.rendezvous.fencing import Vouch
from elastic_ft.rendezvous.probe import ProbeServer, parse_address
from elastic_ft.untrusted import json_object

log = logging.getLogger(__name__)


class NodePresence:
    """One node's lease, alive record and probe; no I/O until first used."""

    def __init__(self, client: EtcdClient, keys: RunKeys, node: str, addr: str, lease_ttl: int) -> None:
        self._client = client
        self._keys = keys
        self.node = node
        self._addr = addr
        self._lease_ttl = lease_ttl
        #: The node's current session (None before its first, or after :meth:`close`).
        self.session: Session | None = None
        #: Where peers probe this node's agent (started with its first alive record), and what it answers a
        #: member that asks for a vouch (:meth:`set_vouch`).
        self._probe: ProbeServer | None = None
        self._vouch: Callable[[], Vouch] | None = None
        #: No member counts as dead before this (``time.monotonic()``): the end of the promises this node gave.
        self.held_until = 0.0

    def live_session(self) -> Session | None:
        """The session, if it has not expired."""
        session = self.session
        return session if session is not None and not session.expired.is_set() else None

    def ensure_session(self) -> tuple[Session, bool]:
        """A live session, and whether it was just opened (its keys are put when the node joins or announces)."""
        if (session := self.live_session()) is not None:
            return session, False
        if self.session is not None:
            self.session.close(revoke=False)
        self.session = Session(self._client, self._lease_ttl)
        return self.session, True

    def alive_record(self) -> bytes:
        """This node's ``alive`` value: its host, its agent's pid, and where peers probe it (``probe.py``)."""
        if self._probe is None:
            self._probe = ProbeServer(self._addr, self._vouch).start()
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "probe": self._probe.address}).encode()

    def lease_proof(self) -> tuple[int, float]:
        """This node's lease, and until when (``time.monotonic()``) it is proven alive; (0, 0) without one (see
        ``local_board``)."""
        session = self.session
        return (0, 0.0) if session is None else (session.id, session.valid_until())

    def lease_proven_since(self, lease: int, since: float) -> bool | None:
        """Whether etcd has answered, since ``since``, that this node's lease ``lease`` is alive (True) or gone
        (False: also when the node holds another one now); None while it has not answered (a refresh goes out
        at once)."""
        session = self.live_session()
        if session is None or session.id != lease:
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
        self.held_until = max(self.held_until, until)

    def alive_nodes(self) -> dict[str, tuple[int, tuple[str, int] | None]]:
        """Every node holding an alive key: its lease and probe address (one range read)."""
        prefix = self._keys.alive("")
        kvs, _ = self._client.get_prefix(prefix)
        found = {}
        for kv in kvs:
            record = json_object(kv.value)
            address = parse_address(record.get("probe")) if record is not None else None
            found[kv.key[len(prefix) :]] = (kv.lease, address)
        return found

    def revoke(self, node: str, lease: int, reason: str) -> None:
        """End ``node``'s lease, so every node sees it dead through its watch at once (idempotent)."""
        self._client.revoke_lease(lease)
        log.warning("node %s revoked the lease of node %s: %s", self.node, node, reason)

    def close(self, *, revoke: bool) -> None:
        """End the session (revoking its lease, or leaving it to expire) and the probe server. Raises what the
        revoke raised, after stopping the probe."""
        try:
            if self.session is not None:
                self.session.close(revoke=revoke)
        finally:
            if self._probe is not None:
                self._probe.stop()
