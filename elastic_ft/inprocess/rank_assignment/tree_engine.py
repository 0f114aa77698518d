"""Pure computation behind :class:`elastic_ft.inprocess.rank_assignment.tree.Tree`.

Nothing here touches a store, a clock or a process: given every rank's
grouping keys, the layers, the previous assignment and the ranks that just
failed, these functions compute the next assignment of the *whole* world.
Every rank runs the same computation on the same inputs and reads its own
entry, so all ranks agree without a further exchange, and the logic can be
tested and timed in isolation.

Representation
--------------
The ranks that join at the first call are laid out once, in *tree order*
(depth first; children in order of the smallest rank they contain, leaves in
rank order). A rank is then known by its fixed *position* in that order, and
every subtree covers a contiguous range of positions. Per-rank data are flat
lists indexed by position and per-subtree counters are flat lists indexed by
node, one list per depth. Depth ``d`` holds the nodes of ``layers[d]``; depth
0 is the root; the ranks themselves are the leaves below the last layer.

A surviving rank's ``rank`` is its index among surviving positions, so ranks
always run ``0 .. world_size - 1`` in tree order. Its ``active_rank`` (its
*slot*) is kept separately, ``-1`` when it is not active.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from itertools import accumulate

from elastic_ft.inprocess.rank_assignment.base import grouping_key, is_grouping_key
from elastic_ft.inprocess.state import Mode, State

_NO_SLOT = -1


class LayerFlag(enum.Flag):
    """Policies a :class:`Layer` enables for the subtrees at its depth.

    Flags combine with ``|``.
    """

    #: A failed active rank may be replaced by a spare found anywhere in this
    #: subtree (searched from the nearest such ancestor outwards).
    RESERVE = enum.auto()
    #: When no spare is found, the gap may be closed by moving the subtree's
    #: own highest active ranks down into it, before the global shift.
    BACKFILL = enum.auto()


@dataclasses.dataclass
class Layer:
    """One level of the topology tree built by ``Tree``.

    Its fields may be set after construction, as NVIDIA's can (``layer.flag
    = LayerFlag.RESERVE``), and are checked again each time; a ``Tree``
    reads them when it first runs.

    Args:
        min_ranks: a subtree at this level with fewer healthy ranks (active
            and spare) than this is terminated as a whole; at the root this
            ends the job.
        max_ranks: at most this many ranks are active in a subtree at this
            level; ``None`` for no limit.
        key_or_fn: the grouping key of the subtree a rank belongs to: a string
            (or an int, float, bool, None, or a tuple of them), or a callable
            taking the rank's :class:`~elastic_ft.State` and returning one
            (e.g. the host name, or ``state.rank // 8``).
        flag: policies for subtrees at this level, see :class:`LayerFlag`.
    """

    min_ranks: int = 1
    max_ranks: int | None = None
    key_or_fn: str | Callable[[State], str] = ""
    flag: LayerFlag | None = None

    def __post_init__(self) -> None:
        self._check()
        object.__setattr__(self, "_built", True)

    def __setattr__(self, name: str, value: object) -> None:
        if not getattr(self, "_built", False):
            super().__setattr__(name, value)
            return
        previous = getattr(self, name)
        super().__setattr__(name, value)
        try:
            self._check()
        except (TypeError, ValueError):
            super().__setattr__(name, previous)  # a failed assignment changes nothing
            raise

    def _check(self) -> None:
        if isinstance(self.min_ranks, bool) or not isinstance(self.min_ranks, int):
            raise TypeError(f"Layer min_ranks must be an int, got {self.min_ranks!r}")
        if self.min_ranks < 1:
            raise ValueError(f"Layer min_ranks must be >= 1, got {self.min_ranks}")
        if self.max_ranks is not None:
            if isinstance(self.max_ranks, bool) or not isinstance(self.max_ranks, int):
                raise TypeError(f"Layer max_ranks must be an int or None, got {self.max_ranks!r}")
            if self.max_ranks < 1:
                raise ValueError(f"Layer max_ranks must be >= 1, got {self.max_ranks}")
            if self.min_ranks > self.max_ranks:
                raise ValueError(f"Layer min_ranks={self.min_ranks} must not exceed max_ranks={self.max_ranks}")
        if not callable(self.key_or_fn) and not is_grouping_key(self.key_or_fn):
            raise TypeError(
                "Layer key_or_fn must be a key (a str, int, float, bool, None or a tuple of them) "
                f"or a callable taking a State and returning one, got {self.key_or_fn!r}"
            )
        if self.flag is not None and not isinstance(self.flag, LayerFlag):
            raise TypeError(f"Layer flag must be a LayerFlag or None, got {self.flag!r}")

    def key(self, state: State) -> str:
        """This rank's grouping key at this layer."""
        return grouping_key(self.key_or_fn, state, "Layer")

    def has(self, flag: LayerFlag) -> bool:
        return self.flag is not None and flag in self.flag


@dataclasses.dataclass(frozen=True)
class TreeTopology:
    """The fixed shape of the tree, built once from every rank's keys.

    ``node_of[d][p]`` is the depth-``d`` node holding position ``p``;
    ``node_start[d][n]`` / ``node_end[d][n]`` bound node ``n``'s positions.
    """

    ranks: list[int]
    node_of: list[list[int]]
    node_start: list[list[int]]
    node_end: list[list[int]]
    min_ranks: list[int]
    capacity: list[int]
    reserve: list[bool]
    backfill: list[bool]

    @property
    def depth(self) -> int:
        return len(self.node_of)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def children(self, depth: int, node: int) -> range:
        """The depth ``depth + 1`` nodes directly below ``node``."""
        below = self.node_of[depth + 1]
        return range(
            below[self.node_start[depth][node]],
            below[self.node_end[depth][node] - 1] + 1,
        )


def build_tree_topology(layers: Sequence[Layer], ranks: Sequence[int], keys: Sequence[Sequence[str]]) -> TreeTopology:
    """Lay the ranks out as a tree.

    Args:
        layers: the layers, root first.
        ranks: the ranks taking part, in increasing order.
        keys: ``keys[d][i]`` is the key of ``ranks[i]`` at ``layers[d]``.

    Raises:
        ValueError: the ranks do not share one root key, or the key columns
            do not match the layers and ranks.
    """
    if len(keys) != len(layers) or any(len(column) != len(ranks) for column in keys):
        raise ValueError(
            f"expected {len(layers)} key columns of {len(ranks)} keys, got {[len(column) for column in keys]}"
        )
    if not ranks:
        raise ValueError("cannot build a tree without ranks")
    roots = set(keys[0])
    if len(roots) != 1:
        raise ValueError(
            "multiple roots: every rank must have the same key at the first "
            f"(root) layer, got {len(roots)} distinct keys: {sorted(roots)[:8]}"
        )

    # Number the nodes of each depth by first appearance in rank order: node
    # (parent, key) gets the next id the first time a rank mentions it.
    count = len(ranks)
    appearance_ids: list[list[int]] = [[0] * count]
    for column in keys[1:]:
        parent_ids = appearance_ids[-1]
        ids: dict[tuple[int, str], int] = {}
        appearance_ids.append([ids.setdefault(pair, len(ids)) for pair in zip(parent_ids, column, strict=True)])

    # Depth-first order with children by first appearance is the
    # lexicographic order of the appearance ids along each rank's path.
    paths = list(zip(*appearance_ids[1:], range(count), strict=True))
    paths.sort()
    order = [path[-1] for path in paths]

    node_of: list[list[int]] = []
    node_start: list[list[int]] = []
    node_end: list[list[int]] = []
    for appearance in appearance_ids:
        # Renumber this depth's nodes in tree order; each covers one run of positions.
        tree_ids: dict[int, int] = {}
        nodes = [tree_ids.setdefault(appearance[index], len(tree_ids)) for index in order]
        sizes = Counter(nodes)
        ends = list(accumulate(sizes[node] for node in range(len(tree_ids))))
        node_of.append(nodes)
        node_start.append([0, *ends[:-1]])
        node_end.append(ends)

    return TreeTopology(
        ranks=[ranks[index] for index in order],
        node_of=node_of,
        node_start=node_start,
        node_end=node_end,
        min_ranks=[layer.min_ranks for layer in layers],
        capacity=[sys.maxsize if layer.max_ranks is None else layer.max_ranks for layer in layers],
        reserve=[layer.has(LayerFlag.RESERVE) for layer in layers],
        backfill=[layer.has(LayerFlag.BACKFILL) for layer in layers],
    )


@dataclasses.dataclass(frozen=True)
class TreeAssignment:
    """The assignment of the whole world after one call.

    Treat as immutable: :func:`reassign_tree` builds a new one.

    Attributes:
        mode: per position.
        slot: per position, the ``active_rank``, ``-1`` when not active.
        active_world_size: number of active ranks.
        alive: surviving positions in increasing order; index is ``rank``.
        alive_count / active_count: per depth, per node, healthy and active
            ranks in the subtree.
    """

    mode: list[Mode]
    slot: list[int]
    active_world_size: int
    alive: list[int]
    alive_count: list[list[int]]
    active_count: list[list[int]]

    @property
    def world_size(self) -> int:
        return len(self.alive)

    def rank_of(self, position: int) -> int | None:
        """Current ``rank`` of a position, ``None`` once it is terminated."""
        if self.mode[position] is Mode.TERMINATED:
            return None
        return bisect_left(self.alive, position)

    def active_rank_of(self, position: int) -> int | None:
        slot = self.slot[position]
        return None if slot == _NO_SLOT else slot


WorldSizeFilter = Callable[[int], int]


def initial_tree_assignment(topology: TreeTopology, world_size_filter: WorldSizeFilter | None = None) -> TreeAssignment:
    """The first assignment: prune undersized subtrees, then activate greedily.

    Subtrees below their ``min_ranks`` are terminated first, so that
    activation only spends ``max_ranks`` budget on ranks that stay. Then the
    surviving ranks are visited in tree order and each is activated, with the
    next free ``active_rank``, if every subtree it belongs to is still below
    its ``max_ranks``. Finally ``world_size_filter`` may deactivate the
    highest active ranks.
    """
    work = _Work.fresh(topology)
    work.propagate(terminated=[], check_all=True)
    work.activate_greedily()
    work.apply_filter(world_size_filter)
    return work.result()


def reassign_tree(
    topology: TreeTopology,
    previous: TreeAssignment,
    terminated_ranks: Collection[int],
    world_size_filter: WorldSizeFilter | None = None,
) -> TreeAssignment:
    """The next assignment after ``terminated_ranks`` (current ranks) failed.

    Steps, each deterministic:

    1. Terminate the failed ranks; walking up from the leaves, terminate every
       subtree left with fewer healthy ranks than its ``min_ranks``.
    2. In increasing order of their rank, each terminated active rank hands
       its exact ``active_rank`` to a spare. The spare comes from the nearest
       ancestor (searching upwards while ancestors carry ``RESERVE``) that
       holds an eligible one: a spare is eligible if activating it keeps
       every subtree containing it within ``max_ranks``; the lowest-ranked
       eligible spare is taken.
    3. Gaps left unfilled inside a ``BACKFILL`` domain (the highest ancestor
       reached through an unbroken chain of ``BACKFILL`` layers) are filled
       within the domain as ``FillGaps`` does: its highest active ranks above
       its new size move down into the lowest gaps.
    4. The slots still free are closed by shifting higher active ranks down.
    5. If anything was terminated, ``world_size_filter`` may deactivate the
       highest active ranks; they become spares.

    With no terminations the assignment is returned unchanged.

    Raises:
        ValueError: a terminated rank is outside ``[0, world_size)``, or the
            filter returns a bad size.
    """
    world_size = previous.world_size
    bad = [rank for rank in terminated_ranks if not 0 <= rank < world_size]
    if bad:
        raise ValueError(f"terminated_ranks must be ranks in [0, world_size={world_size}), got {sorted(bad)[:8]}")
    if not terminated_ranks:
        return previous
    work = _Work.resume(topology, previous)
    terminated_active = work.propagate(terminated=[previous.alive[rank] for rank in terminated_ranks], check_all=False)
    unreplaced = work.replace_from_reserve(terminated_active)
    freed = work.backfill(unreplaced)
    work.shift(freed)
    work.apply_filter(world_size_filter)
    return work.result()


class _Work:
    """Mutable scratch copy of an assignment while one call computes the next."""

    def __init__(
        self,
        topology: TreeTopology,
        mode: list[Mode],
        slot: list[int],
        active_world_size: int,
        alive: list[int],
        alive_count: list[list[int]],
        active_count: list[list[int]],
    ) -> None:
        self.topology = topology
        self.mode = mode
        self.slot = slot
        self.active_world_size = active_world_size
        self.alive = alive
        self.alive_count = alive_count
        self.active_count = active_count

    @classmethod
    def fresh(cls, topology: TreeTopology) -> _Work:
        size = topology.size
        return cls(
            topology,
            mode=[Mode.INACTIVE] * size,
            slot=[_NO_SLOT] * size,
            active_world_size=0,
            alive=list(range(size)),
            alive_count=[
                [end - start for start, end in zip(starts, ends, strict=True)]
                for starts, ends in zip(topology.node_start, topology.node_end, strict=True)
            ],
            active_count=[[0] * len(starts) for starts in topology.node_start],
        )

    @classmethod
    def resume(cls, topology: TreeTopology, previous: TreeAssignment) -> _Work:
        return cls(
            topology,
            mode=list(previous.mode),
            slot=list(previous.slot),
            active_world_size=previous.active_world_size,
            alive=previous.alive,
            alive_count=[list(counts) for counts in previous.alive_count],
            active_count=[list(counts) for counts in previous.active_count],
        )

    def result(self) -> TreeAssignment:
        return TreeAssignment(
            mode=self.mode,
            slot=self.slot,
            active_world_size=self.active_world_size,
            alive=self.alive,
            alive_count=self.alive_count,
            active_count=self.active_count,
        )

    def _add_active(self, position: int, delta: int) -> None:
        for node_of, counts in zip(self.topology.node_of, self.active_count, strict=True):
            counts[node_of[position]] += delta

    def propagate(self, terminated: list[int], check_all: bool) -> list[tuple[int, int]]:
        """Terminate ``terminated`` and every subtree that falls below its minimum.

        Only subtrees that lost ranks can newly fall below their minimum, so
        only those are checked, unless ``check_all`` (the first call, when
        subtrees may start undersized). Returns ``(position, slot)`` of every
        terminated rank that was active, in position order.
        """
        topology = self.topology
        depth = topology.depth
        mode = self.mode
        dead = set(terminated)
        touched: list[set[int]] = []
        for node_of, counts in zip(topology.node_of, self.alive_count, strict=True):
            nodes = set()
            for position in dead:
                node = node_of[position]
                counts[node] -= 1
                nodes.add(node)
            touched.append(nodes)
        if check_all:
            touched = [set(range(len(starts))) for starts in topology.node_start]

        for d in range(depth - 1, -1, -1):
            minimum = topology.min_ranks[d]
            counts = self.alive_count[d]
            for node in touched[d]:
                healthy = counts[node]
                if 0 < healthy < minimum:
                    start, end = topology.node_start[d][node], topology.node_end[d][node]
                    dead.update(p for p in range(start, end) if mode[p] is not Mode.TERMINATED)
                    for below in range(d, depth):
                        first, last = topology.node_of[below][start], topology.node_of[below][end - 1]
                        self.alive_count[below][first : last + 1] = [0] * (last + 1 - first)
                    for above in range(d):
                        ancestor = topology.node_of[above][start]
                        self.alive_count[above][ancestor] -= healthy
                        touched[above].add(ancestor)

        dead_positions = sorted(dead)
        terminated_active = [(p, self.slot[p]) for p in dead_positions if mode[p] is Mode.ACTIVE]
        for node_of, counts in zip(topology.node_of, self.active_count, strict=True):
            for position, _ in terminated_active:
                counts[node_of[position]] -= 1
        for position in dead_positions:
            mode[position] = Mode.TERMINATED
            self.slot[position] = _NO_SLOT
        if dead:
            self.alive = [position for position in self.alive if position not in dead]
        return terminated_active

    def activate_greedily(self) -> None:
        """Activate surviving ranks in tree order while every subtree has room.

        Visiting ranks one by one, each activation uses one unit of room in
        every ancestor, so within one leaf-parent node the visit activates
        its first ``k`` surviving ranks, ``k`` being the least room left
        among its ancestors; whole nodes are handled at once.
        """
        topology = self.topology
        mode = self.mode
        levels = list(zip(topology.node_of, self.active_count, topology.capacity, strict=True))
        leaf_parents = zip(topology.node_start[-1], topology.node_end[-1], strict=True)
        next_slot = 0
        for start, end in leaf_parents:
            room = min(capacity - counts[node_of[start]] for node_of, counts, capacity in levels)
            activated = 0
            for position in range(start, end):
                if activated == room:
                    break
                if mode[position] is not Mode.TERMINATED:
                    mode[position] = Mode.ACTIVE
                    self.slot[position] = next_slot + activated
                    activated += 1
            if activated:
                next_slot += activated
                for node_of, counts, _ in levels:
                    counts[node_of[start]] += activated
        self.active_world_size = next_slot

    def replace_from_reserve(self, terminated_active: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Hand each terminated active rank's slot to a spare; return the rest."""
        topology = self.topology
        search = _SpareSearch(topology, self.mode, self.active_count)
        reserve_depths = []  # where to search, nearest first: the unbroken RESERVE chain
        for d in range(topology.depth - 1, -1, -1):
            if not topology.reserve[d]:
                break
            reserve_depths.append(d)
        spares_left = self.alive_count[0][0] - self.active_count[0][0]
        unreplaced: list[tuple[int, int]] = []
        for position, slot in terminated_active:
            spare = None
            if spares_left:
                for d in reserve_depths:
                    if self._ancestors_have_room(position, d):
                        spare = search.find(d, topology.node_of[d][position])
                        if spare is not None:
                            break
            if spare is None:
                unreplaced.append((position, slot))
            else:
                spares_left -= 1
                self.mode[spare] = Mode.ACTIVE
                self.slot[spare] = slot
                self._add_active(spare, +1)
        return unreplaced

    def _ancestors_have_room(self, position: int, depth: int) -> bool:
        """Whether every subtree strictly above ``depth`` on ``position``'s path has room."""
        topology = self.topology
        return all(self.active_count[d][topology.node_of[d][position]] < topology.capacity[d] for d in range(depth))

    def backfill(self, unreplaced: list[tuple[int, int]]) -> list[int]:
        """Close gaps inside ``BACKFILL`` domains; return the slots left free."""
        topology = self.topology
        # A rank's domain is its highest ancestor reached through BACKFILL layers only.
        domain_depth = topology.depth
        while domain_depth > 0 and topology.backfill[domain_depth - 1]:
            domain_depth -= 1
        if domain_depth == topology.depth:
            return sorted(slot for _, slot in unreplaced)
        freed: list[int] = []
        gaps_by_domain: dict[int, list[int]] = {}
        for position, slot in unreplaced:
            gaps_by_domain.setdefault(topology.node_of[domain_depth][position], []).append(slot)

        for node, gaps in gaps_by_domain.items():
            position_of_slot = {
                self.slot[position]: position
                for position in range(topology.node_start[domain_depth][node], topology.node_end[domain_depth][node])
                if self.slot[position] != _NO_SLOT
            }
            # As FillGaps on the domain's slots: its active ranks keep the
            # lowest len(position_of_slot) slots it held; those above move down.
            held = sorted([*position_of_slot, *gaps])
            kept = len(position_of_slot)
            boundary = held[kept - 1] if kept else -1
            holes = sorted(gap for gap in gaps if gap <= boundary)
            movers = sorted(slot for slot in position_of_slot if slot > boundary)
            for mover, hole in zip(movers, holes, strict=True):
                self.slot[position_of_slot[mover]] = hole
            freed.extend(held[kept:])
        freed.sort()
        return freed

    def shift(self, freed: list[int]) -> None:
        """Close the freed slots by moving every higher slot down."""
        if not freed:
            return
        # new_slot[s] for every old slot s; the extra last entry maps the
        # "no slot" marker -1 to itself when indexed with it.
        new_slot: list[int] = []
        start = 0
        for shift, freed_slot in enumerate(freed):
            new_slot.extend(range(start - shift, freed_slot - shift))
            new_slot.append(_NO_SLOT)
            start = freed_slot + 1
        new_slot.extend(range(start - len(freed), self.active_world_size - len(freed)))
        new_slot.append(_NO_SLOT)
        self.slot = [new_slot[slot] for slot in self.slot]
        self.active_world_size -= len(freed)

    def apply_filter(self, world_size_filter: WorldSizeFilter | None) -> None:
        """Let the filter shrink the active world; deactivated ranks become spares."""
        if world_size_filter is None:
            return
        size = self.active_world_size
        new_size = world_size_filter(size)
        if isinstance(new_size, bool) or not isinstance(new_size, int):
            raise TypeError(f"world_size_filter {world_size_filter!r} must return an int, got {new_size!r} for {size}")
        if not 0 <= new_size <= size:
            raise ValueError(
                f"world_size_filter {world_size_filter!r} must return a size in [0, {size}], got {new_size} for {size}"
            )
        if new_size == size:
            return
        for position, slot in enumerate(self.slot):
            if slot >= new_size:
                self.mode[position] = Mode.INACTIVE
                self.slot[position] = _NO_SLOT
                self._add_active(position, -1)
        self.active_world_size = new_size


class _SpareSearch:
    """Finds the lowest-position spare in a subtree that may be activated.

    A spare qualifies if every subtree on its path below the searched node
    (and the node itself) is below its ``max_ranks``. While spares are being
    activated, counts only grow and spares only disappear, so a subtree or a
    position that once failed to yield a spare never will again in this call:
    each node keeps a cursor that only moves forward, which bounds the whole
    search by the size of the subtrees visited.
    """

    def __init__(self, topology: TreeTopology, mode: list[Mode], active_count: list[list[int]]) -> None:
        self.topology = topology
        self.mode = mode
        self.active_count = active_count
        self.cursor: list[dict[int, int]] = [{} for _ in range(topology.depth)]
        self.leaf_parent_depth = topology.depth - 1

    def find(self, depth: int, node: int) -> int | None:
        topology = self.topology
        if self.active_count[depth][node] >= topology.capacity[depth]:
            return None
        cursors = self.cursor[depth]
        if depth == self.leaf_parent_depth:
            mode = self.mode
            end = topology.node_end[depth][node]
            position = cursors.get(node, topology.node_start[depth][node])
            while position < end and mode[position] is not Mode.INACTIVE:
                position += 1
            cursors[node] = position
            return position if position < end else None
        children = topology.children(depth, node)
        child = cursors.get(node, children.start)
        while child < children.stop:
            spare = self.find(depth + 1, child)
            if spare is not None:
                cursors[node] = child
                return spare
            child += 1
        cursors[node] = child
        return None
