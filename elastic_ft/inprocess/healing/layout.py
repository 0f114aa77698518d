"""Where a state's DTensors place this rank: the :class:`~elastic_ft.inprocess.healing.plan.ShardLayout` healing keys on.

A DTensor's local tensor is one shard of a global tensor; which one depends
on the mesh it lives on, its placements and this rank's coordinate. Two
ranks' states are interchangeable only when every tensor has the same
global shape and placements on a mesh of the same shape, and the ranks sit
at the same coordinate on every dimension some tensor is split on. This
module reads that from a ``state_dict()``'s DTensors (on the root mesh they
share: a tensor on a submesh, such as FSDP's dimension of an HSDP mesh,
names its dimensions, which place it on the root) and reduces the rest to a
digest; and :func:`check_shard` refuses a received state that is not the shard
needed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

from elastic_ft.inprocess.exception import HealingError
from elastic_ft.inprocess.healing.plan import ShardLayout


def _dtensors(value: object, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every DTensor of a state's nested dicts, lists and tuples, with its path, in order."""
    from torch.distributed.tensor import DTensor  # only where a state is walked: DTensor imports much of torch

    if isinstance(value, DTensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _dtensors(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _dtensors(item, f"{path}[{index}]")


def _root_of(mesh: Any) -> Any:
    get_root = getattr(mesh, "_get_root_mesh", None)  # torch's DeviceMesh; a submesh knows the mesh it was cut from
    return get_root() if callable(get_root) else mesh


def _root_dims(mesh: Any, root: Any, path: str) -> list[int]:
    """The root mesh's dimension behind each of ``mesh``'s dimensions."""
    if mesh is root:
        return list(range(mesh.ndim))
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if not names or not root_names or not set(names) <= set(root_names):
        raise ValueError(
            f"state{path}: a DTensor on a submesh with dimensions {names} of a mesh with dimensions {root_names}: "
            "healing cannot tell which shard it is (name the mesh's dimensions, and slice it by those names)"
        )
    return [root_names.index(name) for name in names]


def layout_of(state: object) -> ShardLayout | None:
    """The layout of ``state``'s DTensors on this rank, or None when it holds none.

    Raises:
        ValueError: the DTensors are on meshes of different roots, on a
            submesh that cannot be placed on its root, or this rank is not on
            their mesh; names the tensor.
    """
    root = None
    split: set[int] = set()
    tensors = []
    for path, tensor in _dtensors(state):
        mesh = tensor.device_mesh
        tensor_root = _root_of(mesh)
        if root is None:
            root = tensor_root
        elif (tensor_root.shape, tensor_root.mesh_dim_names) != (root.shape, root.mesh_dim_names):
            raise ValueError(
                f"state{path}: a DTensor on a mesh of shape {tuple(tensor_root.shape)}, the state's first one on "
                f"{tuple(root.shape)}: healing needs one mesh for a state's DTensors"
            )
        dims = _root_dims(mesh, tensor_root, path)
        placements = [str(placement) for placement in tensor.placements]
        split.update(
            dim for dim, placement in zip(dims, tensor.placements, strict=True) if not placement.is_replicate()
        )
        tensors.append([path, list(tensor.shape), dims, placements])
    if root is None:
        return None
    coordinate = root.get_coordinate()
    if coordinate is None:
        raise ValueError(f"this rank is not on the mesh of shape {tuple(root.shape)} its state's DTensors are on")
    described = json.dumps([list(root.mesh_dim_names or ()), tensors], separators=(",", ":"))
    return ShardLayout(
        tuple(root.shape), tuple(sorted(split)), tuple(coordinate), hashlib.sha256(described.encode()).hexdigest()[:32]
    )


def check_shard(received: ShardLayout | None, needed: ShardLayout, shard: tuple[int, int], source: object) -> None:
    """Refuse a DTensor state that is not shard ``shard`` of layout ``needed`` (:class:`HealingError`)."""
    if received is None:
        raise HealingError(f"{source} sent a state without DTensors where {needed.describe()} is needed")
    if not received.same_layout(needed) or received.shard != shard:
        index, shards = shard
        raise HealingError(
            f"{source} sent {received.describe()}, where shard {index} of {shards} of mesh {list(needed.mesh)} "
            f"(split on dims {list(needed.split)}, layout {needed.digest[:8]}) is needed; received layout "
            f"{received.digest[:8]}: refused, nothing loaded"
        )
