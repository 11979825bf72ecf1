"""Whole blocks at any world size: a group's bands of rows dealt to ranks (the packed plan).

[Note: Packed blocks]
The contiguous parameter-major plan (``block_plan.py``) keeps each parameter
contiguous in its group's buffer. A rank boundary inside a matrix must then
fall between its blocks (for a 128 x 128 tile, between 128-row bands), and a
matrix that spans two or more boundaries needs the per-rank share to be a
multiple of its band; with several such matrices, of their least common
multiple. At W = 1024 a DeepSeek-V3 dense layer (570k elements a rank, bands
of 0.2-2.4M) needs a share of 132M, and 128 x 128 tiles pad 72% of the model.

Packed, a parameter's bands are dealt to ranks instead: each rank holds a
run of whole bands of it and, where the next band does not fit, the rest of
its share is left for smaller bands (padding inside the gathered buffer, not
in the parameter). A band is the parameter's block in rows (``blocks_of``:
128 rows of a tiled matrix, one row for ``"rows"``, the whole parameter for
``"whole"``). The bands go out largest first, one band size at a time, each
size from the first rank again with a cursor that only moves forward, so a
rank holds one run of rows of each parameter, in row order across ranks (the
``row_bounds`` a placement names), at an offset of its own in the rank's
share. A parameter's last, partial band follows its full ones. The share is
the smallest for which everything fits (searched from ``max(ceil(numel /
W), largest band)``; a few dozen passes over the group's band sizes).

DeepSeek-V3 at W = 1024 pads 1.1% so, every tile whole (``python -m
fsdp2.plan --layouts --hf-config deepseek-v3``). ``fully_shard`` builds it
where the contiguous plan pads much more (``choose_plan`` in ragged_rows.py);
a parameter is then not contiguous in the gathered buffer, so the group
copies the gathered runs into its parameters (``PackedRows`` in
packed_rows.py), one copy the contiguous plan does not need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .block_plan import Granularity, blocks_of

__all__ = ["PackedPlan", "pack_blocks"]


@dataclass(frozen=True)
class PackedPlan:
    """Each rank's runs ``(parameter index, first row, stop row, offset in the share)``."""

    world_size: int
    shard_numel: int
    runs: tuple[tuple[tuple[int, int, int, int], ...], ...]
    numel: int

    @property
    def padding(self) -> int:
        """Elements of the ranks' shares that hold no parameter."""
        return self.world_size * self.shard_numel - self.numel


@dataclass(frozen=True)
class _Param:
    index: int
    rows: int
    row_numel: int  # elements per row (1 for a vector: its elements are its rows)
    band_rows: int  # rows a cut may not split

    @property
    def band(self) -> int:
        return min(self.band_rows, self.rows) * self.row_numel


def _params(
    shapes: Sequence[Sequence[int]], granularities: Sequence[Granularity], names: Sequence[str]
) -> list[_Param]:
    out = []
    for i, (shape, granularity, name) in enumerate(zip(shapes, granularities, names, strict=True)):
        blocks = blocks_of(shape, granularity, name)
        row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
        rows = shape[0] if len(shape) > 1 else math.prod(shape)
        band_rows = max(blocks.step // row_numel, 1) if row_numel else 1
        out.append(_Param(i, rows, row_numel, band_rows))
    return out


def _deal(params: list[_Param], world_size: int, share: int, record: bool) -> list | None:
    """Each rank's runs, largest bands first (``[]`` per rank unless ``record``); ``None`` if
    something does not fit in ``world_size`` shares of ``share``."""
    room = [share] * world_size
    runs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(world_size)]
    by_band: dict[int, list[_Param]] = {}
    for m in params:
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
                # all that is left, else whole bands: a rank never holds two runs of one
                # parameter (what is left after whole bands does not fit in what they leave)
                take = rows_left if fit >= rows_left else fit - fit % m.band_rows
                if record:
                    runs[r].append((m.index, row, row + take, share - room[r]))
                room[r] -= take * m.row_numel
                row += take
    return runs


def pack_blocks(
    shapes: Sequence[Sequence[int]],
    granularities: Sequence[Granularity],
    world_size: int,
    names: Sequence[str] | None = None,
) -> PackedPlan:
    """The packed plan of a group (see [Note: Packed blocks]): every block whole."""
    if world_size < 1:
        raise ValueError(f"pack_blocks: world_size must be >= 1, got {world_size}")
    names = names or [f"parameter {i}" for i in range(len(shapes))]
    params = _params(shapes, granularities, names)
    numel = sum(m.rows * m.row_numel for m in params)
    low = max([-(-numel // world_size), 1] + [m.band for m in params if m.rows])
    if _deal(params, world_size, low, False) is None:
        high = low
        while _deal(params, world_size, high, False) is None:
            high *= 2
        while high - low > max(1, low // 4096):  # within 0.025% of the smallest share
            mid = (low + high) // 2
            if _deal(params, world_size, mid, False) is None:
                low = mid
            else:
                high = mid
        low = high
    runs = _deal(params, world_size, low, True)
    return PackedPlan(world_size, low, tuple(tuple(r) for r in runs), numel)
