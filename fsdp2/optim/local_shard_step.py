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

import logging
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import dtensor_like, local_tensor
from ..api import OptimizerOffloadPolicy
from .flat_step import ELEMENTWISE_OPTIMIZERS, FlatRun, plan_runs, steps_flat
from .offloaded_step import OffloadedStep

logger = logging.getLogger(__name__)

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
    optimizer: torch.optim.Optimizer,
    *,
    flat_buffers: bool = True,
    offload: OptimizerOffloadPolicy | None = None,
) -> LocalShardStepHandle:
    """Make ``optimizer.step()`` run on the plain local shards of its DTensor parameters.

    The same updates, bit for bit, as stepping on the DTensors, with far less
    CPU overhead per step. Only for elementwise optimizers (SGD, Adam, AdamW,
    Adagrad, RMSprop, ...): an optimizer that mixes elements across a
    parameter (e.g. one that takes a matrix norm of the whole parameter) must
    not use it. Parameter groups holding anything but DTensor parameters whose
    gradients share the parameter's placements are stepped as usual.

    With fsdp2's ``fully_shard`` and one of torch's elementwise optimizers
    (``ELEMENTWISE_OPTIMIZERS`` in flat_step.py: SGD, Adam, AdamW, Adagrad,
    RMSprop, Adamax, NAdam, RAdam, in any of their implementations) the step
    runs on each group's flat shard buffer, a few kernels per run of
    parameters instead of per parameter (see [Note: Flat optimizer steps]);
    ``flat_buffers=False`` keeps the per-parameter local step. Any other
    optimizer, and parameters sharded by upstream's ``fully_shard``, step on
    each local shard.

    ``offload``: an :class:`~fsdp2.OptimizerOffloadPolicy` moves the
    optimizer's state to host memory or to files on a local disk and steps
    unit by unit there, with the same updates, bit for bit (see
    [Note: Stepping in units] in ``offloaded_step.py``) instead of the flat
    runs. Only for the same elementwise optimizers (their own classes, not
    subclasses); the parameters must not change after this call. ``remove()`` brings the state
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
    swap = _LocalSwap(optimizer, flat_buffers)
    return LocalShardStepHandle(
        [
            optimizer.register_step_pre_hook(swap.to_local),
            optimizer.register_step_post_hook(swap.to_dtensor),
        ]
    )


class _LocalSwap:
    """Swaps an optimizer's DTensor parameters (and state) for local tensors around ``step``.

    Parameters of an fsdp2 group's flat buffer step as flat runs (see [Note:
    Flat optimizer steps] in flat_step.py) when the optimizer is elementwise;
    the others step on their local tensors one by one.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, flat_buffers: bool) -> None:
        self.optimizer = optimizer
        self.flat = flat_buffers and steps_flat(optimizer)
        if flat_buffers and not self.flat:
            logger.debug(
                "enable_local_shard_step: %s is not one of the elementwise optimizers (%s); "
                "it steps on each parameter's local shard, not on flat buffers",
                type(optimizer).__name__,
                ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS),
            )
        # id(param group) -> (ids of its params, its flat runs, the rest)
        self._plans: dict[int, tuple[tuple[int, ...], list[FlatRun], list]] = {}
        # (param group, its original params, [(dtensor param, local tensor)], runs stepped)
        self._swapped: list[tuple[dict, list, list[tuple[DTensor, torch.Tensor]], list[FlatRun]]] = []

    def _plan(self, group: dict) -> tuple[list[FlatRun], list]:
        params = group["params"]
        key = tuple(map(id, params))
        cached = self._plans.get(id(group))
        if cached is not None and cached[0] == key and all(r.still_flat() for r in cached[1]):
            return cached[1], cached[2]
        runs, rest = plan_runs(params)
        self._plans[id(group)] = (key, runs, rest)
        return runs, rest

    def to_local(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        state = optimizer.state
        for group in optimizer.param_groups:
            params = group["params"]
            if self.flat and not group.get("differentiable", False):
                runs, rest = self._plan(group)
            else:
                runs, rest = [], params
            # runs are DTensors; their gradients are checked as they are gathered
            if not _all_local_steppable(rest):
                continue
            stepped: list[FlatRun] = []
            singles = list(rest)
            for run in runs:
                grad = run.flat_grad()
                if grad is None or not run.adopt_state(state):
                    # some gradients missing, or state the run cannot hold: one by one
                    # (which rewrites the per-parameter state, so the run rebuilds next time)
                    run.views = None
                    singles.extend(run.params)
                    continue
                run.flat.grad = grad
                if run.state is not None:
                    state[run.flat] = run.state
                stepped.append(run)
            pairs = []
            for p in singles:
                local = local_tensor(p).detach()
                grad = p.grad
                local.grad = None if grad is None else local_tensor(grad)
                if p in state:
                    state[local] = {
                        k: local_tensor(v) if isinstance(v, DTensor) else v
                        for k, v in state.pop(p).items()
                    }
                pairs.append((p, local))
            group["params"] = [run.flat for run in stepped] + [local for _, local in pairs]
            self._swapped.append((group, params, pairs, stepped))

    def to_dtensor(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        state = optimizer.state
        for group, params, pairs, stepped in self._swapped:
            for run in stepped:
                run.flat.grad = None
                run.flat_steps += 1
                run_state = state.pop(run.flat, None)
                if run_state:
                    run.publish(state, run_state)
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
