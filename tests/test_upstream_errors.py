"""Every user mistake upstream's ``fully_shard`` raises on raises the same way in fsdp2.

A table of rows, one per user-reachable ``raise`` in upstream's
``torch/distributed/fsdp/_fully_shard/`` (plus the composable-API contract's
"applied twice"): each row makes the mistake and states upstream's class and
message. Both implementations must raise an instance of that class whose
message contains upstream's (fsdp2: starts with it, its own guidance after);
where upstream's class is ``AssertionError`` or ``NotImplementedError``,
fsdp2's exception is also a ``ValueError`` (see [Note: Exceptions compatible
with upstream] in fsdp2/errors.py). Every rank raises, at W = 2 and 4.

``UPSTREAM_RAISES`` in ``upstream_raises.py`` lists every ``raise`` of the
package (torch 2.13) with the row covering it, or why no user can reach it;
``test_every_upstream_raise_is_accounted_for`` re-reads upstream's source so
a new torch release shows what is new. Rows for APIs fsdp2 does not have yet
(``dp_mesh_dims``, ``DataParallelMeshDims``, ``share_comm_ctx``, the 2.13
communication setters) skip for fsdp2 until those land and run for upstream.
"""

from __future__ import annotations

import ast
import copy
import inspect
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed.fsdp
import torch.nn as nn
from _impl import IMPL, FSDPModule, fully_shard, register_fsdp_forward_method
from checks import check_case, launch_cases
from models import (
    build_mlp,
    build_transformer,
    cpu_mesh,
    mlp_batch,
    mlp_loss,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map
from upstream_raises import EXTRA_ROWS, UPSTREAM_RAISES

if IMPL == "torch":
    API = torch.distributed.fsdp
else:
    import fsdp2 as API


@dataclass
class Expect:
    """Upstream's class, the call that makes the mistake, upstream's message (or alternatives)."""

    cls: type[BaseException]
    thunk: Callable[[], object]
    message: str | tuple[str, ...] | Callable[[], str | tuple[str, ...]]


@dataclass
class Row:
    name: str
    build: Callable[[int, int], Expect]
    min_world: int = 1
    needs: str | None = None  # a 2.13 API fsdp2 may not have yet


ROWS: dict[str, Row] = {}


def row(min_world: int = 1, needs: str | None = None):
    def register(fn: Callable[[int, int], Expect]) -> Callable[[int, int], Expect]:
        name = fn.__name__.removeprefix("_")
        ROWS[name] = Row(name, fn, min_world, needs)
        return fn

    return register


def _available(needs: str | None) -> bool:
    if needs is None:
        return True
    if needs == "dp_mesh_dims":
        return "dp_mesh_dims" in inspect.signature(fully_shard).parameters
    return hasattr(API, needs) or hasattr(FSDPModule, needs)


def _train(model: nn.Module) -> None:
    mlp_loss(model, mlp_batch(0, 4)).backward()


def _mesh2d(world_size: int, names: tuple[str, str] | None = ("replicate", "shard")):
    return init_device_mesh("cpu", (1, world_size), mesh_dim_names=names)


# ---- fully_shard's arguments ---------------------------------------------------------


@row()
def _container_without_forward(rank, world_size):
    container = nn.ModuleList([nn.Linear(2, 2)])
    msg = f"fully_shard does not support containers that do not implement forward: {container}"
    return Expect(ValueError, lambda: fully_shard(container, mesh=cpu_mesh()), msg)


@row()
def _applied_twice(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())
    return Expect(
        AssertionError,
        lambda: fully_shard(model, mesh=cpu_mesh()),
        "Each distinct composable distributed API can only be applied to a module once. "
        f"fully_shard has already been applied to the following module:\n{model}",
    )


@row()
def _mesh_3d(rank, world_size):
    mesh = init_device_mesh("cpu", (1, 1, world_size), mesh_dim_names=("a", "b", "c"))
    msg = f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}"
    return Expect(ValueError, lambda: fully_shard(build_mlp(), mesh=mesh), msg)


@row()
def _mesh_2d_without_names(rank, world_size):
    mesh = _mesh2d(world_size, names=None)
    msg = "Please init the 2D mesh for HSDP with mesh_dim_names specified"
    return Expect(AssertionError, lambda: fully_shard(build_mlp(), mesh=mesh), msg)


def _reshard_type(value):
    def build(rank, world_size):
        return Expect(
            ValueError,
            lambda: fully_shard(build_mlp(), mesh=cpu_mesh(), reshard_after_forward=value),
            "reshard_after_forward should be a bool or an int representing the group size to "
            f"reshard to, not {value}",
        )

    return build


def _reshard_factor(value):
    def build(rank, world_size):
        value_ = value if value is not None else world_size + 1
        return Expect(
            ValueError,
            lambda: fully_shard(build_mlp(), mesh=cpu_mesh(), reshard_after_forward=value_),
            "If passing reshard_after_forward as an int, it should be a factor of "
            f"{world_size}, not {value_}",
        )

    return build


for _value, _name in (("yes", "str"), (1.5, "float")):
    ROWS[f"reshard_after_forward_{_name}"] = Row(f"reshard_after_forward_{_name}", _reshard_type(_value))
for _value, _name in ((0, "0"), (-1, "negative"), (None, "not_a_factor")):
    ROWS[f"reshard_after_forward_{_name}"] = Row(
        f"reshard_after_forward_{_name}", _reshard_factor(_value)
    )


class _WithScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.tensor(2.0))


@row()
def _scalar_parameter(rank, world_size):
    model = nn.Sequential(_WithScalar())
    msg = "fully_shard doesn't support scalar parameters. Change scale to a 1D tensor with numel equal to 1."
    return Expect(ValueError, lambda: fully_shard(model, mesh=cpu_mesh()), msg)


@row()
def _non_contiguous_parameter(rank, world_size):
    model = build_mlp()
    model.mid_proj.weight = nn.Parameter(torch.randn(13, 5).t())
    msg = (
        "FSDP does not support non-contiguous parameters yet: "
        "param.shape=torch.Size([5, 13]) param.stride()=(1, 5)"
    )
    return Expect(NotImplementedError, lambda: fully_shard(model, mesh=cpu_mesh()), msg)


@row()
def _dtensor_with_non_contiguous_local(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    local = torch.randn(6, 4).t()  # DTensor strides (6, 1): contiguous; the local tensor is not
    weight = DTensor.from_local(
        local, mesh["tp"], [Replicate()], run_check=False, shape=(4, 6), stride=(6, 1)
    )
    model = nn.Linear(6, 4, bias=False)
    model.weight = nn.Parameter(weight)
    msg = "Expected contiguous tensor, got param_data.shape=torch.Size([4, 6]) param_data.stride()=(1, 4)"
    return Expect(AssertionError, lambda: fully_shard(model, mesh=mesh["dp"]), msg)


def _placement_fn_result(result, label):
    def build(rank, world_size):
        return Expect(
            ValueError,
            lambda: fully_shard(build_mlp(), mesh=cpu_mesh(), shard_placement_fn=lambda p: result),
            f"Invalid shard_placement_fn result: {result}",
        )

    ROWS[f"shard_placement_fn_returns_{label}"] = Row(f"shard_placement_fn_returns_{label}", build)


_placement_fn_result(Replicate(), "replicate")
_placement_fn_result(1, "int")


@row()
def _shard_dim_beyond_tensor(rank, world_size):
    model = nn.Linear(4, 4)  # the bias is 1-D
    return Expect(
        AssertionError,
        lambda: fully_shard(model, mesh=cpu_mesh(), shard_placement_fn=lambda p: Shard(1)),
        "Shard dim 1 is invalid for 1D tensor: torch.Size([4])",
    )


@row()
def _uneven_shard_on_dim_1(rank, world_size):
    model = nn.Linear(world_size + 1, 4, bias=False)
    return Expect(
        NotImplementedError,
        lambda: fully_shard(model, mesh=cpu_mesh(), shard_placement_fn=lambda p: Shard(1)),
        f"FSDP does not support uneven sharding on dim 1: torch.Size([4, {world_size + 1}]) "
        f"(world size: {world_size})",
    )


def _tp_model(mesh, placements):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for lin in model:
        for name in ("weight", "bias"):
            value = distribute_tensor(getattr(lin, name).detach(), mesh, placements)
            setattr(lin, name, nn.Parameter(value))
    return model


@row()
def _tensor_parallel_over_3_dims(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size, 1, 1, 1), mesh_dim_names=("dp", "a", "b", "c"))
    model = _tp_model(mesh["a", "b", "c"], [Replicate()] * 3)
    msg = "FSDP only supports 1D TP/EP or 2D EP+TP, not (Replicate(), Replicate(), Replicate())"
    return Expect(NotImplementedError, lambda: fully_shard(model, mesh=mesh["dp"]), msg)


@row(min_world=4)
def _tensor_parallel_with_int_reshard(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    model = _tp_model(mesh["tp"], [Replicate()])

    def thunk():
        fully_shard(model[0], mesh=mesh["dp"], reshard_after_forward=2)
        fully_shard(model, mesh=mesh["dp"])
        model(distribute_tensor(torch.randn(2, 4), mesh["tp"], [Replicate()])).sum().backward()

    msg = "Resharding to smaller mesh is not supported for DTensor parameters yet"
    return Expect(NotImplementedError, thunk, msg)


# ---- the first forward (lazy init) and training ----------------------------------------


@row()
def _group_of_several_modules_as_root(rank, world_size):
    model = build_mlp()
    fully_shard([model.in_proj, model.mid_proj], mesh=cpu_mesh())
    msg = lambda: f"FSDP requires a single root module but got {(model.in_proj, model.mid_proj)}"  # noqa: E731
    return Expect(RuntimeError, lambda: model.in_proj(torch.randn(2, 7)), msg)


@row()
def _child_forwarded_before_root(rank, world_size):
    model = build_mlp()
    fully_shard(model.in_proj, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())

    def thunk():
        model.in_proj(torch.randn(2, 7))
        model(torch.randn(2, 7))

    msg = (
        "FSDP state has already been lazily initialized for in_proj\n"
        "FSDP requires running forward through the root module first"
    )
    return Expect(RuntimeError, thunk, msg)


@row()
def _tied_weight_in_two_groups(rank, world_size):
    model = build_transformer(tie_weights=True)
    fully_shard(model.tok_embeddings, mesh=cpu_mesh())
    fully_shard(model.output, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    return Expect(
        ValueError,
        lambda: transformer_loss(model, transformer_batch(0, 2)),
        "Parameter 'output.weight' is shared with a parameter already managed by another FSDP "
        "group. For shared/tied parameters, use fully_shard([module_a, module_b]) to place "
        "them in the same FSDP group.",
    )


@row()
def _mixed_trainable_dtypes(rank, world_size):
    model = build_mlp()
    model.mid_proj.double()
    fully_shard(model, mesh=cpu_mesh())
    prefix = "FSDP expects uniform original parameter dtype but got "
    both = (f"{prefix}{{torch.float64, torch.float32}}", f"{prefix}{{torch.float32, torch.float64}}")
    return Expect(AssertionError, lambda: _train(model), both)


@row()
def _forward_with_meta_parameters(rank, world_size):
    with torch.device("meta"):
        model = build_mlp()
    fully_shard(model.in_proj, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    return Expect(
        RuntimeError,
        lambda: _train(model),
        "FSDP parameters should be materialized from meta device before training, but the "
        "following were still on meta device: ['mid_proj.weight', 'mid_proj.bias', "
        "'out_proj.weight', 'out_proj.bias']\nFor example, call module.to_empty(device) to "
        "materialize to device and call module.reset_parameters() on each module to "
        "initialize values.",
    )


@row()
def _plain_tensor_as_sharded_grad(rank, world_size):
    model = fully_shard(nn.Linear(4, 4, bias=False), mesh=cpu_mesh())
    model.weight.grad = torch.zeros(4, 4)
    return Expect(
        AssertionError,
        lambda: model(torch.randn(2, 4)).sum().backward(),
        "Expected fsdp_param.sharded_param.grad to be DTensor, got <class 'torch.Tensor'>",
    )


@row()
def _load_other_layout_into_shard_dim_1(rank, world_size):
    model = nn.Linear(2 * world_size, 4, bias=False)
    fully_shard(model, mesh=cpu_mesh(), shard_placement_fn=lambda p: Shard(1))
    state = {"weight": distribute_tensor(torch.randn(4, 2 * world_size), cpu_mesh(), [Shard(0)])}

    def thunk():
        model.load_state_dict(state, assign=True)
        model(torch.randn(2, 2 * world_size))

    msg = f"Shard(1) requires even sharding: local_tensor.size()={state['weight'].to_local().size()}"
    return Expect(AssertionError, thunk, msg)


# ---- FSDPModule's methods and friends --------------------------------------------------


@row()
def _deepcopy(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())
    msg = "FSDP does not support deepcopy. Please use state dict for serialization."
    return Expect(AssertionError, lambda: copy.deepcopy(model), msg)


@row()
def _set_reshard_after_forward_int(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())
    msg = "reshard_after_forward should be a bool, got <class 'int'>"
    return Expect(ValueError, lambda: model.set_reshard_after_forward(2), msg)


@row()
def _all_reduce_hook_stream_on_hsdp(rank, world_size):
    model = fully_shard(build_mlp(), mesh=_mesh2d(world_size))
    thunk = lambda: model.set_all_reduce_hook(lambda t: None, stream=torch.Stream("cpu"))  # noqa: E731
    return Expect(ValueError, thunk, "stream cannot be set when using native HSDP")


@row()
def _all_reduce_hook_stream_without_hook(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())

    def thunk():
        model.set_all_reduce_hook(lambda t: None, stream=torch.Stream("cpu"))
        model.set_all_reduce_hook(None)  # keeps the stream, as upstream
        _train(model)

    msg = "all reduce hook stream is specified but hook itself is missing."
    return Expect(AssertionError, thunk, msg)


@row()
def _register_missing_forward_method(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())
    msg = f"{type(model)} does not have a method generate"
    return Expect(ValueError, lambda: register_fsdp_forward_method(model, "generate"), msg)


@row()
def _prefetch_list_with_plain_module(rank, world_size):
    model = build_mlp()
    fully_shard(model.in_proj, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    thunk = lambda: model.set_modules_to_forward_prefetch([model.in_proj, model.mid_proj])  # noqa: E731
    msg = f"Expects FSDPModule but got {type(model.mid_proj)}: {model.mid_proj}"
    return Expect(ValueError, thunk, msg)


@row()
def _reset_iter_state_on_non_root(rank, world_size):
    model = build_mlp()
    fully_shard(model.in_proj, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    _train(model)
    msg = "reset_iter_state must be called on the root FSDP module"
    return Expect(RuntimeError, lambda: model.in_proj.reset_iter_state(), msg)


# ---- all-gather extensions -------------------------------------------------------------

_WRAPPED = {
    torch.ops.aten.detach, torch.ops.aten.view, torch.ops.aten.narrow, torch.ops.aten.split,
    torch.ops.aten.new_zeros, torch.ops.aten._to_copy, torch.ops.aten.slice,
    torch.ops.aten.as_strided, torch.ops.aten.alias, torch.ops.aten.clone,
}  # fmt: skip


class _Wrapped(torch.Tensor):
    """A wrapper subclass whose views stay wrapped (so the sharded local tensor keeps the hooks)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)

    def __init__(self, data):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x._data if isinstance(x, _Wrapped) else x  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable and isinstance(args[0], _Wrapped):
            return args[0]
        if func.overloadpacket in _WRAPPED:
            return tree_map(lambda x: cls(x) if isinstance(x, torch.Tensor) else x, out)
        return out


class _PreOnly(_Wrapped):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._data,), None


class _BadSignature(_Wrapped):
    def fsdp_pre_all_gather(self, mesh, extra):
        return (self._data,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return None if out is not None else (outputs[0], ())


class _Gathered(_PreOnly):
    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return None if out is not None else (outputs[0].to(param_dtype), ())


def _extension_linear(cls):
    lin = nn.Linear(4, 4, bias=False)
    lin.weight = nn.Parameter(cls(lin.weight.detach()), requires_grad=False)
    return lin


@row()
def _extension_with_one_hook(rank, world_size):
    model = _extension_linear(_PreOnly)

    def thunk():
        fully_shard(model, mesh=cpu_mesh())
        model(torch.randn(2, 4))

    msg = (
        "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined if using "
        "all-gather extensions: "
    )
    return Expect(AssertionError, thunk, msg)


@row()
def _extension_pre_hook_signature(rank, world_size):
    model = _extension_linear(_BadSignature)

    def thunk():
        fully_shard(model, mesh=cpu_mesh())
        model(torch.randn(2, 4))

    msg = (
        "Invalid fsdp_pre_all_gather: (mesh, extra)\nExpects fsdp_pre_all_gather(self, mesh: "
        "DeviceMesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, "
        "mp_policy: MixedPrecisionPolicy)"
    )
    return Expect(AssertionError, thunk, msg)


@row(min_world=4)
def _extension_with_int_reshard(rank, world_size):
    model = nn.Sequential(_extension_linear(_Gathered), nn.Linear(4, 4))

    def thunk():
        fully_shard(model[0], mesh=cpu_mesh(), reshard_after_forward=2)
        fully_shard(model, mesh=cpu_mesh())
        model(torch.randn(2, 4)).sum().backward()

    return Expect(NotImplementedError, thunk, "")  # upstream's has no message


# ---- torch 2.13 APIs fsdp2 may not have yet (skipped for fsdp2 until they land) --------


def _dims(**kwargs):
    return API.DataParallelMeshDims(**kwargs)


def _spmd_linear(mesh, placements):
    lin = nn.Linear(4, 4, bias=False)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, placements))
    return lin


@row(needs="DataParallelMeshDims")
def _mesh_dims_empty(rank, world_size):
    msg = "At least one of shard or replicate must be set in DataParallelMeshDims"
    return Expect(ValueError, _dims, msg)


@row(needs="dp_mesh_dims")
def _mesh_dims_emptied_later(rank, world_size):
    dims = _dims(shard="dp")
    dims.shard = None
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    thunk = lambda: fully_shard(build_mlp(), mesh=mesh, dp_mesh_dims=dims)  # noqa: E731
    return Expect(ValueError, thunk, "At least one of shard or replicate must be set in dp_mesh_dims")


@row(needs="dp_mesh_dims")
def _mesh_dims_on_unnamed_mesh(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    thunk = lambda: fully_shard(build_mlp(), mesh=mesh, dp_mesh_dims=_dims(shard="dp"))  # noqa: E731
    return Expect(ValueError, thunk, "mesh must have mesh_dim_names when dp_mesh_dims is provided")


@row(needs="dp_mesh_dims")
def _mesh_dims_unknown_name(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    thunk = lambda: fully_shard(build_mlp(), mesh=mesh, dp_mesh_dims=_dims(shard="x"))  # noqa: E731
    return Expect(ValueError, thunk, "Mesh dim name 'x' not found in mesh.mesh_dim_names ('dp',)")


@row(needs="dp_mesh_dims")
def _mesh_dims_with_int_reshard(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = _spmd_linear(mesh, [Replicate()])
    thunk = lambda: fully_shard(  # noqa: E731
        model, mesh=mesh, dp_mesh_dims=_dims(shard="dp"), reshard_after_forward=2
    )
    msg = "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)"
    return Expect(NotImplementedError, thunk, msg)


@row(needs="dp_mesh_dims")
def _mesh_dims_plain_parameter(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = nn.Linear(4, 4, bias=False)
    thunk = lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=_dims(shard="dp"))  # noqa: E731
    msg = (
        "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh "
        "(e.g. via distribute_module). Got plain tensor for parameter 'weight'."
    )
    return Expect(ValueError, thunk, msg)


@row(needs="dp_mesh_dims")
def _mesh_dims_parameter_on_other_mesh(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    other = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = _spmd_linear(other, [Replicate()])
    thunk = lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=_dims(shard="dp"))  # noqa: E731
    msg = (
        "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got "
        "different mesh objects"
    )
    return Expect(ValueError, thunk, msg)


@row(needs="dp_mesh_dims")
def _mesh_dims_sharded_on_shard_dim(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = _spmd_linear(mesh, [Shard(0)])
    thunk = lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=_dims(shard="dp"))  # noqa: E731
    msg = "Expected Replicate() on DP shard dim 'dp' (index 0) but got S(0)"
    return Expect(ValueError, thunk, msg)


@row(needs="dp_mesh_dims")
def _mesh_dims_sharded_on_replicate_dim(rank, world_size):
    mesh = _mesh2d(world_size, ("r", "dp"))
    model = _spmd_linear(mesh, [Shard(0), Replicate()])
    dims = _dims(shard="dp", replicate="r")
    thunk = lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=dims)  # noqa: E731
    msg = "Expected Replicate() on DP replicate dim 'r' (index 0) but got S(0)"
    return Expect(ValueError, thunk, msg)


_MESHES: dict = {}


def _replicate_only(world_size):
    # One mesh object for both rows: upstream compares the parameters' DTensor mesh with
    # fully_shard's by identity, and equal meshes made later may come back as the first one.
    if world_size not in _MESHES:
        _MESHES[world_size] = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("r", "tp"))
    mesh = _MESHES[world_size]
    return mesh, _spmd_linear(mesh, [Replicate(), Replicate()]), _dims(replicate="r")


@row(needs="dp_mesh_dims")
def _mesh_dims_replicate_only_with_placement_fn(rank, world_size):
    mesh, model, dims = _replicate_only(world_size)
    thunk = lambda: fully_shard(  # noqa: E731
        model, mesh=mesh, dp_mesh_dims=dims, shard_placement_fn=lambda p: None
    )
    msg = (
        "Per-param mesh via shard_placement_fn is not supported with DDPMeshInfo; it requires "
        "FSDPMeshInfo (or subclass)"
    )
    return Expect(ValueError, thunk, msg)


@row(needs="dp_mesh_dims")
def _mesh_dims_replicate_only_set_reshard(rank, world_size):
    mesh, model, dims = _replicate_only(world_size)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    return Expect(AssertionError, lambda: model.set_reshard_after_forward(True), "")


@row(needs="set_reduce_scatter_max_input_buffers")
def _max_input_buffers_bool(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())
    thunk = lambda: model.set_reduce_scatter_max_input_buffers(True)  # noqa: E731
    return Expect(TypeError, thunk, "max_input_buffers must be an int, got bool")


@row(needs="set_reduce_scatter_max_input_buffers")
def _max_input_buffers_zero(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())
    thunk = lambda: model.set_reduce_scatter_max_input_buffers(0)  # noqa: E731
    return Expect(ValueError, thunk, "max_input_buffers must be a positive int, got 0")


class _AllGather:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return torch.distributed.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op
        )


class _ReduceScatter(_AllGather):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return torch.distributed.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


@row(needs="set_symm_mem_for_comm")
def _symm_mem_after_custom_all_gather(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())
    model.set_custom_all_gather(_AllGather())
    msg = "cannot call set_symm_mem() when all gather comm is custom: _AllGather"
    return Expect(AssertionError, model.set_symm_mem_for_comm, msg)


@row(needs="set_allocate_memory_from_process_group_for_comm")
def _pg_allocation_after_custom_all_gather(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())
    model.set_custom_all_gather(_AllGather())
    thunk = lambda: model.set_allocate_memory_from_process_group_for_comm(True)  # noqa: E731
    msg = (
        "cannot call set_allocate_memory_from_process_group() when all gather comm is custom: "
        "_AllGather"
    )
    return Expect(AssertionError, thunk, msg)


@row(needs="set_allocate_memory_from_process_group_for_comm")
def _pg_allocation_after_custom_reduce_scatter(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())
    model.set_custom_reduce_scatter(_ReduceScatter())
    thunk = lambda: model.set_allocate_memory_from_process_group_for_comm(True)  # noqa: E731
    msg = (
        "cannot call set_allocate_memory_from_process_group() when reduce scatter comm is "
        "custom: _ReduceScatter"
    )
    return Expect(AssertionError, thunk, msg)


@row(needs="share_comm_ctx")
def _share_comm_ctx_with_plain_module(rank, world_size):
    lin = nn.Linear(2, 2)
    thunk = lambda: API.share_comm_ctx([lin])  # noqa: E731
    return Expect(ValueError, thunk, f"Expects list of FSDPModules but got {lin}")


# ---- the table ---------------------------------------------------------------------------


def _check_row(r: Row, rank: int, world_size: int) -> None:
    expect = r.build(rank, world_size)
    try:
        expect.thunk()
    except BaseException as e:  # noqa: BLE001 - the class is what is checked
        exc = e
    else:
        raise AssertionError(f"{r.name}: nothing raised; upstream raises {expect.cls.__name__}")
    message = expect.message() if callable(expect.message) else expect.message
    options = message if isinstance(message, tuple) else (message,)
    text = str(exc)
    where = f"{r.name} on rank {rank}: {type(exc).__name__}: {text}"
    assert isinstance(exc, expect.cls), f"{where}\nis not a {expect.cls.__name__}"
    assert any(m in text for m in options), f"{where}\ndoes not contain upstream's {options}"
    if IMPL == "fsdp2":
        assert any(text.startswith(m) for m in options), f"{where}\ndoes not start with {options}"
        if expect.cls in (AssertionError, NotImplementedError):
            assert isinstance(exc, ValueError), f"{where}\nis not also a ValueError"


def _cases(world_size: int) -> dict:
    return {
        name: (lambda rank, ws, r=r: _check_row(r, rank, ws))
        for name, r in ROWS.items()
        if world_size >= r.min_world and _available(r.needs)
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", sorted(ROWS))
def test_upstream_error(name, world_size):
    """Row ``name``: upstream's class and message, on every rank (one launch per world size)."""
    r = ROWS[name]
    if world_size < r.min_world:
        pytest.skip(f"needs a shard group of {r.min_world} ranks")
    if not _available(r.needs):
        pytest.skip(f"{IMPL} has no {r.needs} yet (issue 14, point 8)")
    check_case(launch_cases(("upstream_errors", world_size), world_size, _cases(world_size)), name)


# ---- every upstream raise is accounted for ----------------------------------------------


def _raises_in(node: ast.AST, file: str, scope: tuple[str, ...], sites: list) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _raises_in(child, file, (*scope, child.name), sites)
            continue
        if isinstance(child, ast.Raise):
            exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
            sites.append((file, ".".join(scope), getattr(exc, "id", "?")))
        _raises_in(child, file, scope, sites)


def _upstream_raise_sites() -> list[tuple[str, str, str]]:
    """(file, enclosing function, class) of every ``raise`` in upstream's package source."""
    package = os.path.join(os.path.dirname(torch.distributed.fsdp.__file__), "_fully_shard")
    sites: list[tuple[str, str, str]] = []
    for file in sorted(os.listdir(package)):
        if file.endswith(".py"):
            with open(os.path.join(package, file)) as f:
                _raises_in(ast.parse(f.read()), file, (), sites)
    return sites


def test_every_upstream_raise_is_accounted_for():
    """Each raise of upstream's package is listed with a table row or a reason, and every row is listed."""
    for r in UPSTREAM_RAISES:
        if ":" in r.covered_by:
            reason = r.covered_by.split(":", 1)[0]
            assert reason in ("internal", "private", "accelerator", "ranks"), r
        else:
            missing = [name for name in r.covered_by.split() if name not in ROWS]
            assert not missing, (r, missing)
    covered = {n for r in UPSTREAM_RAISES if ":" not in r.covered_by for n in r.covered_by.split()}
    assert covered | set(EXTRA_ROWS) == set(ROWS), set(ROWS) ^ (covered | set(EXTRA_ROWS))
    if not torch.__version__.startswith("2.13."):
        pytest.skip(f"UPSTREAM_RAISES lists torch 2.13's raises; this is torch {torch.__version__}")
    found = Counter(_upstream_raise_sites())
    listed = Counter((r.file, r.function, r.cls) for r in UPSTREAM_RAISES)
    assert found == listed, f"new in torch: {found - listed}\nno longer in torch: {listed - found}"
