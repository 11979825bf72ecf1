"""All-gather and reduce-scatter through staging buffers: extensions and custom comms.

[Note: Staged all-gather]
The default all-gather needs no copy-in: the group's flat sharded buffer is
the input (see [Note: Copies around the collectives] in collectives.py). Two
features break that: all-gather extensions (the pre hook makes new tensors,
possibly of other dtypes) and a custom all-gather comm (its ``allocate`` owns
the output's memory, and the input must be this rank's block of it, as
upstream lays it out). Then the group's inputs are concatenated with one
``torch.cat`` into rank ``r``'s block of the allocated output, viewed as bytes
when their dtypes differ; copy-out is one ``split_with_sizes_copy`` into every
parameter's buffers, as in the default path.

Custom comms follow upstream's interface: ``allocate(size, *, dtype, device)``
returns a tensor, ``__call__(output_tensor=, input_tensor=, group=,
async_op=)`` all-gathers, ``__call__(output_tensor=, input_tensor=, group=,
op=)`` reduce-scatters. A shard group of one rank runs no collective.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ..._torch_compat import local_tensor
from ..storage.param import FSDPParam
from . import collectives


class AllGather(Protocol):
    """What ``FSDPModule.set_custom_all_gather`` accepts."""

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The all-gather output buffer (this rank's input is its block ``rank``)."""
        ...

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        """Gather every rank's ``input_tensor`` into ``output_tensor``."""
        ...


class ReduceScatter(Protocol):
    """What ``FSDPModule.set_custom_reduce_scatter`` accepts."""

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A reduce-scatter input or output buffer."""
        ...

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: Any,  # a dist.ReduceOp, or NCCL's pre-multiplied sum
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``input_tensor`` over ``group`` and keep this rank's block in ``output_tensor``."""
        ...


def check_comm(comm: Any, what: str) -> None:
    """Fail early if ``comm`` lacks ``allocate`` or is not callable."""
    if not callable(getattr(comm, "allocate", None)) or not callable(comm):
        raise ValueError(
            f"{what} expects an object with allocate(size, *, dtype, device) and "
            f"__call__(output_tensor, input_tensor, group, ...), got {type(comm).__name__}"
        )


class StagedAllGather:
    """One in-flight staged all-gather: the output and how to split it per parameter."""

    def __init__(
        self,
        output: torch.Tensor,
        inputs: list[list[torch.Tensor]],
        work: dist.Work | None,
    ) -> None:
        self.output = output
        self.inputs = inputs
        self.work = work


def gather_inputs(
    fsdp_params: list[FSDPParam],
    slots: list[Tensor],
    device: torch.device,
    pin_memory: bool,
    offload: bool,
) -> list[list[Tensor]]:
    """Each parameter's all-gather inputs: its slot in the unsharded dtype on ``device``, as
    upstream, or what its pre hook makes of its shard (on the device under CPU offload)."""
    inputs = []
    for p, slot in zip(fsdp_params, slots):
        if p.extension is None:
            inputs.append([slot.to(device, p.param_dtype or slot.dtype, non_blocking=pin_memory)])
        else:
            padded = torch.Size([p.shard_rows, *p.orig_size[1:]])
            inputs.append(hook_inputs(p, device, offload, padded))
    return inputs


def hook_inputs(
    p: FSDPParam, device: torch.device, offload: bool, padded_size: torch.Size | None
) -> Any:
    """What a parameter's ``fsdp_pre_all_gather`` makes of its shard; under CPU offload the
    shard is first moved to ``device``, as upstream hands it to the hook."""
    local = local_tensor(p.sharded_param)
    if offload:
        local = local.to(device, non_blocking=True)
    return p.extension.pre_all_gather(local, p.orig_size, p.orig_stride, padded_size, p.fqn)


def all_gather(
    fsdp_params: list[FSDPParam],
    inputs: list[list[torch.Tensor]],
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    comm: AllGather | None,
    async_op: bool,
    skip_collective: bool = False,
) -> StagedAllGather:
    """Copy ``inputs`` (per parameter, 1-D) into this rank's block and all-gather.

    ``skip_collective``: a shard group of one rank whose block is already the
    whole output (see [Note: Forcing collectives on one rank]).
    """
    flat = [t for ts in inputs for t in ts]
    as_bytes = len({t.dtype for t in flat}) > 1
    if as_bytes:
        flat = [t.view(torch.uint8) for t in flat]
    total = sum(t.numel() for t in flat)
    dtype, device = flat[0].dtype, flat[0].device
    size = (total * world_size,)
    if comm is not None:
        output = comm.allocate(size, dtype=dtype, device=device)
    else:
        output = torch.empty(size, dtype=dtype, device=device)
    block = output.narrow(0, rank * total, total)
    torch.cat(flat, out=block)
    work = None
    if not skip_collective:
        if comm is not None:
            work = comm(output_tensor=output, input_tensor=block, group=group, async_op=async_op)
        else:
            work = collectives.all_gather(output, block, group, async_op)
    return StagedAllGather(output, inputs, work)


def copy_out(staged: StagedAllGather, fsdp_params: list[FSDPParam], world_size: int) -> None:
    """Split the gathered blocks into every parameter's (or extension's) output buffers."""
    outs: list[torch.Tensor] = []
    for p, ins in zip(fsdp_params, staged.inputs):
        if p.extension is not None:
            outs.extend(p.extension.alloc_outputs(ins, world_size))
        else:
            outs.append(p.alloc_unsharded())
    split_blocks(staged.output, outs, world_size)


def split_blocks(output: torch.Tensor, outs: list[torch.Tensor], world_size: int) -> None:
    """Each rank's block of ``output`` cut into ``outs`` in order (each ``W`` times its piece)."""
    if output.dtype == torch.uint8:
        outs = [o.view(torch.uint8) for o in outs]
    torch.split_with_sizes_copy(
        output.view(world_size, -1),
        [o.numel() // world_size for o in outs],
        dim=1,
        out=[o.view(world_size, -1) for o in outs],
    )
