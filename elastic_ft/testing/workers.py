"""Pieces of the training workers that tests, the demo and benchmarks share."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def init_gloo(store: dist.Store | None, iteration: int, timeout: datetime.timedelta) -> tuple[int, int]:
    """Join this iteration's gloo group as ``RANK`` of ``WORLD_SIZE``; returns both.

    With a ``store`` (the Wrapper's, ``call_wrapper.base_store``), the group
    bootstraps from a prefix of it unique to the iteration, so no rank hosts
    anything; without one, from ``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets them.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if store is None:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    else:
        pg_store = dist.PrefixStore(f"pg/{iteration}", store)
        dist.init_process_group("gloo", store=pg_store, rank=rank, world_size=world_size, timeout=timeout)
    return rank, world_size
