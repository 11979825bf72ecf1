"""fully_shard(): shard a module in place and make it an FSDPModule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._torch_compat import composable_apis, mark_composable_api
from .api import (
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    RaggedShard,
    resolve_dp_mesh_dims,
    resolve_policies,
)
from .errors import FSDPAssertionError, FSDPNotImplementedError
from .module import FSDPModule, UnshardHandle
from .module_functions import register_fsdp_forward_method
from .runtime.comm.comm_context import CommContext
from .runtime.common.mixed_precision import keeps_own_dtype
from .runtime.common.profiler_ranges import warn_once
from .runtime.group.arenas import join_arenas
from .runtime.group.param_group import FSDPParamGroup
from .runtime.hooks.state import FSDPState, state_of
from .runtime.meshes.dp_mesh_dims import (
    SpmdDims,
    SpmdLayout,
    rows_within_model_shards,
    spmd_dims_for,
    spmd_layout,
)
from .runtime.meshes.mesh import (
    FSDPMeshInfo,
    PostForwardMeshInfo,
    default_mesh,
    device_for,
    mesh_info_for,
    post_forward_mesh_info,
    spmd_mesh_for,
)
from .runtime.meshes.param_meshes import MeshGroup, group_by_mesh, split_by_dtype
from .runtime.storage.param import FSDPParam
from .runtime.storage.ragged_rows import RaggedRows, plan_rows

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method"]

_fsdp_classes: dict[type, type] = {}

# The argument types of fully_shard (see its docstring).
MeshArg = DeviceMesh | None
ReshardArg = bool | int | None
# a Shard, a ShardPlacementResult (placement and mesh info) or None (Shard(0))
PlacementFnArg = Callable[[nn.Parameter], Any] | None
IgnoredArg = set[nn.Parameter] | None
DpMeshDimsArg = DataParallelMeshDims | None


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: MeshArg = ...,
    reshard_after_forward: ReshardArg = ...,
    shard_placement_fn: PlacementFnArg = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: IgnoredArg = ...,
    dp_mesh_dims: DpMeshDimsArg = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: MeshArg = ...,
    reshard_after_forward: ReshardArg = ...,
    shard_placement_fn: PlacementFnArg = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: IgnoredArg = ...,
    dp_mesh_dims: DpMeshDimsArg = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module,
    *,
    mesh=None,
    reshard_after_forward=None,
    shard_placement_fn=None,
    mp_policy=MixedPrecisionPolicy(),
    offload_policy=OffloadPolicy(),
    ignored_params=None,
    dp_mesh_dims=None,
):
    """Shard ``module``'s parameters across ``mesh`` (fully sharded data parallel).

    Every parameter of ``module`` not already managed by an inner
    ``fully_shard`` call becomes an ``nn.Parameter`` wrapping a ``DTensor``
    that is ``Shard(0)`` over ``mesh``. The parameters form one group: before
    the module's forward they are all-gathered in one collective, after it
    they are freed (see ``reshard_after_forward``), in backward they are
    gathered again and their gradients are reduce-scattered in one collective
    to the mean over ranks, accumulated on the sharded parameters' ``.grad``.

    Call it bottom-up: on each block (e.g. transformer layer), then on the
    root. Build the optimizer afterwards, on ``model.parameters()``.

    Args:
        module: the module to shard, modified in place; a list of modules
            forms one group.
        mesh: the data-parallel ``DeviceMesh``: 1-D (FSDP) or 2-D with named
            ``(replicate, shard)`` dims (HSDP). Defaults to a mesh over the
            whole default process group on the current accelerator or CPU.
            With tensor parallelism, pass the data-parallel sub-mesh of the
            mesh whose tp sub-mesh ``parallelize_module`` used.
        reshard_after_forward: ``True`` frees the unsharded parameters after
            forward and all-gathers again in backward; ``False`` keeps them
            until the end of backward (more memory, one all-gather less);
            ``None`` means ``False`` for the root module and ``True`` for the
            others; an int ``k`` (a divisor of the shard dim's size) keeps
            them sharded over groups of ``k`` consecutive ranks after forward
            so the backward all-gather is over ``k`` ranks only.
        shard_placement_fn: optional ``param -> Shard | ShardPlacementResult |
            RaggedShard | None``: ``RaggedShard(granularity)`` for every parameter
            makes the call's group parameter-major (fsdp2 only; docs/layouts.md);
            otherwise shard that parameter on another dim (``None`` means ``Shard(0)``);
            dims other than 0 must divide evenly by the shard dim's size. A
            ``ShardPlacementResult(placement, mesh_info)`` also names the mesh
            (torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo``) to shard it over: the
            call then makes one group per mesh (see [Note: Per-parameter
            meshes] in runtime/meshes/param_meshes.py). Called once per parameter.
        mp_policy: mixed precision: the dtype of the all-gather and compute
            (``param_dtype``), of the gradient reduction (``reduce_dtype``),
            of the forward outputs (``output_dtype``), and whether floating
            forward inputs are cast to ``param_dtype``. Sharded parameters and
            the optimizer keep the original dtype.
        offload_policy: ``CPUOffloadPolicy()`` keeps sharded parameters,
            gradients and hence optimizer state in host memory; ``OffloadPolicy()``
            (default) keeps them on the device.
        ignored_params: parameters left alone: not sharded, not moved, no
            gradient reduction.
        dp_mesh_dims: a :class:`DataParallelMeshDims` naming the
            data-parallel dims of ``mesh``, which is then the full SPMD mesh
            (e.g. ``(dp, tp)``) and every parameter a DTensor on it,
            ``Replicate()`` on those dims: FSDP shards over ``shard`` and
            replicates over ``replicate`` (HSDP; DDP when only ``replicate``
            is set). Several names per field are flattened into one dim.
            See [Note: SPMD meshes] in dp_mesh_dims.py.

    Returns:
        The same module (or list), now also an instance of :class:`FSDPModule`.
    """
    modules = _validate_modules(module)
    mp_policy, offload_policy = resolve_policies(mp_policy, offload_policy)
    mesh = mesh if mesh is not None else default_mesh()
    spmd: SpmdDims | None = None
    if dp_mesh_dims is not None:  # see [Note: SPMD meshes] in dp_mesh_dims.py
        spmd = spmd_dims_for(mesh, resolve_dp_mesh_dims(dp_mesh_dims))
        mesh_info = spmd.mesh_info
        if mesh_info.replicate_only and shard_placement_fn is not None:
            raise ValueError(
                "Per-param mesh via shard_placement_fn is not supported with DDPMeshInfo; it "
                "requires FSDPMeshInfo (or subclass)\n"
                "dp_mesh_dims names replicate dims only (DDP): nothing is sharded, so drop "
                "shard_placement_fn"
            )
    else:
        mesh_info = mesh_info_for(mesh)
    raf_value = reshard_after_forward
    reshard_after_forward, _ = _resolve_reshard_after_forward(raf_value, mesh_info, spmd)
    device = device_for(mesh)
    ignored = set(ignored_params or ())
    params, owners, names = _managed_params(modules, ignored)
    # See [Note: Per-parameter meshes] in runtime/meshes/param_meshes.py
    mesh_groups = group_by_mesh(params, names, shard_placement_fn, mesh_info, spmd)
    mesh_groups = split_by_dtype(mesh_groups)  # parameter-major groups are of one dtype
    _move_buffers(modules, ignored, device)
    comm_ctx = CommContext()  # this call's, until a root's lazy init shares the root's
    groups = [
        _make_group(
            g, owners, names, modules, device, comm_ctx, raf_value, spmd,
            mp_policy=mp_policy, offload_policy=offload_policy,
        )
        for g in mesh_groups
    ]
    FSDPState(
        modules,
        groups,
        comm_ctx,
        auto_reshard_after_forward=reshard_after_forward is None,
        mp_policy=mp_policy,
    )
    # The groups under this call share arenas from now on: see [Note: Arenas] in arena.py
    join_arenas(_groups_under(modules))
    for m in modules:
        cls = m.__class__
        fsdp_cls = _fsdp_classes.get(cls)
        if fsdp_cls is None:  # setdefault: ranks that are threads all get the first class made
            attrs = {"__deepcopy__": _no_deepcopy}
            fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), attrs)
            fsdp_cls = _fsdp_classes.setdefault(cls, fsdp_cls)
        m.__class__ = fsdp_cls
        mark_composable_api(m)  # e.g. torch's replicate() then leaves these parameters to us
    return module


def _groups_under(modules: tuple[nn.Module, ...]) -> list[FSDPParamGroup]:
    """Every group of the states on ``modules`` and their submodules, once, in module order."""
    seen: dict[int, FSDPParamGroup] = {}
    for m in modules:
        for sub in m.modules():
            state = state_of(sub)
            if state is not None:
                for group in state.param_groups:
                    seen.setdefault(id(group), group)
    return list(seen.values())


def _make_group(
    mesh_group: MeshGroup,
    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]],
    names: dict[nn.Parameter, str],
    modules: tuple[nn.Module, ...],
    device: torch.device,
    comm_ctx: CommContext,
    reshard_after_forward: Any,
    call_spmd: SpmdDims | None,
    *,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> FSDPParamGroup:
    """One parameter group: the parameters of ``mesh_group``, sharded over its mesh."""
    params, mesh_info, spmd = mesh_group.params, mesh_group.mesh_info, mesh_group.spmd
    # the call's SPMD rules apply to its own mesh only, as upstream
    raf, post_forward = _resolve_reshard_after_forward(
        reshard_after_forward, mesh_info, call_spmd if mesh_group.is_default else None
    )
    shard_dims = {
        p: _shard_dim(p, names[p], mesh_info, device, mesh_group.placements[p], spmd is not None)
        for p in params
    }
    ragged = _ragged_rows(mesh_group, names)  # parameter -> (its rows, its RaggedShard)
    layouts: dict[nn.Parameter, SpmdLayout] = {}
    if spmd is not None:
        layouts = {
            p: spmd_layout(p, owners[p][0][1], names[p], spmd, shard_dims[p],
                           ragged[p][1] if p in ragged else None)
            for p in params
        }
        spmd_meshes = {p: layout.mesh for p, layout in layouts.items()}
    else:
        spmd_meshes = _spmd_meshes(params, mesh_info.mesh)
        layouts = {p: _ragged_layout(p, placement, spmd_meshes.get(p), mesh_info)
                   for p, (_, placement) in ragged.items()}
        spmd_meshes.update({p: layout.mesh for p, layout in layouts.items()})
    fsdp_params = [
        FSDPParam(
            p, owners[p], mesh_info, names[p], shard_dims[p], spmd_meshes.get(p),
            **_layout_kwargs(layouts.get(p)),
            rows=ragged[p][0] if p in ragged else None,
        )
        for p in params
    ]
    for fsdp_param, p in zip(fsdp_params, params):
        fsdp_param.keeps_dtype = keeps_own_dtype(mp_policy, p, names[p])
    return FSDPParamGroup(
        fsdp_params,
        params,
        modules,
        mesh_info,
        device,
        comm_ctx,
        reshard_after_forward=raf is not False,
        post_forward_mesh_info=post_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
    )


def _ragged_layout(
    param: nn.Parameter, placement: RaggedShard, spmd_mesh: DeviceMesh | None,
    mesh_info: FSDPMeshInfo,
) -> SpmdLayout:
    """A parameter-major parameter's mesh and placements: the data-parallel dims' then the
    tensor-parallel ones; TP dims that split its rows first (see [Note: Model-parallel
    parameters on the parameter-major layout] in runtime/storage/ragged.py)."""
    dp = ((Replicate(),) if mesh_info.is_hsdp else ()) + (placement,)
    if spmd_mesh is None:
        return SpmdLayout(mesh_info.mesh, dp, frozenset())
    layout = SpmdLayout(spmd_mesh, (*dp, *param.placements), frozenset())
    return rows_within_model_shards(layout, placement)


def _ragged_rows(
    mesh_group: MeshGroup, names: dict[nn.Parameter, str]
) -> dict[nn.Parameter, tuple[RaggedRows, RaggedShard]]:
    """``RaggedShard`` results: each parameter's rows and placement, or what it cannot do yet.

    A group is parameter-major or dim-0 as a whole; see [Note: The
    parameter-major layout] in runtime/storage/ragged.py. A DTensor parameter
    (tensor parallelism, a ``dp_mesh_dims`` mesh) is planned by its local rows,
    as the dim-0 layout shards its local tensor (see [Note: Model-parallel
    parameters on the parameter-major layout] in runtime/storage/ragged.py).
    """
    params, mesh_info = mesh_group.params, mesh_group.mesh_info
    requests = {p: pl for p, pl in mesh_group.placements.items() if isinstance(pl, RaggedShard)}
    if not requests:
        return {}
    first = names[next(iter(requests))]
    for p in params:
        if p not in requests:
            raise ValueError(
                f"shard_placement_fn returned {mesh_group.placements[p]} for '{names[p]}' "
                f"but a RaggedShard for '{first}': one fully_shard call is parameter-major "
                "or dim-0 as a whole; return RaggedShard for every parameter of the call, or none"
            )
    refusal = None
    bad = next((p for p in params if p.dim() == 0), None)
    if bad is not None:
        refusal = f"0-d parameters ('{names[bad]}')"
    if refusal is not None:
        raise FSDPNotImplementedError(
            f"RaggedShard for '{first}': the parameter-major layout does not support "
            f"{refusal} yet; return None from shard_placement_fn (the dim-0 layout) for "
            "this call"
        )
    local_shapes = [p.to_local().shape if isinstance(p, DTensor) else p.shape for p in params]
    rows = plan_rows(
        local_shapes, [requests[p].granularity for p in params],
        mesh_info.shard_mesh_size, mesh_info.shard_mesh_rank, [names[p] for p in params],
    )
    return {p: (r, RaggedShard(requests[p].granularity, r.row_bounds)) for p, r in zip(params, rows)}



def _no_deepcopy(self: nn.Module, memo: dict) -> Any:
    raise FSDPAssertionError(
        "FSDP does not support deepcopy. Please use state dict for serialization.\n"
        "Copy the model before fully_shard, or build a new one and load "
        "model.state_dict() into it."
    )


# ---- validation ---------------------------------------------------------------


def _validate_modules(module: Any) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, list) else (module,)
    if not modules:
        raise ValueError("fully_shard expects a module or a non-empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(f"fully_shard expects nn.Module(s), got {type(m).__name__}")
        if state_of(m) is not None:
            raise FSDPAssertionError(
                "Each distinct composable distributed API can only be applied to a module "
                f"once. fully_shard has already been applied to the following module:\n{m}\n"
                "Apply fully_shard once per module (bottom-up: blocks first, then the root)."
            )
    # Checked on the argument itself, as upstream: a list of modules is fine.
    container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
    if container and type(module).forward is nn.Module.forward:
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: {module}\n"
            "Shard each of its modules (fully_shard(m) for m in the container), or pass "
            "list(container) to shard them as one group."
        )
    return modules


def _resolve_reshard_after_forward(
    value: Any, mesh_info: FSDPMeshInfo, spmd: SpmdDims | None
) -> tuple[bool | None, PostForwardMeshInfo | None]:
    """Validate ``reshard_after_forward``; an int becomes ``True`` plus its smaller group.

    With ``dp_mesh_dims`` (``spmd``), upstream's rules: nothing sharded (DDP)
    keeps the parameters gathered, and an int is refused.
    """
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if spmd is not None and not spmd.shard_indices:
        return False, None
    if spmd is not None and is_int:
        raise FSDPNotImplementedError(
            "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims); "
            "pass True, False or None"
        )
    if value is None or isinstance(value, bool):
        return value, None
    size = mesh_info.shard_mesh_size
    if isinstance(value, int):
        if value >= 1 and size % value == 0:
            if value == 1:  # sharded over one rank: the same as keeping it unsharded
                warn_once(  # upstream's text, on its logger
                    "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
                    "instead of reshard_after_forward=True (bool)"
                )
                return False, None
            if value == size:
                return True, None
            return True, post_forward_mesh_info(mesh_info, value)
        raise ValueError(
            "If passing reshard_after_forward as an int, it should be a factor of "
            f"{size}, not {value}\nAn int reshard_after_forward is the size of the group "
            "the parameters stay sharded over after forward; or pass True/False/None."
        )
    raise ValueError(
        "reshard_after_forward should be a bool or an int representing the group size to "
        f"reshard to, not {value}\n(got {type(value).__name__} {value!r}; None means True "
        "for every module but the root)"
    )


def _managed_params(
    modules: tuple[nn.Module, ...], ignored: set[nn.Parameter]
) -> tuple[list[nn.Parameter], dict[nn.Parameter, list[tuple[nn.Module, str]]], dict[nn.Parameter, str]]:
    """Parameters this call manages (not ignored, not in an inner group).

    Returns them in registration order, every ``(module, attribute)`` that
    holds each (tied weights have several), and each one's name relative to
    the module passed to ``fully_shard`` (for error messages).
    """
    already_managed: set[nn.Parameter] = set()
    roots = set(modules)
    params: list[nn.Parameter] = []
    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    names: dict[nn.Parameter, str] = {}
    seen: set[nn.Module] = set()
    multi = len(modules) > 1
    stack = [(m, f"{type(m).__name__}[{i}]." if multi else "") for i, m in enumerate(modules)]
    stack.reverse()
    while stack:
        m, prefix = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if "replicate" in composable_apis(m):
            continue  # torch's replicate() owns this subtree's parameters, as upstream
        inner = state_of(m)
        if inner is not None and m not in roots:
            for group in inner.param_groups:
                for p in group.fsdp_params:
                    p.adopt_registered()  # it may have been replaced (load_state_dict(assign=True))
                    already_managed.add(p.sharded_param)
            continue
        for name, p in m._parameters.items():
            if p is None or p in ignored:
                continue
            if p not in owners:
                owners[p] = []
                params.append(p)
                names[p] = prefix + name
            owners[p].append((m, name))
        children = [(child, f"{prefix}{name}.") for name, child in m.named_children()]
        stack.extend(reversed(children))
    # Parameters also held by an inner group belong to it (e.g. tied weights).
    managed = [p for p in params if p not in already_managed]
    return managed, {p: owners[p] for p in managed}, {p: names[p] for p in managed}


def _shard_dim(
    param: nn.Parameter,
    name: str,
    mesh_info: FSDPMeshInfo,
    device: torch.device,
    placement: Shard | None,
    on_spmd_mesh: bool = False,
) -> int:
    """Validate ``param`` and return the tensor dim FSDP shards it on (``placement``: its result)."""
    _validate_param(param, name, device, on_spmd_mesh)
    if placement is None:
        return 0
    local = param.to_local() if isinstance(param, DTensor) else param
    ndim = local.dim()
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise FSDPAssertionError(
            f"Shard dim {dim} is invalid for {ndim}D tensor: {param.shape}\n"
            f"shard_placement_fn returned {placement} for '{name}'; the dim must be in "
            f"[-{ndim}, {ndim})"
        )
    size = mesh_info.shard_mesh_size
    if dim > 0 and local.size(dim) % size != 0:
        raise FSDPNotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {local.size()} "
            f"(world size: {size})\n"
            f"shard_placement_fn returned {placement} for '{name}', but dim {dim} "
            f"({local.size(dim)}) does not divide evenly over the shard mesh size {size}; "
            "sharding a dim other than 0 needs even division: pick another dim or return "
            "None (Shard(0))"
        )
    return dim


def _spmd_meshes(params: list[nn.Parameter], dp_mesh: DeviceMesh) -> dict[nn.Parameter, DeviceMesh]:
    """The (data-parallel, tensor-parallel) mesh of each DTensor parameter."""
    by_tp_mesh: dict[DeviceMesh, DeviceMesh] = {}
    out = {}
    for p in params:
        if isinstance(p, DTensor):
            tp_mesh = p.device_mesh
            if tp_mesh not in by_tp_mesh:
                by_tp_mesh[tp_mesh] = spmd_mesh_for(dp_mesh, tp_mesh)
            out[p] = by_tp_mesh[tp_mesh]
    return out


def _layout_kwargs(layout: SpmdLayout | None) -> dict[str, Any]:
    if layout is None:
        return {}
    return {"placements": layout.placements, "dp_dims": layout.dp_dims}


def _validate_param(
    param: nn.Parameter, name: str, device: torch.device, on_spmd_mesh: bool = False
) -> None:
    if param.dim() == 0:
        attr = name.rsplit(".", 1)[-1]  # upstream names the attribute
        raise ValueError(
            "fully_shard doesn't support scalar parameters. "
            f"Change {attr} to a 1D tensor with numel equal to 1.\n"
            f"Parameter '{name}' is a scalar (0-dim); FSDP shards on dim 0. Reshape it to "
            "shape (1,) or pass it in ignored_params"
        )
    if isinstance(param, DTensor):
        if param.device_mesh.device_type != device.type:
            raise ValueError(
                "Requires DTensor to have mesh of the same type as the FSDP mesh but got "
                f"{param.device_mesh.device_type} for DTensor and {device.type} for FSDP\n"
                f"Parameter '{name}' is a DTensor on a '{param.device_mesh.device_type}' mesh "
                f"but fully_shard's mesh is on '{device.type}'; use meshes of one device type"
            )
        if not param.is_meta and param.device != device:
            raise FSDPAssertionError(
                f"Expects DTensor to be moved to {param.device_mesh.device_type} but got "
                f"{param.device}\nParameter '{name}' is a DTensor on {param.device} but "
                f"fully_shard shards on {device}; build its mesh on the current device"
            )
        # With dp_mesh_dims the DTensor spans the data-parallel dims too (see dp_mesh_dims.py).
        if len(param.placements) > 2 and not on_spmd_mesh:
            raise FSDPNotImplementedError(
                f"FSDP only supports 1D TP/EP or 2D EP+TP, not {param.placements}\n"
                f"Parameter '{name}' is a DTensor on a {len(param.placements)}-D mesh; "
                "distribute it over at most 2 model-parallel mesh dims"
            )
    local = param.to_local() if isinstance(param, DTensor) else param
    if param.is_contiguous() and not local.is_contiguous():  # a DTensor given other strides
        raise FSDPAssertionError(
            "Expected contiguous tensor, got "
            f"param_data.shape={local.shape!r} param_data.stride()={local.stride()!r}\n"
            f"Parameter '{name}' is a DTensor whose local tensor is not contiguous; make the "
            "local tensor contiguous before DTensor.from_local"
        )
    if not param.is_contiguous():
        raise FSDPNotImplementedError(
            "FSDP does not support non-contiguous parameters yet: "
            f"param.shape={param.shape!r} param.stride()={param.stride()!r}\n"
            f"Parameter '{name}' is not contiguous; make it contiguous before fully_shard, "
            "e.g. module.<name> = nn.Parameter(module.<name>.contiguous())"
        )
    param = local
    if not param.is_meta and param.device.type != device.type and param.device.type != "cpu":
        raise ValueError(
            f"Parameter '{name}' is on {param.device} but the mesh's device is {device}; "
            "move the module to the mesh's device first"
        )
    # A CPU parameter with an accelerator mesh is moved while sharding, like upstream.


def _move_buffers(modules: tuple[nn.Module, ...], ignored: set, device: torch.device) -> None:
    if device.type == "cpu":
        return
    for m in modules:
        for sub in m.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.is_meta and buf.device != device:
                    sub._buffers[name] = buf.to(device)
