"""Batched collectives of one parameter group, and the copy-in of the all-gather.

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
The copy-out and the reduce-scatter input are the group's ``BufferOrder``'s
(``RankMajor`` in rank_major.py; the parameter-major order, ``ParamMajor`` in
ragged.py, has neither copy: see [Note: Buffer orders] in buffer_order.py).

Collectives are looked up on ``torch.distributed`` at call time so that
users' patches, counters and profilers see every one of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
