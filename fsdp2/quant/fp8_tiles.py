"""Block-scaled fp8 all-gather: each rank quantizes its own whole 128 x 128 tiles.

[Note: Block-scaled fp8 all-gather]
DeepSeek-V3's recipe keeps one scale per 128 x 128 tile of a weight: the tile
``T`` is sent as ``e4m3`` codes ``round(T / s)`` with ``s = amax(|T|) / 448``,
and read back as ``codes * s``. ``gather_fp8_tiles`` binds all-gather hooks
(see [Note: All-gather extensions] in runtime/storage/extensions.py) onto a
sharded model's 2-D weights: before each all-gather a rank quantizes the
tiles of its own rows (its padded dim-0 shard) and the group gathers the
codes (one byte per element) and the scales (one fp32 per tile) in its one
collective; after it, each rank dequantizes the gathered tiles into the
weight the module computes with, in the group's ``param_dtype``.

A tile's scale depends on its elements only, so where no tile straddles two
ranks (the rows per rank, ``ceil(rows / W)``, a multiple of the tile; any
world size for one rank) the gathered weight is, bit for bit,
``dequantize_tiles(*quantize_tiles(full_weight))``: quantizing after the
gather gives the same at every world size, for half the bytes of a bf16
all-gather plus ``4 / tile**2`` per element for the scales. The padding rows
of a short last shard are zeros, which change no tile's maximum. Gradients
are reduced in full precision, as fp8 all-gathers do (the dequantized weight
is the unsharded parameter; its gradient passes straight through).

On the parameter-major layout (``RaggedShard((tile, tile))``) every rank's
rows start at a tile boundary at any world size: each rank quantizes its own
rows, padded with zero rows to the largest rank's (every rank sends as
much), and the post hook cuts each rank's codes and scales out of its block
in rank order (see [Note: Extensions on the parameter-major layout] in
runtime/comm/ragged_staged.py): exact at every world size.

Codes travel as ``uint8`` (gloo has no float8; the bytes are the same).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .._torch_compat import local_tensor
from ..ragged_placement import RaggedShardBase

__all__ = ["FP8_MAX", "dequantize_tiles", "gather_fp8_tiles", "quantize_tiles"]

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def _padded(x: torch.Tensor, tile: int) -> torch.Tensor:
    rows, cols = x.shape
    pad_r, pad_c = -rows % tile, -cols % tile
    return torch.nn.functional.pad(x, (0, pad_c, 0, pad_r)) if pad_r or pad_c else x


def quantize_tiles(x: torch.Tensor, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of a 2-D ``x``: ``e4m3`` codes as ``uint8``, one fp32 scale per tile.

    ``codes`` has ``x``'s shape; ``scales`` is ``(ceil(rows / tile), ceil(cols / tile))``.
    Partial tiles at the edges are quantized as if padded with zeros.
    """
    rows, cols = x.shape
    padded = _padded(x.float(), tile)
    tiles = padded.unflatten(0, (-1, tile)).unflatten(2, (-1, tile))  # (R/t, t, C/t, t)
    amax = tiles.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (tiles / scales[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    codes = codes.flatten(2).flatten(0, 1)[:rows, :cols]
    return codes.view(torch.uint8).contiguous(), scales


def dequantize_tiles(
    codes: torch.Tensor, scales: torch.Tensor, tile: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``codes * scale`` per tile, in ``dtype`` (``codes`` as ``quantize_tiles`` returns them)."""
    rows, cols = codes.shape
    values = _padded(codes.view(FP8).float(), tile)
    tiles = values.unflatten(0, (-1, tile)).unflatten(2, (-1, tile))
    out = (tiles * scales[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :cols]
    return out.to(dtype).contiguous()


def _pre_all_gather(tile: int, shard_rows: int) -> Callable[..., Any]:
    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None,
                            mp_policy=None):
        padded = self.new_zeros((shard_rows, self.shape[1]))  # zero rows change no tile's amax
        padded[: self.shape[0]].copy_(self.detach())
        return quantize_tiles(padded, tile), None

    return fsdp_pre_all_gather


def _post_all_gather(tile: int) -> Callable[..., Any]:
    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        codes, scales = all_gather_outputs
        weight = dequantize_tiles(codes, scales, tile, param_dtype)
        if out is not None:  # .data: no version bump on a leaf that requires grad
            out.data.copy_(weight[: out.shape[0]])
            return None
        return weight, (weight,)

    return fsdp_post_all_gather


def _pre_all_gather_rows(tile: int, most_rows: int) -> Callable[..., Any]:
    # The parameter-major layout: this rank's rows (whole tiles from a tile boundary), padded
    # with zero rows to the largest rank's, so that every rank sends as much.
    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None,
                            mp_policy=None):
        padded = self.new_zeros((most_rows, self.shape[1]))
        padded[: self.shape[0]].copy_(self.detach())
        return quantize_tiles(padded, tile), None

    return fsdp_pre_all_gather


def _post_all_gather_rows(tile: int, row_bounds: tuple[int, ...]) -> Callable[..., Any]:
    # Each rank's block holds its rows' codes and scales first: cut them out, in rank order.
    most = max(b - a for a, b in zip(row_bounds, row_bounds[1:]))
    most_tiles = -(-most // tile)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        codes, scales = all_gather_outputs
        parts, part_scales = [], []
        for r, (a, b) in enumerate(zip(row_bounds, row_bounds[1:])):
            if b > a:
                parts.append(codes[r * most : r * most + b - a])
                part_scales.append(scales[r * most_tiles : r * most_tiles + -(-(b - a) // tile)])
        weight = dequantize_tiles(torch.cat(parts), torch.cat(part_scales), tile, param_dtype)
        if out is not None:  # .data: no version bump on a leaf that requires grad
            out.data.copy_(weight)
            return None
        return weight, (weight,)

    return fsdp_post_all_gather


def gather_fp8_tiles(
    module: nn.Module,
    tile: int = 128,
    filter_fn: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[str]:
    """Gather ``module``'s sharded 2-D weights as block-scaled fp8 (see [Note: Block-scaled fp8
    all-gather]). Returns the names of the parameters it set up.

    Call after ``fully_shard`` (and after ``to_empty()``, which makes new local
    tensors), before the first forward; on every rank. ``filter_fn(name, param)``
    picks the weights (default: every 2-D parameter). A weight whose rows per
    rank are not whole tiles raises ``ValueError`` naming it. On the
    parameter-major layout (``RaggedShard((tile, tile))``, or any granularity
    whose cuts fall on tile boundaries) every rank's rows start at a tile
    boundary at every world size, so no weight is refused there; each rank
    sends its own rows' tiles (padded with zero rows to the largest rank's).
    """
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"gather_fp8_tiles(tile={tile!r}): expected a positive int")
    chosen = []
    for name, param in module.named_parameters():
        if filter_fn is not None and not filter_fn(name, param):
            continue
        if filter_fn is None and param.dim() != 2:
            continue
        if not isinstance(param, DTensor):
            raise ValueError(
                f"gather_fp8_tiles: parameter '{name}' is not sharded (a {type(param).__name__}); "
                "call it after fully_shard"
            )
        placement = param.placements[-1]
        model_parallel = [pl for pl in param.placements[:-1] if not pl.is_replicate()]
        if model_parallel:  # tiles of a tensor-parallel shard: not built
            raise ValueError(
                f"gather_fp8_tiles: parameter '{name}' is tensor-parallel ({tuple(param.placements)});"
                " fp8 tiles gather weights sharded by FSDP alone: filter it out with filter_fn"
            )
        if isinstance(placement, RaggedShardBase) and param.dim() == 2:
            chosen.append(_bind_rows(name, param, placement.row_bounds, tile))
            continue
        if param.dim() != 2 or not isinstance(placement, Shard) or placement.dim != 0:
            raise ValueError(
                f"gather_fp8_tiles: parameter '{name}' is {param.dim()}-D with placements "
                f"{tuple(param.placements)}; tiles need a 2-D weight sharded on dim 0"
            )
        rows, world = param.shape[0], param.device_mesh.size(param.device_mesh.ndim - 1)
        shard_rows = -(-rows // world)
        cuts = [r * shard_rows for r in range(1, world) if r * shard_rows < rows]
        if any(c % tile for c in cuts):
            raise ValueError(
                f"gather_fp8_tiles: parameter '{name}' has {rows} rows, {shard_rows} per rank "
                f"at W={world}: a {tile} x {tile} tile would straddle two ranks, and the "
                f"gathered weight would depend on W. Use a world size for which "
                f"ceil({rows} / W) is a multiple of {tile}, or leave '{name}' out (filter_fn)"
            )
        local = local_tensor(param)
        local.fsdp_pre_all_gather = MethodType(_pre_all_gather(tile, shard_rows), local)
        local.fsdp_post_all_gather = MethodType(_post_all_gather(tile), local)
        chosen.append(name)
    return chosen


def _bind_rows(name: str, param: DTensor, row_bounds: tuple[int, ...], tile: int) -> str:
    """The parameter-major layout's hooks on ``param`` (rows ``row_bounds`` per rank)."""
    rows = param.shape[0]
    cuts = sorted({b for b in row_bounds if 0 < b < rows})
    if any(c % tile for c in cuts):
        raise ValueError(
            f"gather_fp8_tiles: parameter '{name}' is held by the ranks in rows {row_bounds}: "
            f"a {tile} x {tile} tile would straddle two ranks, and the gathered weight would "
            f"depend on W. Shard it with RaggedShard(({tile}, {tile})) (whole tiles on every "
            f"rank at any world size), or leave '{name}' out (filter_fn)"
        )
    most = max(b - a for a, b in zip(row_bounds, row_bounds[1:]))
    local = local_tensor(param)
    local.fsdp_pre_all_gather = MethodType(_pre_all_gather_rows(tile, most), local)
    local.fsdp_post_all_gather = MethodType(_post_all_gather_rows(tile, row_bounds), local)
    return name
