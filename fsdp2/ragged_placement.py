"""The parameter-major layout's placement and its DTensor rules.

``RaggedShardBase`` is ``Shard(0)`` whose ranks hold given runs of rows
(``row_bounds``), not ``torch.chunk``'s: the base of ``fsdp2.RaggedShard``.
``keep_ragged_placements`` teaches DTensor's sharding propagation and
redistribution about it. Every private torch API they need is reached through
``_torch_compat/dtensor.py`` (``ShardWithOwnRows``, the propagation and planner
wrappers); this module holds the rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ._torch_compat import (
    ShardWithOwnRows,
    dtensor_spec,
    gather_rows_on_mesh_dim,
    is_dtensor_spec,
    is_strided_shard,
    op_schema_like,
    transform_info,
    tree_flatten,
    tree_unflatten,
    with_output_spec,
    wrap_redistribute_planning,
    wrap_sharding_propagation,
)


class RaggedShardBase(ShardWithOwnRows):
    """``Shard(0)`` whose ranks hold given runs of rows (``row_bounds``), not ``torch.chunk``'s.

    The base of ``fsdp2.RaggedShard`` (the parameter-major layout's
    placement). DTensor asks a ``Shard`` placement which rows each rank
    holds and how to gather or split them; this answers from ``row_bounds``
    (``W + 1`` row indices, rank ``r`` holding ``[row_bounds[r],
    row_bounds[r + 1])``), so ``full_tensor()``, ``redistribute`` to
    ``Replicate`` / ``Shard(0)`` and back, DCP's chunk metadata and
    serialization see the true layout. Two ragged placements are equal when
    their bounds are, and never equal to a plain ``Shard(0)`` (DTensor caches
    redistribution plans by spec equality: an equal ``Shard(0)`` spec would
    hand back ``torch.chunk``'s); only ``DTensorSpec``'s shard-order check,
    written ``placement != Shard(dim)``, sees it as not different from
    ``Shard(0)``. Pointwise sharding propagation labels its outputs plain
    ``Shard(0)``, so out-of-place DTensor math on these tensors is not
    supported: fsdp2 steps them on local tensors.
    """

    row_bounds: tuple[int, ...] = ()

    def _run(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s ``(first row, rows)``."""
        return self.row_bounds[rank], self.row_bounds[rank + 1] - self.row_bounds[rank]

    def _runs(self) -> list[tuple[int, int]]:
        """Each rank's ``(first row, rows)``, in the mesh dim's rank order."""
        return [self._run(rank) for rank in range(len(self.row_bounds) - 1)]

    def rows_of(self, rank: int) -> tuple[int, int]:
        start, rows = self._run(rank)
        return rows, start

    def _padded(self, rows: torch.Tensor, most: int) -> torch.Tensor:
        """``rows`` padded with zeros to ``most`` rows on the shard dim."""
        pad = most - rows.size(self.dim)
        if not pad:
            return rows
        return torch.nn.functional.pad(rows, [0, 0] * (rows.dim() - self.dim - 1) + [0, pad])

    def split(self, tensor: torch.Tensor, with_padding: bool, contiguous: bool) -> tuple:
        runs = self._runs()
        most = max(rows for _, rows in runs) if with_padding else 0
        shards, pads = [], []
        for start, size in runs:
            shard = tensor.narrow(self.dim, start, size)
            if with_padding:
                shard = self._padded(shard, most)
            shards.append(shard.contiguous() if contiguous else shard)
            pads.append(most - size if with_padding else 0)
        return shards, pads

    def gathered(self, local: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
        runs = self._runs()
        most = max(rows for _, rows in runs)
        gathered = gather_rows_on_mesh_dim(self._padded(local, most).contiguous(), mesh, mesh_dim)
        blocks = gathered.split(most, dim=self.dim)
        in_rows = sorted(range(len(runs)), key=lambda k: runs[k][0])  # the rank order, ragged
        return torch.cat([blocks[k].narrow(self.dim, 0, runs[k][1]) for k in in_rows], self.dim)

    def rows_for(self, local: torch.Tensor, shard_index: int) -> torch.Tensor:
        start, size = self._run(shard_index)
        return local.narrow(self.dim, start, size).clone()

    def _key(self) -> tuple:
        """What makes two ragged placements equal (their kind, dim and rows)."""
        return (RaggedShardBase, self.dim, self.row_bounds)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RaggedShardBase):
            return self._key() == other._key()
        # never equal to torch.chunk's Shard: DTensor's caches would hand back its plans
        return False if isinstance(other, Placement) else NotImplemented

    def __ne__(self, other: object) -> bool:
        if isinstance(other, RaggedShardBase):
            return not self == other
        # DTensorSpec checks its shard order with `placement != Shard(dim)`: same dim passes
        if isinstance(other, Shard) and not is_strided_shard(other):
            return other.dim != self.dim
        return True if isinstance(other, Placement) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())


class RowRuns(RaggedShardBase):
    """Runs of dim-0 rows dealt to a 1-D mesh's ranks in any order: rank ``k`` holds rows
    ``[runs[k][0], runs[k][0] + runs[k][1])``; the runs cover the rows once.

    The placement of optimizer state sharded across HSDP replicas
    (``enable_local_shard_step(shard_across_replicas=True)``, see [Note: Replica
    slices] in runtime/group/replica_slices.py): on the flattened ``(replicate,
    shard)`` mesh each rank holds its replica's slice of its shard's rows, so the
    runs follow the shards, then the replicas, not the ranks' order. The same
    DTensor rules as ``RaggedShard`` apply (``full_tensor()``, DCP's chunks).
    """

    def __init__(self, runs: tuple[tuple[int, int], ...]) -> None:
        super().__init__(0)
        keep_ragged_placements()
        self.runs = tuple((int(start), int(rows)) for start, rows in runs)

    def _key(self) -> tuple:
        return (RowRuns, self.runs)

    def _run(self, rank: int) -> tuple[int, int]:
        return self.runs[rank]

    def _runs(self) -> list[tuple[int, int]]:
        return list(self.runs)

    def __repr__(self) -> str:
        return f"RowRuns({self.runs})"

    __str__ = __repr__

    def __reduce__(self) -> tuple:
        return (RowRuns, (self.runs,))

    def __hash__(self) -> int:
        return hash(self._key())


_INSTALLED = False


def keep_ragged_placements() -> None:
    """Teach DTensor's sharding propagation the ragged placement; installed once, on first use.

    DTensor knows ``torch.chunk``'s layout only: on an op whose inputs are
    ``RaggedShardBase`` DTensors it would label the outputs plain ``Shard(0)``
    (values in ragged rows: a silently wrong tensor) or refuse in-place ops.
    The wrapped propagator propagates an op with ragged inputs as if they
    were ``Shard(0)``; it runs when that needs no redistribution of a ragged
    input and every sharded output keeps its source's rows on dim 0
    (elementwise and foreach ops, casts, copies, reductions over other dims
    or to a scalar), its outputs then carry the ragged placement back; any
    other op raises ``NotImplementedError`` (go through ``full_tensor()`` or
    DCP). Redistribute plans between ragged rows and ``Shard(0)`` of the same
    dim go through ``Replicate`` (torch's plan would take them for a no-op).
    Ops on other DTensors take the original paths unchanged.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    wrap_sharding_propagation(_keeping_ragged)
    wrap_redistribute_planning(_through_replicate)
    _INSTALLED = True


def _ragged_of(spec: object) -> tuple | None:
    if is_dtensor_spec(spec) and any(isinstance(p, RaggedShardBase) for p in spec.placements):
        return spec.placements
    return None


def _plain(spec: object) -> object:
    if _ragged_of(spec) is None:
        return spec
    placements = tuple(
        Shard(p.dim) if isinstance(p, RaggedShardBase) else p for p in spec.placements
    )
    return dtensor_spec(spec.mesh, placements, spec.tensor_meta)


def _refusal(op_schema: Any) -> NotImplementedError:
    return NotImplementedError(
        f"{op_schema.op} on a DTensor with a RaggedShard placement (fsdp2's "
        "parameter-major layout): DTensor has no rule for it; call full_tensor() "
        "or redistribute to Replicate first, or work on to_local()"
    )


def _spec_lists(op_schema: Any) -> list:
    return [a for a in op_schema.args_schema if isinstance(a, (list, tuple))
            and a and all(is_dtensor_spec(x) for x in a)]


def _same_layouts(op_schema: Any) -> bool:
    """Operands meet elementwise (foreach lists: the i-th of each list): sharded operands
    of one place must share one ragged placement and shape; the rest are replicated."""
    lists = _spec_lists(op_schema)
    n = len(lists[0]) if lists else 1
    if any(len(a) != n for a in lists):
        return False
    singles = [a for a in tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))[0]
               if is_dtensor_spec(a) and not any(a is x for lst in lists for x in lst)]
    for i in range(n):
        specs = [lst[i] for lst in lists] + singles
        sharded = [s for s in specs if any(not p.is_replicate() for p in s.placements)]
        if not sharded:
            continue
        first = sharded[0]
        if _ragged_of(first) is None or any(
            s.placements != first.placements or s.shape != first.shape for s in sharded
        ):
            return False
    return True


def _plain_tree(tree: Any) -> Any:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([_plain(x) for x in leaves], spec)


def _keeping_ragged(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``original`` propagation, with ragged inputs taken as ``Shard(0)`` and put back."""

    def propagate(op_schema: Any) -> Any:
        sources = [s for s in op_schema.args_spec if _ragged_of(s) is not None]
        if not sources:
            return original(op_schema)
        if not _same_layouts(op_schema):
            raise _refusal(op_schema)
        plain_schema = op_schema_like(
            op_schema, _plain_tree(op_schema.args_schema), _plain_tree(op_schema.kwargs_schema)
        )
        result = original(plain_schema)
        refuse = result.needs_redistribute and any(
            _ragged_of(s) is not None for s in op_schema.args_spec
        )
        outputs, tree = tree_flatten(result.output_spec)
        lists = _spec_lists(op_schema)
        fixed = []
        for i, out in enumerate(outputs):
            # an output's source: the ragged operand at its place in the foreach lists
            # (the i-th of each list), else the first ragged operand
            place = [lst[i] for lst in lists if len(lst) == len(outputs)
                     and _ragged_of(lst[i]) is not None]
            src = place[0] if place else sources[0]
            if is_dtensor_spec(out) and any(isinstance(p, Shard) for p in out.placements):
                rows_kept = (
                    out.placements == _plain(src).placements
                    and out.tensor_meta is not None and src.tensor_meta is not None
                    and out.tensor_meta.shape[:1] == src.tensor_meta.shape[:1]
                )
                if not rows_kept:
                    refuse = True
                    break
                out = dtensor_spec(out.mesh, src.placements, out.tensor_meta)
            fixed.append(out)
        if refuse:
            raise _refusal(op_schema)
        # a new object: the plain result may be cached for real Shard(0) inputs
        return with_output_spec(result, tree_unflatten(fixed, tree))

    return propagate


def _through_replicate(gen: Callable[..., Any]) -> Callable[..., Any]:
    """``gen``'s redistribute plans, except between ragged rows and ``torch.chunk``'s."""

    def planned(src_spec: Any, dst_spec: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = list(zip(src_spec.placements, dst_spec.placements))
        crossing = [
            i for i, (s, d) in enumerate(pairs)
            if (isinstance(s, RaggedShardBase) or isinstance(d, RaggedShardBase))
            and isinstance(s, Shard) and isinstance(d, Shard) and not (
                isinstance(s, RaggedShardBase) and isinstance(d, RaggedShardBase) and s == d
            )
        ]
        if not crossing:
            return gen(src_spec, dst_spec, *args, **kwargs)
        if len(pairs) != 1:  # the layout runs on 1-D meshes only
            raise NotImplementedError(
                f"redistribute {src_spec.placements} -> {dst_spec.placements}: a RaggedShard "
                "placement converts on a 1-D mesh only"
            )
        src, dst = pairs[0]
        shape = list(src_spec.shape)
        return [transform_info(0, (src, Replicate()), shape),
                transform_info(0, (Replicate(), dst), shape)]

    return planned
