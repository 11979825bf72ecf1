"""The parameter-major layout seen from one parameter and one rank: its run of rows.

``plan_rows`` turns a group's plan, contiguous (see [Note: Block-aligned
shards] in block_plan.py) or packed where that pads much less (see [Note:
Packed blocks] in block_packing.py), into each parameter's ``RaggedRows``:
which rows each rank holds and where each rank's sit in its shard.
``FSDPParam`` reads them as it reads ``ShardLayout`` for ``torch.chunk``; see
[Note: The parameter-major layout] in ragged.py for the buffers they
describe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .block_packing import PackedPlan, pack_blocks
from .block_plan import BlockPlan, Granularity, plan_blocks


@dataclass(frozen=True)
class RaggedRows:
    """Rows ``[row_start, row_start + local_rows)`` of a parameter of ``size``, held by ``rank``."""

    size: torch.Size
    world_size: int
    rank: int
    row_bounds: tuple[int, ...]  # W + 1 row indices: rank r holds [row_bounds[r], row_bounds[r + 1])
    start: int  # where the whole parameter sits in the group's unsharded buffer
    shard_offset: int  # where this rank's rows sit in its S-element shard
    shard_numel: int  # S
    rank_offsets: tuple[int, ...] = ()  # packed: where each rank's rows sit in its shard
    packed: bool = False  # the packed plan: the unsharded buffer is not the gathered one
    dim: int = 0

    @property
    def row_numel(self) -> int:
        return math.prod(self.size[1:]) if len(self.size) > 1 else 1

    @property
    def row_start(self) -> int:
        return self.row_bounds[self.rank]

    @property
    def local_rows(self) -> int:
        return self.row_bounds[self.rank + 1] - self.row_bounds[self.rank]

    @property
    def shard_rows(self) -> int:
        return self.local_rows  # no padding inside a run: the padding is between parameters

    @property
    def local_size(self) -> torch.Size:
        return torch.Size([self.local_rows, *self.size[1:]])

    @property
    def padded_shard_numel(self) -> int:
        return self.local_rows * self.row_numel

    @property
    def gathered_rows(self) -> int:
        """Rows of the gathered parameter (its own: no padding rows)."""
        return self.size[0]

    def local_rows_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full tensor of ``size``."""
        return tensor.narrow(0, self.row_start, self.local_rows)


def same_placements(placements: Sequence, expected: Sequence) -> bool:
    """Placement by placement, of one type and equal (torch's ``Shard`` answers equal to any
    placement of its dim, a ragged one included)."""
    return len(placements) == len(expected) and all(
        type(a) is type(b) and a == b for a, b in zip(placements, expected)
    )


#: the contiguous plan's padding (a fraction of the group) above which the packed plan is
#: tried; it is taken where it pads less than half as much (see choose_plan)
PACK_ABOVE = 0.03


def choose_plan(
    shapes: Sequence[Sequence[int]],
    granularities: Sequence[Granularity],
    world_size: int,
    names: Sequence[str] | None = None,
) -> BlockPlan | PackedPlan:
    """The contiguous plan of a group, or the packed one where the contiguous pads more than
    ``PACK_ABOVE`` of the group and the packed less than half of that.

    The packed plan costs one copy after each all-gather and before each
    reduce-scatter (the parameters are not contiguous in the gathered buffer),
    so it is taken only where it saves much memory and traffic: tiles or
    blocks larger than a rank's share (see [Note: Packed blocks]).
    """
    plan = plan_blocks([tuple(s) for s in shapes], granularities, world_size, names)
    numel = sum(plan.numels)
    if world_size == 1 or plan.padding <= PACK_ABOVE * numel:
        return plan
    packed = pack_blocks([tuple(s) for s in shapes], granularities, world_size, names)
    return packed if 2 * packed.padding < plan.padding else plan


def _packed_rows(
    shapes: Sequence[torch.Size], plan: PackedPlan, world_size: int, rank: int
) -> list[RaggedRows]:
    """Each parameter's rows in a packed plan: its runs, in rank order, at their offsets."""
    bounds = [[0] * (world_size + 1) for _ in shapes]
    offsets = [[0] * world_size for _ in shapes]
    for r, runs in enumerate(plan.runs):
        for i, _first, stop, offset in runs:
            bounds[i][r + 1] = stop
            offsets[i][r] = offset
    rows, start = [], 0
    for i, shape in enumerate(shapes):
        b = bounds[i]
        for r in range(world_size):  # a rank holding nothing: its run starts where it ends
            b[r + 1] = max(b[r + 1], b[r])
        rows.append(RaggedRows(
            torch.Size(shape), world_size, rank, tuple(b), start, offsets[i][rank],
            plan.shard_numel, tuple(offsets[i]), packed=True,
        ))
        start += math.prod(shape)
    return rows


def plan_rows(
    shapes: Sequence[torch.Size],
    granularities: Sequence[Granularity],
    world_size: int,
    rank: int,
    names: Sequence[str],
) -> list[RaggedRows]:
    """For each parameter of the group's plan (``choose_plan``), the rows ``rank`` holds."""
    plan = choose_plan(shapes, granularities, world_size, names)
    if isinstance(plan, PackedPlan):
        return _packed_rows(shapes, plan, world_size, rank)
    share = plan.shard_numel
    rows = []
    for shape, start, numel in zip(shapes, plan.starts, plan.numels):
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        bounds = []
        for r in range(world_size + 1):  # the row each rank boundary falls on (a cut: whole rows)
            inside = min(max(r * share - start, 0), numel)
            bounds.append(inside // row if row else 0)
        offset = min(max(start - rank * share, 0), share)
        rows.append(RaggedRows(torch.Size(shape), world_size, rank, tuple(bounds), start, offset, share))
    return rows
