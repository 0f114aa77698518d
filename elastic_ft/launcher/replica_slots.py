"""A replica group id for each ``ftrun --replica-groups`` node: the lowest free slot, held on the launcher's lease.

TorchFT's scripts read their group's id from ``REPLICA_GROUP_ID`` and the
number of groups from ``NUM_REPLICA_GROUPS`` (for their data sampler), so a
node's id must lie in ``[0, groups)`` and no two live nodes may share one.
Each launcher takes the lowest slot nobody holds with one compare-and-create
of ``replicas/slots/<id>`` on a lease of its own (etcd's Go ``concurrency``
idiom); a launcher that dies lets its lease end, and a replacement node
takes the freed id within the lease's TTL. A claim retried after an
ambiguous answer finds its own value and keeps that slot.

While the launcher runs, :meth:`ReplicaSlot.keep` follows the lease: if etcd
lost it (an outage longer than the TTL ends every lease at once), it takes a
new lease and puts its slot back, retrying with backoff for as long as etcd
is away; the workers train on meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time

from elastic_ft.etcd.client import EtcdClient, key_missing, put_op
from elastic_ft.etcd.kv import EtcdRequestError, EtcdUnavailableError
from elastic_ft.etcd.session import Session
from elastic_ft.keys import ReplicaKeys
from elastic_ft.runtime.waits import Backoff

log = logging.getLogger(__name__)


class SlotError(RuntimeError):
    """No replica group id could be taken within the launcher's join timeout; says why."""


class ReplicaSlot:
    """This launcher's replica group id among ``groups``, held on a lease of ``ttl`` seconds. No I/O until
    :meth:`claim`."""

    def __init__(self, client: EtcdClient, keys: ReplicaKeys, owner: str, groups: int, ttl: int) -> None:
        if groups < 1:
            raise ValueError(f"a job has at least one replica group, got {groups}")
        self._client, self._keys, self._owner, self._groups, self._ttl = client, keys, owner.encode(), groups, ttl
        self._session: Session | None = None
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self.replica: int | None = None

    def claim(self, timeout: float) -> int:
        """Take the lowest free id, waiting for one to free; returns it.

        Raises:
            SlotError: none was free, or etcd was unreachable, for ``timeout`` seconds (the message says which).
        """
        deadline = time.monotonic() + timeout
        backoff = Backoff()
        why = ""
        while time.monotonic() < deadline:
            try:
                if self._session is None:
                    self._session = Session(self._client, self._ttl)
                taken = self._holders()
                mine = [replica for replica, owner in taken.items() if owner == self._owner]
                if mine:
                    self.replica = mine[0]
                    return self.replica
                for replica in range(self._groups):
                    if replica not in taken and self._take(replica, self._session.id):
                        self.replica = replica
                        return replica
                holders = ", ".join(f"{r}: {o.decode(errors='replace')}" for r, o in sorted(taken.items()))
                why = f"all {self._groups} replica group ids are held ({holders}); a dead node's frees within its lease"
            except EtcdUnavailableError as error:
                why = f"etcd was unreachable at {self._client.describe_endpoints()}: {error}"
            except EtcdRequestError as error:
                why = f"etcd refused a request: {error}"
            backoff.pause(max(0.0, deadline - time.monotonic()))
        raise SlotError(f"no replica group id within {timeout:.0f} s: {why}")

    def keep(self) -> None:
        """Hold the slot while the launcher runs: a lost lease is replaced, and the slot put back on it."""
        if self.replica is None:
            raise RuntimeError("ReplicaSlot.keep() before claim()")
        self._keeper = threading.Thread(target=self._keep, name="elastic_ft-replica-slot", daemon=True)
        self._keeper.start()

    def release(self) -> None:
        """Give the slot up at once (its lease revoked), for the next node."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(5)
        if self._session is not None:
            try:
                self._session.close(revoke=True)
            except (EtcdUnavailableError, EtcdRequestError) as error:
                log.warning("cannot revoke replica group %s's lease (it ends within its TTL): %s", self.replica, error)

    def _holders(self) -> dict[int, bytes]:
        """Every slot's holder; a key that names no slot of this job is untrusted noise, and ignored."""
        found, _ = self._client.get_prefix(self._keys.slots)
        holders = {}
        for kv in found:
            name = kv.key[len(self._keys.slots) :]
            # Only the key this module spells ("7", never "07" or another script's digits) names slot 7.
            if name.isascii() and name.isdigit() and str(int(name)) == name and int(name) < self._groups:
                holders[int(name)] = kv.value
        return holders

    def _take(self, replica: int, lease: int) -> bool:
        key = self._keys.slot(replica)
        return self._client.txn([key_missing(key)], [put_op(key, self._owner, lease)]).succeeded

    def _keep(self) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            session = self._session
            if session is not None and not session.expired.wait(0.5):
                continue
            try:
                if session is not None:
                    session.close(revoke=False)
                self._session = Session(self._client, self._ttl)
                holder = self._holders().get(self.replica)  # type: ignore[arg-type]
                if holder is None and self._take(self.replica, self._session.id):  # type: ignore[arg-type]
                    log.warning("replica group %d: etcd lost this node's lease; the id is held again", self.replica)
                elif holder != self._owner:
                    log.error(
                        "replica group %d: etcd lost this node's lease and %s took the id meanwhile: two nodes "
                        "now run replica group %d",
                        self.replica,
                        (holder or b"?").decode(errors="replace"),
                        self.replica,
                    )
                    return
                backoff.reset()
            except (EtcdUnavailableError, EtcdRequestError) as error:
                log.debug("replica group %s: etcd unavailable while holding the id; retrying: %s", self.replica, error)
                self._session = None
                backoff.pause()
