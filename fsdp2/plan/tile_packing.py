"""Whole fp8 tiles at any world size: a group's tile bands packed onto ranks (planner only).

[Note: Packed tiles]
The parameter-major layout (``runtime/storage/block_plan.py``) keeps each
parameter contiguous in its group's buffer. A rank boundary inside a matrix
must then fall between 128-row bands, and a matrix that spans two or more
boundaries needs the per-rank share to be a multiple of its band; with
several such matrices, of their least common multiple. At W = 1024 a
DeepSeek-V3 dense layer (570k elements a rank, bands of 0.2-2.4M) needs a
share of 132M, and 128 x 128 tiles pad 72% of the model.

Packed, a matrix's bands are dealt to ranks instead: each rank holds a run
of whole bands of it and, where the next band does not fit, the rest of its
share is left for smaller bands (padding inside the gathered buffer, not in
the parameter). The bands go out largest first, one band size at a time,
each size from the first rank again with a cursor that only moves forward,
so a rank holds one run of rows of each matrix, in row order across ranks
(the ``row_bounds`` a placement names). A matrix's last, partial band
follows its full ones. Vectors are cut anywhere, stacks between their
matrices (as in the parameter-major layout). The share is the smallest
for which everything fits (searched from ``max(ceil(numel / W), largest
band)``; a few dozen passes over the group's band sizes).

DeepSeek-V3 at W = 1024 pads 1.2% so, every tile whole (``python -m
fsdp2.plan --layouts --hf-config deepseek-v3``). ``fully_shard`` does not
build this layout yet: a matrix split with gaps is not contiguous in the
gathered buffer, so its unsharded parameter needs a copy-out (as the dim-0
layout's do), and the placement must accept a rank's run of rows starting
anywhere in its shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PackedPlan", "pack_tiles"]


@dataclass(frozen=True)
class PackedPlan:
    """Each rank's runs of rows ``(parameter index, first row, stop row)``, and the share."""

    world_size: int
    shard_numel: int
    runs: tuple[tuple[tuple[int, int, int], ...], ...]
    numel: int

    @property
    def padding(self) -> int:
        """Elements of the ranks' shares that hold no parameter."""
        return self.world_size * self.shard_numel - self.numel


@dataclass(frozen=True)
class _Matrix:
    index: int
    rows: int
    row_numel: int  # elements per row (1 for a vector: its elements are its rows)
    band_rows: int  # rows a cut may not split (the tile's, or 1)

    @property
    def band(self) -> int:
        return min(self.band_rows, self.rows) * self.row_numel


def _matrices(shapes: Sequence[Sequence[int]], tile: int) -> list[_Matrix]:
    out = []
    for i, shape in enumerate(shapes):
        if len(shape) == 2:
            out.append(_Matrix(i, shape[0], shape[1], tile))
        elif len(shape) > 2:  # a stack: cut between its matrices, which hold whole tiles
            out.append(_Matrix(i, shape[0], math.prod(shape[1:]), 1))
        else:  # a vector (or a scalar): cut anywhere
            out.append(_Matrix(i, math.prod(shape), 1, 1))
    return out


def _deal(matrices: list[_Matrix], world_size: int, share: int, record: bool) -> list | None:
    """Each rank's runs, largest bands first (``[]`` per rank unless ``record``); ``None`` if
    something does not fit in ``world_size`` shares of ``share``."""
    room = [share] * world_size
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
    by_band: dict[int, list[_Matrix]] = {}
    for m in matrices:
        if m.rows * m.row_numel:  # (an empty parameter holds nothing anywhere)
            by_band.setdefault(m.band, []).append(m)
    for band in sorted(by_band, reverse=True):
        if band > share:
            return None
        r = 0
        for m in by_band[band]:
            row = 0
            while row < m.rows:
                rows_left = m.rows - row
                while r < world_size and room[r] < min(m.band_rows, rows_left) * m.row_numel:
                    r += 1
                if r == world_size:
                    return None
                fit = room[r] // m.row_numel
                take = rows_left if fit >= rows_left else fit - fit % m.band_rows
                room[r] -= take * m.row_numel
                if record:
                    runs[r].append((m.index, row, row + take))
                row += take
    return runs


def pack_tiles(shapes: Sequence[Sequence[int]], world_size: int, tile: int = 128) -> PackedPlan:
    """The packed plan of a group (see [Note: Packed tiles]): bands of ``tile`` rows whole."""
    if world_size < 1 or tile < 1:
        raise ValueError(f"pack_tiles: world_size and tile must be >= 1, got {world_size}, {tile}")
    matrices = _matrices(shapes, tile)
    numel = sum(m.rows * m.row_numel for m in matrices)
    low = max([-(-numel // world_size), 1] + [m.band for m in matrices if m.rows])
    if _deal(matrices, world_size, low, False) is None:
        high = low
        while _deal(matrices, world_size, high, False) is None:
            high *= 2
        while high - low > max(1, low // 4096):  # within 0.025% of the smallest share
            mid = (low + high) // 2
            if _deal(matrices, world_size, mid, False) is None:
                low = mid
            else:
                high = mid
        low = high
    runs = _deal(matrices, world_size, low, True)
    return PackedPlan(world_size, low, tuple(tuple(r) for r in runs), numel)
