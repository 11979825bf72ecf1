"""HSDP with the optimizer state sharded across replicas: each replica rank owns 1/R of a shard.

[Note: Replica slices]
Plain HSDP all-reduces each group's reduce-scattered gradient over the
``replicate`` dim, and every replica steps its whole shard with a whole copy
of the shard's optimizer state (Adam: 8 bytes per parameter, R times over).
With ``enable_local_shard_step(optimizer, shard_across_replicas=True)`` the
group's flat buffer (one dtype) is cut into R contiguous *slices* of about
``ceil(N / R)`` elements, each cut between two rows of the parameter it falls
in (``row_cuts``; the collectives pad each slice to the largest); replica
rank ``r`` owns slice ``r`` and:

- the all-reduce becomes a reduce-scatter over ``replicate`` (``reduce``):
  this rank's slice of the flat gradient holds the reduced values, the rest
  of the flat gradient is zeroed (so a norm over it counts each element once
  across replicas, see clip_grad.py);
- the optimizer steps only the slice (optim/replica_sharded_step.py) and
  keeps only the slice's state;
- after the step, one all-gather over ``replicate`` of the updated slices
  (``start_gather``, asynchronous) rewrites the whole buffer. ``step()``
  waits for it (``wait``) before it returns, unless
  ``overlap_replica_gather=True``: then it runs behind the next forward and
  is waited for before the parameters are next used by fsdp2: the group's
  next unshard (on the all-gather stream's side, before the unshard's own
  all-gather), its ``state_dict``, ``summon_full_params``, the next step.
  Anything else reading the parameters (an EMA, ``full_tensor()``) would
  see the slices of other replicas from before the step: the default waits
  because nothing can hook such reads.

A reduce-scatter and an all-gather move the bytes of one ring all-reduce, so
the communication per step is plain HSDP's. With R = 2 the reduced values are
bit-identical to the all-reduce's (one addition of two operands); for R > 2 the
backend may sum in another order (within one rounding).

A group whose gradients do not cover the whole buffer (frozen parameters in
it) keeps the all-reduce (every slice is then exact too) and is still stepped
in slices and gathered.

[Note: Replica slices in state dicts]
Cut between rows, a rank's slice holds a run of whole rows of each parameter
(maybe none): on the flattened ``(replicate, shard)`` mesh, rank ``k`` holds
rows ``[a_k, a_k + n_k)``, the runs following the shards, then the replicas.
``RowRuns`` (ragged_placement.py) is the placement that names them, so the
optimizer's state dict gives each parameter's state as a DTensor of this true
layout (a view of the slice's live state) instead of gathering it over
replicas: ``full_tensor()``, DCP's chunk offsets and resharding need nothing
else. ``enable`` makes the flattened mesh (a process group over the HSDP
mesh's ranks, collective, like any mesh slicing) and gathers every rank's runs
once. A group where that cannot be said (another shard dim, tensor-parallel
parameters) keeps plain HSDP's layout in state dicts, gathered over replicas.

The parameter-major layout slices the same way: its flat buffer is the
rank's ``S`` elements of the plan (whole parameters with gaps between), its
reduce-scattered gradient has the same layout, and the flat runs step their
parameters' elements in the slice, gaps skipped (flat_run.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ..._torch_compat import fake_tensors_active, flatten_mesh, local_tensor
from ...ragged_placement import RowRuns
from ..comm import collectives
from ..comm.comm_context import CommContext
from ..storage.flat_shard import FlatShard, flat_shard_of
from ..storage.param import FSDPParam


class ReplicaSlices:
    """This replica rank's slice of one group's flat buffer, and the collectives over replicas."""

    def __init__(self, flat: FlatShard, group: dist.ProcessGroup) -> None:
        self.flat = flat
        self.group = group
        self.num_replicas = dist.get_world_size(group)
        self.replica_rank = dist.get_rank(group)
        self.numel = flat.layout.numel
        self.bounds = row_cuts(flat, self.num_replicas)
        self.sizes = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
        self.chunk = max(self.sizes)  # each replica's part of the collectives, padded to it
        self.start, self.stop = self.bounds[self.replica_rank], self.bounds[self.replica_rank + 1]
        self._pending: tuple | None = None  # (work, output, input) of the post-step all-gather
        # Where each rank's slice lies, for state dicts (set by enable, see _state_layout)
        self.state_mesh: Any = None
        self.state_placements: list[RowRuns] | None = None

    def placement_of(self, param: torch.Tensor) -> RowRuns | None:
        """The ``RowRuns`` naming each rank's rows of ``param`` (one of the group's sharded
        parameters) in state dicts; ``None`` where the slices are no runs of rows."""
        if self.state_placements is None:
            return None
        index = next(i for i, p in enumerate(self.flat.fsdp_params) if p.sharded_param is param)
        return self.state_placements[index]

    def covers(self, flat_grad: torch.Tensor) -> bool:
        """Whether ``flat_grad`` is laid out as the whole buffer (every slot has a gradient)."""
        return flat_grad.numel() == self.numel

    def _even(self) -> bool:
        return self.chunk * self.num_replicas == self.numel

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (the buffer's layout) with each replica's slice at ``r * chunk``."""
        if self._even():
            return flat
        out = flat.new_zeros(self.chunk * self.num_replicas)
        for r, (a, n) in enumerate(zip(self.bounds, self.sizes)):
            out[r * self.chunk : r * self.chunk + n].copy_(flat[a : a + n])
        return out

    def unpadded(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """The inverse of ``padded``: every replica's slice of ``gathered`` into ``out``."""
        if self._even():
            out.copy_(gathered)
            return
        for r, (a, n) in enumerate(zip(self.bounds, self.sizes)):
            out[a : a + n].copy_(gathered[r * self.chunk : r * self.chunk + n])

    def reduce(self, flat_grad: torch.Tensor, op: object) -> None:
        """Reduce-scatter ``flat_grad`` over replicas: the slice reduced, the rest zeroed."""
        out = flat_grad.new_empty(self.chunk)
        collectives.reduce_scatter(out, self.padded(flat_grad), self.group, op)
        flat_grad[: self.start].zero_()
        flat_grad[self.stop :].zero_()
        flat_grad[self.start : self.stop].copy_(out[: self.stop - self.start])

    def start_gather(self) -> None:
        """After the step: all-gather the updated slices over replicas (asynchronously)."""
        self.wait()
        buffer = self.flat.buffer
        inp = buffer.new_zeros(self.chunk)  # this replica's slice, padded
        inp[: self.stop - self.start].copy_(buffer[self.start : self.stop])
        out = buffer.new_empty(self.chunk * self.num_replicas)
        work = collectives.all_gather(out, inp, self.group, async_op=True)
        self._pending = (work, out, inp, buffer)

    @property
    def gathering(self) -> bool:
        return self._pending is not None

    def wait(self, ctx: CommContext | None = None) -> None:
        """Finish the post-step all-gather, if one is in flight: the buffer is whole again.

        On the current stream; ``ctx``: through its named wait (an unshard's,
        on the copy-in stream, see [Note: Streams] in comm_context.py).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        work, out, _, buffer = pending
        if work is not None:
            if ctx is not None:
                ctx.wait_work("replica_gather->copy_in", work)
            else:
                work.wait()
        self.unpadded(out, buffer)


def row_cuts(flat: FlatShard, num_replicas: int) -> list[int]:
    """``num_replicas + 1`` cuts of ``flat``'s buffer into nearly equal slices, between rows.

    Each even cut ``r * ceil(N / R)`` moves to the nearest row boundary of the
    parameter whose slot holds it (a cut in padding or between slots stays), so
    a replica's slice holds whole rows of each parameter: what a placement can
    name (see [Note: Replica slices]).
    """
    numel = flat.layout.numel
    chunk = -(-numel // num_replicas)
    slots = [  # a row: one dim-0 slice of the local shard (also for other shard dims)
        (flat.layout.starts[i], flat.layout.stops[i], max(1, math.prod(p.local_size[1:])))
        for i, p in enumerate(flat.fsdp_params)
        if flat.layout.stops[i] > flat.layout.starts[i]
    ]
    cuts = [0]
    for r in range(1, num_replicas):
        cut = min(r * chunk, numel)
        for start, stop, row in slots:
            if start < cut < stop:
                cut = min(stop, start + (cut - start + row // 2) // row * row)
                break
        cuts.append(max(cut, cuts[-1]))
    return cuts + [numel]


def of_params(fsdp_params: list[FSDPParam]) -> ReplicaSlices | None:
    """The replica slices of the group holding ``fsdp_params``, or ``None`` (plain HSDP)."""
    if not fsdp_params:
        return None
    flat = flat_shard_of(fsdp_params[0].sharded_param)
    return None if flat is None else flat.replica_slices  # type: ignore[return-value]


def slices_of(param: torch.Tensor) -> ReplicaSlices | None:
    """The replica slices of the group whose flat buffer ``param`` views, or ``None``."""
    flat = flat_shard_of(param)
    return None if flat is None else flat.replica_slices  # type: ignore[return-value]


def enable(param: torch.Tensor, name: str) -> ReplicaSlices | None:
    """Shard the optimizer state of ``param``'s group across replicas; ``None`` for a plain tensor.

    Raises ``ValueError`` for a parameter not on a 2-D (replicate, shard) mesh,
    ``NotImplementedError`` for a DTensor outside fsdp2's flat buffers or a
    group of several dtypes. ``name`` names the parameter in errors.
    """
    flat = flat_shard_of(param)
    if not isinstance(param, DTensor):
        return None  # a plain (replicated) tensor steps as it is
    if flat is None:
        raise NotImplementedError(
            f"shard_across_replicas=True: parameter {name} is a DTensor outside fsdp2's flat "
            "shard buffers (sharded by torch's fully_shard, or by hand); shard its module with "
            "fsdp2.fully_shard, or drop the option"
        )
    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 2 or not isinstance(placements[0], Replicate) or placements[1].is_replicate():
        raise ValueError(
            f"shard_across_replicas=True needs HSDP: a 2-D (replicate, shard) mesh; parameter "
            f"{name} is on a {mesh.ndim}-D mesh with placements {tuple(placements)}. With a 1-D "
            "mesh the optimizer state is already sharded over every rank: drop the option"
        )
    if flat.layout.mixed:
        raise NotImplementedError(
            f"shard_across_replicas=True: parameter {name} is in a group of several dtypes "
            "(one uint8 flat buffer); give the parameters of other dtypes their own fully_shard "
            "call, or drop the option"
        )
    if local_tensor(param).device != flat.buffer.device:
        raise NotImplementedError(
            f"shard_across_replicas=True: parameter {name} is not on its group's buffer's device"
        )
    if flat.replica_slices is None:
        slices = ReplicaSlices(flat, mesh.get_group(0))
        slices.state_mesh, slices.state_placements = _state_layout(slices, mesh)
        flat.replica_slices = slices
    return flat.replica_slices  # type: ignore[return-value]


def _state_layout(slices: ReplicaSlices, mesh: Any) -> tuple[Any, list[RowRuns] | None]:
    """The flattened mesh and each parameter's ``RowRuns`` on it (see [Note: Replica slices
    in state dicts]); ``(None, None)`` where a slice is not a run of rows of a parameter.

    Collective over the mesh's ranks (``enable`` runs on every rank): the flattened mesh's
    group is made, and the ranks' runs are gathered over it.
    """
    mine = _slice_rows(slices)
    if not mesh.mesh_dim_names or fake_tensors_active():  # (the planner takes no state dicts)
        return None, None
    flat_mesh = flatten_mesh(mesh, "_".join(mesh.mesh_dim_names) + "_state")
    everyone: list = [None] * flat_mesh.size()
    dist.all_gather_object(everyone, mine, group=flat_mesh.get_group())
    if any(rows is None for rows in everyone):
        return None, None
    count = len(slices.flat.fsdp_params)
    return flat_mesh, [RowRuns(tuple(rows[i] for rows in everyone)) for i in range(count)]


def _slice_rows(slices: ReplicaSlices) -> list[tuple[int, int]] | None:
    """Per parameter of the group, ``(first row, rows)`` of the full parameter in this
    rank's slice; ``None`` unless each is a run of dim-0 rows of a plain (not model-parallel)
    parameter in the flat buffer."""
    flat, out = slices.flat, []
    for i, p in enumerate(flat.fsdp_params):
        if not p.in_flat or p.shard_dim != 0 or p.tp_spec is not None or p.dp_dims:
            return None
        row = max(1, p.row_numel)
        start = flat.layout.starts[i]
        real = start + p.local_rows * row  # past it: padding rows
        lo, hi = (min(max(cut, start), real) for cut in (slices.start, slices.stop))
        if (lo - start) % row or (hi - lo) % row:
            return None
        first = p.layout.row_start if p.ragged else min(
            p.layout.rank * p.layout.shard_rows, p.layout.size[0]
        )
        out.append((first + (lo - start) // row, (hi - lo) // row))
    return out


def trainable_outside(slices: ReplicaSlices, param_ids: set[int]) -> list[str]:
    """Names of the group's parameters that require gradients and are not in ``param_ids``."""
    return [
        p.fqn for p in slices.flat.fsdp_params
        if p.sharded_param.requires_grad and id(p.sharded_param) not in param_ids
    ]


def disable(slices: ReplicaSlices) -> None:
    """Back to plain HSDP: the pending all-gather finishes, the group all-reduces again."""
    slices.wait()
    slices.flat.replica_slices = None
