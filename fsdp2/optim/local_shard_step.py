"""The optimizer step on the local shards of DTensor parameters.

[Note: Why local shards]
``torch.optim`` and ``torch.nn.utils.clip_grad_norm_`` work on sharded
``DTensor`` parameters as they are, but every foreach kernel then goes
through DTensor's dispatcher (sharding propagation, unwrapping, rewrapping)
once per op. For elementwise optimizers (SGD, Adam, AdamW, ...) the result on
a ``Shard`` placement is exactly the same math on each rank's local tensor,
so we run the step on the plain local tensors and only rewrap the optimizer
state. The state stays keyed by the DTensor parameters with DTensor values,
so ``optimizer.state_dict()`` and ``torch.distributed.checkpoint`` see the
same thing as without the fast path. It works on any DTensor parameters
(ours or upstream's ``fully_shard``); ``clip_grad.py`` does the same for the
gradient norm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import dtensor_like, local_tensor
from ..api import OptimizerOffloadPolicy
from .offloaded_step import OffloadedStep

__all__ = ["enable_local_shard_step"]


class LocalShardStepHandle:
    """Returned by :func:`enable_local_shard_step`; ``remove()`` turns the fast path off."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            if hasattr(handle, "remove"):
                handle.remove()
            else:  # the offloaded step: its state comes back into memory
                handle.close()
        self._handles = []


def enable_local_shard_step(
    optimizer: torch.optim.Optimizer, *, offload: OptimizerOffloadPolicy | None = None
) -> LocalShardStepHandle:
    """Make ``optimizer.step()`` run on the plain local shards of its DTensor parameters.

    The same updates, bit for bit, as stepping on the DTensors, with far less
    CPU overhead per step. Only for elementwise optimizers (SGD, Adam, AdamW,
    Adagrad, RMSprop, ...): an optimizer that mixes elements across a
    parameter (e.g. one that takes a matrix norm of the whole parameter) must
    not use it. Parameter groups holding anything but DTensor parameters whose
    gradients share the parameter's placements are stepped as usual.

    ``offload``: an :class:`~fsdp2.OptimizerOffloadPolicy` moves the
    optimizer's state to host memory or to files on a local disk and steps
    unit by unit there, with the same updates, bit for bit (see
    [Note: Stepping in units] in ``offloaded_step.py``). Only for the
    elementwise optimizers of ``torch.optim`` (``SGD``, ``Adam``, ``AdamW``,
    ``Adagrad``, ``RMSprop``, ``Adamax``, ``NAdam``, ``RAdam``); the
    parameters must not change after this call. ``remove()`` brings the state
    back into ordinary memory.

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
    if offload is not None:
        stepper = OffloadedStep(optimizer, offload)
        return LocalShardStepHandle(
            [
                optimizer.register_step_pre_hook(stepper.before_step),
                optimizer.register_step_post_hook(stepper.after_step),
                optimizer.register_load_state_dict_post_hook(stepper.after_load),
                stepper,
            ]
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
