"""The optimizer-step engine: one cut, one way to publish state, a tier for where state lives.

``StepEngine`` runs around the user's ``optimizer.step()`` (a pre- and a
post-hook). It cuts each param group once (``plan_group`` in step_plan.py:
flat runs of fsdp2's buffers, leftovers stepped per parameter) and steps the
group in one of two strategies, chosen by its tier (state_store.py):

- ``MemoryTier``: the group's DTensor parameters are swapped for plain
  tensors the optimizer steps without DTensor dispatch (see [Note: Why local
  shards] in local_shard_step.py): the pieces of the flat runs (see [Note:
  Flat optimizer steps] in flat_run.py) and, as the fallback for whatever
  cannot be flat, each parameter's local shard with its local state. The
  user's optimizer steps them all in one call; then the parameters come back.
- ``HostStore`` / ``DiskStore``: the runs are cut into units (``plan_units``)
  and each unit steps on the tier's state views (see [Note: Stepping in
  units] in unit_step.py); the user's optimizer then steps empty lists.

Either way ``optimizer.state`` holds the views that state_views.py makes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import local_tensor
from ..api import OptimizerOffloadPolicy
from ..file_tensors import MappedFiles
from . import unit_step
from .flat_run import FlatRun
from .state_store import DiskStore, open_tier, release_free_heap
from .state_views import publish, unwrap
from .step_plan import GroupPlan, Unit, elementwise_names, is_elementwise, plan_group, plan_units

logger = logging.getLogger("fsdp2.optim.local_shard_step")  # the name users filter on


class _Swapped:
    """One param group during an in-memory ``step``: what it held, and what stands in for it."""

    def __init__(self, group: dict, params: list) -> None:
        self.group = group
        self.params = params  # the group's own list, put back after the step
        self.runs: list[FlatRun] = []  # stepped as flat runs
        self.singles: list[tuple[DTensor, torch.Tensor]] = []  # (parameter, its local tensor)


class StepEngine:
    """Steps ``optimizer`` on flat runs and local shards, with its state in a tier.

    ``flat_buffers``: cut groups into flat runs (elementwise optimizers only);
    ``offload``: ``None`` keeps the state in memory, else the host or disk tier
    it names (elementwise optimizers only; the parameters are planned now and
    must not change).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        flat_buffers: bool,
        offload: OptimizerOffloadPolicy | None = None,
    ) -> None:
        if offload is not None and not is_elementwise(optimizer):
            raise ValueError(
                f"OptimizerOffloadPolicy needs an elementwise optimizer ({elementwise_names()}); "
                f"{type(optimizer).__name__} may mix elements across a parameter: step it "
                "without offload=..."
            )
        self.optimizer = optimizer
        self.flat = flat_buffers and is_elementwise(optimizer)
        if flat_buffers and not self.flat:
            logger.debug(
                "enable_local_shard_step: %s is not one of the elementwise optimizers (%s); "
                "it steps on each parameter's local shard, not on flat buffers",
                type(optimizer).__name__,
                elementwise_names(),
            )
        self.plans: dict[int, GroupPlan] = {}  # id(param group) -> its cut
        self.units: list[Unit] = []  # a store tier's units, made from the plans
        self.copies = False  # the host tier steps host copies of device parameters
        if offload is not None and offload.tier == "host":
            self.copies = unit_step.params_on_accelerator(optimizer)
            if not self.copies:  # CPU ranks: the state already is in host memory, keep it in place
                offload = None
        if offload is not None:  # planned once: the tier's layout depends on it
            groups = optimizer.param_groups
            plans = [self.plan_of(g) for g in groups]
            self.units = plan_units(optimizer, plans, offload.unit_bytes, self.copies)
        self.tier = open_tier(offload, [u.layout for u in self.units])
        self._swapped: list[_Swapped] = []
        self._held: list[list[Any]] = []
        if self.tier.in_units:
            self.after_load(optimizer)  # state the optimizer has already moves into the tier

    def plan_of(self, group: dict) -> GroupPlan:
        """``group``'s cut, planned again when its parameters or their buffers changed."""
        plan = self.plans.get(id(group))
        if plan is None or not plan.holds(group["params"]):
            flat = self.flat and not group.get("differentiable", False)
            plan = plan_group(group["params"], flat)
            self.plans[id(group)] = plan
        return plan

    def runs(self) -> list[FlatRun]:
        """Every flat run planned so far."""
        return [run for plan in self.plans.values() for run in plan.runs]

    # ---- the hooks ----------------------------------------------------------------

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.tier.in_units:
            self._step_units(optimizer, args, kwargs)
        else:
            self._swap_in(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        for g, params in zip(optimizer.param_groups, self._held):
            g["params"] = params
        self._held = []
        self._swap_out(optimizer.state)

    def after_load(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``load_state_dict``: a store tier copies the loaded state in.

        In memory there is nothing to do here: each flat run sees the new
        ``optimizer.state`` before its next step and rebuilds from it
        (``FlatRun.adopt_state``); leftovers read it as it is.
        """
        if not self.tier.in_units:
            return
        state, tier = optimizer.state, self.tier
        in_place = None
        if isinstance(tier, DiskStore):  # a DCP load may have written the files already
            maps = MappedFiles.now()
            in_place = lambda i: lambda j, k, v: maps.region(v) == tier.region(i, j, k)  # noqa: E731
        for i, unit in enumerate(self.units):
            unit_step.load_unit(unit, tier.views(i), state, self.copies, in_place and in_place(i))
            unit_step.keep(unit, tier.release(i), state)
        self.tier.wait()

    def close(self) -> None:
        """Stop: state in files comes back into ordinary memory, the tier is released."""
        if isinstance(self.tier, DiskStore):
            state = self.optimizer.state
            for unit in self.units:
                for i, p in enumerate(unit.params):
                    if p in state:
                        publish(state, p, {
                            k: v.clone() if k in unit.keys[i] else v
                            for k, v in unwrap(state[p]).items()
                        })
        self.tier.close()

    # ---- in memory: one call over every run and leftover ----------------------------

    def _swap_in(self, optimizer: torch.optim.Optimizer) -> None:
        state = optimizer.state
        for group in optimizer.param_groups:
            params = group["params"]
            plan = self.plan_of(group)
            # runs are DTensors; their gradients are checked as they are gathered
            if not _all_local_steppable(plan.leftovers):
                continue
            swapped = _Swapped(group, params)
            stand_ins: list[torch.Tensor] = []
            singles = list(plan.leftovers)
            for run in plan.runs:
                grad = run.flat_grad()
                if grad is None or not run.adopt_state(state):
                    # some gradients missing, or state the run cannot hold: one by one
                    # (which rewrites the per-parameter state, so the run rebuilds next time)
                    run.forget()
                    singles.extend(run.params)
                    continue
                stand_ins += run.attach(state, grad)
                swapped.runs.append(run)
            for p in singles:  # the per-parameter fallback
                local = local_tensor(p).detach()
                grad = p.grad
                local.grad = None if grad is None else local_tensor(grad)
                if p in state:
                    state[local] = unwrap(state.pop(p))
                swapped.singles.append((p, local))
                stand_ins.append(local)
            group["params"] = stand_ins
            self._swapped.append(swapped)

    def _swap_out(self, state: dict) -> None:
        for swapped in self._swapped:
            for run in swapped.runs:
                run.detach(state)
            for p, local in swapped.singles:
                local.grad = None
                if local in state:
                    publish(state, p, state.pop(local))
            swapped.group["params"] = swapped.params
        self._swapped = []

    # ---- in a store: unit by unit ---------------------------------------------------

    def _step_units(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Step every unit, then leave the optimizer's own step nothing to do."""
        if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported with OptimizerOffloadPolicy: the "
                "units step before the closure could run; call the closure, then step()"
            )
        state, tier = optimizer.state, self.tier
        tier.prefetch(0)
        for i, unit in enumerate(self.units):
            tier.prefetch(i + 1)
            unit_step.step_unit(optimizer, unit, tier.views(i), state, self.copies, tier.live.hold)
            if isinstance(tier, DiskStore):
                # What the unit's kernels allocated (and the state a first step created
                # before it moved to disk) is freed, but glibc keeps such blocks in its
                # heap, resident, and they pile up unit after unit: hand them back now.
                release_free_heap()
            unit_step.keep(unit, tier.release(i), state)
        self._held = [g["params"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["params"] = []


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
