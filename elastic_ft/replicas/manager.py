"""TorchFT's ``Manager`` over etcd: a fault stays in its replica group, and no Lighthouse is needed.

Each step of a replicated job (:mod:`elastic_ft.replicas`):

1. ``start_quorum()`` (``Optimizer.zero_grad`` calls it): while the quorum
   is unchanged, nothing; after a fault or when the last vote agreed on a
   newer quorum, the rank builds the newer quorum's cross-replica group,
   learns every member's step, and the members behind receive the state of
   one at the highest step (healing), before the step's forward pass;
2. ``allreduce()`` (DDP's communication hook calls it): the gradients
   averaged over the quorum's replica groups. A failure (a replica group
   gone mid-step) marks the step failed, records it in etcd, and aborts the
   group, which releases every other member blocked on it;
3. ``should_commit()`` (``Optimizer.step`` calls it): the vote, one
   all-reduce across the quorum (and within the replica group): the step
   commits only if no member failed, and the vote carries the newest quorum
   any member has seen, so that every member switches at the same step.
   A member whose vote fails does not commit; if another member did, the
   next quorum finds it behind and heals it.

The quorum lives in etcd and costs nothing per step: every rank follows it
through a watch (:mod:`elastic_ft.replicas.membership`). While etcd is away,
training goes on in the last quorum; only a change waits for etcd.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from elastic_ft.etcd.client import client_for
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.handoff import ReplicaHandoff
from elastic_ft.inprocess.healing.layout import check_shard, layout_of
from elastic_ft.inprocess.healing.transfer import receive_state, send_state
from elastic_ft.replicas.membership import LeaseLost, ReplicaMembership
from elastic_ft.replicas.process_group import CancellableStore, ProcessGroupGloo
from elastic_ft.replicas.quorum import (
    NO_QUORUM,
    MemberRecord,
    Quorum,
    check_replica_id,
    complete_groups,
    plan_healing,
)
from elastic_ft.replicas.sentinel import LeaseSentinel
from elastic_ft.runtime.waits import pause

log = logging.getLogger(__name__)

#: The lease TTL of a rank's records: how long a host lost as a whole (its sentinel with it) stays in the quorum.
LEASE_TTL = 5
#: Seconds a quorum holds a pending change: a failure some of its groups have not seen yet, or a group whose records
#: are gone while no collective failed (etcd let its lease expire: the sentinel takes a new one, and the rank
#: publishes its record again, within about a third of the TTL once etcd answers).
QUORUM_GRACE = float(LEASE_TTL)
_ARRIVAL_POLL = 0.005
#: The key that closes a quorum's arrivals, and its two values.
_CLOSED = "closed"
_COMPLETE = b"complete"
_ABANDONED = b"abandoned"


class Manager:
    """TorchFT's ``Manager``: see the module docstring. The arguments are TorchFT's; those that place its
    Lighthouse or its per-group servers (``lighthouse_addr``, ``store_addr``, ``store_port``, ``port``,
    ``hostname``, ``heartbeat_interval``, ``checkpoint_transport``) are accepted and unused: the replica groups
    meet in etcd (:class:`~elastic_ft.handoff.ReplicaHandoff`)."""

    def __init__(
        self,
        pg: ProcessGroupGloo,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        quorum_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        connect_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        replica_id: str | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        **unused: Any,
    ) -> None:
        _check_arguments(pg, load_state_dict, state_dict, min_replica_size, timeout, quorum_timeout, unused)
        handoff = ReplicaHandoff.from_env(os.environ)
        if handoff is None:
            raise RuntimeError(
                "Manager: no etcd for the replica groups; run under ftrun, or set ELASTIC_FT_ETCD_ENDPOINTS and "
                "ELASTIC_FT_RUN_ID (the same in every replica group)"
            )
        self._pg = pg
        self._load_state_dict = load_state_dict
        self._state_dict = state_dict
        self._min_replicas = min_replica_size
        self._timeout = timeout
        self._quorum_timeout = quorum_timeout.total_seconds()
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._group_rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        self._group_world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        if not 0 <= self._group_rank < self._group_world_size:
            raise ValueError(
                f"Manager: rank {self._group_rank} is not in a replica group of {self._group_world_size} rank(s)"
            )
        self._replica_id = check_replica_id(replica_id if replica_id is not None else _default_replica_id())
        self._handoff = handoff
        self._client = client_for(dataclasses.replace(handoff, connect_timeout=connect_timeout.total_seconds()))
        self._sentinel = LeaseSentinel(LEASE_TTL)
        lease = self._sentinel.start(connect_timeout.total_seconds())
        self._step = 0
        self._batches_committed = 0
        self._quorum: Quorum | None = None
        self._next_quorum_at_least = 0
        self._errored: Exception | None = None
        self._commit_failures = 0
        self._membership = ReplicaMembership(
            self._client, handoff.keys, self._record(), lease, min_replica_size, QUORUM_GRACE
        )
        self._membership.start()
        self._follow_leases(self._sentinel)
        _leave_on_uncaught_exception(self)
        log.info(
            "replica %s rank %d of %d: following the job's quorums in etcd (%s)",
            self._replica_id,
            self._group_rank,
            self._group_world_size,
            handoff.keys.replicas.prefix,
        )

    # ---- TorchFT's step protocol ------------------------------------------------------------------------------

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: datetime.timedelta | None = None
    ) -> None:
        """Begin a step: join the newer quorum the last vote agreed on, or the one after a failure (and heal).

        ``shrink_only`` (TorchFT's: a quorum that takes no newcomer) is accepted and has no effect: a group that
        comes back joins at the next quorum, whose change every member agrees on in a vote.
        """
        self._errored = None
        if self._quorum is not None and self._next_quorum_at_least <= self._quorum.id:
            return
        deadline = time.monotonic() + (timeout.total_seconds() if timeout is not None else self._quorum_timeout)
        while True:
            quorum = self._await_quorum(self._next_quorum_at_least, deadline)
            if self._build_group(quorum, deadline):
                break
        self._quorum = quorum
        self._heal(quorum, allow_heal)
        self._publish(self._record())
        log.info(
            "replica %s rank %d: in quorum %d of %s at step %d",
            self._replica_id,
            self._group_rank,
            quorum.id,
            list(quorum.replicas),
            self._step,
        )

    def wait_quorum(self) -> None:
        """TorchFT's: wait for the quorum ``start_quorum`` began. The quorum is joined synchronously here."""

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None) -> _Done:
        """Average ``tensor`` over the quorum's replica groups, in place. After a failure in this step, leaves it
        as it is (the step will not commit)."""
        if self._errored is None:
            try:
                self._pg.allreduce_sum([tensor])
                if reduce_op is None or reduce_op == dist.ReduceOp.AVG:
                    tensor.div_(self.num_participants())
            except Exception as error:  # noqa: BLE001 - any failure of the group fails the step, not the job
                self.report_error(error)
        return _Done(tensor)

    def should_commit(self, timeout: datetime.timedelta | None = None) -> bool:
        """The vote: True if every member of the quorum (and of this replica group) may commit this step."""
        vote = torch.tensor([0 if self._errored is None else 1, self._latest_quorum_id()], dtype=torch.int64)
        if self._errored is None:
            try:
                self._pg.allreduce_max(vote)
            except Exception as error:  # noqa: BLE001
                self.report_error(error)
                vote[0] = 1
        if self._group_world_size > 1:
            _agree_in_group(vote)
        commit = int(vote[0]) == 0
        if commit:
            self._step += 1
            self._batches_committed += self.num_participants()
            self._commit_failures = 0
            if int(vote[1]) > self._quorum_id():
                self._next_quorum_at_least = int(vote[1])  # every member saw the same vote: all switch now
        else:
            self._commit_failures += 1
            if self._errored is not None:
                self._fail()
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                raise RuntimeError(f"should_commit failed {self._commit_failures} times in a row (max_retries)")
        return commit

    def report_error(self, error: Exception) -> None:
        """This step failed on this rank: it will not commit, anywhere."""
        if self._errored is None:
            log.warning("replica %s rank %d: step %d failed: %s", self._replica_id, self._group_rank, self._step, error)
        self._errored = error

    def errored(self) -> Exception | None:
        return self._errored

    # ---- TorchFT's accessors ----------------------------------------------------------------------------------

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def num_participants(self) -> int:
        return len(self._quorum.replicas) if self._quorum is not None else 0

    def participating_rank(self) -> int | None:
        return self._quorum.index(self._replica_id) if self._quorum is not None else None

    def is_participating(self) -> bool:
        return self._quorum is not None

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def shutdown(self, wait: bool = True) -> None:
        """Leave the replica groups: the records go (the lease is revoked), the group is dropped."""
        self._membership.stop()
        self._sentinel.close()
        self._pg.abort()
        self._client.close()

    # ---- the quorum's life ------------------------------------------------------------------------------------

    def _record(self, failed: int = NO_QUORUM) -> MemberRecord:
        return MemberRecord(
            self._replica_id,
            self._group_rank,
            self._group_world_size,
            self._step,
            self._quorum_id(),
            failed,
        )

    def _quorum_id(self) -> int:
        return self._quorum.id if self._quorum is not None else NO_QUORUM

    def _latest_quorum_id(self) -> int:
        state, _ = self._membership.state()
        latest = state.latest
        return max(latest.id if latest is not None else NO_QUORUM, self._quorum_id())

    def _fail(self) -> None:
        """A collective of the quorum failed here: record it (the next quorum forms without the lost groups), and
        abort the group so that every member blocked on it fails too."""
        failed = self._quorum_id()
        self._pg.abort()
        self._next_quorum_at_least = failed + 1
        self._publish(self._record(failed=failed))

    def _await_quorum(self, at_least: int, deadline: float) -> Quorum:
        """The latest quorum with id ``at_least`` or more that includes this replica group."""
        while True:
            self._check_sentinel()
            state, version = self._membership.state()
            latest = state.latest
            if latest is not None and latest.id >= at_least and self._replica_id in latest.replicas:
                return latest
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"replica {self._replica_id}: no quorum with it (id >= {at_least}) formed within "
                    f"{self._quorum_timeout:.0f} s; the latest is {latest}"
                )
            self._membership.wait_for_change(version, min(left, 1.0))

    def _build_group(self, quorum: Quorum, deadline: float) -> bool:
        """Build ``quorum``'s cross-replica group; False if the quorum was given up (a newer one with this replica
        group came first, a member left while the group was built, or the deadline passed).

        Every rank of every member group arrives in the quorum's store, and the first to see all arrived, or
        a newer quorum, closes the arrivals with one compare-and-set, ``complete`` or ``abandoned``: every rank
        builds its group rank's cross-replica group, or none does. So no rank waits for one that left for a
        newer quorum, and the ranks of a replica group never train in different quorums. A member lost while
        the groups are built, a newer quorum or the deadline cancels them at once (:meth:`_given_up`), in the
        store's waits and in gloo's wait for a peer's connection alike.
        """
        keys = self._handoff.keys.replicas
        store = EtcdStore(self._client, keys.arrivals(quorum.id))
        store.set(f"{self._replica_id}/{self._group_rank}", b"1")
        arrivals = [f"{replica}/{rank}" for replica in quorum.replicas for rank in range(quorum.group_world_size)]
        while not store.check([_CLOSED]):
            if store.check(arrivals):
                store.compare_set(_CLOSED, b"", _COMPLETE)
            elif self._newer_quorum_than(quorum) or time.monotonic() > deadline:
                store.compare_set(_CLOSED, b"", _ABANDONED)
            else:
                pause(_ARRIVAL_POLL)
        if store.get(_CLOSED) != _COMPLETE:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {self._replica_id}: quorum {quorum.id}'s members did not all arrive")
            return False
        try:
            given_up = functools.partial(self._given_up, quorum, deadline)
            gloo = CancellableStore(EtcdStore(self._client, keys.group_store(quorum.id, self._group_rank)), given_up)
            self._pg.configure_in(gloo, quorum.index(self._replica_id), len(quorum.replicas), given_up)
        except Exception as error:  # noqa: BLE001 - a member lost meanwhile: the next quorum goes on without it
            log.warning("replica %s: quorum %d's group failed to form (%s)", self._replica_id, quorum.id, error)
            self._quorum = quorum
            self._fail()
            return False
        return True

    def _newer_quorum_than(self, quorum: Quorum) -> bool:
        latest = self._membership.state()[0].latest
        return latest is not None and latest.id > quorum.id and self._replica_id in latest.replicas

    def _given_up(self, quorum: Quorum, deadline: float) -> str | None:
        """Why building ``quorum``'s group is no longer worth waiting for, or None: a member's records are gone, a
        newer quorum with this replica group formed (every member moves to it), or the deadline passed."""
        if (lost := self._lost_from(quorum)) is not None:
            return lost
        if self._newer_quorum_than(quorum):
            return f"a quorum newer than {quorum.id} formed"
        if time.monotonic() > deadline:
            return f"quorum {quorum.id}'s group was not built within the quorum timeout ({self._quorum_timeout:.0f} s)"
        return None

    def _lost_from(self, quorum: Quorum) -> str | None:
        """Why ``quorum`` can no longer form its group (a member's records gone), or None."""
        present = complete_groups(self._membership.state()[0].members, quorum.group_world_size)
        lost = [replica for replica in quorum.replicas if replica not in present]
        return f"replica group(s) {lost} left quorum {quorum.id}" if lost else None

    def _heal(self, quorum: Quorum, allow_heal: bool) -> None:
        """Every member's step; the members behind the highest receive the state of one at it (a state of DTensors
        only when it is the shard the receiver holds: the same group rank of another replica group).

        A member lost meanwhile fails this step, as it would fail the all-reduce: the error is reported, the step
        does not commit, and the next quorum heals again. A member that gave up building the group (a newer
        quorum) shuts its connections down, so the others see the same.
        """
        try:
            steps = [int(t) for t in self._pg.allgather(torch.tensor([self._step], dtype=torch.int64))]
        except Exception as error:  # noqa: BLE001 - a member lost: the step fails, not the job
            self.report_error(error)
            return
        healing = plan_healing(steps, sync_all=self._init_sync)
        index = quorum.index(self._replica_id)
        receivers = [receiver for receiver, sender in healing.senders.items() if sender == index]
        behind = index in healing.senders
        if behind and not allow_heal:
            raise RuntimeError(f"replica {self._replica_id} is behind (step {self._step}) but allow_heal=False")
        own = layout_of(self._full_state()) if behind else None  # DTensors: the shard it needs is the one it has
        try:
            if receivers:
                send_state(self._pg.backend, receivers, self._full_state(), self._step)
            received = receive_state(self._pg.backend, healing.senders[index]) if behind else None
        except Exception as error:  # noqa: BLE001 - a member lost: the step fails, not the job
            self.report_error(error)
            return
        if received is not None:
            if own is not None:
                check_shard(received.layout, own, own.shard, f"replica {quorum.replicas[healing.senders[index]]}")
            self._load_full_state(received.state)
            log.info(
                "replica %s rank %d: healed to step %d from replica %s (%d bytes)",
                self._replica_id,
                self._group_rank,
                self._step,
                quorum.replicas[healing.senders[index]],
                received.nbytes,
            )

    def _full_state(self) -> dict[str, Any]:
        return {"user": self._state_dict() if self._state_dict is not None else None, "torchft": self.state_dict()}

    def _load_full_state(self, state: Any) -> None:
        if not isinstance(state, dict) or "torchft" not in state:
            raise RuntimeError("the state a replica sent is not a Manager's state")
        self.load_state_dict(state["torchft"])
        if self._load_state_dict is not None:
            self._load_state_dict(state["user"])

    def _publish(self, record: MemberRecord) -> None:
        """This rank's record; if its lease is gone for good, on a new sentinel's lease."""
        try:
            self._membership.publish(record)
        except LeaseLost as error:
            log.warning("replica %s rank %d: %s", self._replica_id, self._group_rank, error)
            self._sentinel.close()
            self._check_sentinel(record)

    def _check_sentinel(self, record: MemberRecord | None = None) -> None:
        """A sentinel that died took this rank's records with it: start another, publish again (``record``, or
        the current one)."""
        if self._sentinel.alive():
            return
        log.warning("replica %s rank %d: the lease sentinel died; starting another", self._replica_id, self._group_rank)
        self._sentinel = LeaseSentinel(LEASE_TTL)
        lease = self._sentinel.start(self._timeout.total_seconds())
        self._membership.publish(record or self._record(), lease=lease)
        self._follow_leases(self._sentinel)

    def _follow_leases(self, sentinel: LeaseSentinel) -> None:
        """Publish this rank's record again on each new lease ``sentinel`` takes (after etcd lost the last)."""

        def follow() -> None:
            while (lease := sentinel.next_lease()) is not None:
                try:
                    self._membership.republish(lease)
                except LeaseLost as error:  # the main thread starts another sentinel at its next quorum
                    log.warning("replica %s rank %d: %s", self._replica_id, self._group_rank, error)

        threading.Thread(target=follow, name="elastic_ft-lease-follower", daemon=True).start()


def _leave_on_uncaught_exception(manager: Manager) -> None:
    """A rank that dies of an exception leaves the quorum before the interpreter's teardown (torch's takes about
    half a second), so the other groups, blocked on it in a collective, go on at once."""
    previous = sys.excepthook

    def leave_then_report(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        manager._pg.abort()
        manager._sentinel.close()
        previous(kind, value, traceback)

    sys.excepthook = leave_then_report


class _Done:
    """A finished collective, as TorchFT's ``allreduce`` returns it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(self._tensor)
        return future


def _agree_in_group(vote: torch.Tensor) -> None:
    """The ranks of one replica group commit together: the vote's maximum over the group's default process group
    (the job's own, which a replica group of several ranks initializes)."""
    if not dist.is_initialized():
        raise RuntimeError("a replica group of several ranks needs its default process group (init_process_group)")
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)


def _default_replica_id() -> str:
    """TorchFT's scripts pass ``replica_id``; without one, the group's place under a launcher (its node)."""
    return os.environ.get("REPLICA_GROUP_ID") or os.environ.get("GROUP_RANK") or "0"


def _check_arguments(
    pg: object,
    load_state_dict: object,
    state_dict: object,
    min_replica_size: object,
    timeout: object,
    quorum_timeout: object,
    unused: dict[str, Any],
) -> None:
    known_unused = {
        "world_size_mode",
        "store_addr",
        "store_port",
        "lighthouse_addr",
        "port",
        "hostname",
        "heartbeat_interval",
        "checkpoint_transport",
        "quorum_retries",
    }
    unknown = sorted(set(unused) - known_unused)
    if unknown:
        raise TypeError(f"Manager() got unexpected keyword argument(s) {unknown}")
    if not isinstance(pg, ProcessGroupGloo):
        raise TypeError(f"Manager pg={pg!r}: expected elastic_ft.torchft.ProcessGroupGloo")
    if (load_state_dict is None) != (state_dict is None):
        raise ValueError("Manager: give load_state_dict and state_dict together, or neither")
    if not isinstance(min_replica_size, int) or isinstance(min_replica_size, bool) or min_replica_size < 1:
        raise ValueError(f"Manager min_replica_size={min_replica_size!r}: expected a whole number >= 1")
    for name, value in (("timeout", timeout), ("quorum_timeout", quorum_timeout)):
        if not isinstance(value, datetime.timedelta) or value.total_seconds() <= 0:
            raise ValueError(f"Manager {name}={value!r}: expected a positive datetime.timedelta")
