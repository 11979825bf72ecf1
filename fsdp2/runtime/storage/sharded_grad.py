"""Gradients at a sharded parameter's two ends: the TP-local unsharded one, and the reduced rows.

Between them sits the reduction (runtime/group/reduction.py). Here: turning the
gradient autograd wrote on an unsharded tensor-parallel parameter into the
local tensor FSDP reduces, the dtype autograd accumulates it in, and adding a
rank's reduced rows to the sharded parameter's ``.grad`` (with the
post-accumulate-grad hooks autograd would have run there).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ..._torch_compat import dtensor_like, local_tensor, post_accumulate_grad_hooks
from ...errors import FSDPAssertionError


def local_grad(
    grad: torch.Tensor,
    tp_spec: tuple[DeviceMesh, tuple[Placement, ...]] | None,
    dp_dims: frozenset[int],
) -> torch.Tensor:
    """The local tensor FSDP reduces of an unsharded parameter's gradient ``grad``."""
    if tp_spec is None:
        return grad
    # TP may leave e.g. a Partial gradient; reduce it over TP first. Under
    # dp_mesh_dims the data-parallel dims are left as they are: FSDP's own
    # reduction handles them (a Partial there is reduced once, not twice).
    target = tp_spec[1]
    if dp_dims:
        target = tuple(
            mine if i in dp_dims else spec
            for i, (mine, spec) in enumerate(zip(grad.placements, target, strict=True))
        )
    if tuple(grad.placements) != target:
        grad = grad.redistribute(placements=target)
    return local_tensor(grad)


def set_grad_dtype(
    param: nn.Parameter | None, dtype: torch.dtype, defer: bool, reduce_grads: bool
) -> None:
    """torch >= 2.15: the dtype autograd accumulates ``param``'s (unsharded) gradient in.

    See [Note: Gradient accumulation dtype] in reduction.py. ``defer``
    (pre-backward): a gradient that is about to be reduced, or that already
    accumulates in ``dtype``, takes autograd's output as it comes; otherwise
    (and after each post-backward) the gradient is kept in ``dtype`` and
    autograd upcasts what it adds.
    """
    if param is None or not param.requires_grad or param.dtype == dtype:
        return
    grad = param.grad
    if defer and (grad is not None or reduce_grads):
        param.grad_dtype = None
        return
    if grad is not None and grad.dtype != dtype:
        param.grad_dtype = None
        param.grad = grad.to(dtype)
    param.grad_dtype = dtype


def accumulate_sharded_grad(sharded_param: nn.Parameter, rows: torch.Tensor, fqn: str) -> None:
    """Set or add this rank's reduced gradient ``rows`` on the sharded parameter."""
    existing = sharded_param.grad
    if existing is None:
        sharded_param.grad = dtensor_like(sharded_param, rows)
    elif not isinstance(existing, DTensor):
        raise FSDPAssertionError(
            "Expected fsdp_param.sharded_param.grad to be DTensor, got "
            f"{type(existing)}\nParameter '{fqn}' has a plain tensor as .grad; FSDP "
            "accumulates into sharded (DTensor) gradients: set .grad to None (e.g. "
            "optimizer.zero_grad()) or to a DTensor like the parameter"
        )
    else:
        local_tensor(existing).add_(rows)
    # Autograd never accumulates into the sharded parameter itself, so its
    # post-accumulate-grad hooks (e.g. an optimizer step in backward) run here.
    hooks = post_accumulate_grad_hooks(sharded_param)
    if hooks:
        for hook in hooks:
            hook(sharded_param)
