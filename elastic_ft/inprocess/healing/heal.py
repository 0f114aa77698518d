"""Peer state healing: at the start of an iteration after a restart, ranks behind take the state from a live peer.

With ``Wrapper(state_dict=..., load_state_dict=...)`` every active rank, at
the start of every iteration after the first:

1. publishes its progress (optimizer steps its state has taken, whether
   it holds the world's state at all, and, when its state holds DTensors,
   which shard of which layout: ``state_dict()`` is read for it) in the
   iteration's store, and meets
   the other active ranks at the heal barrier, whose result lists everyone's
   progress (one read per rank, whatever the world size);
2. computes the :func:`~elastic_ft.inprocess.healing.plan.plan_recovery`
   every rank computes from the same records;
3. if it sends, calls ``state_dict()`` and streams it to its receivers; if
   it receives, receives the state, checks every tensor's checksum (and that
   a DTensor state is the shard the plan says it needs), and only then calls
   ``load_state_dict(state)``; otherwise does nothing.

Each sender and its receivers form a gloo group of their own, bootstrapped
from the iteration's store (so no rank hosts anything, and transfers from
different senders run in parallel). It is created after the iteration's
socket baseline, so a restart cuts its connections like the function's own,
and if the iteration is interrupted it is freed one restart later, like
the function's groups (:mod:`elastic_ft.inprocess.delivery.process_groups`). A transfer that fails is an
ordinary fault: the iteration restarts and the plan is computed afresh. A
``load_state_dict`` that raises is not: the rank's state may be half loaded,
so it leaves the job with :class:`~elastic_ft.inprocess.exception.HealingError`
and the node side escalates; a ``state_dict`` that raises likewise (a
restart would only call it again).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.iteration import IterationView
from elastic_ft.etcd.group_store import GroupStore, group_store
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.inprocess.delivery.process_groups import ProcessGroupKeeper
from elastic_ft.inprocess.exception import HealingError, StateTransferError
from elastic_ft.inprocess.healing.layout import check_shard, layout_of
from elastic_ft.inprocess.healing.plan import RankProgress, RecoveryPlan, ShardLayout, plan_recovery
from elastic_ft.inprocess.healing.transfer import Received, receive_state, run_interruptibly, send_state
from elastic_ft.inprocess.restart.logs import get_logger
from elastic_ft.keys import HEAL_BARRIER
from elastic_ft.untrusted import json_value

log = get_logger("healing")


@dataclass(frozen=True)
class HealResult:
    """What healing did on this rank in one iteration."""

    plan: RecoveryPlan
    #: "sent", "received" or "idle".
    role: str
    #: The rank's step afterwards (the sender's for a receiver).
    step: int
    #: Bytes of state this rank sent to each receiver or received; 0 when idle.
    nbytes: int = 0
    seconds: float = 0.0
    #: The rank holds the world's state afterwards; else it loads the user's checkpoint (``CallWrapper.holds_state``).
    holds_state: bool = True


def parse_progress(payload: str | bytes | None, world_size: int) -> list[RankProgress]:
    """The heal barrier's result (untrusted): one record per active rank, in rank order."""
    records = json_value(payload or None)
    if not isinstance(records, list) or len(records) != world_size:
        raise StateTransferError(f"the heal barrier's result is not {world_size} progress records: {payload!r:.120}")
    progress = []
    for rank, record in enumerate(records):
        try:
            if not isinstance(record, dict):
                raise TypeError(f"a JSON object, got {record!r:.60}")
            # Untrusted values: RankProgress checks their types (TypeError, ValueError).
            shard = record.get("shard")
            held = tuple(shard) if isinstance(shard, list) else shard
            layout = record.get("layout")
            placed = None if layout is None else ShardLayout.from_json(layout)
            progress.append(RankProgress(rank, record.get("step"), record.get("fresh"), held, placed))  # type: ignore[arg-type]
        except (TypeError, ValueError) as error:
            raise StateTransferError(f"malformed progress record of active rank {rank}: {error}") from None
    return progress


def exchange_progress(
    store: IterationView,
    active_rank: int,
    active_world_size: int,
    step: int,
    fresh: bool,
    timeout: datetime.timedelta,
    shard: tuple[int, int] | None = None,
    layout: ShardLayout | None = None,
) -> list[RankProgress]:
    """Publish this rank's progress, wait for every active rank's, and return them all."""
    store.set_heal_progress(active_rank, step, fresh, shard, None if layout is None else layout.to_json())
    payload = store.arrive_and_wait(HEAL_BARRIER, [active_rank], active_world_size, timeout)
    return parse_progress(payload, active_world_size)


@contextmanager
def _transfer_group(
    store: IterationView,
    sender: int,
    members: list[int],
    active_rank: int,
    timeout: datetime.timedelta,
    keeper: ProcessGroupKeeper,
) -> Iterator[Any]:
    """The gloo group of ``sender`` and its receivers; gloo's errors become :class:`StateTransferError`.

    The group is kept alive if the transfer does not finish (see the
    module docstring); once it finished, it is freed as usual. Members meet
    at a store barrier once their side of the group is connected: gloo
    connects every pair of members, receivers too, and a receiver that
    finished and freed its group would otherwise close its connections
    under another receiver still connecting (which then fails with
    "Connection closed by peer"). The group connects in a helper thread
    (:func:`~elastic_ft.inprocess.healing.transfer.run_interruptibly`), so a
    restart reaches this thread while a connect to an unreachable peer
    waits.
    """
    member = members.index(active_rank)
    bootstrap = _bootstrap_store(store, sender)

    def connect() -> Any:
        group = dist.ProcessGroupGloo(bootstrap, member, len(members), timeout)
        keeper.track(group)
        return group

    def abandon() -> None:
        if isinstance(bootstrap, GroupStore):
            bootstrap.abandon(f"the state transfer from rank {sender} was given up (a restart)")

    try:
        # gloo connects to every member in C code: to a peer cut off without a FIN or RST, a connect waits
        # out the group's timeout, where no restart reaches the thread and no released socket wakes it.
        group = run_interruptibly(connect, "elastic_ft-heal-connect", abandon)
        if len(members) > 2:  # two members share one connection: nothing else to close under them
            store.arrive_and_wait(keys.heal_group_ready(sender), [member], len(members), timeout)
        yield group
    except RuntimeError as error:  # gloo: a peer's connection closed, a timeout
        raise StateTransferError(f"the state transfer from rank {sender} to {members[1:]} failed: {error}") from error
    finally:
        if isinstance(bootstrap, GroupStore):
            bootstrap.close()
    keeper.untrack(group)


def _bootstrap_store(store: IterationView, sender: int) -> dist.Store:
    """The store ``sender``'s transfer group is built in, under the iteration's keys.

    On an etcd store, a :class:`~elastic_ft.etcd.group_store.GroupStore`:
    its waits a restart can end (``abandon``). A member that died before it
    published its address would otherwise hold the connecting thread in
    gloo's constructor for the group's whole timeout, calling back into
    Python, and a process that exits meanwhile aborts. A store in C++
    (TCPStore) waits without Python, and is used through a prefix view.
    """
    if isinstance(store.base, EtcdStore) and isinstance(store, IterationView):
        return group_store(store.base, f"{store.key_prefix}/{keys.heal_group(sender)}")
    return dist.PrefixStore(keys.heal_group(sender), store.store)


def heal(
    store: IterationView,
    active_rank: int,
    active_world_size: int,
    iteration: int,
    step: int,
    fresh: bool,
    state_dict: Callable[[], Any],
    load_state_dict: Callable[[Any], Any],
    timeout: datetime.timedelta,
    keeper: ProcessGroupKeeper,
    shard: tuple[int, int] | None = None,
    shards: int | None = None,
) -> HealResult:
    """Run this rank's part of the iteration's healing; see the module docstring.

    ``shard``: the shard this rank's state holds; ``shards``: the mesh's
    shard dimension this iteration (a sharded model, see
    :mod:`~elastic_ft.inprocess.healing.plan`).

    Without ``shards`` (the rank assignment says nothing of shards), a rank
    that holds state reads ``state_dict()`` to publish where its DTensors
    place it, and the plan is keyed by that layout.

    Raises:
        StateTransferError: the exchange or a transfer failed (the iteration restarts).
        HealingError: ``state_dict`` or ``load_state_dict`` raised, a state's DTensors cannot be placed, or a
            sender's shard is not the one this rank needs (the rank leaves, the node side escalates).
    """
    state = layout = None
    if shards is None and not fresh:
        state = _state_of(state_dict, active_rank)
        try:
            layout = layout_of(state)
        except ValueError as error:
            raise HealingError(f"rank {active_rank}: {error}") from None
    progress = exchange_progress(store, active_rank, active_world_size, step, fresh, timeout, shard, layout)
    plan = plan_recovery(progress, rotation=iteration, shards=shards)
    if active_rank == 0 or plan.heals:
        log.info("iteration %d: rank %d: %s", iteration, active_rank, plan.reason)
    if active_rank in plan.unhealable:
        log.warning(
            "iteration %d: rank %d loads the checkpoint: %s", iteration, active_rank, plan.unhealable[active_rank]
        )
    source = plan.source_of(active_rank)
    receivers = plan.receivers_of(active_rank)
    sender = active_rank if receivers else source
    if sender is None:
        return HealResult(plan, "idle", step, holds_state=plan.holds_state(active_rank))
    members = [sender, *plan.receivers_of(sender)]
    started = time.monotonic()
    if receivers:
        with _transfer_group(store, sender, members, active_rank, timeout, keeper) as group:
            sent = state if state is not None else _state_of(state_dict, active_rank)
            destinations = list(range(1, len(members)))
            nbytes = run_interruptibly(lambda: send_state(group, destinations, sent, step), "elastic_ft-heal-send")
        elapsed = time.monotonic() - started
        log.info(
            "iteration %d: rank %d sent its state at step %d (%.1f MB) to ranks %s in %.3f s",
            iteration,
            active_rank,
            step,
            nbytes / 1e6,
            list(receivers),
            elapsed,
        )
        return HealResult(plan, "sent", step, nbytes, elapsed)
    with _transfer_group(store, sender, members, active_rank, timeout, keeper) as group:
        received = run_interruptibly(lambda: receive_state(group, 0), "elastic_ft-heal-receive")
    return _load(received, plan, source, active_rank, iteration, load_state_dict, started)


def _state_of(state_dict: Callable[[], Any], active_rank: int) -> Any:
    try:
        return state_dict()
    except Exception as error:
        raise HealingError(f"rank {active_rank}: state_dict() raised {error!r}") from error


def _load(
    received: Received,
    plan: RecoveryPlan,
    source: int | None,
    active_rank: int,
    iteration: int,
    load_state_dict: Callable[[Any], Any],
    started: float,
) -> HealResult:
    """A receiver's last part: the state received checked against the plan, then loaded."""
    sent_step = received.step
    if sent_step != plan.max_step:
        raise StateTransferError(f"rank {source} sent its state at step {sent_step}, the plan says {plan.max_step}")
    needed = plan.shard_needed(active_rank)
    if plan.layout is not None and needed is not None:
        check_shard(received.layout, plan.layout, needed, f"rank {source}")
    try:
        load_state_dict(received.state)
    except Exception as error:
        raise HealingError(
            f"rank {active_rank}: load_state_dict raised on the state healed from rank {source} "
            f"at step {sent_step}: {error!r}"
        ) from error
    elapsed = time.monotonic() - started
    log.info(
        "iteration %d: rank %d healed from rank %d to step %d (%.1f MB) in %.3f s",
        iteration,
        active_rank,
        source,
        sent_step,
        received.nbytes / 1e6,
        elapsed,
    )
    return HealResult(plan, "received", sent_step, received.nbytes, elapsed)
