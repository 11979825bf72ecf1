"""Move one tensor between its shards on every rank and a full copy on rank 0.

[Note: Full tensors through rank 0]
The naive full state dict calls ``dtensor.full_tensor()`` on every value: an
all-gather that leaves the whole parameter on *every* rank, and a loop that
keeps them all leaves every rank holding the full model. Here rank 0 alone
builds the full tensor: it allocates the output once and receives each shard
point-to-point straight into its slot (a shard along dim 0 is a contiguous
slice of the output, so nothing is staged on CPU). Every other rank sends its
shard and allocates nothing. Loading runs the same pairs the other way: rank
0 sends each rank its slice of the full tensor, which is received straight
into the rank's local shard. So no rank ever holds more than one full tensor
beyond its shards, and only rank 0 holds even that one.

Which rank holds which chunk follows from the DTensor's mesh and placements,
the way DTensor lays out ``Shard``/``Replicate``: mesh dims are applied left to
right and each ``Shard(d)`` splits dim ``d`` of what is left into
``torch.chunk`` pieces (ranks past the end get empty pieces). Replicas of a
chunk (``Replicate`` mesh dims, e.g. HSDP) all receive it on load; on gather
only the lowest rank holding it sends. Other placements (``Partial``, strided
shards) are refused with a clear error.

Communication is over the default process group with global ranks, so any
mesh works; tensors travel on CPU with gloo and on the current accelerator
otherwise (with one staging copy of at most one full tensor on rank 0).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._torch_compat import local_tensor

__all__ = ["Chunk", "chunks_of", "check_placements", "comm_device", "gather_to_rank0",
           "rank", "scatter_from_rank0"]


@dataclass(frozen=True)
class Chunk:
    """The block of a full tensor that one global rank holds."""

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This chunk of ``full`` (a view)."""
        view = full
        for dim, (start, length) in enumerate(zip(self.offsets, self.sizes)):
            view = view.narrow(dim, start, length)
        return view


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def comm_device() -> torch.device:
    """Where tensors travel: CPU for gloo (and without a process group), else the accelerator."""
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend())
    accelerator = torch.accelerator.current_accelerator()
    if "gloo" in backend or "mpi" in backend or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def check_placements(name: str, value: DTensor) -> None:
    """Refuse placements whose chunks this module cannot compute (names ``name``)."""
    for p in value.placements:
        if type(p) is not Shard and type(p) is not Replicate:
            raise NotImplementedError(
                f"'{name}' is a DTensor with placements {tuple(value.placements)}; full state "
                "dicts support Shard and Replicate placements only. Save a sharded "
                "checkpoint (fsdp2.save_checkpoint / torch.distributed.checkpoint) instead"
            )


def chunks_of(value: DTensor) -> list[Chunk]:
    """The chunk every rank of ``value``'s mesh holds, in mesh order."""
    mesh = value.device_mesh
    shape = tuple(value.shape)
    ranks = mesh.mesh.flatten().tolist()
    chunks = []
    for coord, global_rank in zip(itertools.product(*(range(n) for n in mesh.shape)), ranks):
        offsets = [0] * len(shape)
        sizes = list(shape)
        for mesh_dim, placement in enumerate(value.placements):
            if not isinstance(placement, Shard):
                continue
            dim = placement.dim % len(shape)
            step = -(-sizes[dim] // mesh.shape[mesh_dim])  # torch.chunk: ceil-sized pieces
            start = min(coord[mesh_dim] * step, sizes[dim])
            offsets[dim] += start
            sizes[dim] = min(step, sizes[dim] - start)
        chunks.append(Chunk(global_rank, tuple(offsets), tuple(sizes)))
    return chunks


def _own_chunks(value: DTensor, name: str) -> tuple[list[Chunk], torch.Tensor]:
    """Every rank's non-empty chunk, and this rank's local tensor checked against its own."""
    check_placements(name, value)
    local = local_tensor(value)
    chunks = chunks_of(value)
    me = rank()
    for c in chunks:
        if c.rank == me and tuple(local.shape) != c.sizes:
            raise AssertionError(
                f"rank {me}: local shard of shape {tuple(local.shape)} does not match the "
                f"chunk {c.sizes} computed for placements {value.placements}"
            )
    return [c for c in chunks if c.numel > 0], local


def gather_to_rank0(
    value: torch.Tensor, device: torch.device, name: str = "tensor"
) -> torch.Tensor | None:
    """The full value of ``value`` as a new CPU tensor on rank 0; ``None`` elsewhere.

    Collective for a DTensor (every rank of the default group calls it in the
    same order); a plain tensor is taken as replicated and only copied on rank 0.
    ``name`` is used in errors.
    """
    me = rank()
    if not isinstance(value, DTensor):
        return value.detach().to("cpu", copy=True) if me == 0 else None
    chunks, local = _own_chunks(value, name)
    senders: dict[tuple, Chunk] = {}
    for c in chunks:  # replicas: the lowest rank holding a chunk sends it
        key = (c.offsets, c.sizes)
        if key not in senders or c.rank < senders[key].rank:
            senders[key] = c
    if me != 0:
        if any(c.rank == me for c in senders.values()):
            dist.send(local.detach().to(device).contiguous(), dst=0)
        return None
    out = torch.empty(value.shape, dtype=value.dtype, device="cpu")
    staging = out if device.type == "cpu" else torch.empty_like(out, device=device)
    works = []
    for c in senders.values():
        view = c.of(staging)
        if c.rank == 0:
            view.copy_(local)
        elif view.is_contiguous():
            works.append(dist.irecv(view, src=c.rank))
        else:  # e.g. Shard(1): one chunk at a time through a contiguous buffer
            buf = torch.empty(c.sizes, dtype=value.dtype, device=device)
            dist.recv(buf, src=c.rank)
            view.copy_(buf)
    for work in works:
        work.wait()
    if staging is not out:
        out.copy_(staging)
    return out


def scatter_from_rank0(
    full: torch.Tensor | None, target: torch.Tensor, device: torch.device, name: str = "tensor"
) -> None:
    """Write rank 0's ``full`` into ``target`` on every rank, in place.

    ``target`` is a DTensor (each rank receives its chunk) or a plain tensor
    (broadcast). Collective over the default group; ``full`` is read on rank 0
    only and must already have ``target``'s full shape.
    """
    me = rank()
    if not isinstance(target, DTensor):
        _broadcast_into(full, target, device)
        return
    chunks, local = _own_chunks(target, name)
    if me != 0:
        if any(c.rank == me for c in chunks):
            direct = local.is_contiguous() and local.device == device
            buf = local if direct else torch.empty(local.shape, dtype=local.dtype, device=device)
            dist.recv(buf, src=0)
            if buf is not local:
                local.copy_(buf)
        return
    source = full.detach().to(device=device, dtype=target.dtype)
    works = []
    for c in chunks:
        piece = c.of(source)
        if c.rank == 0:
            local.copy_(piece)
        elif piece.is_contiguous():
            works.append(dist.isend(piece, dst=c.rank))
        else:
            dist.send(piece.contiguous(), dst=c.rank)
    for work in works:
        work.wait()


def _broadcast_into(full: torch.Tensor | None, target: torch.Tensor, device: torch.device) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        target.copy_(full)
        return
    direct = target.is_contiguous() and target.device == device
    buf = target if direct else torch.empty(target.shape, dtype=target.dtype, device=device)
    if rank() == 0:
        buf.copy_(full)
    dist.broadcast(buf, src=0)
    if buf is not target:
        target.copy_(buf)
