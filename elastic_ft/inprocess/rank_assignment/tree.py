"""Topology-aware rank assignment: :class:`Tree` over :class:`Layer` s.

The I/O (one grouping-key exchange) is here; every decision is in
:mod:`elastic_ft.inprocess.rank_assignment.tree_engine`.
"""

from __future__ import annotations

import dataclasses
import datetime
import warnings
from collections.abc import Sequence

from elastic_ft.inprocess.exception import RankDiscarded
from elastic_ft.inprocess.rank_assignment.base import (
    DEFAULT_TIMEOUT,
    RankAssignment,
    RankAssignmentCtx,
    check_timeout,
    discard,
    policy_name,
    rank_and_terminated,
)
from elastic_ft.inprocess.rank_assignment.exchange import KeyExchangeStore, gather_keys
from elastic_ft.inprocess.rank_assignment.tree_engine import (
    Layer,
    TreeAssignment,
    TreeTopology,
    WorldSizeFilter,
    build_tree_topology,
    initial_tree_assignment,
    reassign_tree,
)
from elastic_ft.inprocess.state import Mode, State
from elastic_ft.keys import rank_assignment_exchange


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
    :func:`elastic_ft.inprocess.rank_assignment.tree_engine.reassign_tree` for the exact, deterministic
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

    #: A joiner's Tree would build its topology afresh while the others reassign theirs.
    admits_new_ranks = False

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
        check_timeout("Tree", timeout)
        self.layers = layers
        self.world_size_filter = world_size_filter
        self.timeout = timeout
        self.name = policy_name(type(self), name)
        self._calls = 0
        self._initial_world_size = 0
        self._topology: TreeTopology | None = None
        self._assignment: TreeAssignment | None = None
        self._position = -1

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        call = self._calls
        self._calls += 1
        rank, terminated = rank_and_terminated(ctx, "Tree")
        if self._topology is None or self._assignment is None:
            if rank in terminated and not isinstance(ctx.store, KeyExchangeStore):
                raise discard(rank, terminated)  # it cannot take part in the key exchange
            self._topology, self._assignment = self._build(ctx, call, rank, terminated)
            self._position = self._topology.ranks.index(rank)
            if any(other in self._topology.ranks for other in terminated):
                # A store that holds the failed ranks' keys too (NVIDIA's protocol) built them into
                # the tree: they fail now, with replacements, as in a later call.
                self._assignment = reassign_tree(self._topology, self._assignment, terminated, self.world_size_filter)
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
                raise discard(rank, terminated)
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

    @property
    def init_rank_map(self) -> dict[int, RankView]:
        """Every rank's place after the last call, by the rank it had when the tree was built.

        Each rank computes the whole world's assignment (it is a pure
        function of inputs every rank shares), so any one of them can show
        the others' states: what NVIDIA's ``Tree.init_rank_map`` gives, each
        entry with its ``state``. Empty before the first call.
        """
        topology, assignment = self._topology, self._assignment
        if topology is None or assignment is None:
            return {}
        views = {
            # Ranks already failed when the tree was built: never in it.
            initial: RankView(State(None, self._initial_world_size, initial_rank=initial, mode=Mode.TERMINATED))
            for initial in range(self._initial_world_size)
            if initial not in topology.ranks
        }
        for position, initial in enumerate(topology.ranks):
            mode = assignment.mode[position]
            active = mode is Mode.ACTIVE
            views[initial] = RankView(
                State(
                    assignment.rank_of(position),
                    max(assignment.world_size, 1),
                    active_rank=assignment.active_rank_of(position) if active else None,
                    active_world_size=assignment.active_world_size,
                    initial_rank=initial,
                    initial_world_size=self._initial_world_size,
                    mode=mode,
                )
            )
        return views

    def _build(
        self, ctx: RankAssignmentCtx, call: int, rank: int, terminated: set[int]
    ) -> tuple[TreeTopology, TreeAssignment]:
        """Gather every healthy rank's keys, build the tree, activate.

        A store that speaks NVIDIA's ``StoreMixin`` key protocol
        (``get_keys``) holds every rank's keys, the failed ones' too, so the
        tree is built over all of them, as NVIDIA's ``Tree`` builds it.
        """
        self._initial_world_size = ctx.state.world_size
        everyone = isinstance(ctx.store, KeyExchangeStore)
        healthy = [other for other in range(ctx.state.world_size) if everyone or other not in terminated]
        what = f"Tree {self.name!r}"
        columns = gather_keys(
            ctx.store,
            rank_assignment_exchange(self.name, call),
            rank,
            healthy,
            [layer.key(ctx.state) for layer in self.layers],
            self.timeout,
            what,
        )
        try:
            topology = build_tree_topology(self.layers, healthy, columns)
        except ValueError as error:
            raise TreeTopologyError(f"{what}: {error}") from None
        misplaced = next(
            ((position, placed) for position, placed in enumerate(topology.ranks) if placed != healthy[position]), None
        )
        if misplaced is not None:
            # Every rank computes this alike; the tree's order wins, but ranks the launcher meant
            # to be neighbours may not be: worth a word, as NVIDIA's Tree gives one.
            warnings.warn(
                f"{what}: the ranks' order does not follow the topology: rank {misplaced[1]} is at "
                f"position {misplaced[0]} of the tree (group members should have consecutive ranks)",
                stacklevel=3,
            )
        return topology, initial_tree_assignment(topology, self.world_size_filter)


@dataclasses.dataclass(frozen=True)
class RankView:
    """One rank's entry of :attr:`Tree.init_rank_map`: its ``state`` after the last call."""

    state: State


class TreeTopologyError(ValueError, RuntimeError):
    """The ranks' keys do not form one tree (several roots, or key lists of different shapes).

    A ``ValueError`` (bad input) that is also a ``RuntimeError``, the type
    NVIDIA's ``Tree`` raises for it.
    """
