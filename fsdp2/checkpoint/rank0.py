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
the way DTensor lays them out: mesh dims are applied left to right, and each
one splits, along its tensor dim, the sequence of full-tensor indices a rank
holds so far. ``Shard(d)`` takes the rank's ``torch.chunk`` piece of it (ranks
past the end get empty pieces). A strided shard with split factor ``k`` (FSDP
over a dim tensor parallelism already split ``k`` ways, see param.py) first
chunks the sequence into ``k`` pieces, then takes the rank's ``torch.chunk``
piece of *each*, concatenated: ``k`` separate ranges of that dim, e.g. rows
0-2 and 6-8 of 12 at dp coordinate 0 for ``(_StridedShard(0, 2), Shard(0))``.
A later ``Shard(0)`` (FSDP + TP) then leaves one range per rank (rows 0-2 at
(0, 0), 6-8 at (0, 1)); ``Shard(1)`` or another split factor leaves several.
So a chunk is a list of ranges per dim, and a box
(one range per dim) is a plain slice of both the full and the local tensor.
A one-box chunk that is a contiguous slice of the output moves straight into
place; any other moves through a buffer of the chunk's size (at most one
shard). ``DTensor.full_tensor()`` is the reference the tests compare with.
Replicas of a chunk (``Replicate`` mesh dims, e.g. HSDP) all receive it on
load; on gather only the lowest rank holding it sends. ``Partial`` is refused
with a clear error.

A DTensor on a sub-mesh, e.g. the parameters TP leaves alone in a (dp, tp)
model (on the dp mesh), lives on a different mesh on each TP rank: the meshes
are copies holding the same values, and rank 0 sees only its own. So the
callers gather every rank's meshes once (``meshes_of``, ``copies_by_mesh``)
and pass them in: on load every copy's ranks receive their chunk; on gather
the replicas across copies are deduplicated like any other.

Communication is over the default process group with global ranks, so any
mesh works; tensors travel on CPU with gloo and on the current accelerator
otherwise (with one staging copy of at most one full tensor on rank 0).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._torch_compat import local_tensor, strided_split_factor

__all__ = ["Chunk", "MeshCopies", "chunks_of", "check_placements", "comm_device",
           "copies_by_mesh", "gather_to_rank0", "meshes_of", "rank", "scatter_from_rank0"]


MeshRanks = tuple[int, ...]  # a mesh's global ranks, in mesh (row-major) order
MeshCopies = dict[MeshRanks, list[MeshRanks]]  # this rank's mesh -> every rank's copy of it
Run = tuple[int, int]  # (start, length): a range of indices along one dim of the full tensor
Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # local offsets, full offsets, sizes


@dataclass(frozen=True)
class Chunk:
    """The part of a full tensor that one global rank holds.

    ``runs[d]`` lists the ranges of dim ``d`` of the full tensor that, in order,
    make up dim ``d`` of the rank's local tensor: one range for ``Shard`` and
    ``Replicate``, several for strided shards.
    """

    rank: int
    runs: tuple[tuple[Run, ...], ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sum(length for _, length in runs) for runs in self.runs)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def boxes(self) -> list[Box]:
        """The chunk as slices that are plain boxes of both the local and the full tensor."""
        per_dim = []
        for runs in self.runs:
            local_starts = itertools.accumulate((length for _, length in runs), initial=0)
            per_dim.append([(lo, start, length) for lo, (start, length) in zip(local_starts, runs)])
        return [
            (tuple(b[0] for b in combo), tuple(b[1] for b in combo), tuple(b[2] for b in combo))
            for combo in itertools.product(*per_dim)
        ]


def _box(tensor: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, sizes)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def comm_device() -> torch.device:
    """Where tensors travel: the accelerator where the default group's backend serves it,
    else CPU (gloo, no process group, a CUDA build without a GPU, a CPU-only backend)."""
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend())
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if "gloo" in backend or "mpi" in backend or accelerator is None:
        return torch.device("cpu")
    served = {part.split(":")[0] for part in dist.get_backend_config().split(",")}
    if accelerator.type not in served:  # e.g. "cpu:mybackend" on a GPU machine
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def check_placements(name: str, value: DTensor) -> None:
    """Refuse placements whose chunks this module cannot compute (names ``name``)."""
    for p in value.placements:
        if strided_split_factor(p) is None and not isinstance(p, (Shard, Replicate)):
            raise NotImplementedError(
                f"'{name}' is a DTensor with placements {tuple(value.placements)}; full state "
                "dicts support Shard, Replicate and strided-shard placements only. Save a "
                "sharded checkpoint (fsdp2.save_checkpoint / torch.distributed.checkpoint) instead"
            )


def _chunk_bounds(length: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of piece ``index`` of ``torch.chunk`` over ``length`` (empty past the end)."""
    step = -(-length // num_chunks)
    return min(index * step, length), min((index + 1) * step, length)


def _take(runs: list[Run], start: int, stop: int) -> list[Run]:
    """Elements ``[start, stop)`` of the index sequence that ``runs`` spells out."""
    out: list[Run] = []
    pos = 0
    for first, length in runs:
        lo, hi = max(start, pos), min(stop, pos + length)
        if lo < hi:
            out.append((first + lo - pos, hi - lo))
        pos += length
    return out


def _split(runs: list[Run], num_chunks: int, index: int, split_factor: int) -> list[Run]:
    """Piece ``index`` of ``num_chunks`` of ``runs``, taken from each of ``split_factor`` parts."""
    length = sum(n for _, n in runs)
    out: list[Run] = []
    for part in range(split_factor):
        part_start, part_stop = _chunk_bounds(length, split_factor, part)
        lo, hi = _chunk_bounds(part_stop - part_start, num_chunks, index)
        for first, n in _take(runs, part_start + lo, part_start + hi):
            if out and out[-1][0] + out[-1][1] == first:  # adjacent ranges: one range
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((first, n))
    return out


def meshes_of(values: Iterable[object]) -> list[MeshRanks]:
    """The distinct meshes of the DTensors among ``values``, in order of first appearance."""
    seen: dict[MeshRanks, None] = {}
    for value in values:
        if isinstance(value, DTensor):
            seen.setdefault(_ranks_of(value.device_mesh), None)
    return list(seen)


def copies_by_mesh(per_rank: list[list[MeshRanks]]) -> MeshCopies:
    """Every copy of each of this rank's meshes, from ``meshes_of`` on every rank (by rank).

    The ranks' ``i``-th meshes are copies of one another; they must be equal
    or disjoint.
    """
    mine = per_rank[rank()]
    if any(len(meshes) != len(mine) for meshes in per_rank):
        raise ValueError(
            f"Ranks hold DTensors on different numbers of meshes ({[len(m) for m in per_rank]}); "
            "every rank must pass the same model, sharded the same way"
        )
    copies: MeshCopies = {}
    for i, own in enumerate(mine):
        distinct = list(dict.fromkeys(meshes[i] for meshes in per_rank))
        held = [r for ranks in distinct for r in ranks]
        if len(held) != len(set(held)):
            raise NotImplementedError(
                f"DTensor meshes {distinct} overlap without being equal; full state dicts need "
                "every rank's mesh to be the same mesh or a disjoint copy of it"
            )
        copies[own] = distinct
    return copies


def _ranks_of(mesh: DeviceMesh) -> MeshRanks:
    return tuple(mesh.mesh.flatten().tolist())


def chunks_of(value: DTensor, copies: MeshCopies | None = None) -> list[Chunk]:
    """The chunk every rank holds, in mesh order, over every copy of ``value``'s mesh.

    Without ``copies`` only this rank's own mesh is known.
    """
    mesh = value.device_mesh
    own = _ranks_of(mesh)
    shape = tuple(value.shape)
    chunks = []
    for coord_index, coord in enumerate(itertools.product(*(range(n) for n in mesh.shape))):
        runs = [[(0, size)] if size else [] for size in shape]
        for mesh_dim, placement in enumerate(value.placements):
            split_factor = strided_split_factor(placement)  # before Shard: a subclass in old torch
            if split_factor is None and not isinstance(placement, Shard):
                continue  # Replicate
            dim = placement.dim % len(shape)
            runs[dim] = _split(runs[dim], mesh.shape[mesh_dim], coord[mesh_dim], split_factor or 1)
        frozen = tuple(tuple(r) for r in runs)
        for ranks in (copies or {}).get(own, [own]):
            chunks.append(Chunk(ranks[coord_index], frozen))
    return chunks


def _own_chunks(
    value: DTensor, name: str, copies: MeshCopies | None
) -> tuple[list[Chunk], torch.Tensor]:
    """Every rank's non-empty chunk, and this rank's local tensor checked against its own."""
    check_placements(name, value)
    local = local_tensor(value)
    chunks = chunks_of(value, copies)
    me = rank()
    for c in chunks:
        if c.rank == me and tuple(local.shape) != c.sizes:
            raise AssertionError(
                f"rank {me}: local shard of shape {tuple(local.shape)} does not match the "
                f"chunk {c.sizes} computed for placements {value.placements}"
            )
    return [c for c in chunks if c.numel > 0], local


def gather_to_rank0(
    value: torch.Tensor,
    device: torch.device,
    name: str = "tensor",
    copies: MeshCopies | None = None,
) -> torch.Tensor | None:
    """The full value of ``value`` as a new CPU tensor on rank 0; ``None`` elsewhere.

    Collective for a DTensor (every rank of the default group calls it in the
    same order); a plain tensor is taken as replicated and only copied on rank 0.
    ``name`` is used in errors; ``copies`` (``copies_by_mesh``) is needed when
    rank 0 is not on every rank's mesh.
    """
    me = rank()
    if not isinstance(value, DTensor):
        return value.detach().to("cpu", copy=True) if me == 0 else None
    chunks, local = _own_chunks(value, name, copies)
    senders: dict[tuple, Chunk] = {}
    for c in chunks:  # replicas: the lowest rank holding a chunk sends it
        if c.runs not in senders or c.rank < senders[c.runs].rank:
            senders[c.runs] = c
    if me != 0:
        if any(c.rank == me for c in senders.values()):
            dist.send(local.detach().to(device).contiguous(), dst=0)
        return None
    out = torch.empty(value.shape, dtype=value.dtype, device="cpu")
    staging = out if device.type == "cpu" else torch.empty_like(out, device=device)
    works = []
    for c in senders.values():
        boxes = c.boxes()
        if c.rank == 0:
            for local_at, full_at, sizes in boxes:
                _box(staging, full_at, sizes).copy_(_box(local, local_at, sizes))
            continue
        if len(boxes) == 1:
            view = _box(staging, boxes[0][1], c.sizes)
            if view.is_contiguous():
                works.append(dist.irecv(view, src=c.rank))
                continue
        # e.g. Shard(1) or a strided shard: one chunk at a time through a contiguous buffer
        buf = torch.empty(c.sizes, dtype=value.dtype, device=device)
        dist.recv(buf, src=c.rank)
        for local_at, full_at, sizes in boxes:
            _box(staging, full_at, sizes).copy_(_box(buf, local_at, sizes))
    for work in works:
        work.wait()
    if staging is not out:
        out.copy_(staging)
    return out


def scatter_from_rank0(
    full: torch.Tensor | None,
    target: torch.Tensor,
    device: torch.device,
    name: str = "tensor",
    copies: MeshCopies | None = None,
) -> None:
    """Write rank 0's ``full`` into ``target`` on every rank, in place.

    ``target`` is a DTensor (each rank receives its chunk) or a plain tensor
    (broadcast). Collective over the default group; ``full`` is read on rank 0
    only and must already have ``target``'s full shape. ``copies`` as for
    ``gather_to_rank0``.
    """
    me = rank()
    if not isinstance(target, DTensor):
        _broadcast_into(full, target, device)
        return
    chunks, local = _own_chunks(target, name, copies)
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
        boxes = c.boxes()
        if c.rank == 0:
            for local_at, full_at, sizes in boxes:
                _box(local, local_at, sizes).copy_(_box(source, full_at, sizes))
            continue
        if len(boxes) == 1:
            piece = _box(source, boxes[0][1], c.sizes)
            if piece.is_contiguous():
                works.append(dist.isend(piece, dst=c.rank))
                continue
        buf = torch.empty(c.sizes, dtype=source.dtype, device=device)
        for local_at, full_at, sizes in boxes:
            _box(buf, local_at, sizes).copy_(_box(source, full_at, sizes))
        dist.send(buf, dst=c.rank)
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
