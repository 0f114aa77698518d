"""Rank reassignment and spare activation after faults.

After some ranks fail, the survivors must agree on a new consecutive
numbering (``rank``, ``world_size``) and on which of them run the training
function (``active_rank``, ``active_world_size``); the others stay as idle
spares that can replace an active rank at a later fault.

* :mod:`.base`: the interface (:class:`RankAssignment`, :class:`RankFilter`,
  :class:`RankAssignmentCtx`);
* :mod:`.policies`: :class:`ShiftRanks`, :class:`FillGaps`,
  :class:`FilterCountGroupedByKey` and the filters;
* :mod:`.tree`: :class:`Tree` over :class:`Layer` s, whose decisions are the
  pure functions of :mod:`.tree_engine`;
* :mod:`.segments`: :class:`SegmentSpares`, hot spare nodes by segment
  (``ftrun --segment-size``), whose decision is :func:`.segments.next_slots`;
* :mod:`.replicas`: :class:`ShardedReplicas`, whole replica groups of a
  sharded model (HSDP, FSDP), and the :class:`ReplicaMesh` a rank trains on;
* :mod:`.exchange`: the one grouping-key exchange through the store;
* :mod:`.from_config`: the policy a job config describes.

The public names mirror NVIDIA's ``nvidia_resiliency_ext.inprocess.rank_assignment``
so that code written against it moves over with an import change.
"""

from elastic_ft.inprocess.exception import RankAssignmentTimeout, RankDiscarded
from elastic_ft.inprocess.rank_assignment.base import RankAssignment, RankAssignmentCtx, RankFilter
from elastic_ft.inprocess.rank_assignment.policies import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    FilterCountGroupedByKey,
    FilterGroupedByKey,
    MaxActiveWorldSize,
    ShiftRanks,
    ranks_failing_group_condition,
)
from elastic_ft.inprocess.rank_assignment.replicas import ReplicaMesh, ShardedReplicas
from elastic_ft.inprocess.rank_assignment.segments import SegmentSpares
from elastic_ft.inprocess.rank_assignment.tree import Tree
from elastic_ft.inprocess.rank_assignment.tree_engine import Layer, LayerFlag

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "FilterCountGroupedByKey",
    "FilterGroupedByKey",
    "Layer",
    "LayerFlag",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankAssignmentTimeout",
    "RankDiscarded",
    "RankFilter",
    "ReplicaMesh",
    "SegmentSpares",
    "ShardedReplicas",
    "ShiftRanks",
    "Tree",
    "ranks_failing_group_condition",
]
