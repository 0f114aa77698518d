"""The stores a call hands out to bootstrap process groups: one per iteration, closed at the next restart."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from elastic_ft.etcd.group_store import GroupStore


class GroupStores:
    """Each iteration's store for ``init_process_group`` (``CallWrapper.process_group_store``), over ``base``.

    A prefix of ``base`` of its own per iteration (``<name>/<iteration>``),
    so no group meets a failed iteration's ranks. Over an etcd store it is
    a :class:`~elastic_ft.etcd.group_store.GroupStore` (gloo's and NCCL's
    write-once keys read from one watch), which stays open for its iteration
    (NCCL may read it after the group is built) and is closed by
    :meth:`close`. The etcd modules are imported only where one is used.
    """

    def __init__(self, base: dist.Store) -> None:
        self.base = base
        self._open: dict[int, GroupStore] = {}

    def for_iteration(self, iteration: int, name: str) -> dist.Store:
        from elastic_ft.etcd.store import EtcdStore

        if not isinstance(self.base, EtcdStore):
            return dist.PrefixStore(f"{name}/{iteration}", self.base)
        from elastic_ft.etcd.group_store import group_store

        store = self._open.get(iteration)
        if store is None or not store.prefix.endswith(f"/{name}/{iteration}/"):
            store = group_store(self.base, f"{name}/{iteration}/")
            self._open[iteration] = store
        return store

    def close(self, before: int | None = None) -> None:
        """Close the stores of the iterations before ``before`` (None: all)."""
        for iteration in [i for i in self._open if before is None or i < before]:
            self._open.pop(iteration).close()
