"""TorchFT's ``DistributedDataParallel``: torch's, its gradients averaged across replica groups by the Manager."""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import parallel

from elastic_ft.replicas.manager import Manager

_NO_PEERS = timedelta(seconds=60)  # the one-rank group never waits for anyone


def _one_rank_group() -> dist.ProcessGroup:
    """A process group of this rank alone: DDP's own broadcasts and checks go nowhere, its gradients go through
    the communication hook."""
    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(
        torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(store, 0, 1, _NO_PEERS)
    )
    return group


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torch's ``DistributedDataParallel`` whose gradient buckets the :class:`Manager` averages across the
    quorum's replica groups.

    Its buckets are never rebuilt (``find_unused_parameters=True``, as TorchFT does): a replica group back
    from a fault starts with the initial bucket order, and every member must all-reduce the same buckets.
    The Manager syncs the weights when a replica group joins, so DDP's own initial broadcast is skipped.
    """

    def __init__(self, manager: Manager, module: nn.Module, **kwargs: Any) -> None:
        super().__init__(module, process_group=_one_rank_group(), find_unused_parameters=True, **kwargs)
        self.register_comm_hook(manager, _average_across_replicas)


def _average_across_replicas(manager: Manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return manager.allreduce(bucket.buffer()).get_future()
