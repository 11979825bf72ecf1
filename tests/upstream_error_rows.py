"""The rows of test_upstream_errors.py: one user mistake each, upstream's class and message.

Each row builds what it needs (a model, a mesh), and returns an ``Expect``:
upstream's exception class, the call that makes the mistake, and upstream's
message (a string, alternatives, or a callable giving them once the objects
it shows exist). Rows for torch 2.13 APIs that fsdp2 may lack are in
``upstream_error_rows_213.py``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed.fsdp
import torch.nn as nn
from _impl import IMPL, FSDPModule, fully_shard, register_fsdp_forward_method
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
    exact: bool = False  # str(error) must be upstream's message itself (upstream's test compares it)


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


def available(needs: str | None) -> bool:
    if needs is None:
        return True
    if needs == "dp_mesh_dims":
        return "dp_mesh_dims" in inspect.signature(fully_shard).parameters
    return hasattr(API, needs) or hasattr(FSDPModule, needs)


def _forward_backward(model: nn.Module) -> None:
    """One forward and backward of an MLP batch, no optimizer step."""
    mlp_loss(model, mlp_batch(0, 4)).backward()


def mesh2d(world_size: int, names: tuple[str, str] | None = ("replicate", "shard")):
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
    mesh = mesh2d(world_size, names=None)
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
    _key = f"reshard_after_forward_{_name}"
    ROWS[_key] = Row(_key, _reshard_type(_value))
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
    msg = (
        "fully_shard doesn't support scalar parameters. "
        "Change scale to a 1D tensor with numel equal to 1."
    )
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
    msg = (
        "Expected contiguous tensor, got "
        "param_data.shape=torch.Size([4, 6]) param_data.stride()=(1, 4)"
    )
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
    def msg():  # the modules' classes are the FSDP ones by now
        return f"FSDP requires a single root module but got {(model.in_proj, model.mid_proj)}"

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
    both = tuple(f"{prefix}{{{a}, {b}}}" for a, b in (("torch.float64", "torch.float32"),
                                                         ("torch.float32", "torch.float64")))
    return Expect(AssertionError, lambda: _forward_backward(model), both)


@row()
def _forward_with_meta_parameters(rank, world_size):
    with torch.device("meta"):
        model = build_mlp()
    fully_shard(model.in_proj, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    return Expect(
        RuntimeError,
        lambda: _forward_backward(model),
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

    local_size = state["weight"].to_local().size()
    msg = f"Shard(1) requires even sharding: local_tensor.size()={local_size}"
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
    model = fully_shard(build_mlp(), mesh=mesh2d(world_size))
    stream = torch.Stream("cpu")
    thunk = lambda: model.set_all_reduce_hook(lambda t: None, stream=stream)  # noqa: E731
    return Expect(ValueError, thunk, "stream cannot be set when using native HSDP", exact=True)


@row()
def _all_reduce_hook_stream_without_hook(rank, world_size):
    model = fully_shard(build_mlp(), mesh=cpu_mesh())

    def thunk():
        model.set_all_reduce_hook(lambda t: None, stream=torch.Stream("cpu"))
        model.set_all_reduce_hook(None)  # keeps the stream, as upstream
        _forward_backward(model)

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
    targets = [model.in_proj, model.mid_proj]
    thunk = lambda: model.set_modules_to_forward_prefetch(targets)  # noqa: E731
    msg = f"Expects FSDPModule but got {type(model.mid_proj)}: {model.mid_proj}"
    return Expect(ValueError, thunk, msg)


@row()
def _reset_iter_state_on_non_root(rank, world_size):
    model = build_mlp()
    fully_shard(model.in_proj, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    _forward_backward(model)
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
