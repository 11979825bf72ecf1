"""Batched collectives of one parameter group, with their copy-in and copy-out.

[Note: Copies around the collectives]
All-gather input: the group's flat sharded buffer *is* the input (sharded
parameters are views of it), so there is no copy-in. Only when the input must
differ from the sharded storage (mixed precision casts it to ``param_dtype``;
CPU offload moves it to the device) one copy writes the whole flat shard into
this rank's block of the all-gather output, which is then gathered in place.
All-gather output: ``W`` rank-major blocks, each the concatenation of every
parameter's padded shard. A group of one parameter gathers straight into that
parameter's padded full buffer (no copy-out); otherwise one
``split_with_sizes_copy`` scatters the blocks into each parameter's buffer
(as bytes for a group of several dtypes).
Reduce-scatter input: the same rank-major layout built from the unsharded
gradients by one ``chunk_cat`` kernel (which also converts them to the
reduce dtype), or the gradient itself when the group has one evenly
divisible parameter already in the reduce dtype. Parameters sharded on a dim
other than 0 are permuted into their blocks one copy each.
HSDP: the reduce-scatter output is then all-reduced over the replicate group.

Collectives are looked up on ``torch.distributed`` at call time so that
users' patches, counters and profilers see every one of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..._torch_compat import chunk_cat
from ..storage import ragged
from ..storage.param import FSDPParam


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool = False,
) -> dist.Work | None:
    """All-gather ``input`` from every rank into ``output`` (rank-major)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp.RedOpType,
) -> None:
    """Reduce ``input`` over ranks and keep this rank's block in ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=op, group=group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType) -> None:
    """Reduce ``tensor`` in place over ``group`` (HSDP's replicate dim)."""
    dist.all_reduce(tensor, op=op, group=group)


def copy_in(
    output: torch.Tensor, sharded_flat: torch.Tensor, rank: int, non_blocking: bool
) -> torch.Tensor:
    """Write the flat shard into this rank's block of ``output``; return that block.

    One copy for the whole group: a cast to the output's dtype and/or a
    host-to-device move. Across devices the data moves first in its own dtype
    (from pinned memory, asynchronously when ``non_blocking``) and is cast on
    the device, where casting is cheap.
    """
    numel = sharded_flat.numel()
    block = output.narrow(0, rank * numel, numel)
    source = sharded_flat
    if source.device != block.device and source.dtype != block.dtype:
        source = source.to(block.device, non_blocking=non_blocking)
    block.copy_(source, non_blocking=non_blocking)
    return block


def all_gather_output(
    fsdp_params: list[FSDPParam],
    shard_numel: int,
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Return where the all-gather writes: a single parameter's own full buffer, else a flat one.

    With several parameters their unsharded buffers are allocated only at
    copy-out, so a prefetched all-gather holds one group's worth of memory,
    not two, until its consumer waits for it.
    """
    if len(fsdp_params) == 1:
        return fsdp_params[0].alloc_unsharded()
    return torch.empty(world_size * shard_numel, dtype=dtype, device=device)


def copy_out(output: torch.Tensor, fsdp_params: list[FSDPParam], world_size: int) -> None:
    """Scatter the rank-major all-gather output into each parameter's buffer.

    A ``uint8`` output holds parameters of several dtypes as bytes, in
    ``fsdp_params`` order (see [Note: Mixed-dtype groups] in flat_shard.py).
    """
    if len(fsdp_params) == 1:
        return  # gathered straight into the parameter's buffer
    outs = [p.alloc_unsharded() for p in fsdp_params]
    if output.dtype == torch.uint8:
        outs = [o.view(torch.uint8) for o in outs]
    torch.split_with_sizes_copy(
        output.view(world_size, -1),
        [o.numel() // world_size for o in outs],
        dim=1,
        out=[o.view(world_size, -1) for o in outs],
    )


def reduce_scatter_input(
    grads: list[torch.Tensor],
    fsdp_params: list[FSDPParam],
    world_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The flat rank-major reduce-scatter input for ``grads`` (padded, chunked, in ``dtype``).

    ``out`` (flat, e.g. from a custom comm's ``allocate``) receives it instead
    of a new buffer. In the parameter-major layout the gradients go at their
    plan's starts instead (see [Note: The parameter-major layout] in ragged.py).
    """
    if fsdp_params[0].ragged:
        return ragged.reduce_scatter_input(
            grads, [p.layout for p in fsdp_params], world_size, dtype, out
        )
    if len(grads) == 1 and out is None:
        grad, param = grads[0], fsdp_params[0]
        even = param.padded_shard_numel * world_size == param.numel
        if param.shard_dim == 0 and grad.dtype == dtype and grad.is_contiguous() and even:
            return grad.view(-1)
    total = sum(p.padded_shard_numel for p in fsdp_params)
    if out is not None:
        flat = out.view(world_size, total)
    else:
        flat = torch.empty((world_size, total), dtype=dtype, device=grads[0].device)
    if all(p.shard_dim == 0 for p in fsdp_params):
        chunk_cat(grads, world_size, flat)
        return flat.view(-1)
    offset = 0
    for grad, p in zip(grads, fsdp_params):
        block = flat[:, offset : offset + p.padded_shard_numel]
        if p.shard_dim == 0:  # rare: dim-0 and other dims in one group
            tmp = torch.empty_like(block)
            chunk_cat([grad], world_size, tmp)
            block.copy_(tmp)
        else:
            block.view(p.layout.block_shape()).copy_(p.layout.rank_blocks(grad))
        offset += p.padded_shard_numel
    return flat.view(-1)


def split_sharded_grads(output: torch.Tensor, fsdp_params: list[FSDPParam]) -> list[torch.Tensor]:
    """Views of this rank's unpadded gradient rows in the reduce-scatter output."""
    if fsdp_params and fsdp_params[0].ragged:
        return ragged.sharded_views(output, [p.layout for p in fsdp_params])
    views = []
    offset = 0
    for p in fsdp_params:
        views.append(output[offset : offset + p.local_rows * p.row_numel].view(p.local_size))
        offset += p.padded_shard_numel
    return views


def padded_blocks(output: torch.Tensor, fsdp_params: list[FSDPParam]) -> list[torch.Tensor]:
    """Views of each parameter's whole block (rows and padding) in the reduce-scatter output."""
    if fsdp_params and fsdp_params[0].ragged:
        return ragged.shard_blocks(output, [p.layout for p in fsdp_params])
    views = []
    offset = 0
    for p in fsdp_params:
        views.append(output[offset : offset + p.padded_shard_numel])
        offset += p.padded_shard_numel
    return views
