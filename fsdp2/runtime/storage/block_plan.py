"""Cutting a parameter-major group buffer into equal per-rank ranges at block boundaries.

[Note: Block-aligned shards]
In the parameter-major layout a group's parameters sit whole and contiguous
in one flat buffer, in registration order, and rank ``r`` holds the range
``[r * S, (r + 1) * S)`` of it. Every rank holds the same ``S`` elements (the
collectives need equal blocks), so where a rank boundary falls inside a
parameter is fixed by ``S`` and by where the parameter starts. Each
parameter has a *granularity*, the blocks a boundary may not cut. A
boundary always falls between rows (slices along dim 0), so that what a rank
holds of a parameter is a run of whole rows, which a DTensor placement can
name; the granularity then says which row boundaries qualify:

- ``"rows"``: every one (the default, as ``Shard(0)``);
- an ``int`` ``b``: those that are also a multiple of ``b`` elements into
  the flattened parameter, so flat blocks of ``b`` (a quantization block,
  e.g. 256) stay whole: every ``lcm(row, b)`` elements;
- a pair ``(th, tw)``: tiles of the last two dims of a matrix: a run of rows
  holds whole tiles only as whole bands of ``th`` rows, so every ``th``
  rows; a stack of matrices (3-D and up) is cut between matrices, which
  hold whole tiles;
- ``"whole"``: none (one owner holds the parameter).

``plan_blocks`` places the parameters in order, each at the first offset at
or after the previous one's end from which every rank boundary inside it
falls on one of its block boundaries: the gap left before a parameter is
the only padding, and it is zero unless a boundary would cut a block. ``S``
is the smallest share for which the whole group fits in ``W * S`` (searched
from ``ceil(numel / W)`` upward: a few passes over the parameters). The plan
depends only on the sizes, the granularities and ``W``, so every rank
computes the same one without communicating.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

Granularity = str | int | tuple[int, int]


@dataclass(frozen=True)
class Blocks:
    """Where a rank boundary may fall inside one parameter: every ``step`` elements (``step >= numel``: nowhere)."""

    numel: int
    step: int

    def is_cut(self, q: int) -> bool:
        return q % self.step == 0

    def floor_cut(self, x: int) -> int:
        """The largest cut ``<= x``."""
        return x - x % self.step

    @property
    def whole(self) -> bool:
        return self.step >= self.numel


def blocks_of(shape: Sequence[int], granularity: Granularity, name: str = "parameter") -> Blocks:
    """The blocks ``granularity`` makes of a parameter of ``shape``; ``ValueError`` if it has none."""
    numel = math.prod(shape)
    whole = max(numel, 1)
    row = max(math.prod(shape[1:]), 1) if len(shape) > 1 else 1
    if granularity == "whole" or numel == 0:
        return Blocks(numel, whole)
    if granularity == "rows":
        return Blocks(numel, row)
    if isinstance(granularity, bool) or not isinstance(granularity, (int, tuple)):
        raise ValueError(
            f"{name}: granularity {granularity!r} is not one of 'rows', 'whole', a block "
            "size in elements (int) or a tile (rows, cols)"
        )
    if isinstance(granularity, int):
        if granularity < 1:
            raise ValueError(f"{name}: a block of {granularity} elements; give a size >= 1")
        return Blocks(numel, min(math.lcm(row, granularity), whole))
    if len(granularity) != 2 or not all(isinstance(t, int) and t >= 1 for t in granularity):
        raise ValueError(f"{name}: tile {granularity!r} is not a pair of sizes >= 1 (rows, cols)")
    if len(shape) != 2:  # vectors: whole elements; stacks: whole matrices
        return Blocks(numel, row)
    return Blocks(numel, min(granularity[0], shape[0]) * row)


@dataclass(frozen=True)
class Piece:
    """Part of one parameter that a rank holds: elements ``[start, stop)`` of parameter ``index``,
    at ``offset`` in that rank's shard."""

    index: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class BlockPlan:
    """A group's parameter-major buffer: each parameter's offset, and the per-rank share ``shard_numel``."""

    world_size: int
    shard_numel: int
    starts: tuple[int, ...]
    numels: tuple[int, ...]

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def padding(self) -> int:
        """Elements of the buffer that belong to no parameter (gaps and the tail)."""
        return self.padded_numel - sum(self.numels)

    def pieces(self, rank: int) -> list[Piece]:
        """What rank ``rank`` holds, in buffer order (parameters it holds nothing of are left out)."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        first = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        out = []
        for i in range(first, len(self.starts)):
            start = self.starts[i]
            if start >= hi:
                break
            a, b = max(start, lo), min(start + self.numels[i], hi)
            if a < b:
                out.append(Piece(i, a - start, b - start, a - lo))
        return out


def _place(cursor: int, blocks: Blocks, share: int) -> int | None:
    """The first start ``>= cursor`` from which every rank boundary inside the parameter is a cut."""
    n = blocks.numel
    start = cursor
    for _ in range(2):  # here (shifted by less than a block), else from the next rank boundary
        first = (start // share + 1) * share  # the first boundary after ``start``
        if start + n <= first:
            return start
        q = blocks.floor_cut(first - start)
        if q > 0:
            shifted = first - q
            if all(blocks.is_cut(q + k) for k in range(share, n - q, share)):
                return shifted
        start = first
    return None


def _fit(blocks: list[Blocks], world_size: int, share: int) -> list[int] | None:
    starts, cursor, limit = [], 0, world_size * share
    for b in blocks:
        start = _place(cursor, b, share)
        if start is None or start + b.numel > limit:
            return None
        starts.append(start)
        cursor = start + b.numel
    return starts


_NEAR = 16  # shares right above the lower bound, tried one by one


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _smallest_share(blocks: list[Blocks], world_size: int, low: int) -> int:
    """The smallest per-rank share ``>= low`` the group fits in (see [Note: Block-aligned shards]).

    A parameter that spans two rank boundaries fits only when the share is a
    multiple of its block, so the candidates are ``low`` rounded up to each
    such block and to all of them at once, and the few shares just above
    ``low`` (a parameter that spans one boundary only needs a shift); where none fits (padding pushed
    the group past ``W * share``), the share doubles its way up and bisects
    back down.
    """
    spanning = sorted({b.step for b in blocks if b.numel > low and not b.whole})
    common = math.lcm(*spanning) if spanning else 1
    candidates = {_round_up(low, common)} | {_round_up(low, s) for s in spanning}
    candidates |= set(range(low, low + _NEAR))
    for share in sorted(candidates):
        if _fit(blocks, world_size, share) is not None:
            return share
    low = max(candidates)
    step = 1
    while _fit(blocks, world_size, low + step) is None:
        step *= 2
    bad, good = low + step // 2 if step > 1 else low, low + step
    while good - bad > 1:
        mid = (bad + good) // 2
        if _fit(blocks, world_size, mid) is None:
            bad = mid
        else:
            good = mid
    return good


def plan_blocks(
    shapes: Sequence[Sequence[int]],
    granularities: Sequence[Granularity],
    world_size: int,
    names: Sequence[str] | None = None,
) -> BlockPlan:
    """The parameter-major plan of a group: see [Note: Block-aligned shards]."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    names = names or [f"parameter {i}" for i in range(len(shapes))]
    blocks = [blocks_of(s, g, n) for s, g, n in zip(shapes, granularities, names, strict=True)]
    numels = tuple(b.numel for b in blocks)
    total = sum(numels)
    low = max([-(-total // world_size), 1] + [b.numel for b in blocks if b.whole])
    share = _smallest_share(blocks, world_size, low)
    starts = _fit(blocks, world_size, share)
    return BlockPlan(world_size, share, tuple(starts), numels)


def chunk_padding(shapes: Sequence[Sequence[int]], world_size: int) -> int:
    """Elements of padding ``torch.chunk`` on dim 0 adds to a group (the dim-0 layout's)."""
    pad = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        pad += (world_size * -(-rows // world_size) - rows) * row
    return pad
