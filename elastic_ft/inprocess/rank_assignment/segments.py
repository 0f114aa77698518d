"""Hot spare nodes by segment: a failed rank's place goes to a spare of its own segment first.

With ``ftrun --segment-size N`` the job trains in whole segments of ``N``
nodes of one label (an NVLink domain, a rack): the rendezvous puts each
segment's nodes on consecutive ranks and the other nodes' ranks in reserve
(:func:`elastic_ft.rendezvous.rules.segment_layout`). A group a job builds
on consecutive ranks (a tensor-parallel group per segment) then stays
inside one domain, as long as every rank keeps its place.

:class:`SegmentSpares` keeps those places. At each restart the survivors
keep their ``active_rank`` (their *slot*); each slot a failed rank left is
taken by a reserve rank of the slot's segment label (the label the slot's
segment-mates hold), else by any reserve rank, lowest rank first. Only when
no reserve rank is left do the active ranks close up, as ``ShiftRanks``
would. A restart that finds reserve ranks below the round's active world
size (a joiner, a late spare) fills the highest slots with them.

The decision (:func:`next_slots`) is a pure function of every rank's label
and slot, which the ranks exchange once per restart (joiners too, so the
policy keeps nothing between calls and admits new ranks).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections import Counter
from collections.abc import Sequence

from elastic_ft.inprocess.rank_assignment.base import (
    DEFAULT_TIMEOUT,
    RankAssignment,
    RankAssignmentCtx,
    check_timeout,
    discard,
    rank_and_terminated,
)
from elastic_ft.inprocess.rank_assignment.exchange import gather_keys
from elastic_ft.inprocess.state import Mode
from elastic_ft.keys import rank_assignment_exchange


@dataclasses.dataclass(frozen=True)
class Seat:
    """A surviving rank before a reassignment: its node's segment label, and the slot it holds (None: reserve)."""

    segment: str
    slot: int | None


def next_slots(seats: Sequence[Seat], active_world_size: int | None, segment_ranks: int) -> list[int | None]:
    """The slot of each surviving rank (``seats``, in rank order) after a reassignment; None: reserve.

    Args:
        seats: every surviving rank's label and slot, in rank order.
        active_world_size: the most ranks that train (the round's whole segments); None: all of them.
        segment_ranks: the ranks of one segment; slot ``s`` is in segment ``s // segment_ranks``.
    """
    if segment_ranks < 1:
        raise ValueError(f"segment_ranks must be >= 1, got {segment_ranks}")
    size = len(seats) if active_world_size is None else min(active_world_size, len(seats))
    slots = [seat.slot for seat in seats]
    if all(slot is None for slot in slots):  # the first assignment: the rendezvous put whole segments first
        return [index if index < size else None for index in range(len(seats))]
    labels_by_group: dict[int, Counter[str]] = {}
    for seat in seats:
        if seat.slot is not None:
            labels_by_group.setdefault(seat.slot // segment_ranks, Counter())[seat.segment] += 1
    held = {slot for slot in slots if slot is not None}
    reserve = [index for index, slot in enumerate(slots) if slot is None]
    for slot in (slot for slot in range(size) if slot not in held):
        if not reserve:
            break
        mates = labels_by_group.get(slot // segment_ranks)
        home = mates.most_common(1)[0][0] if mates else None
        chosen = next((index for index in reserve if seats[index].segment == home), reserve[0])
        reserve.remove(chosen)
        slots[chosen] = slot
    # Slots no reserve rank could fill: the active ranks close up (the world shrinks, as with ShiftRanks).
    active = sorted((slot, index) for index, slot in enumerate(slots) if slot is not None)
    for new, (_, index) in enumerate(active):
        slots[index] = new
    return slots


class SegmentSpares(RankAssignment):
    """Replace a failed rank in its place, by a reserve rank of its segment first (see the module docstring).

    ``ftrun``'s agent hands each worker its node's label and the ranks of a
    segment (:class:`~elastic_ft.handoff.WorkerHandoff`); the Wrapper's
    default rank assignment is this policy then.

    Args:
        active_world_size: the most ranks that train (None: all).
        segment: this rank's node's segment label.
        segment_ranks: the ranks of one segment (its nodes times the workers per node).
        timeout: how long a restart waits for every rank's label and slot.
    """

    def __init__(
        self,
        active_world_size: int | None,
        segment: str,
        segment_ranks: int,
        *,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        if not isinstance(segment, str) or not segment:
            raise TypeError(f"SegmentSpares segment must be a non-empty str, got {segment!r}")
        for name, value in (("segment_ranks", segment_ranks), ("active_world_size", active_world_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"SegmentSpares {name} must be a whole number >= 1, got {value!r}")
        check_timeout("SegmentSpares", timeout)
        self.active_world_size = active_world_size
        self.segment = segment
        self.segment_ranks = segment_ranks
        self.timeout = timeout

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, terminated = rank_and_terminated(ctx, "SegmentSpares")
        if rank in terminated:
            raise discard(rank, terminated)
        state = ctx.state
        survivors = [other for other in range(state.world_size) if other not in terminated]
        slot = state.active_rank if state.mode is Mode.ACTIVE else None
        # Called once per restart iteration on every rank, joiners included: the iteration names the exchange.
        labels, held = gather_keys(
            ctx.store,
            rank_assignment_exchange("SegmentSpares", state.iteration),
            rank,
            survivors,
            [self.segment, "" if slot is None else str(slot)],
            self.timeout,
            "SegmentSpares",
        )
        seats = [Seat(label, int(text) if text else None) for label, text in zip(labels, held, strict=True)]
        slots = next_slots(seats, self.active_world_size, self.segment_ranks)
        mine = slots[survivors.index(rank)]
        active = sum(1 for other in slots if other is not None)
        state = dataclasses.replace(
            state,
            rank=survivors.index(rank),
            world_size=len(survivors),
            mode=Mode.ACTIVE if mine is not None else Mode.INACTIVE,
            active_rank=mine,
            active_world_size=active,
        )
        return dataclasses.replace(ctx, state=state, terminated_ranks=set())
