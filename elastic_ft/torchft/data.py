"""TorchFT's ``DistributedSampler``: a dataset sharded over the replica groups and, within each, its ranks."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils import data


class DistributedSampler(data.distributed.DistributedSampler):
    """Shard ``num_replicas * replica_rank + group_rank`` of ``num_replicas * num_replica_groups``.

    ``num_replica_groups`` is the most replica groups the job will have (the quorum's size changes with
    faults, a sampler's shards cannot): while a group is out, its shard is not trained on.
    """

    def __init__(
        self,
        dataset: data.Dataset[Any],
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not 0 <= replica_rank < num_replica_groups:
            raise ValueError(f"replica_rank {replica_rank} is not in 0..{num_replica_groups - 1}")
        group_rank = dist.get_rank() if group_rank is None else group_rank
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        self.global_rank = group_rank + num_replicas * replica_rank
        self.global_world_size = num_replicas * num_replica_groups
        super().__init__(dataset, rank=self.global_rank, num_replicas=self.global_world_size, **kwargs)
