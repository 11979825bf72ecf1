"""The parameter-major layout seen from one parameter and one rank: its run of rows.

``plan_rows`` turns a group's block plan (see [Note: Block-aligned shards]
in block_plan.py) into each parameter's ``RaggedRows``: which rows each rank
holds and where this rank's sit in its shard. ``FSDPParam`` reads them as
it reads ``ShardLayout`` for ``torch.chunk``; see [Note: The
parameter-major layout] in ragged.py for the buffer they describe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .block_plan import Granularity, plan_blocks


@dataclass(frozen=True)
class RaggedRows:
    """Rows ``[row_start, row_start + local_rows)`` of a parameter of ``size``, held by ``rank``."""

    size: torch.Size
    world_size: int
    rank: int
    row_bounds: tuple[int, ...]  # W + 1 row indices: rank r holds [row_bounds[r], row_bounds[r + 1])
    start: int  # where the whole parameter sits in the group's W * S buffer
    shard_offset: int  # where this rank's rows sit in its S-element shard
    shard_numel: int  # S
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


def plan_rows(
    shapes: Sequence[torch.Size],
    granularities: Sequence[Granularity],
    world_size: int,
    rank: int,
    names: Sequence[str],
) -> list[RaggedRows]:
    """For each parameter of the group's plan, the rows ``rank`` holds."""
    plan = plan_blocks([tuple(s) for s in shapes], granularities, world_size, names)
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
