"""The per-rank state that rank assignments read and rewrite.

A :class:`State` says where one worker process stands in the job: its index
among the surviving ranks (``rank``), how many ranks survive (``world_size``),
and whether it runs the training function in this restart iteration
(``mode``, ``active_rank``, ``active_world_size``). Inactive ranks are spares:
alive and initialised, waiting to replace an active rank that fails.

States are immutable; assignments return a new state built with
:func:`dataclasses.replace`, so a state handed to user code can never change
underneath it.
"""

from __future__ import annotations

import dataclasses
import enum
import os


class Mode(enum.Enum):
    """What a rank does in the current restart iteration."""

    #: The state was built but no rank assignment has run yet.
    INITIALIZED = enum.auto()
    #: The rank runs the wrapped training function.
    ACTIVE = enum.auto()
    #: The rank is a healthy spare and waits idle.
    INACTIVE = enum.auto()
    #: The rank left the job and takes no further part.
    TERMINATED = enum.auto()


def _check_index(name: str, value: int | None, allow_none: bool) -> None:
    if value is None:
        if not allow_none:
            raise TypeError(f"{name} must be an int, got None")
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclasses.dataclass(frozen=True)
class State:
    """The position of one rank in the job, as seen by rank assignments.

    ``State(rank, world_size)`` builds the state a worker starts with: every
    other field takes its initial value, and ``initial_rank`` and
    ``initial_world_size`` record ``rank`` and ``world_size`` so they survive
    later renumbering.

    Args:
        rank: index of this rank among the surviving ranks, ``0 <= rank <
            world_size``; ``None`` only for a rank that left the job.
        world_size: number of surviving ranks, active and inactive.
        active_rank: index among the active ranks, the ``RANK`` the training
            function sees; ``None`` unless ``mode`` is :attr:`Mode.ACTIVE`.
        active_world_size: number of active ranks, the ``WORLD_SIZE`` the
            training function sees; ``None`` before the first assignment.
        initial_rank: ``rank`` when the job started (defaults to ``rank``).
        initial_world_size: ``world_size`` when the job started (defaults to
            ``world_size``).
        iteration: index of the current restart iteration.
        mode: what the rank does in this iteration.
        fn_exception: the exception that interrupted the wrapped function on
            this rank in the last iteration (without its traceback), as the
            Wrapper hands the state to ``finalize`` and ``health_check``;
            ``None`` when the function did not fail here. Not compared.
        shard_size: ranks per replica group of a sharded model (HSDP's
            shard dimension), set by
            :class:`~elastic_ft.inprocess.rank_assignment.ShardedReplicas`;
            ``None`` when the model is replicated whole (DDP).
        held_shard: the shard of the model this rank's state holds,
            ``(index, shards)``; ``None`` when it holds none (a new rank) or
            the model is not sharded. The Wrapper sets it once the rank
            trains in its place.
    """

    rank: int | None
    world_size: int
    active_rank: int | None = None
    active_world_size: int | None = None
    initial_rank: int | None = None
    initial_world_size: int | None = None
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)
    shard_size: int | None = None
    held_shard: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        _check_index("world_size", self.world_size, allow_none=False)
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        _check_index("rank", self.rank, allow_none=True)
        if self.rank is not None and self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        _check_index("active_world_size", self.active_world_size, allow_none=True)
        _check_index("active_rank", self.active_rank, allow_none=True)
        if (
            self.active_rank is not None
            and self.active_world_size is not None
            and self.active_rank >= self.active_world_size
        ):
            raise ValueError(
                f"active_rank must be in [0, active_world_size={self.active_world_size}), got {self.active_rank}"
            )
        _check_index("iteration", self.iteration, allow_none=False)
        if not isinstance(self.mode, Mode):
            raise TypeError(f"mode must be a Mode, got {self.mode!r}")
        # A frozen dataclass can only fill its derived defaults this way.
        if self.initial_rank is None:
            object.__setattr__(self, "initial_rank", self.rank)
        if self.initial_world_size is None:
            object.__setattr__(self, "initial_world_size", self.world_size)
        _check_index("shard_size", self.shard_size, allow_none=True)
        if self.shard_size == 0:
            raise ValueError("shard_size must be >= 1, got 0")
        if self.held_shard is not None:
            held = self.held_shard
            if not (
                isinstance(held, tuple)
                and len(held) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in held)
                and 0 <= held[0] < held[1]
            ):
                raise ValueError(f"held_shard must be (index, shards) with 0 <= index < shards, got {held!r}")
        if self.fn_exception is not None and not isinstance(self.fn_exception, BaseException):
            raise TypeError(f"fn_exception must be an exception or None, got {self.fn_exception!r}")

    @classmethod
    def from_env(cls) -> State:
        """The state a worker starts with, from the ``RANK`` and ``WORLD_SIZE`` its launcher set."""
        values = {}
        for name in ("RANK", "WORLD_SIZE"):
            text = os.environ.get(name)
            if text is None:
                raise ValueError(f"State.from_env needs the {name} environment variable, which is not set")
            try:
                values[name] = int(text)
            except ValueError:
                raise ValueError(f"State.from_env: {name} must be an integer, got {text!r}") from None
        return cls(rank=values["RANK"], world_size=values["WORLD_SIZE"])

    def set_distributed_vars(self) -> None:
        """Expose an active rank's ``active_rank`` and ``active_world_size`` as ``RANK`` and ``WORLD_SIZE``.

        What the training function's ``init_process_group`` reads; an
        inactive or terminated rank leaves the environment alone.
        """
        if self.mode is Mode.ACTIVE and self.active_rank is not None and self.active_world_size is not None:
            os.environ["RANK"] = str(self.active_rank)
            os.environ["WORLD_SIZE"] = str(self.active_world_size)

    def advance(self) -> State:
        """The state of the next restart iteration: a new state (states are immutable), ``iteration + 1``."""
        return dataclasses.replace(self, iteration=self.iteration + 1, fn_exception=None)

    def freeze(self) -> State:
        """This state: it is already immutable (NVIDIA's ``State.freeze`` returns a read-only copy)."""
        return self


#: NVIDIA's name for the read-only state handed to hooks. Every :class:`State`
#: here is read-only, so both names are one class.
FrozenState = State
