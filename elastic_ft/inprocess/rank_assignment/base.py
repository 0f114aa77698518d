"""The interface of rank assignments, and what every policy shares.

Rank reassignment and spare activation after faults:

After some ranks fail, the survivors must agree on a new consecutive
numbering (``rank``, ``world_size``) and on which of them run the training
function (``active_rank``, ``active_world_size``); the others stay as idle
spares that can replace an active rank at a later fault.

Policies are small callables taking and returning a :class:`RankAssignmentCtx`
and compose with :class:`elastic_ft.inprocess.compose.Compose`, rightmost first:

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
data (see :mod:`elastic_ft.inprocess.rank_assignment.tree_engine`).

The public names mirror NVIDIA's ``nvidia_resiliency_ext.inprocess`` so that
code written against it moves over with an import change.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import json
import math
import threading
from collections import Counter
from collections.abc import Collection
from typing import TYPE_CHECKING

from elastic_ft.inprocess.exception import RankDiscarded
from elastic_ft.inprocess.state import Mode, State

if TYPE_CHECKING:
    import torch.distributed

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)


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


def check_terminated_ranks(ctx: RankAssignmentCtx, owner: str) -> None:
    world_size = ctx.state.world_size
    bad = [rank for rank in ctx.terminated_ranks if not 0 <= rank < world_size]
    if bad:
        raise ValueError(
            f"{owner}: terminated_ranks must be ranks in [0, world_size={world_size}), got {sorted(bad)[:8]}"
        )


def require_rank(state: State, owner: str) -> int:
    if state.rank is None:
        raise ValueError(f"{owner} needs a state with a rank, got rank=None")
    return state.rank


def rank_and_terminated(ctx: RankAssignmentCtx, owner: str) -> tuple[int, set[int]]:
    """This rank and the checked set of terminated ranks: the inputs every reassignment starts from."""
    check_terminated_ranks(ctx, owner)
    return require_rank(ctx.state, owner), set(ctx.terminated_ranks)


def discard(rank: int, terminated_ranks: Collection[int]) -> RankDiscarded:
    return RankDiscarded(f"rank {rank} is among the terminated ranks {sorted(terminated_ranks)[:16]}")


def activate_all(state: State) -> State:
    return dataclasses.replace(
        state,
        mode=Mode.ACTIVE,
        active_rank=state.rank,
        active_world_size=state.world_size,
    )


#: Marks a grouping key that was not a plain string (see :func:`grouping_key`).
_ENCODED_KEY = "\x1f"


def grouping_key(key_or_fn: object, state: State, owner: str) -> str:
    """A rank's grouping key as a string: ``key_or_fn`` itself, or what it returns for ``state``.

    Keys are compared for equality only (branches are ordered by first
    appearance). A string is its own key; an int, float, bool, ``None``, or a
    tuple or list of those (NVIDIA's tests group by ``rank // 8``) becomes a
    tagged JSON text, so that ``1`` and ``"1"`` stay different groups and
    every rank encodes a key alike.

    Raises:
        TypeError: a key of another type (an object has no equality every
            rank agrees on), naming ``owner`` and the rank.
    """
    key = key_or_fn if isinstance(key_or_fn, str) or not callable(key_or_fn) else key_or_fn(state)
    if isinstance(key, str) and not key.startswith(_ENCODED_KEY):
        return key
    if not is_grouping_key(key):
        raise TypeError(
            f"{owner} key_or_fn {key_or_fn!r} must give a str, int, float, bool, None or a tuple of them, "
            f"got {key!r} for rank {state.rank}"
        )
    return _ENCODED_KEY + json.dumps(key, separators=(",", ":"), allow_nan=False)


def is_grouping_key(value: object, depth: int = 0) -> bool:
    """True for a value :func:`grouping_key` can encode alike on every rank."""
    if value is None or isinstance(value, (str, int, bool)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (tuple, list)) and depth < 4:
        return all(is_grouping_key(item, depth + 1) for item in value)
    return False


class _NameCounter(threading.local):
    """Per-thread instance counts, for default policy names.

    Ranks build their policies in the same order, so the n-th instance of a
    class gets the same name on every rank. Counting per thread keeps that
    true when ranks are simulated as threads of one process.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()


name_counter = _NameCounter()


def policy_name(cls: type, name: str | None) -> str:
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__} name must be a non-empty str, got {name!r}")
        return name
    index = name_counter.counts[cls.__name__]
    name_counter.counts[cls.__name__] += 1
    return f"{cls.__name__}-{index}"


def admits_new_ranks(policy: object) -> bool:
    """Whether ``policy`` can take ranks that join a running world (respawned workers).

    A joiner enters a restart with no history, so a policy that keeps state
    between calls (:class:`~elastic_ft.inprocess.rank_assignment.tree.Tree`
    builds its topology once) says ``admits_new_ranks = False``; then the
    world never grows and no worker is respawned. A composition admits them
    when all its parts do; any other callable is taken to be stateless.
    """
    parts = getattr(policy, "parts", None)
    if isinstance(parts, tuple):
        return all(admits_new_ranks(part) for part in parts)
    return bool(getattr(policy, "admits_new_ranks", True))


def check_timeout(owner: str, timeout: datetime.timedelta) -> None:
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"{owner} timeout must be a datetime.timedelta, got {timeout!r}")
    if timeout <= datetime.timedelta(0):
        raise ValueError(f"{owner} timeout must be positive, got {timeout}")
