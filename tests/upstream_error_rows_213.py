"""Rows for torch 2.13 APIs fsdp2 may not have yet (issue 14, point 8).

``dp_mesh_dims`` / ``DataParallelMeshDims``, ``share_comm_ctx`` and the 2.13
communication setters: each row names the API it needs and is skipped for an
implementation without it, so it runs for upstream now and for fsdp2 once the
API lands.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from _impl import fully_shard
from models import build_mlp, cpu_mesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from upstream_error_rows import API, Expect, mesh2d, row


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
    msg = "At least one of shard or replicate must be set in dp_mesh_dims"
    return Expect(ValueError, thunk, msg)


@row(needs="dp_mesh_dims")
def _mesh_dims_on_unnamed_mesh(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    dims = _dims(shard="dp")
    thunk = lambda: fully_shard(build_mlp(), mesh=mesh, dp_mesh_dims=dims)  # noqa: E731
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
    mesh = mesh2d(world_size, ("r", "dp"))
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
