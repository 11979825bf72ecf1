"""Optimizer step and gradient clipping on the local shards of DTensor parameters.

[Note: Why local shards]
``torch.optim`` and ``torch.nn.utils.clip_grad_norm_`` work on sharded
``DTensor`` parameters as they are, but every foreach kernel then goes
through DTensor's dispatcher (sharding propagation, unwrapping, rewrapping)
once per op. For elementwise optimizers (SGD, Adam, AdamW, ...) the result on
a ``Shard`` placement is exactly the same math on each rank's local tensor,
so we run the step on the plain local tensors and only rewrap the optimizer
state. The state stays keyed by the DTensor parameters with DTensor values,
so ``optimizer.state_dict()`` and ``torch.distributed.checkpoint`` see the
same thing as without the fast path. The grad norm needs one all-reduce per
mesh instead of one per parameter.

Both work on any DTensor parameters (ours or upstream's ``fully_shard``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._torch_compat import (
    dtensor_like,
    foreach_mul,
    foreach_norm,
    local_tensor,
    strided_split_factor,
)

__all__ = ["clip_grad_norm_", "enable_local_shard_step"]


class LocalShardStepHandle:
    """Returned by :func:`enable_local_shard_step`; ``remove()`` turns the fast path off."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def enable_local_shard_step(optimizer: torch.optim.Optimizer) -> LocalShardStepHandle:
    """Make ``optimizer.step()`` run on the plain local shards of its DTensor parameters.

    The same updates, bit for bit, as stepping on the DTensors, with far less
    CPU overhead per step. Only for elementwise optimizers (SGD, Adam, AdamW,
    Adagrad, RMSprop, ...): an optimizer that mixes elements across a
    parameter (e.g. one that takes a matrix norm of the whole parameter) must
    not use it. Parameter groups holding anything but DTensor parameters whose
    gradients share the parameter's placements are stepped as usual.

    Example::

        optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
        fsdp2.enable_local_shard_step(optim)
        ...
        optim.step()  # unchanged call sites; state_dict() still holds DTensors
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"enable_local_shard_step expects a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    swap = _LocalSwap(optimizer)
    return LocalShardStepHandle(
        [
            optimizer.register_step_pre_hook(swap.to_local),
            optimizer.register_step_post_hook(swap.to_dtensor),
        ]
    )


class _LocalSwap:
    """Swaps an optimizer's DTensor parameters (and state) for local tensors around ``step``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # (param group, its original params, [(dtensor param, local tensor)])
        self._swapped: list[tuple[dict, list, list[tuple[DTensor, torch.Tensor]]]] = []

    def to_local(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        state = optimizer.state
        for group in optimizer.param_groups:
            params = group["params"]
            if not _all_local_steppable(params):
                continue
            pairs = []
            for p in params:
                local = local_tensor(p).detach()
                grad = p.grad
                local.grad = None if grad is None else local_tensor(grad)
                if p in state:
                    state[local] = {
                        k: local_tensor(v) if isinstance(v, DTensor) else v
                        for k, v in state.pop(p).items()
                    }
                pairs.append((p, local))
            group["params"] = [local for _, local in pairs]
            self._swapped.append((group, params, pairs))

    def to_dtensor(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        state = optimizer.state
        for group, params, pairs in self._swapped:
            for p, local in pairs:
                local.grad = None
                if local in state:
                    state[p] = {k: _rewrap(p, local, v) for k, v in state.pop(local).items()}
            group["params"] = params
        self._swapped = []


def _all_local_steppable(params: list) -> bool:
    for p in params:
        if not isinstance(p, DTensor):
            return False
        grad = p.grad
        if grad is not None and (
            not isinstance(grad, DTensor)
            or grad.placements != p.placements
            or grad.device_mesh != p.device_mesh
        ):
            return False
    return True


def _rewrap(param: DTensor, local: torch.Tensor, value: Any) -> Any:
    # State shaped like the parameter (moments, momentum buffers) is sharded
    # like it; scalars such as Adam's step count stay plain tensors.
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
        return dtensor_like(param, value)
    return value


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
    for g in grads:
        if isinstance(g, DTensor):
            key = (g.device_mesh, _sharded_mesh_dims(g))
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
