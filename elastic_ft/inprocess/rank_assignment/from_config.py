"""The rank-assignment policy a job config describes (``rank_assignment`` section).

The job config itself (:mod:`elastic_ft.job_config`) is data, shared with the
node side; turning it into worker-side objects happens here.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from elastic_ft.inprocess.compose import Compose
from elastic_ft.inprocess.rank_assignment.base import RankAssignment
from elastic_ft.inprocess.rank_assignment.policies import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    MaxActiveWorldSize,
    ShiftRanks,
)
from elastic_ft.inprocess.rank_assignment.tree import Tree
from elastic_ft.inprocess.rank_assignment.tree_engine import Layer, LayerFlag
from elastic_ft.inprocess.state import State
from elastic_ft.job_config import JobConfig


def key_function(key: str) -> Callable[[State], str]:
    """How a rank computes a layer's grouping key from the config's ``key``: job, host or env:NAME."""
    if key == "job":
        return lambda _state: "job"
    if key == "host":
        return lambda _state: socket.gethostname()
    name = key.removeprefix("env:")
    return lambda _state: os.environ.get(name, "")


def policy_from_config(config: JobConfig) -> RankAssignment | Compose | None:
    """The policy of ``config``'s ``rank_assignment`` section; ``None`` when the section sets nothing.

    A ``Tree`` when layers are given (the filters become its
    ``world_size_filter``), otherwise ``Compose(filters..., ActivateAllRanks(), ShiftRanks())``.
    """
    policy = config.rank_assignment
    has_filter = policy.max_active_world_size is not None or policy.active_world_size_divisible_by != 1
    if not policy.tree and not has_filter:
        return None

    def world_size_filter(size: int) -> int:
        if policy.max_active_world_size is not None:
            size = min(size, policy.max_active_world_size)
        return size - size % policy.active_world_size_divisible_by

    if policy.tree:
        layers = []
        for layer in policy.tree:
            flag = None
            for name in layer.flags:
                flag = LayerFlag[name] if flag is None else flag | LayerFlag[name]
            layers.append(Layer(layer.min_ranks, layer.max_ranks, key_function(layer.key), flag))
        return Tree(layers, world_size_filter if has_filter else None)
    filters: list[RankAssignment] = [ActivateAllRanks()]
    if policy.active_world_size_divisible_by != 1:
        filters.insert(0, ActiveWorldSizeDivisibleBy(policy.active_world_size_divisible_by))
    if policy.max_active_world_size is not None:
        filters.insert(0, MaxActiveWorldSize(policy.max_active_world_size))
    return Compose(*filters, ShiftRanks())
