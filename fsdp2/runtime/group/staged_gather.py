"""One group's staged all-gather: started from its slots, finished into its parameters.

The group's buffer order picks the path: upstream's rank-major blocks (see
[Note: Staged all-gather] in staged_collectives.py) or the parameter-major
rows with the hooks' inputs beside them (see [Note: Extensions on the
parameter-major layout] in ragged_staged.py). Either way every parameter ends
unsharded: its extension's outputs set, or its view of the gathered buffer.
"""

from __future__ import annotations

import torch

from ...errors import FSDPNotImplementedError
from ..comm import ragged_staged, staged_collectives
from ..comm.staged_collectives import AllGather, StagedAllGather
from ..meshes.mesh import FSDPMeshInfo
from ..storage.buffer_order import BufferOrder
from ..storage.param import FSDPParam


def check_one_dtype(order: BufferOrder, casts_per_param: bool, module_fqn: str) -> None:
    """The parameter-major staged path gathers one dtype: refuse per-parameter casts there."""
    if order.ragged and casts_per_param:
        raise FSDPNotImplementedError(
            f"fully_shard({module_fqn or 'the root'}): RaggedShard groups gather "
            "one dtype (no mixed dtypes or per-parameter casts yet); return None from "
            "shard_placement_fn for this module"
        )


def start(
    fsdp_params: list[FSDPParam],
    slots: list[torch.Tensor],
    order: BufferOrder,
    dtype: torch.dtype,
    device: torch.device,
    mesh_info: FSDPMeshInfo,
    comm: AllGather | None,
    *,
    pin_memory: bool,
    offload: bool,
    async_op: bool,
    alone: bool,
) -> StagedAllGather:
    """Copy the group's inputs (``slots``, or what the pre hooks make of them) into this rank's
    block and issue the all-gather; ``dtype`` is the parameter-major rows' gathered dtype,
    ``alone`` a shard group of one rank (no collective)."""
    group, rank, world_size = (
        mesh_info.shard_process_group, mesh_info.shard_mesh_rank, mesh_info.shard_mesh_size
    )
    if not order.ragged:
        inputs = staged_collectives.gather_inputs(fsdp_params, slots, device, pin_memory, offload)
        return staged_collectives.all_gather(
            fsdp_params, inputs, group, rank, world_size, comm, async_op, skip_collective=alone
        )
    rows, hook_inputs = ragged_staged.gather_inputs(fsdp_params, slots, device, pin_memory, offload)
    ragged_staged.agree_on_inputs(fsdp_params, None if alone else group, device)
    return ragged_staged.all_gather(
        fsdp_params, rows, hook_inputs, dtype, device, group, rank, world_size, comm, async_op,
        skip_collective=alone,
    )


def wait(staged: StagedAllGather) -> None:
    """Wait for the collective (none on a shard group of one rank)."""
    if staged.work is not None:
        staged.work.wait()


def finish(
    staged: StagedAllGather,
    fsdp_params: list[FSDPParam],
    order: BufferOrder,
    dtype: torch.dtype,
    device: torch.device,
    world_size: int,
) -> None:
    """Copy the gathered blocks out and register every parameter unsharded."""
    if order.ragged:  # the parameters view the group's buffer (hooked ones too)
        output = order.unsharded_output(dtype, device)
        ragged_staged.copy_out(staged, fsdp_params, output, world_size)
    else:
        staged_collectives.copy_out(staged, fsdp_params, world_size)
    for p in fsdp_params:
        if p.extension is not None:
            p.unshard_extension()
        else:
            p.finish_copy_out()
        p.to_unsharded()
