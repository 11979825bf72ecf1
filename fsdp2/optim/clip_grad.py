"""``clip_grad_norm_`` on the local shards of DTensor gradients.

``torch.nn.utils.clip_grad_norm_`` works on sharded gradients as they are,
but pays DTensor's dispatch once per parameter and one all-reduce per
parameter. Here each rank takes the norm of its local shards with foreach
kernels and one all-reduce per mesh (per sharded mesh dim) combines them; the
same result on every rank, for any DTensor gradients (ours or upstream's
``fully_shard``). See [Note: Why local shards] in ``local_shard_step.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._torch_compat import foreach_mul, foreach_norm, local_tensor, strided_split_factor
from ..runtime.group.replica_slices import slices_of

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients of (sharded) parameters by their total norm, like ``torch.nn.utils``.

    Same arguments and result as ``torch.nn.utils.clip_grad_norm_``, for a
    model whose gradients are ``DTensor`` shards (and plain tensors, e.g.
    ignored parameters, taken as replicated): each rank takes the norm of its
    local shards with foreach kernels, and one all-reduce per mesh (per
    sharded mesh dim) combines them. Returns the total norm as a plain
    tensor, the same on every rank. ``foreach`` is accepted for signature
    compatibility; local shards always use foreach kernels.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    if any(isinstance(g, DTensor) and any(p.is_partial() for p in g.placements) for g in grads):
        # Partial values are not disjoint pieces: let DTensor reduce them first.
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite, foreach
        )
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            key = (g.device_mesh, _sharded_mesh_dims(g))
            if slices_of(p) is not None:  # each replica holds its slice only (zeros elsewhere)
                key = (g.device_mesh, (0, *key[1]))  # see [Note: Replica slices]
            buckets.setdefault(key, []).append(local_tensor(g))
        else:
            buckets.setdefault((None, ()), []).append(g)
    is_inf = math.isinf(norm_type)
    partials = []
    for (mesh, dims), locals_ in buckets.items():
        partial = _local_norm_power(locals_, norm_type)
        for dim in dims:
            op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
            dist.all_reduce(partial, op=op, group=mesh.get_group(dim))
        partials.append(partial)
    stacked = torch.stack([t.to(partials[0].device) for t in partials])
    total = stacked.max() if is_inf else stacked.sum().pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite, so they "
            "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    all_locals = [t for locals_ in buckets.values() for t in locals_]
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for t in all_locals:
        by_device.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), ts in by_device.items():
        foreach_mul(ts, coef.to(device))
    return total


def _sharded_mesh_dims(dtensor: DTensor) -> tuple[int, ...]:
    """Mesh dims over which the local values are disjoint pieces (reduce the norm there)."""
    return tuple(
        i
        for i, p in enumerate(dtensor.placements)
        # a strided shard (FSDP over a TP-sharded dim) is not a Shard on torch 2.13
        if p.is_shard() or p.is_partial() or strided_split_factor(p) is not None
    )


def _local_norm_power(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """max |x| (inf-norm) or sum |x|^p over ``tensors``, in float32 or wider, as a 0-dim tensor."""
    norms = []
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() > 0:  # empty shards add nothing (and have no inf-norm)
            by_device.setdefault((t.device, t.dtype), []).append(t)
    for ts in by_device.values():
        norms.extend(foreach_norm(ts, norm_type))
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    device = norms[0].device
    stacked = torch.stack([n.to(device, torch.promote_types(n.dtype, torch.float32)) for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum()
