"""Which rank orthogonalizes which Muon matrix, and how its rows travel there.

[Note: Muon owners]
Newton-Schulz needs a whole matrix, and a sharded parameter holds only some
of its rows (or columns) on each rank of its shard group. The naive fix
gathers every matrix on every rank (``full_tensor()``) and runs the same
Newton-Schulz ``W`` times. Instead each matrix gets one *owner* rank in its
shard group: the ranks send the owner their rows of the momentum-updated
gradient, the owner alone orthogonalizes, and sends each rank its rows of the
result back (see [Note: Muon on sharded parameters] in ``muon.py``).

Owners are chosen once, identically on every rank, from metadata alone
(shapes, placements, meshes): matrices sorted by Newton-Schulz cost, largest
first, each given to the least-loaded rank so far (longest-processing-time
greedy; ties go to the lower rank). A 3-D parameter is a stack of matrices,
one per leading index (stacked expert weights): sharded over that leading
dim, each rank already holds its experts whole and orthogonalizes them where
they are, and the greedy starts from that load.

A plain tensor or an all-``Replicate`` DTensor is whole on every rank; every
rank orthogonalizes it, as ``torch.optim.Muon`` would. A matrix whose rows are
all on one rank of its group (``RaggedShard("whole")``, which cuts only
between parameters) is orthogonalized where it is, by that rank alone: it
needs no communication, and its owner is the planner's choice, not the
greedy's (the greedy starts from that load).

[Note: Muon on expert-parallel stacks]
A mixture-of-experts stack ``(E, out, in)`` sharded as torchtitan shards it
is split over two mesh dims: ``ep`` hands each rank a block of experts
(``Shard(0)``), FSDP's ``efsdp`` then splits either the experts again
(``Shard(0)``, which DTensor records as ``_StridedShard(0)`` on ``efsdp``) or
each expert's rows (``Shard(1)``). Mesh dims that split the expert dim never
cut a matrix, so they need no communication: a rank's local stack is whole
experts of its own. Only a mesh dim on a matrix dim (at most one) moves rows,
over its own group, with the *local* experts as the stack; every rank of
that group holds the same experts, since they share their ``ep`` coordinate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._torch_compat import local_tensor, strided_split_factor
from ..ragged_placement import RaggedShardBase

__all__ = ["MuonLoad", "Plan", "assign_owners", "check_param", "layout_of"]


@dataclass
class ParamLayout:
    """How one Muon parameter is laid out over its shard group."""

    name: str
    param: torch.Tensor
    # None: the whole parameter is on every rank (plain tensor, all Replicate)
    group: dist.ProcessGroup | None = None
    rank: int = 0  # this rank's index in ``group``
    world_size: int = 1
    shard_dim: int | None = None  # tensor dim the group splits
    sizes: list[int] = field(default_factory=list)  # rows (or columns) per rank, torch.chunk
    holder: int | None = None  # the rank of ``group`` holding every row of a 2-D matrix
    comm_device: torch.device | None = None  # where collectives and Newton-Schulz run
    # experts this rank steps (a 3-D stack whose expert dim is split over other mesh dims
    # holds fewer than p.shape[0]); None: p.shape[0]
    local_experts: int | None = None

    @property
    def offsets(self) -> list[int]:
        return [sum(self.sizes[:j]) for j in range(self.world_size)]

    @property
    def matrix_shape(self) -> tuple[int, int]:
        return tuple(self.param.shape[-2:])  # type: ignore[return-value]

    @property
    def moves_rows(self) -> bool:
        """Whether a matrix is split over ranks (else each rank holds whole matrices)."""
        return (
            self.group is not None and self.holder is None
            and self.shard_dim >= self.param.dim() - 2
        )

    @property
    def matrix_shard_dim(self) -> int:
        return self.shard_dim - (self.param.dim() - 2)


@dataclass
class Unit:
    """One matrix: a 2-D parameter, or one expert of a 3-D one."""

    layout: ParamLayout
    index: int  # position in the plan (the order every rank agrees on)
    expert: int | None  # index into the *local* leading dim of a 3-D parameter
    owner: int | None  # rank in the layout's group that orthogonalizes it; None: every rank
    cost: float


@dataclass
class MuonLoad:
    """Newton-Schulz work per rank of one shard group, in multiply-add flops per step."""

    group_ranks: list[int]  # global ranks of the shard group
    flops: list[float]  # per rank of the group, every matrix it orthogonalizes
    total: float  # the group's whole work (what every rank does under full_tensor())

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.flops) / len(self.flops)
        return max(self.flops) / mean if mean else 1.0


def ns_cost(shape: tuple[int, int], ns_steps: int) -> float:
    """Flops of ``ns_steps`` Newton-Schulz iterations on one matrix (2 per multiply-add)."""
    small, large = sorted(shape)
    # X X^T (s*s*l), B = bA + cA^2 (s^3), aX + B X (s*s*l)
    return ns_steps * 2.0 * (2 * small * small * large + small**3)


def check_param(p: torch.Tensor, name: str) -> None:
    """Raise for a parameter ``fsdp2.Muon`` cannot step, naming it and the fix."""
    if p.dim() not in (2, 3):
        raise ValueError(
            f"fsdp2.Muon: parameter {name} has shape {tuple(p.shape)}; Muon orthogonalizes "
            "2-D matrices (or 3-D stacks of them, one per expert). Put 0-D/1-D parameters "
            "(norms, biases) and embeddings/output heads in a second optimizer, e.g. "
            "torch.optim.AdamW, as the Muon recipe does"
        )
    if torch.is_complex(p):
        raise ValueError(f"fsdp2.Muon: parameter {name} is complex; Muon supports real matrices")
    if not isinstance(p, DTensor):
        return
    placements = p.placements
    where = f"parameter {name} (shape {tuple(p.shape)}, placements {tuple(placements)})"
    expert_dims, _ = _expert_parallel_dims(p)
    if expert_dims:  # see [Note: Muon on expert-parallel stacks]
        placements = tuple(pl for i, pl in enumerate(placements) if i not in expert_dims)
    if any(strided_split_factor(pl) is not None for pl in placements):
        raise NotImplementedError(
            f"fsdp2.Muon: {where} is sharded by tensor parallelism and FSDP on the same dim; "
            "fsdp2.Muon orthogonalizes matrices sharded over one mesh dim (FSDP's Shard(0), "
            "HSDP's (Replicate(), Shard(0))). Keep tensor-parallel matrices out of this optimizer "
            "(step them with torch.optim.Muon on full_tensor() copies), or shard them with "
            "fully_shard alone"
        )
    if any(pl.is_partial() for pl in placements):
        raise ValueError(
            f"fsdp2.Muon: {where} holds partial (unreduced) values on its mesh "
            f"{p.device_mesh}; Muon needs each rank's values to be rows of the matrix. "
            "Pass the sharded parameters of fully_shard (Shard(0) over the mesh)"
        )
    shard_dims = [i for i, pl in enumerate(placements) if pl.is_shard()]
    if len(shard_dims) > 1:
        tensor_dims = {placements[i].dim for i in shard_dims}
        if len(tensor_dims) > 1:
            raise NotImplementedError(
                f"fsdp2.Muon: {where} is sharded over several mesh dims on different tensor dims "
                "(tensor parallelism); fsdp2.Muon orthogonalizes matrices sharded over one mesh "
                "dim (FSDP's Shard(0), HSDP's (Replicate(), Shard(0))). Keep tensor-parallel "
                "matrices out of this optimizer (step them with torch.optim.Muon on "
                "full_tensor() copies), or shard them with fully_shard alone"
            )
        raise ValueError(
            f"fsdp2.Muon: {where} is sharded over {len(shard_dims)} mesh dims of "
            f"{p.device_mesh}; fsdp2.Muon moves rows within one shard group. Shard over a "
            "1-D mesh (or HSDP's (replicate, shard) mesh), e.g. fully_shard(..., "
            "mesh=init_device_mesh(device_type, (world_size,)))"
        )
    if p.device_mesh.get_coordinate() is None:
        raise ValueError(
            f"fsdp2.Muon: {where} lives on mesh {p.device_mesh}, which does not include "
            f"rank {dist.get_rank()}; give each rank an optimizer over the parameters it holds"
        )


def _splits_dim0(placement) -> bool:
    """Whether ``placement`` splits tensor dim 0 (``Shard(0)`` or a strided shard of it)."""
    if strided_split_factor(placement) is not None or placement.is_shard():
        return placement.dim == 0
    return False


def _expert_parallel_dims(p: DTensor) -> tuple[list[int], int | None]:
    """(mesh dims splitting the expert dim, the one mesh dim splitting rows) of an expert-
    parallel stack: a 3-D DTensor sharded over more than one mesh dim, at least one of them
    on dim 0; ``([], None)`` for anything else (see [Note: Muon on expert-parallel stacks])."""
    if p.dim() != 3:
        return [], None
    sharded = [i for i, pl in enumerate(p.placements)
               if pl.is_shard() or strided_split_factor(pl) is not None]
    experts = [i for i in sharded if _splits_dim0(p.placements[i])]
    rows = [i for i in sharded if i not in experts]
    if len(sharded) < 2 or not experts or len(rows) > 1:
        return [], None
    return experts, (rows[0] if rows else None)


def layout_of(p: torch.Tensor, name: str) -> ParamLayout:
    """The layout of a parameter that passed ``check_param``."""
    from ..runtime.meshes.mesh import device_for

    layout = ParamLayout(name, p)
    if not isinstance(p, DTensor):
        return layout
    mesh_dims = [i for i, pl in enumerate(p.placements) if pl.is_shard()]
    mesh = p.device_mesh
    expert_dims, rows_dim = _expert_parallel_dims(p)
    if expert_dims:  # see [Note: Muon on expert-parallel stacks]
        layout.local_experts = local_tensor(p).shape[0]
        mesh_dims = [rows_dim] if rows_dim is not None else []
    if not mesh_dims or mesh.size(mesh_dims[0]) == 1:
        layout.comm_device = device_for(mesh)
        return layout
    mesh_dim = mesh_dims[0]
    shard_dim = p.placements[mesh_dim].dim
    shard_dim = shard_dim + p.dim() if shard_dim < 0 else shard_dim
    size, world = p.shape[shard_dim], mesh.size(mesh_dim)
    per = math.ceil(size / world)
    layout.group = mesh.get_group(mesh_dim)
    layout.rank = mesh.get_local_rank(mesh_dim)
    layout.world_size = world
    layout.shard_dim = shard_dim
    layout.sizes = [max(0, min(per, size - j * per)) for j in range(world)]
    placement = p.placements[mesh_dim]
    if isinstance(placement, RaggedShardBase):  # the parameter-major layout's own rows
        bounds = placement.row_bounds
        layout.sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    holders = [j for j, n in enumerate(layout.sizes) if n]
    if p.dim() == 2 and len(holders) == 1:  # whole on one rank: stepped there, nothing moves
        layout.holder = holders[0]
    layout.comm_device = device_for(mesh)
    return layout


@dataclass
class Plan:
    """Every matrix with its owner, and the Newton-Schulz work that gives each rank."""

    units: list[Unit]
    loads: list[MuonLoad]


def assign_owners(layouts: list[ParamLayout], ns_steps: list[int]) -> Plan:
    """Every matrix of ``layouts`` as a ``Unit`` with its owner (see [Note: Muon owners])."""
    units: list[Unit] = []
    loads: dict[int, MuonLoad] = {}  # by id(group)
    shared = 0.0  # whole on every rank: every rank orthogonalizes it
    movable: list[Unit] = []
    for layout, steps in zip(layouts, ns_steps):
        cost = ns_cost(layout.matrix_shape, steps)
        p = layout.param
        num_experts = p.shape[0] if layout.local_experts is None else layout.local_experts
        experts = [None] if p.dim() == 2 else list(range(num_experts))
        if layout.group is None:
            units += [Unit(layout, len(units) + i, e, None, cost) for i, e in enumerate(experts)]
            shared += cost * len(experts)
            continue
        group = layout.group
        if id(group) not in loads:
            ranks = dist.get_process_group_ranks(group)
            loads[id(group)] = MuonLoad(ranks, [0.0] * layout.world_size, 0.0)
        load = loads[id(group)]
        load.total += cost * len(experts)
        if layout.holder is not None:  # a matrix whole on one rank: that rank steps it
            load.flops[layout.holder] += cost
            if layout.rank == layout.holder:
                units.append(Unit(layout, len(units), None, layout.rank, cost))
            continue
        if not layout.moves_rows:
            # 3-D sharded over experts: rank j holds sizes[j] experts whole
            for j, n in enumerate(layout.sizes):
                load.flops[j] += n * cost
            units += [
                Unit(layout, len(units) + e, e, layout.rank, cost)
                for e in range(layout.sizes[layout.rank])
            ]
            continue
        for e in experts:
            unit = Unit(layout, len(units), e, -1, cost)
            units.append(unit)
            movable.append(unit)
    for unit in sorted(movable, key=lambda u: (-u.cost, u.index)):
        flops = loads[id(unit.layout.group)].flops
        unit.owner = min(range(len(flops)), key=lambda j: (flops[j], j))
        flops[unit.owner] += unit.cost
    reports = list(loads.values())
    if not reports:
        rank = dist.get_rank() if dist.is_initialized() else 0
        reports = [MuonLoad([rank], [0.0], 0.0)]
    for report in reports:
        report.flops = [f + shared for f in report.flops]
        report.total += shared
    return Plan(units, reports)
