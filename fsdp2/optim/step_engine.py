"""The in-memory step: flat runs where the layout allows, each parameter's local shard elsewhere.

Around ``optimizer.step()`` (a pre- and a post-hook) each param group's
DTensor parameters are replaced by plain tensors the optimizer can step
without DTensor dispatch (see [Note: Why local shards] in
local_shard_step.py): the pieces of the group's flat runs (see [Note: Flat
optimizer steps] in flat_run.py) and, as the fallback for whatever cannot be
flat, each parameter's local shard with its local state. After the step the
parameters come back and the state is DTensor-valued again.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import dtensor_like, local_tensor
from .flat_run import FlatRun
from .step_plan import elementwise_names, is_elementwise, plan_runs

logger = logging.getLogger("fsdp2.optim.local_shard_step")  # the name users filter on


class _Swapped:
    """One param group during ``step``: what it held, and what stands in for it."""

    def __init__(self, group: dict, params: list, runs: list[FlatRun]) -> None:
        self.group = group
        self.params = params  # the group's own list, put back after the step
        self.runs = runs  # stepped as flat runs
        self.singles: list[tuple[DTensor, torch.Tensor]] = []  # (parameter, its local tensor)


class StepEngine:
    """Steps ``optimizer`` on flat runs and local shards instead of DTensors (in-memory state)."""

    def __init__(self, optimizer: torch.optim.Optimizer, flat_buffers: bool) -> None:
        self.optimizer = optimizer
        self.flat = flat_buffers and is_elementwise(optimizer)
        if flat_buffers and not self.flat:
            logger.debug(
                "enable_local_shard_step: %s is not one of the elementwise optimizers (%s); "
                "it steps on each parameter's local shard, not on flat buffers",
                type(optimizer).__name__,
                elementwise_names(),
            )
        # id(param group) -> (ids of its params, its flat runs, the leftovers)
        self.plans: dict[int, tuple[tuple[int, ...], list[FlatRun], list]] = {}
        self._swapped: list[_Swapped] = []

    def runs(self) -> list[FlatRun]:
        """Every flat run planned so far."""
        return [run for _, runs, _ in self.plans.values() for run in runs]

    def _plan(self, group: dict) -> tuple[list[FlatRun], list]:
        params = group["params"]
        key = tuple(map(id, params))
        cached = self.plans.get(id(group))
        if cached is not None and cached[0] == key and all(r.still_flat() for r in cached[1]):
            return cached[1], cached[2]
        runs, leftovers = plan_runs(params)
        self.plans[id(group)] = (key, runs, leftovers)
        return runs, leftovers

    def before_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        state = optimizer.state
        for group in optimizer.param_groups:
            params = group["params"]
            if self.flat and not group.get("differentiable", False):
                runs, leftovers = self._plan(group)
            else:
                runs, leftovers = [], params
            # runs are DTensors; their gradients are checked as they are gathered
            if not _all_local_steppable(leftovers):
                continue
            swapped = _Swapped(group, params, [])
            stand_ins: list[torch.Tensor] = []
            singles = list(leftovers)
            for run in runs:
                grad = run.flat_grad()
                if grad is None or not run.adopt_state(state):
                    # some gradients missing, or state the run cannot hold: one by one
                    # (which rewrites the per-parameter state, so the run rebuilds next time)
                    run.forget()
                    singles.extend(run.params)
                    continue
                stand_ins += run.attach(state, grad)
                swapped.runs.append(run)
            for p in singles:
                local = local_tensor(p).detach()
                grad = p.grad
                local.grad = None if grad is None else local_tensor(grad)
                if p in state:
                    state[local] = {
                        k: local_tensor(v) if isinstance(v, DTensor) else v
                        for k, v in state.pop(p).items()
                    }
                swapped.singles.append((p, local))
                stand_ins.append(local)
            group["params"] = stand_ins
            self._swapped.append(swapped)

    def after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        state = optimizer.state
        for swapped in self._swapped:
            for run in swapped.runs:
                run.detach(state)
            for p, local in swapped.singles:
                local.grad = None
                if local in state:
                    state[p] = {k: _rewrap(p, local, v) for k, v in state.pop(local).items()}
            swapped.group["params"] = swapped.params
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
