"""Block-quantized optimizer state (torchao's low-bit AdamW) on sharded parameters.

[Note: Quantized state on block-aligned shards]
torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` (and their ``Adam``
twins) keep each state tensor as codes plus one scale per block of
``block_size`` elements of the *flattened* tensor. On a DTensor parameter
they build the state from ``p.to_local()``: each rank quantizes its own
shard in blocks counted from the shard's first element, and keeps fp32 where
the shard has fewer than 4096 elements or does not divide into blocks. With
``Shard(0)`` the shard boundaries move with the world size, so the blocks,
the quantize-or-fp32 choice, and with them the training, change with ``W``:
upstream's ``fully_shard`` behaves so, and fsdp2's dim-0 layout keeps
upstream's bits.

The parameter-major layout with a granularity of ``block_size`` elements
(``RaggedShard(256)``; any multiple of the block size, or any ragged
placement whose every rank boundary falls on a block boundary) cuts a
parameter only between blocks counted from its first element, so each local
block *is* a global block. fsdp2 then builds such a parameter's state
itself, in place of the optimizer's ``_new_buffer`` (an instance attribute
set at the optimizer's first ``step()``): the quantize-or-fp32 choice is the
optimizer's own, asked about the whole parameter (its ``_new_buffer`` on a
``meta`` tensor of the full shape), and each rank quantizes its rows with the
optimizer's own ``_subclass_zeros``. A rank holding no rows of a quantized
parameter keeps an empty fp32 tensor (a quantized tensor needs at least one
block). Everything else (the step itself, compiled by torchao, on the
DTensors) is torchao's: the elementwise math and the block-wise
quantization of one block do not depend on where the rank's shard starts, so
codes, scales and parameters equal torchao's single-process step's at any
``W`` (``tests/test_quantized_state.py``).

Parameters on any other placement (dim-0, a ragged placement that cuts
blocks, replicated, not sharded) get the optimizer's own ``_new_buffer``.

Reads torchao's private ``_AdamBase._new_buffer(p, signed)``,
``_subclass_zeros(p, signed, block_size)`` and ``block_size`` (torchao 0.18,
checked on torch 2.13 and 2.15).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import RaggedShardBase, cache_keys_see_local_tensors

__all__ = ["block_aligned", "is_block_quantized", "use_block_aligned_state"]

_ATTR = "_fsdp2_quantized_state"  # on the optimizer: set once its _new_buffer is ours


def is_block_quantized(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torchao's block-quantized Adam / AdamW optimizers."""
    cls = type(optimizer)
    return (
        cls.__module__.split(".")[0] == "torchao"
        and callable(getattr(cls, "_new_buffer", None))
        and callable(getattr(cls, "_subclass_zeros", None))
        and isinstance(getattr(optimizer, "block_size", None), int)
    )


def block_aligned(param: torch.Tensor, block_size: int) -> bool:
    """Whether every rank boundary of ``param``'s ragged placement falls between blocks.

    Blocks of ``block_size`` elements of the flattened parameter, counted from
    its first element: then each rank's blocks are the whole parameter's.
    """
    if not isinstance(param, DTensor):
        return False
    ragged = [p for p in param.placements if isinstance(p, RaggedShardBase)]
    if len(ragged) != 1 or ragged[0].dim != 0 or not ragged[0].row_bounds:
        return False
    row = math.prod(param.shape[1:])
    return all(b * row % block_size == 0 for b in ragged[0].row_bounds)


def quantizes_whole(optimizer: torch.optim.Optimizer, shape: torch.Size, signed: bool) -> bool:
    """The optimizer's own quantize-or-fp32 choice for a tensor of ``shape`` (asked on ``meta``)."""
    probe = type(optimizer)._new_buffer(optimizer, torch.empty(shape, device="meta"), signed)
    return type(probe) is not torch.Tensor


def use_block_aligned_state(optimizer: torch.optim.Optimizer) -> None:
    """Build ``optimizer``'s state of block-aligned parameters as its single-process step would.

    Idempotent; called at a torchao optimizer's first ``step()`` by fsdp2's
    global step pre-hook (see [Note: Quantized state on block-aligned shards]).
    """
    if optimizer.__dict__.get(_ATTR):
        return
    cache_keys_see_local_tensors()  # torchao compiles its step per parameter: see there
    original: Callable[[torch.Tensor, bool], Any] = optimizer._new_buffer
    block_size: int = optimizer.block_size

    def new_buffer(p: torch.Tensor, signed: bool) -> torch.Tensor:
        if not block_aligned(p, block_size):
            return original(p, signed)
        local = p.to_local()
        if local.numel() and quantizes_whole(optimizer, p.shape, signed):
            out = optimizer._subclass_zeros(local, signed, block_size)
        else:
            out = torch.zeros_like(local)
        state = DTensor.from_local(
            out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
        return state.to(p.device)  # from_local moves to the mesh's device type (CPU offload)

    optimizer._new_buffer = new_buffer
    optimizer.__dict__[_ATTR] = True
