"""Rank reassignment and spare activation after faults.

After some ranks fail, the survivors must agree on a new consecutive
numbering (``rank``, ``world_size``) and on which of them run the training
function (``active_rank``, ``active_world_size``); the others stay as idle
spares that can replace an active rank at a later fault.

Policies are small callables taking and returning a :class:`RankAssignmentCtx`
and compose with :class:`elastic_ft.Compose`, rightmost first:

* rank assignments renumber the survivors: :class:`ShiftRanks`,
  :class:`FillGaps`, or mark more ranks for termination:
  :class:`FilterCountGroupedByKey`;
* rank filters choose the active ranks: :class:`ActivateAllRanks`,
  :class:`MaxActiveWorldSize`, :class:`ActiveWorldSizeDivisibleBy`;
* :class:`Tree` does all of it at once over a topology tree of
  :class:`Layer` s, and is used alone.

Every rank computes the same answer from the same inputs. Where ranks need
each other's data (grouping keys), they exchange it once through the store in
the context, under keys namespaced by policy name and call number, as JSON,
with a timeout; the decisions themselves are pure functions of the gathered
data (see :mod:`elastic_ft.rank_tree`).

The public names mirror NVIDIA's ``nvidia_resiliency_ext.inprocess`` so that
code written against it moves over with an import change.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import json
import threading
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch.distributed

from elastic_ft.rank_tree import (
    Layer,
    LayerFlag,
    TreeAssignment,
    TreeTopology,
    WorldSizeFilter,
    build_tree_topology,
    initial_tree_assignment,
    reassign_tree,
)
from elastic_ft.state import Mode, State

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "FilterCountGroupedByKey",
    "Layer",
    "LayerFlag",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankAssignmentTimeout",
    "RankDiscarded",
    "RankFilter",
    "ShiftRanks",
    "Tree",
    "ranks_failing_group_condition",
]

STORE_PREFIX = "elastic_ft/rank_assignment"
DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)


class RankDiscarded(Exception):
    """This rank takes no further part in the job: it was terminated or discarded."""


class RankAssignmentTimeout(TimeoutError):
    """Ranks did not all publish their data to the store in time."""


@dataclasses.dataclass
class RankAssignmentCtx:
    """Input and output of a :class:`RankAssignment`.

    Args:
        state: this rank's state.
        store: the store shared by all ranks, used by policies that exchange
            data.
        terminated_ranks: current ``state.rank`` values of the ranks that
            failed since the last call; the same on every rank.
    """

    state: State
    store: torch.distributed.Store
    terminated_ranks: Collection[int]


class RankAssignment(abc.ABC):
    """A policy that renumbers ranks and/or selects the active ones.

    Called once per restart iteration on every surviving rank, with the
    state it returned last time. Returns a new context; raises
    :class:`RankDiscarded` on a rank that leaves the job.
    """

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        """Compute this rank's next state."""


class RankFilter(RankAssignment):
    """A policy that only selects the active ranks, keeping ``rank`` and ``world_size``.

    Filters normally come after (to the left of, in :class:`~elastic_ft.Compose`)
    the assignments that renumber ranks.
    """

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        """Choose whether this rank is active."""


def _check_terminated_ranks(ctx: RankAssignmentCtx, owner: str) -> None:
    world_size = ctx.state.world_size
    bad = [rank for rank in ctx.terminated_ranks if not 0 <= rank < world_size]
    if bad:
        raise ValueError(
            f"{owner}: terminated_ranks must be ranks in [0, world_size={world_size}), got {sorted(bad)[:8]}"
        )


def _require_rank(state: State, owner: str) -> int:
    if state.rank is None:
        raise ValueError(f"{owner} needs a state with a rank, got rank=None")
    return state.rank


def _rank_and_terminated(ctx: RankAssignmentCtx, owner: str) -> tuple[int, set[int]]:
    """This rank and the checked set of terminated ranks: the inputs every reassignment starts from."""
    _check_terminated_ranks(ctx, owner)
    return _require_rank(ctx.state, owner), set(ctx.terminated_ranks)


def _discard(rank: int, terminated_ranks: Collection[int]) -> RankDiscarded:
    return RankDiscarded(f"rank {rank} is among the terminated ranks {sorted(terminated_ranks)[:16]}")


def _activate_all(state: State) -> State:
    return dataclasses.replace(
        state,
        mode=Mode.ACTIVE,
        active_rank=state.rank,
        active_world_size=state.world_size,
    )


class ShiftRanks(RankAssignment):
    """Close the gaps left by terminated ranks by shifting later ranks down.

    Survivors keep their relative order; every rank after the first
    terminated one gets a new index::

        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+
        | 0 | X | 2 | 3 | X | X | 6 | 7 | --> | 0 | 2 | 3 | 6 | 7 |
        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+

    Every survivor becomes active with ``active_rank == rank``; compose a
    :class:`RankFilter` on the left to keep spares.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, terminated = _rank_and_terminated(ctx, "ShiftRanks")
        if rank in terminated:
            raise _discard(rank, terminated)
        state = dataclasses.replace(
            ctx.state,
            rank=rank - sum(1 for other in terminated if other < rank),
            world_size=ctx.state.world_size - len(terminated),
        )
        return dataclasses.replace(ctx, state=_activate_all(state), terminated_ranks=set())


class FillGaps(RankAssignment):
    """Fill the gaps left by terminated ranks with the highest ranks.

    Ranks below the new world size keep their index; survivors at or above
    it move, in increasing order, into the gaps below it, lowest first::

        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+
        | 0 | X | 2 | 3 | X | X | 6 | 7 | --> | 0 | 6 | 2 | 3 | 7 |
        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+

    Every survivor becomes active with ``active_rank == rank``; compose a
    :class:`RankFilter` on the left to keep spares.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, terminated = _rank_and_terminated(ctx, "FillGaps")
        if rank in terminated:
            raise _discard(rank, terminated)
        world_size = ctx.state.world_size - len(terminated)
        if rank >= world_size:
            # This rank is the k-th survivor at or above the new size; it takes
            # the k-th gap below the new size.
            skipped = sum(1 for other in terminated if world_size <= other < rank)
            gaps = sorted(other for other in terminated if other < world_size)
            rank = gaps[rank - world_size - skipped]
        state = dataclasses.replace(ctx.state, rank=rank, world_size=world_size)
        return dataclasses.replace(ctx, state=_activate_all(state), terminated_ranks=set())


class ActivateAllRanks(RankFilter):
    """Make every rank active: ``active_rank = rank``, ``active_world_size = world_size``."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        _require_rank(ctx.state, "ActivateAllRanks")
        return dataclasses.replace(ctx, state=_activate_all(ctx.state))


def _activate_below(state: State, active_world_size: int) -> State:
    """Activate exactly the ranks below ``active_world_size``."""
    rank = state.rank
    active = rank is not None and rank < active_world_size
    return dataclasses.replace(
        state,
        mode=Mode.ACTIVE if active else Mode.INACTIVE,
        active_rank=rank if active else None,
        active_world_size=active_world_size,
    )


def _current_active_world_size(state: State) -> int:
    if state.active_world_size is None:
        return state.world_size
    return min(state.active_world_size, state.world_size)


def _check_positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner} {name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{owner} {name} must be >= 1, got {value}")


class MaxActiveWorldSize(RankFilter):
    """Keep at most ``max_active_world_size`` ranks active: those with the lowest ranks.

    Args:
        max_active_world_size: the largest active world size; ``None`` for no
            limit beyond the current one.
    """

    def __init__(self, max_active_world_size: int | None = None) -> None:
        if max_active_world_size is not None:
            _check_positive_int("MaxActiveWorldSize", "max_active_world_size", max_active_world_size)
        self.max_active_world_size = max_active_world_size

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        _require_rank(ctx.state, "MaxActiveWorldSize")
        size = _current_active_world_size(ctx.state)
        if self.max_active_world_size is not None:
            size = min(size, self.max_active_world_size)
        return dataclasses.replace(ctx, state=_activate_below(ctx.state, size))


class ActiveWorldSizeDivisibleBy(RankFilter):
    """Round the active world size down to a multiple of ``divisor``.

    The ranks below the rounded size are active, the others are spares.
    ``Compose(ActiveWorldSizeDivisibleBy(M), MaxActiveWorldSize(N))`` keeps the
    largest multiple of ``M`` not greater than ``N`` active.

    Args:
        divisor: a positive int.
    """

    def __init__(self, divisor: int = 1) -> None:
        _check_positive_int("ActiveWorldSizeDivisibleBy", "divisor", divisor)
        self.divisor = divisor

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        _require_rank(ctx.state, "ActiveWorldSizeDivisibleBy")
        size = _current_active_world_size(ctx.state) // self.divisor * self.divisor
        return dataclasses.replace(ctx, state=_activate_below(ctx.state, size))


# ---------------------------------------------------------------------------
# Store exchange


class _NameCounter(threading.local):
    """Per-thread instance counts, for default policy names.

    Ranks build their policies in the same order, so the n-th instance of a
    class gets the same name on every rank. Counting per thread keeps that
    true when ranks are simulated as threads of one process.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()


_name_counter = _NameCounter()


def _policy_name(cls: type, name: str | None) -> str:
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__} name must be a non-empty str, got {name!r}")
        return name
    index = _name_counter.counts[cls.__name__]
    _name_counter.counts[cls.__name__] += 1
    return f"{cls.__name__}-{index}"


def _check_timeout(owner: str, timeout: datetime.timedelta) -> None:
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"{owner} timeout must be a datetime.timedelta, got {timeout!r}")
    if timeout <= datetime.timedelta(0):
        raise ValueError(f"{owner} timeout must be positive, got {timeout}")


def _gather_keys(
    store: torch.distributed.Store,
    prefix: str,
    rank: int,
    ranks: Sequence[int],
    keys: list[str],
    timeout: datetime.timedelta,
    what: str,
) -> list[list[str]]:
    """All-gather every rank's list of string keys through the store.

    Each rank publishes its keys under its own store key and counts itself
    in; the last to arrive reads them all and publishes one compact table
    (distinct keys once, then an index per rank), which everyone reads. That
    is one round of O(1) store operations per rank, not one read per peer.

    Returns columns: ``columns[i][j]`` is ``keys[i]`` of ``ranks[j]``.

    Raises:
        RankAssignmentTimeout: naming the ranks that never published.
        ValueError: ranks published differently shaped keys.
    """

    def rank_key(peer: int) -> str:
        return f"{prefix}/keys/{peer}"

    table_key = f"{prefix}/table"
    # Values are JSON text; the store keeps a str as its UTF-8 bytes.
    store.set(rank_key(rank), json.dumps(keys))
    if store.add(f"{prefix}/arrived", 1) == len(ranks):
        values = store.multi_get([rank_key(peer) for peer in ranks])
        store.set(table_key, json.dumps(_encode_columns(values, len(keys))))
    try:
        store.wait([table_key], timeout)
    except RuntimeError as error:  # torch.distributed.DistStoreError on timeout
        missing = [peer for peer in ranks if not store.check([rank_key(peer)])]
        if missing:
            detail = f"{len(missing)} of {len(ranks)} ranks did not publish: {missing[:32]}"
        else:
            detail = "every rank published, but the last to arrive never published the table"
        raise RankAssignmentTimeout(
            f"{what}: timed out after {timeout.total_seconds():g} s gathering grouping keys under {prefix!r}; {detail}"
        ) from error
    table = json.loads(store.get(table_key))
    if "error" in table:
        raise ValueError(f"{what}: {table['error']}")
    return [
        [distinct[code] for code in codes] for distinct, codes in zip(table["distinct"], table["codes"], strict=True)
    ]


def _encode_columns(values: list[bytes], width: int) -> dict[str, Any]:
    """The table every rank reads: each column's distinct keys, and each rank's index into them."""
    try:
        # One decode of all values as a JSON array is far cheaper than one per rank.
        published = json.loads(b"[" + b",".join(values) + b"]")
    except ValueError:
        return {"error": "a rank published keys that are not JSON"}
    for value in published:
        if not isinstance(value, list) or len(value) != width:
            return {"error": f"every rank must publish {width} keys, one rank published {value!r}"}
    distinct: list[list[str]] = []
    codes: list[list[int]] = []
    for column in range(width):
        index: dict[str, int] = {}
        codes.append([index.setdefault(value[column], len(index)) for value in published])
        distinct.append(list(index))
    return {"distinct": distinct, "codes": codes}


def ranks_failing_group_condition(
    ranks: Sequence[int], keys: Sequence[str], condition: Callable[[int], bool]
) -> set[int]:
    """The ranks whose group's size fails ``condition``.

    ``keys[i]`` is the group of ``ranks[i]``; ``condition`` is evaluated once
    per group with the number of ranks in it.
    """
    sizes = Counter(keys)
    failing = {key for key, size in sizes.items() if not condition(size)}
    return {rank for rank, key in zip(ranks, keys, strict=True) if key in failing}


class FilterCountGroupedByKey(RankAssignment):
    """Mark for termination every rank whose group's healthy count fails a condition.

    Healthy ranks (those not in ``terminated_ranks``) are grouped by
    ``key_or_fn``; a group whose size ``n`` gives ``condition(n) == False`` is
    added to ``terminated_ranks`` as a whole. Compose it to the right of an
    assignment that then drops the ranks::

        condition = lambda count: count == 2
        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+---+---+---+
        | 0 | X | 2 | 3 | X | X | 6 | 7 | --> | X | X | 2 | 3 | X | X | 6 | 7 |
        +---+---+---+---+---+---+---+---+     +---+---+---+---+---+---+---+---+
        | key=0 | key=1 | key=2 | key=3 |
        |count=1|count=2|count=0|count=2|

        Compose(ShiftRanks(), FilterCountGroupedByKey(lambda s: host_of(s), lambda n: n == 8))

    Healthy ranks exchange their keys through the store once per call.

    Args:
        key_or_fn: the group key: a string, or a callable taking the
            :class:`~elastic_ft.State` and returning one.
        condition: called with a group's healthy count; ``False`` terminates
            the group.
        timeout: how long to wait for every healthy rank's key.
        name: namespace of this instance's store keys; must be the same on
            every rank and differ between instances sharing a store. By
            default the n-th instance a thread builds is named
            ``FilterCountGroupedByKey-n``.
    """

    def __init__(
        self,
        key_or_fn: str | Callable[[State], str],
        condition: Callable[[int], bool],
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        *,
        name: str | None = None,
    ) -> None:
        if not isinstance(key_or_fn, str) and not callable(key_or_fn):
            raise TypeError(
                "FilterCountGroupedByKey key_or_fn must be a str or a callable "
                f"taking a State and returning a str, got {key_or_fn!r}"
            )
        if not callable(condition):
            raise TypeError(f"FilterCountGroupedByKey condition must be callable, got {condition!r}")
        _check_timeout("FilterCountGroupedByKey", timeout)
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout
        self.name = _policy_name(type(self), name)
        self._calls = 0

    def _key(self, state: State) -> str:
        if isinstance(self.key_or_fn, str):
            return self.key_or_fn
        key = self.key_or_fn(state)
        if not isinstance(key, str):
            raise TypeError(
                f"FilterCountGroupedByKey key_or_fn {self.key_or_fn!r} must return "
                f"a str, got {key!r} for rank {state.rank}"
            )
        return key

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        call = self._calls
        self._calls += 1
        rank, terminated = _rank_and_terminated(ctx, "FilterCountGroupedByKey")
        if rank in terminated:
            return ctx
        healthy = [other for other in range(ctx.state.world_size) if other not in terminated]
        (keys,) = _gather_keys(
            ctx.store,
            f"{STORE_PREFIX}/{self.name}/{call}",
            rank,
            healthy,
            [self._key(ctx.state)],
            self.timeout,
            f"FilterCountGroupedByKey {self.name!r} call {call}",
        )
        failing = ranks_failing_group_condition(healthy, keys, self.condition)
        return dataclasses.replace(ctx, terminated_ranks=terminated | failing)


# ---------------------------------------------------------------------------
# Tree


class Tree(RankAssignment):
    """Topology-aware rank assignment and spare activation over a tree of layers.

    At the first call the ranks exchange their grouping keys (one per
    :class:`Layer`, root first) and build a tree: one root, a level of
    subtrees per further layer, ranks as leaves. Ranks are renumbered in tree
    order. Each layer bounds its subtrees: at most ``max_ranks`` active ranks,
    at least ``min_ranks`` healthy ones or the subtree is terminated. Ranks
    are activated depth first while every subtree has room; the rest are
    spares.

    At each later call, with the failed ranks in ``ctx.terminated_ranks``:
    undersized subtrees are terminated; terminated active ranks are replaced
    by spares from the nearest ``RESERVE`` ancestors; remaining gaps are
    closed inside ``BACKFILL`` domains, then by a global shift; and
    ``world_size_filter`` may turn the highest active ranks into spares. See
    :func:`elastic_ft.rank_tree.reassign_tree` for the exact, deterministic
    rules.

    A rank that is terminated or discarded gets :class:`RankDiscarded`.
    ``Tree`` renumbers ranks itself and is not composed with other policies.

    Args:
        layers: the layers, root first; every rank must have the same root
            key.
        world_size_filter: optional; maps the active world size to the size
            wanted, no greater.
        timeout: how long the first call waits for every rank's keys.
        name: namespace of this instance's store keys (see
            :class:`FilterCountGroupedByKey`).

    Example::

        Tree([
            Layer(min_ranks=128, max_ranks=256, key_or_fn="root", flag=LayerFlag.RESERVE),
            Layer(min_ranks=8, max_ranks=8, key_or_fn=lambda _: socket.gethostname(),
                  flag=LayerFlag.RESERVE),
        ])
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        world_size_filter: WorldSizeFilter | None = None,
        *,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        name: str | None = None,
    ) -> None:
        layers = list(layers)
        if not layers:
            raise ValueError("Tree needs at least one Layer, got none")
        for index, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"Tree layers[{index}] must be a Layer, got {layer!r}")
        if world_size_filter is not None and not callable(world_size_filter):
            raise TypeError(f"Tree world_size_filter must be callable or None, got {world_size_filter!r}")
        _check_timeout("Tree", timeout)
        self.layers = layers
        self.world_size_filter = world_size_filter
        self.timeout = timeout
        self.name = _policy_name(type(self), name)
        self._calls = 0
        self._topology: TreeTopology | None = None
        self._assignment: TreeAssignment | None = None
        self._position = -1

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        call = self._calls
        self._calls += 1
        rank, terminated = _rank_and_terminated(ctx, "Tree")
        if self._topology is None or self._assignment is None:
            if rank in terminated:
                raise _discard(rank, terminated)
            self._topology, self._assignment = self._build(ctx, call, rank, terminated)
            self._position = self._topology.ranks.index(rank)
        else:
            previous = self._assignment
            expected_rank = previous.rank_of(self._position)
            if (rank, ctx.state.world_size) != (expected_rank, previous.world_size):
                raise ValueError(
                    f"Tree {self.name!r} expected the state it returned last time "
                    f"(rank={expected_rank}, world_size={previous.world_size}), got "
                    f"rank={rank}, world_size={ctx.state.world_size}; Tree renumbers "
                    "ranks itself and cannot be composed with other rank assignments"
                )
            self._assignment = reassign_tree(self._topology, previous, terminated, self.world_size_filter)

        assignment = self._assignment
        new_rank = assignment.rank_of(self._position)
        if new_rank is None:
            if rank in terminated:
                raise _discard(rank, terminated)
            raise RankDiscarded(
                f"rank {rank} was discarded: a subtree it belongs to fell below "
                f"its min_ranks after ranks {sorted(terminated)[:16]} terminated"
            )
        state = dataclasses.replace(
            ctx.state,
            rank=new_rank,
            world_size=assignment.world_size,
            mode=assignment.mode[self._position],
            active_rank=assignment.active_rank_of(self._position),
            active_world_size=assignment.active_world_size,
        )
        return dataclasses.replace(ctx, state=state, terminated_ranks=set())

    def _build(
        self, ctx: RankAssignmentCtx, call: int, rank: int, terminated: set[int]
    ) -> tuple[TreeTopology, TreeAssignment]:
        """Gather every healthy rank's keys, build the tree, activate."""
        healthy = [other for other in range(ctx.state.world_size) if other not in terminated]
        what = f"Tree {self.name!r}"
        columns = _gather_keys(
            ctx.store,
            f"{STORE_PREFIX}/{self.name}/{call}",
            rank,
            healthy,
            [layer.key(ctx.state) for layer in self.layers],
            self.timeout,
            what,
        )
        try:
            topology = build_tree_topology(self.layers, healthy, columns)
        except ValueError as error:
            raise ValueError(f"{what}: {error}") from None
        return topology, initial_tree_assignment(topology, self.world_size_filter)
