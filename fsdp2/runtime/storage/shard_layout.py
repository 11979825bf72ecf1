"""Where one parameter's rows fall when it is split over a shard group (``torch.chunk`` rule).

"Rows" are slices along the shard dim. Every rank owns ``ceil(d / W)`` rows
(``shard_rows``) except at the end, where ranks get fewer or none
(``local_rows``); the slot of each rank is padded to ``shard_rows`` so every
rank contributes the same number of elements to the collectives. For shard
dims > 0 (which divide evenly, as upstream requires) the gathered rank blocks
are not the parameter's memory layout: ``rank_blocks`` views a full tensor
as ``(W, *shard shape)`` blocks, rank-major, for the copies that put them in
place (see [Note: Other shard dims and tensor parallelism] in param.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ShardLayout:
    """The rows of a tensor of ``size`` that rank ``rank`` of ``world_size`` holds on ``dim``."""

    size: torch.Size
    dim: int
    world_size: int
    rank: int
    row_numel: int = field(init=False)  # elements in one slice along ``dim``
    shard_rows: int = field(init=False)  # ceil: rows per rank before the end
    local_rows: int = field(init=False)  # this rank's rows (fewer or none at the end)

    def __post_init__(self) -> None:
        rows = self.size[self.dim]
        set_ = object.__setattr__  # frozen: derived fields are set once, here
        set_(self, "row_numel", math.prod(s for i, s in enumerate(self.size) if i != self.dim))
        set_(self, "shard_rows", -(-rows // self.world_size))
        set_(self, "local_rows", max(0, min(self.shard_rows, rows - self.rank * self.shard_rows)))

    @property
    def local_size(self) -> torch.Size:
        size = list(self.size)
        size[self.dim] = self.local_rows
        return torch.Size(size)

    @property
    def padded_shard_numel(self) -> int:
        return self.shard_rows * self.row_numel

    @property
    def gathered_rows(self) -> int:
        """Rows on the shard dim of the gathered padded tensor: ``W`` padded shards."""
        return self.shard_rows * self.world_size

    def local_rows_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's unpadded rows of a full tensor of ``size``."""
        start = min(self.rank * self.shard_rows, self.size[self.dim])
        return tensor.narrow(self.dim, start, self.local_rows)

    def block_shape(self) -> tuple[int, ...]:
        """``(W, *padded shard shape)``: the gathered rank blocks of a shard dim > 0."""
        block = list(self.size)
        block[self.dim] = self.shard_rows
        return (self.world_size, *block)

    def rank_blocks(self, full: torch.Tensor) -> torch.Tensor:
        """A ``(W, *shard shape)`` view of a full tensor, block ``r`` being rank ``r``'s shard.

        Only for shard dims > 0 (which divide evenly).
        """
        k = self.dim
        size = list(self.size)
        split = size[:k] + [self.world_size, self.shard_rows] + size[k + 1 :]
        return full.view(split).movedim(k, 0)
