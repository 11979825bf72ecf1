"""Per-parameter meshes: ``shard_placement_fn`` results grouped by the process groups they shard over.

[Note: Per-parameter meshes]
``shard_placement_fn`` may return, besides ``None`` or ``Shard(dim)``, a
``ShardPlacementResult(placement, mesh_info)`` naming the mesh a parameter is
sharded over: torchtitan shards a mixture-of-experts block's experts over
the expert-data-parallel mesh (``efsdp``) and the rest of the block over
``dp`` with one ``fully_shard`` call. The mesh info is torch's own object
(``FSDPMeshInfo``, ``HSDPMeshInfo``, or one ``_get_mesh_info`` built from a
``DataParallelMeshDims``); we reuse its mesh and process groups, never make
new ones.

One call then makes one parameter group per ``(shard group, replicate group)``
pair, as upstream: groups in the order of each one's first parameter,
parameters in managed order within each. Each group has its own flat buffer,
all-gather, reduce-scatter and post-forward mesh; the state runs them in
upstream's order (see [Note: Several groups in one state] in hooks.py).
Parameters on one pair of process groups must name one mesh-info object; the
call's own mesh (``None`` or a plain ``Shard``) counts as an object of its
own, so mixing it with a result over the same groups is refused, as upstream.
Unlike upstream, ``shard_placement_fn`` is called once per parameter (upstream
calls it twice).

[Note: Parameter-major groups of several dtypes]
A dim-0 group of several dtypes is one flat buffer of bytes (see [Note:
Mixed-dtype groups] in flat_shard.py). A parameter-major group is planned in
elements of one dtype (its parameters sit whole at the plan's starts and
view the all-gather output), so a ``RaggedShard`` call whose parameters have
several dtypes makes one group per dtype on the same meshes (``split_by_dtype``),
in the order of each dtype's first parameter: one all-gather per dtype and
use, each group's rows planned and reduced in its own dtype (a LoRA block's
frozen bf16 base and fp32 adapters: the base is gathered, never reduced).
Settings that name the call's mesh (hooks, custom comms) apply to all of
them: ``check_one_group`` counts meshes, not groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import Shard

from ...api import RaggedShard, ShardPlacementResult, is_upstream_instance, resolve_dp_mesh_dims
from ...errors import FSDPAssertionError, FSDPNotImplementedError
from .dp_mesh_dims import SpmdDims
from .mesh import FSDPMeshInfo


class DDPMeshInfoInResultError(ValueError, AttributeError):
    """A ``DDPMeshInfo`` in a ``ShardPlacementResult`` (upstream fails with ``AttributeError``)."""


@dataclass
class MeshGroup:
    """The parameters of one ``fully_shard`` call that shard over one pair of process groups."""

    mesh_info: FSDPMeshInfo
    spmd: SpmdDims | None  # the group's SPMD mesh when its mesh info names dp_mesh_dims
    is_default: bool  # on the call's own mesh (``None`` / ``Shard`` results)
    params: list[nn.Parameter] = field(default_factory=list)
    placements: dict[nn.Parameter, Shard | None] = field(default_factory=dict)


_DEFAULT = object()  # stands for the call's own mesh info


def group_by_mesh(
    params: list[nn.Parameter],
    names: dict[nn.Parameter, str],
    shard_placement_fn: Any,
    mesh_info: FSDPMeshInfo,
    spmd: SpmdDims | None,
) -> list[MeshGroup]:
    """Split a call's parameters into groups by the process groups they shard over.

    Calls ``shard_placement_fn`` once per parameter; see [Note: Per-parameter meshes].
    """
    groups: dict[tuple[Any, Any], tuple[object, MeshGroup]] = {}
    for p in params:
        result = shard_placement_fn(p) if shard_placement_fn is not None else None
        placement, source = _resolve(result, names[p])
        if source is _DEFAULT:
            info, group_spmd = mesh_info, spmd
        else:
            info, group_spmd = _adapt(source)
        key = (info.shard_process_group, info.replicate_process_group if info.is_hsdp else None)
        if key not in groups:
            groups[key] = (source, MeshGroup(info, group_spmd, source is _DEFAULT))
        owner, group = groups[key]
        if owner is not source:
            raise ValueError(
                "Params sharing the same process group must use the same FSDPMeshInfo object, "
                f"but got different objects: {_describe(owner, mesh_info, spmd)} vs "
                f"{_describe(source, mesh_info, spmd)}\nfsdp2: '{names[p]}' shards over the "
                "same process groups as an earlier parameter under another mesh-info object "
                "(the call's own mesh counts as one); build one mesh info per mesh and return "
                "it for every parameter on that mesh"
            )
        group.params.append(p)
        group.placements[p] = placement
    return [group for _, group in groups.values()]


def split_by_dtype(mesh_groups: list[MeshGroup]) -> list[MeshGroup]:
    """Each all-``RaggedShard`` group of several dtypes as one group per dtype; see
    [Note: Parameter-major groups of several dtypes]."""
    out: list[MeshGroup] = []
    for group in mesh_groups:
        ragged = all(isinstance(group.placements[p], RaggedShard) for p in group.params)
        if not ragged or len({p.dtype for p in group.params}) < 2:
            out.append(group)
            continue
        by_dtype: dict[Any, MeshGroup] = {}
        for p in group.params:
            if p.dtype not in by_dtype:
                by_dtype[p.dtype] = MeshGroup(group.mesh_info, group.spmd, group.is_default)
            by_dtype[p.dtype].params.append(p)
            by_dtype[p.dtype].placements[p] = group.placements[p]
        out.extend(by_dtype.values())
    return out


def _resolve(result: Any, name: str) -> tuple[Shard | None, object]:
    """``(placement, mesh-info object or _DEFAULT)`` of one ``shard_placement_fn`` result."""
    if result is None:
        return None, _DEFAULT
    if isinstance(result, RaggedShard):  # the parameter-major layout, on the call's mesh
        return result, _DEFAULT
    if type(result) is Shard:
        return result, _DEFAULT
    if isinstance(result, ShardPlacementResult) or is_upstream_instance(
        result, "ShardPlacementResult"
    ):
        placement = result.placement
        if isinstance(placement, RaggedShard):
            raise FSDPNotImplementedError(
                f"shard_placement_fn returned a ShardPlacementResult holding {placement} for "
                f"'{name}': the parameter-major layout runs on the call's own mesh only; "
                "return the RaggedShard itself"
            )
        if placement is not None and not isinstance(placement, Shard):
            raise FSDPAssertionError(
                f"Expected Shard, got {type(placement)}: {placement}\nfsdp2: the "
                f"ShardPlacementResult for '{name}' must hold Shard(dim) or None"
            )
        return placement, result.mesh_info
    raise ValueError(
        f"Invalid shard_placement_fn result: {result}\n"
        f"shard_placement_fn returned {result!r} for '{name}'; it must return a "
        "Shard(dim), a ShardPlacementResult(placement, mesh_info) or None"
    )


def _adapt(source: Any) -> tuple[FSDPMeshInfo, SpmdDims | None]:
    """fsdp2's ``FSDPMeshInfo`` (and SPMD dims) for torch's mesh-info object ``source``."""
    if not is_upstream_instance(source, "FSDPMeshInfo"):
        if is_upstream_instance(source, "DDPMeshInfo"):
            raise DDPMeshInfoInResultError(
                f"'{type(source).__name__}' object has no attribute 'shard_process_group'\n"
                "fsdp2: a ShardPlacementResult's mesh_info must shard (FSDPMeshInfo or "
                "HSDPMeshInfo); a DDPMeshInfo replicates only"
            )
        raise ValueError(
            f"ShardPlacementResult.mesh_info must be torch's FSDPMeshInfo or HSDPMeshInfo, got "
            f"{type(source).__name__}: e.g. FSDPMeshInfo(mesh=mesh['efsdp'], shard_mesh_dim=0)"
        )
    hsdp = is_upstream_instance(source, "HSDPMeshInfo")
    info = FSDPMeshInfo(
        mesh=source.mesh,
        shard_mesh_dim=source.shard_mesh_dim,
        shard_process_group=source.shard_process_group,
        shard_mesh_size=source.shard_mesh_size,
        shard_mesh_rank=source.shard_mesh_rank,
        **({
            "replicate_mesh_dim": source.replicate_mesh_dim,
            "replicate_process_group": source.replicate_process_group,
            "replicate_mesh_size": source.replicate_mesh_size,
            "replicate_mesh_rank": source.replicate_mesh_rank,
        } if hsdp else {}),
    )
    if not getattr(source, "is_spmd_mesh", False):
        return info, None
    dims = resolve_dp_mesh_dims(source.dp_mesh_dims)
    spmd_mesh = source.spmd_mesh
    dim_names = spmd_mesh.mesh_dim_names
    spmd = SpmdDims(
        mesh=spmd_mesh,
        dims=dims,
        shard_indices=tuple(dim_names.index(n) for n in dims.shard_names),
        replicate_indices=tuple(dim_names.index(n) for n in dims.replicate_names),
        mesh_info=info,
    )
    return info, spmd


def _describe(source: object, mesh_info: FSDPMeshInfo, spmd: SpmdDims | None) -> str:
    """``source`` as upstream shows a mesh info (the call's own described in the same form)."""
    if source is not _DEFAULT:
        return repr(source)
    kind = "HSDPMeshInfo" if mesh_info.is_hsdp else "FSDPMeshInfo"
    dims = spmd.dims if spmd is not None else None
    return (
        f"{kind}(mesh={mesh_info.mesh}, shard_mesh_dim={mesh_info.shard_mesh_dim}, "
        f"replicate_mesh_dim={mesh_info.replicate_mesh_dim}, dp_mesh_dims={dims})"
    )


def check_one_group(groups: list[Any], method: str, what: str) -> None:
    """Upstream's refusal of a per-module setting (``what``) for a call that made groups on
    several meshes (not one per dtype: [Note: Parameter-major groups of several dtypes])."""
    if len({id(g.mesh_info) for g in groups}) > 1:
        fqns = ", ".join(repr(g.module_fqn) for g in groups if g.module_fqn) or "this module"
        raise ValueError(
            f"{method} is not supported with multiple param groups (from per-param mesh via "
            f"shard_placement_fn). The {what} would be ambiguous across groups with different "
            f"meshes.\nfsdp2: {fqns} shards its parameters over {len(groups)} meshes; give "
            f"the parameters that need the {what} a fully_shard call of their own"
        )
