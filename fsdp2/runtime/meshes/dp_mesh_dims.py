"""``fully_shard(..., dp_mesh_dims=...)``: the mesh is the whole SPMD mesh, parameters live on it.

[Note: SPMD meshes]
Without ``dp_mesh_dims``, ``fully_shard`` gets the data-parallel mesh alone
and tensor-parallel parameters arrive as DTensors on a separate tp mesh (see
[Note: Other shard dims and tensor parallelism] in param.py). With it, the
``mesh`` is the full SPMD mesh (data-parallel *and* model-parallel dims, all
named) and every parameter is already a DTensor on exactly that mesh object,
``Replicate()`` on the data-parallel dims (e.g. after ``distribute_module``);
``DataParallelMeshDims`` names those dims:

- ``shard`` only: FSDP over that dim (several names: one flattened dim);
- ``shard`` and ``replicate``: HSDP, replicated over the (flattened)
  replicate dims and sharded over the shard dims;
- ``replicate`` only: no sharding, gradients all-reduced over it (DDP). The
  shard group is then this rank alone, so unsharding is free and the
  parameters stay unsharded after forward, as upstream.

A parameter's local tensor (its model-parallel shard) is sharded over the
shard group exactly as in the TP case; the sharded DTensor keeps the
parameter's mesh and placements with ``Shard(dim)`` on the shard dim, or a
strided shard where a model-parallel dim to its right already splits that
tensor dim (``full_tensor()`` then reassembles it). Several shard dims are
flattened into one dim of the DTensor's mesh. The unsharded parameter is the
original DTensor layout again, and its gradient is taken as it comes on the
data-parallel dims (a ``Partial`` there is FSDP's to reduce, not a second
all-reduce), redistributed on the others.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..._torch_compat import concatenate_meshes, flatten_mesh, strided_shard, strided_split_factor
from ...api import DataParallelMeshDims
from .mesh import FSDPMeshInfo, reordered_mesh


class OverlappingDimsError(ValueError, RuntimeError):
    """A mesh dim named twice in ``dp_mesh_dims`` (upstream: a ``RuntimeError`` from the mesh)."""


@dataclass(frozen=True)
class SpmdDims:
    """The data-parallel dims of one ``fully_shard`` call's SPMD mesh, resolved."""

    mesh: DeviceMesh  # the full SPMD mesh passed to fully_shard
    dims: DataParallelMeshDims
    shard_indices: tuple[int, ...]
    replicate_indices: tuple[int, ...]
    mesh_info: FSDPMeshInfo  # the (flattened) shard and replicate groups


@dataclass(frozen=True)
class SpmdLayout:
    """Where one sharded parameter lives: its DTensor mesh and placements."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    dp_dims: frozenset[int]  # the data-parallel dims of the parameter's own mesh


def spmd_dims_for(mesh: DeviceMesh, dims: DataParallelMeshDims) -> SpmdDims:
    """Validate ``dp_mesh_dims`` against ``mesh`` and make its shard / replicate groups."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if dims.shard is None and dims.replicate is None:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided; e.g. "
            "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))"
        )
    shard, replicate = dims.shard_names, dims.replicate_names
    for name in (*shard, *replicate):
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")
    for field in (shard, replicate):
        if len(set(field)) < len(field):
            raise OverlappingDimsError(
                f"Slicing overlapping dim_names {field} is not allowed. fsdp2: dp_mesh_dims "
                "names a mesh dim twice; name each data-parallel dim once"
            )
    both = sorted(set(shard) & set(replicate))
    if both:
        raise OverlappingDimsError(
            f"Cannot concatenate overlapping meshes: fsdp2: dp_mesh_dims names {both} as both "
            "a shard and a replicate dim; each data-parallel dim is either sharded or replicated"
        )
    return SpmdDims(
        mesh=mesh,
        dims=dims,
        shard_indices=tuple(names.index(n) for n in shard),
        replicate_indices=tuple(names.index(n) for n in replicate),
        mesh_info=_mesh_info(mesh, shard, replicate),
    )


def _submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    if len(names) == 1:
        return mesh[names[0]]
    return flatten_mesh(mesh[names], "_".join(names))


def _mesh_info(
    mesh: DeviceMesh, shard: tuple[str, ...], replicate: tuple[str, ...]
) -> FSDPMeshInfo:
    if not replicate:  # FSDP
        dp = _submesh(mesh, shard)
        return FSDPMeshInfo(
            mesh=dp, shard_mesh_dim=0, shard_process_group=dp.get_group(0),
            shard_mesh_size=dp.size(0), shard_mesh_rank=dp.get_local_rank(0),
        )
    rep = _submesh(mesh, replicate)
    if not shard:  # DDP: a shard group of this rank alone
        return FSDPMeshInfo(
            mesh=rep, shard_mesh_dim=0, shard_process_group=_own_group(),
            shard_mesh_size=1, shard_mesh_rank=0,
            replicate_mesh_dim=0, replicate_process_group=rep.get_group(0),
            replicate_mesh_size=rep.size(0), replicate_mesh_rank=rep.get_local_rank(0),
            replicate_only=True,
        )
    dp = concatenate_meshes([rep, _submesh(mesh, shard)])  # HSDP: (replicate, shard)
    return FSDPMeshInfo(
        mesh=dp, shard_mesh_dim=1, shard_process_group=dp.get_group(1),
        shard_mesh_size=dp.size(1), shard_mesh_rank=dp.get_local_rank(1),
        replicate_mesh_dim=0, replicate_process_group=dp.get_group(0),
        replicate_mesh_size=dp.size(0), replicate_mesh_rank=dp.get_local_rank(0),
    )


# world -> this rank's own group; see [Note: Process-group caches are per world] in mesh.py.
_OWN_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = (
    weakref.WeakKeyDictionary()
)


def _own_group() -> dist.ProcessGroup:
    """A process group of this rank alone (only this rank takes part in making it)."""
    world = dist.group.WORLD
    group = _OWN_GROUPS.get(world)
    if group is None:  # one per world, and each thread-rank has its own world
        group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        _OWN_GROUPS[world] = group
    return group


def spmd_layout(
    param: nn.Parameter,
    attr: str,
    fqn: str,
    spmd: SpmdDims,
    shard_dim: int,
    ragged: Placement | None = None,
) -> SpmdLayout:
    """Check ``param`` against the SPMD mesh and lay out its sharded DTensor (see the Note).

    ``ragged``: the parameter-major layout's placement for the shard dim, in place of
    ``Shard(dim)``; refused where a model-parallel dim after it splits dim 0.
    """
    if not isinstance(param, DTensor):
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be "
            "DTensors on the full SPMD mesh (e.g. via distribute_module). "
            f"Got plain tensor for parameter '{attr}'. fsdp2: '{fqn}'; distribute it "
            "Replicate() on the data-parallel dims, or pass it in ignored_params"
        )
    mesh = spmd.mesh
    if param.device_mesh is not mesh:
        raise ValueError(
            "Expected param's DTensor mesh to be the same mesh passed "
            f"to fully_shard, but got different mesh objects. fsdp2: '{fqn}' is on "
            f"{param.device_mesh}, fully_shard got {mesh}; distribute parameters on the mesh "
            "object you pass (slicing or re-creating a mesh makes a new object)"
        )
    names = mesh.mesh_dim_names
    placements = tuple(param.placements)
    for kind, indices in (("shard", spmd.shard_indices), ("replicate", spmd.replicate_indices)):
        for idx in indices:
            if not isinstance(placements[idx], Replicate):
                raise ValueError(
                    f"Expected Replicate() on DP {kind} dim '{names[idx]}' (index {idx}) "
                    f"but got {placements[idx]}. fsdp2: parameter '{fqn}'; FSDP shards "
                    "the data-parallel dims itself"
                )
    new = list(placements)
    for idx in spmd.shard_indices:
        if ragged is not None:
            new[idx] = ragged
            continue
        # model-parallel dims to the right that split the same tensor dim: FSDP
        # shards within their shards, a strided shard in DTensor's terms
        split = math.prod(
            mesh.size(j) for j in range(idx + 1, mesh.ndim) if _splits(placements[j], shard_dim)
        )
        new[idx] = strided_shard(shard_dim, split) if split > 1 else Shard(shard_dim)
    dp_dims = frozenset(spmd.shard_indices + spmd.replicate_indices)
    if len(spmd.shard_indices) <= 1:
        layout = SpmdLayout(mesh, tuple(new), dp_dims)
    else:
        layout = _flattened_layout(spmd, new, dp_dims)
    return layout if ragged is None else rows_within_model_shards(layout, ragged)


def rows_within_model_shards(layout: SpmdLayout, ragged: Placement) -> SpmdLayout:
    """The model-parallel dims after the parameter-major placement that split the rows,
    moved before it on the same ranks' mesh (see [Note: Model-parallel parameters on the
    parameter-major layout] in ragged.py): its rows are then rows of their shard."""
    placements = layout.placements
    at = next(i for i, pl in enumerate(placements) if pl is ragged)
    first = tuple(j for j in range(at + 1, len(placements)) if _splits(placements[j], 0))
    if not first:
        return layout
    order = (*first, *(j for j in range(len(placements)) if j not in first))
    return SpmdLayout(reordered_mesh(layout.mesh, order), tuple(placements[j] for j in order),
                      layout.dp_dims)


def _splits(placement: Placement, dim: int) -> bool:
    if strided_split_factor(placement) is not None:
        return placement.dim == dim
    return isinstance(placement, Shard) and placement.dim == dim


def _flattened_layout(
    spmd: SpmdDims, placements: list[Placement], dp_dims: frozenset[int]
) -> SpmdLayout:
    """Several shard dims: one flattened dim in their place (HSDP: the replicate dim before it)."""
    names = spmd.mesh.mesh_dim_names
    shard_names = set(spmd.dims.shard_names)
    replicate_names = set(spmd.dims.replicate_names)
    hsdp = spmd.mesh_info.is_hsdp
    meshes: list[DeviceMesh] = []
    out: list[Placement] = []
    shard_done = False
    for i, name in enumerate(names):
        if name in shard_names:
            if not shard_done:
                meshes.append(spmd.mesh_info.mesh)
                out.extend([Replicate(), placements[i]] if hsdp else [placements[i]])
                shard_done = True
        elif name in replicate_names and hsdp:
            continue  # part of the (replicate, shard) mesh above
        else:
            meshes.append(spmd.mesh[name])
            out.append(placements[i])
    return SpmdLayout(concatenate_meshes(meshes), tuple(out), dp_dims)
