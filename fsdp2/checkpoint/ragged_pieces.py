"""The parameter-major layout's rows saved in pieces no larger than dim-0's chunks.

[Note: Ragged rows in checkpoints]
DCP's reader loads a saved chunk whole before copying what a rank needs of
it, so a load holds the largest saved chunk beside the state it loads into.
A rank's ``RaggedShard`` rows of a parameter can be the whole parameter (a
small group on few ranks) where ``Shard(0)`` holds ``1/W`` of it: loading
such a checkpoint peaked about one parameter higher than dim-0's. So
``save_checkpoint`` writes a rank's rows of a parameter as the fewest pieces
of at most ``torch.chunk``'s ``ceil(rows / W)`` rows each: no saved chunk is
larger than the dim-0 layout's, and the checkpoint loads into any layout as
before (DCP matches chunks by overlap).

Only fsdp2's own save does this, through its planner: the DTensor keeps
upstream's one chunk per rank, because other writers assume it (torch's
Hugging Face safetensors writer keys a file's tensors by name: two pieces of
one name in one file would keep only the last). A plain ``dcp.save`` of the
same state writes one chunk per rank, as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .._torch_compat import local_tensor
from ..ragged_placement import RaggedShardBase
from ..runtime.storage.shard_storage import own_storage


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of a rank's chunk: ``rows`` rows from ``start`` (counted in the chunk) on ``dim``."""

    dim: int
    start: int
    rows: int

    def of(self, local: torch.Tensor) -> torch.Tensor:
        """The piece of ``local`` (the rank's chunk), over a storage of its own where it is
        contiguous: DCP's writer clones a tensor whose storage is larger than it, and keeps
        every tensor of a file until the file is written."""
        piece = local.narrow(self.dim, self.start, self.rows)
        if not piece.is_contiguous():
            return piece
        return own_storage(piece.detach().reshape(-1)).view(piece.shape)


def _most_rows(value: DTensor) -> tuple[int, int] | None:
    """``(dim, dim-0's rows per chunk)`` for a DTensor ragged on one mesh dim, else ``None``."""
    ragged = [(i, p) for i, p in enumerate(value.placements) if isinstance(p, RaggedShardBase)]
    if len(ragged) != 1 or type(local_tensor(value)) is not torch.Tensor:
        return None  # a subclass (quantized state, ...) is saved as DCP saves it
    mesh_dim, placement = ragged[0]
    return placement.dim, -(-value.shape[placement.dim] // value.device_mesh.size(mesh_dim))


def split(item: WriteItem, value: Any) -> list[tuple[WriteItem, Piece | None]]:
    """``item`` (a rank's chunk of ``value``) as the write items of its pieces, each with the
    ``Piece`` that resolves it; ``[(item, None)]`` where it stays whole."""
    found = _most_rows(value) if isinstance(value, DTensor) else None
    if found is None or item.type != WriteItemType.SHARD or item.tensor_data is None:
        return [(item, None)]
    dim, most = found
    chunk = item.tensor_data.chunk
    rows = chunk.sizes[dim]
    if rows <= most:
        return [(item, None)]
    size = -(-rows // -(-rows // most))  # the fewest pieces that fit, torch.chunk's sizes
    out = []
    for start in range(0, rows, size):
        piece = Piece(dim, start, min(size, rows - start))
        offsets = torch.Size(o + start if d == dim else o for d, o in enumerate(chunk.offsets))
        sizes = torch.Size(piece.rows if d == dim else s for d, s in enumerate(chunk.sizes))
        out.append((dataclasses.replace(
            item,
            index=MetadataIndex(item.index.fqn, offsets),
            tensor_data=dataclasses.replace(
                item.tensor_data, chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes)),
        ), piece))
    return out
