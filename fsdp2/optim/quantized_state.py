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
``meta`` tensor of its size), and each rank quantizes its rows with the
optimizer's own ``_subclass_zeros``. A rank holding no rows of a quantized
parameter keeps an empty fp32 tensor (a quantized tensor needs at least one
block). Everything else (the step itself, compiled by torchao, on the
DTensors) is torchao's: the elementwise math and the block-wise
quantization of one block do not depend on where the rank's shard starts, so
codes, scales and parameters equal torchao's single-process step's at any
``W`` (``tests/test_quantized_state.py``).

Parameters on any other placement (dim-0, a ragged placement that cuts
blocks, replicated, not sharded) get the optimizer's own ``_new_buffer``; an
optimizer holding no fsdp2-sharded parameter (over upstream's
``fully_shard``, or a plain model) is left as torchao made it
(``default_step.py`` attaches only where fsdp2 shards).

[Note: Loading quantized state at another world size]
DCP reshards a checkpoint by copying each saved chunk's rows into the rows
each rank now holds, and torchao's state tensors take any copy: quantized
into fp32 dequantizes, fp32 into quantized quantizes, quantized into
quantized copies codes and scales where the blocks line up (and raises
torchao's ``ValueError`` where a copy would cut a block). Where dim-0 shards
put the blocks elsewhere at the new world size, or make another
quantize-or-fp32 choice, the load would change the state silently: training
goes on from other moments than the saved run had. So ``state_dict()``
records, per parameter, the *units* its state is kept in (runs of elements
in fp32, or in blocks counted from a given element: ``state_units``) in
each param group, under ``"fsdp2_state_units"`` (the live groups hold it
too, so that flattened optimizer state dicts carry it), and
``load_state_dict`` compares the saved units with this layout's before
torch's load runs: the same units (any world size on block-aligned shards,
and any dim-0 world sizes whose shards happen to keep the blocks) load;
others raise ``ValueError`` naming the parameter, and the optimizer must not
step before a checkpoint that fits is loaded (DCP has already written into
its state in place). A checkpoint without the entry (saved without fsdp2,
or before it recorded one) is not checked: DCP's default planner refuses
it as a missing key until the entry is dropped from the state dict it
loads into, which is then the user's explicit choice.

Reads torchao's private ``_AdamBase._new_buffer(p, signed)``,
``_subclass_zeros(p, signed, block_size)`` and ``block_size`` (torchao 0.18,
checked on torch 2.13 and 2.15).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from .._torch_compat import cache_keys_see_local_tensors
from ..ragged_placement import RaggedShardBase

__all__ = ["block_aligned", "is_block_quantized", "state_units", "use_block_aligned_state"]

_ATTR = "_fsdp2_quantized_state"  # on the optimizer: set once its _new_buffer is ours
_DECIDED = "_fsdp2_quantizes"  # on the optimizer: numel -> quantized, torchao's choice
UNITS_KEY = "fsdp2_state_units"  # in each saved param group: one entry per parameter

# (start, end, quantized): elements [start, end) of the flattened parameter kept in fp32,
# or quantized in blocks counted from ``start``
Units = tuple[tuple[int, int, bool], ...]


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


def quantizes(optimizer: torch.optim.Optimizer, numel: int) -> bool:
    """The optimizer's own quantize-or-fp32 choice for a tensor of ``numel`` elements.

    Asked of its class's ``_new_buffer`` on a ``meta`` tensor (torchao decides by
    the element count), once per size.
    """
    decided = optimizer.__dict__.setdefault(_DECIDED, {})
    if numel not in decided:
        probe = type(optimizer)._new_buffer(optimizer, torch.empty(numel, device="meta"), True)
        decided[numel] = type(probe) is not torch.Tensor
    return decided[numel]


def _row_bounds(param: DTensor) -> tuple[int, ...] | None:
    """Rows each rank's state covers, where only dim 0 is sharded (``None``: another layout)."""
    sharded = [(i, p) for i, p in enumerate(param.placements) if not p.is_replicate()]
    if not sharded:
        return (0, param.shape[0]) if param.dim() else None
    if len(sharded) != 1 or not isinstance(sharded[0][1], Shard) or sharded[0][1].dim != 0:
        return None
    mesh_dim, placement = sharded[0]
    if isinstance(placement, RaggedShardBase):
        return placement.row_bounds or None
    rows, ranks = param.shape[0], param.device_mesh.size(mesh_dim)
    per = -(-rows // ranks)  # torch.chunk's rows per rank
    return tuple(min(r * per, rows) for r in range(ranks)) + (rows,)


def state_units(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Units | None:
    """The runs of ``param``'s elements its state keeps in fp32 or in blocks (``None``: unknown).

    Two layouts of one parameter whose units are equal hold the same state
    values in the same blocks: a checkpoint moves between them exactly.
    """
    block_size = optimizer.block_size
    if not isinstance(param, DTensor) or block_aligned(param, block_size):
        chunks = [(0, param.numel(), quantizes(optimizer, param.numel()))]
    else:
        bounds = _row_bounds(param)
        if bounds is None:
            return None
        row = math.prod(param.shape[1:])
        chunks = [(a * row, b * row, quantizes(optimizer, (b - a) * row))
                  for a, b in zip(bounds, bounds[1:])]
    units: list[tuple[int, int, bool]] = []
    for start, end, quantized in chunks:
        if start == end:
            continue
        if units and units[-1][2] == quantized and (
            not quantized or (start - units[-1][0]) % block_size == 0
        ):
            units[-1] = (units[-1][0], end, quantized)  # the same blocks go on
        else:
            units.append((start, end, quantized))
    return tuple(units)


def _refresh_units(optimizer: torch.optim.Optimizer, *args: Any) -> None:
    """Each live param group holds its parameters' units too.

    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with
    ``flatten_optimizer_state_dict=True`` (torchtitan's) carry only the keys a
    live group has, so the entry must be one of them.
    """
    for group in optimizer.param_groups:
        group[UNITS_KEY] = tuple(state_units(optimizer, p) for p in group["params"])


def _save_units(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict()`` post-hook: each saved param group records its parameters' units."""
    _refresh_units(optimizer)
    groups = [{**saved, UNITS_KEY: group[UNITS_KEY]}
              for group, saved in zip(optimizer.param_groups, state_dict["param_groups"])]
    return {**state_dict, "param_groups": groups}


def _check_units(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``load_state_dict`` pre-hook: refuse state whose blocks do not fit this layout."""
    groups = []
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, state_dict["param_groups"])):
        saved = dict(saved)
        units = saved.pop(UNITS_KEY, None)
        groups.append(saved)
        if units is None:
            continue  # saved without fsdp2: nothing to compare
        for i, (param, was) in enumerate(zip(group["params"], units)):
            now = state_units(optimizer, param)
            if was is None or now is None or tuple(map(tuple, was)) == now:
                continue
            raise ValueError(
                f"{type(optimizer).__name__}: the saved state of parameter {i} of param group "
                f"{g} (shape {tuple(param.shape)}) is kept in other units than this layout "
                f"keeps it in (saved: {_describe(was)}; here: {_describe(now)}, blocks of "
                f"{optimizer.block_size}): loading it would requantize or dequantize it "
                "silently. Load it on the layout and world size it was saved with, or train "
                f"on fsdp2.RaggedShard({optimizer.block_size}) shards (each block on one rank: "
                "the same state at any world size). DCP has already written into this "
                "optimizer's state: load a fitting checkpoint before stepping it."
            )
    return {**state_dict, "param_groups": groups}


def _describe(units: Any) -> str:
    return ", ".join(f"[{a}, {b}) {'quantized' if q else 'fp32'}" for a, b, q in units) or "empty"


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
        if local.numel() and quantizes(optimizer, p.numel()):
            out = optimizer._subclass_zeros(local, signed, block_size)
        else:
            out = torch.zeros_like(local)
        state = DTensor.from_local(
            out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
        return state.to(p.device)  # from_local moves to the mesh's device type (CPU offload)

    optimizer._new_buffer = new_buffer
    _refresh_units(optimizer)
    optimizer.register_state_dict_post_hook(_save_units)
    optimizer.register_load_state_dict_pre_hook(_check_units)
    optimizer.register_load_state_dict_post_hook(_refresh_units)  # the load set saved groups
    optimizer.__dict__[_ATTR] = True
