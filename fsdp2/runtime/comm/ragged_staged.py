"""The parameter-major layout's staged all-gather: plain rows and hook inputs at once.

[Note: Extensions on the parameter-major layout]
A ``RaggedShard`` group gathers its flat buffer as it is: the output is the
group's ``W * S`` buffer, and every unsharded parameter views it at its
plan's start (see [Note: The parameter-major layout] in ragged.py). A
parameter with all-gather hooks (e.g. ``fsdp2.quant.gather_fp8_tiles``)
sends what its pre hook returns instead of its rows, so each rank's block of
the one collective holds

- the rows of the parameters without hooks, back to back in registration
  order, then zeros up to the largest rank's total (every rank knows every
  rank's rows from the plan, so no sizes are exchanged);
- each hooked parameter's inputs, which must have the same size on every
  rank (ranks hold different rows here: a hook pads to the largest rank's
  rows, read from its placement's ``row_bounds``).

After the collective the plain rows are copied to their places in the
``W * S`` buffer, and each post hook fills its parameter's view of that
buffer (``out=``; the unsharded parameter is part of the group's buffer from
the first gather on, so the post hook is always called with ``out``). A
hooked parameter's own rows are not sent at all.

A custom all-gather comm (``set_custom_all_gather``) takes the same path,
hooks or not: its ``allocate`` owns the staging output (this rank's block is
the input, as upstream lays it out), and the rows are copied from there into
the group's buffer, as upstream copies them out into its parameters.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from ...errors import FSDPAssertionError
from ..storage.param import FSDPParam
from ..storage.ragged_rows import RaggedRows
from . import staged_collectives
from .staged_collectives import AllGather, StagedAllGather


def _rows(layout: RaggedRows, rank: int) -> int:
    return layout.row_bounds[rank + 1] - layout.row_bounds[rank]


@functools.lru_cache(maxsize=256)
def _plain_copies(layouts: tuple[RaggedRows, ...], world_size: int) -> tuple[list[int], list[tuple]]:
    """Per rank, the plain rows it sends; and each ``(rank, at in its block, start, numel)`` copy.

    Made once per group layout: the gathers of later steps reuse it.
    """
    numels, copies = [], []
    for r in range(world_size):
        at = 0
        for lay in layouts:
            n = _rows(lay, r) * lay.row_numel
            if n:
                copies.append((r, at, lay.start + lay.row_bounds[r] * lay.row_numel, n))
                at += n
        numels.append(at)
    return numels, copies


def _plain_layouts(fsdp_params: list[FSDPParam]) -> tuple[RaggedRows, ...]:
    return tuple(p.layout for p in fsdp_params if p.extension is None)


def gather_inputs(
    fsdp_params: list[FSDPParam],
    slots: list[torch.Tensor],
    device: torch.device,
    pin_memory: bool,
    offload: bool,
) -> tuple[list[torch.Tensor | None], dict[int, Any]]:
    """The rows of the parameters without hooks (on ``device``; ``None`` for a hooked one,
    which sends its inputs instead) and each hooked parameter's pre-hook inputs by index."""
    rows: list[torch.Tensor | None] = []
    hooked = {}
    for i, (p, slot) in enumerate(zip(fsdp_params, slots)):
        if p.extension is None:
            rows.append(slot.to(device, non_blocking=pin_memory))
        else:
            rows.append(None)
            hooked[i] = staged_collectives.hook_inputs(p, device, offload, None)
    return rows, hooked


def agree_on_inputs(
    fsdp_params: list[FSDPParam], group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Before a subclass parameter's first collective on this layout: every rank's pre-hook
    inputs qualify, or every rank raises (see [Note: Subclasses on the parameter-major
    layout] in extensions.py). ``group``: ``None`` for a shard group of one rank;
    ``device``: the group's (NCCL takes no host tensor)."""
    pending = [p.extension for p in fsdp_params
               if p.extension is not None and p.extension.rows is not None
               and (not p.extension.agreed or group is None)]
    if not pending:
        return
    local = next((e.problem for e in pending if e.problem is not None), None)
    flag = torch.tensor([int(local is not None)], device=device)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        raise FSDPAssertionError(local or "Another rank's all-gather inputs of a tensor "
                                 "subclass on the parameter-major layout do not qualify; see "
                                 "its error")
    for e in pending:
        e.agreed = True


def all_gather(
    fsdp_params: list[FSDPParam],
    slots: list[torch.Tensor | None],
    hook_inputs: dict[int, list[torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    comm: AllGather | None,
    async_op: bool,
    skip_collective: bool,
) -> StagedAllGather:
    """Gather the plain rows (``slots``, cast to ``dtype``) and the hooks' inputs in one collective.

    ``slots``: the parameters' rows on the device, ``None`` for a hooked one;
    ``hook_inputs``: the pre hooks' flat inputs by parameter index; ``comm``: a
    custom all-gather (``set_custom_all_gather``), which allocates the output.
    """
    plain = [slot.to(dtype) for slot in slots if slot is not None]
    numels, _ = _plain_copies(_plain_layouts(fsdp_params), world_size)
    padding = max(numels) - numels[rank]
    pieces = [*plain, torch.zeros(padding, dtype=dtype, device=device)]
    inputs = [pieces] + [hook_inputs[i] for i in sorted(hook_inputs)]
    return staged_collectives.all_gather(
        fsdp_params, inputs, group, rank, world_size, comm, async_op, skip_collective
    )


def copy_out(
    staged: StagedAllGather, fsdp_params: list[FSDPParam], output: torch.Tensor, world_size: int
) -> None:
    """Plain rows into ``output`` (the buffer the unsharded parameters view: see ``unsharded_output``
    in storage/ragged.py); hook outputs into their buffers."""
    numels, copies = _plain_copies(_plain_layouts(fsdp_params), world_size)
    most = max(numels)
    plain = output.new_empty(world_size * most)
    outs = [plain]
    hooked = [p for p in fsdp_params if p.extension is not None]
    for p, ins in zip(hooked, staged.inputs[1:]):
        outs.extend(p.extension.alloc_outputs(ins, world_size))
    staged_collectives.split_blocks(staged.output, outs, world_size)
    blocks = plain.view(world_size, most)
    for r, at, start, n in copies:
        output[start : start + n].copy_(blocks[r, at : at + n])
