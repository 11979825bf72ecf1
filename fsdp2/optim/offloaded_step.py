"""The optimizer step unit by unit, with the state in a host or disk store.

[Note: Stepping in units]
``enable_local_shard_step(optim, offload=OptimizerOffloadPolicy(...))``
replaces ``optim.step()``'s work by a loop over *units*: runs of
consecutive parameters of one parameter group holding about
``unit_bytes`` of state. Each unit is stepped by a private optimizer of the
same class with the group's current hyperparameters, on the parameters'
local shards, their gradients and the unit's state tensors, which are views
of the unit's region in the store (``state_store.py``). The optimizers this
accepts are elementwise, so each element's update is the same computation
whichever tensors share a kernel call: the result is bit for bit the step
the optimizer would take on its own. The optimizer's own ``step`` then runs
on empty parameter lists (its hooks run once, as before) and the lists come
back after it.

A parameter's state is first created by the unit's step (so its values are
the optimizer's own initial state), then copied into the store and replaced
by views of it. ``optimizer.state`` keeps DTensor-wrapped views of the
store, so ``state_dict()``, DCP and ``save_checkpoint`` read the state
wherever it lives, and ``load_state_dict`` (DCP's load goes through it)
copies the loaded values into the store. Scalar state (Adam's ``step``)
stays in memory.

With parameters on an accelerator the ``host`` tier keeps an fp32-exact
host copy of each parameter shard in the unit's region too: the gradient
shard is copied down, the unit steps on the host, and the parameter shard
is copied back up. On CPU ranks nothing moves (tests take the copying path
on CPU by standing in for ``params_on_accelerator``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._torch_compat import dtensor_like, local_tensor
from ..agree import agree
from ..api import OptimizerOffloadPolicy
from .state_store import DiskStore, HostStore, StoreError, UnitLayout, release_free_heap
from .step_plan import PARAM_COPY, Unit, ctor_args, elementwise_names, is_elementwise, plan_units

logger = logging.getLogger(__name__)


def params_on_accelerator(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter's local shard is off the host (the host tier then copies)."""
    return any(
        local_tensor(p).device.type != "cpu" if isinstance(p, DTensor) else p.device.type != "cpu"
        for g in optimizer.param_groups for p in g["params"]
    )


class OffloadedStep:
    """Steps ``optimizer`` unit by unit on a store's state (see [Note: Stepping in units])."""

    def __init__(self, optimizer: torch.optim.Optimizer, policy: OptimizerOffloadPolicy) -> None:
        if not is_elementwise(optimizer):
            raise ValueError(
                f"OptimizerOffloadPolicy needs an elementwise optimizer ({elementwise_names()}); "
                f"{type(optimizer).__name__} may mix elements across a parameter: step it "
                "without offload=..."
            )
        self.optimizer = optimizer
        self.policy = policy
        self.copies = policy.tier == "host" and params_on_accelerator(optimizer)
        self.units = plan_units(optimizer, policy.unit_bytes, self.copies)
        layouts = [u.layout for u in self.units]
        self.store = _agree_on_store(lambda: _make_store(policy, layouts))
        self._held: list[list[Any]] = []
        self._load_into_store()

    # ---- the step ---------------------------------------------------------------

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Step every unit, then leave the optimizer's own step nothing to do."""
        if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported with OptimizerOffloadPolicy: the "
                "units step before the closure could run; call the closure, then step()"
            )
        state = optimizer.state
        self.store.prefetch(0)
        for i, unit in enumerate(self.units):
            self.store.prefetch(i + 1)
            self._step_unit(unit, self.store.views(i), state)
            self._keep(unit, self.store.release(i), state)
        if isinstance(self.store, DiskStore):
            # What the units' kernels allocated (and the state a first step created in
            # memory before it moved to disk) is freed; hand the heap the C allocator
            # keeps for it back to the system, so host memory holds a few units only.
            release_free_heap()
        self._held = [g["params"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["params"] = []

    def after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        for g, params in zip(optimizer.param_groups, self._held):
            g["params"] = params
        self._held = []

    @torch.no_grad()
    def _step_unit(self, unit: Unit, views: dict, state: Any) -> None:
        """One unit's step on its tier's views; what the step creates moves into the tier."""
        group = self.optimizer.param_groups[unit.group]
        params, sub_state = [], {}
        for i, p in enumerate(unit.params):
            if p.grad is None:
                continue
            local = _local(p).detach()
            work = views[(i, PARAM_COPY)] if self.copies else local
            if self.copies:
                work.grad = _local(p.grad).to("cpu")
            else:
                work.grad = _local(p.grad)
            if p in state:
                sub_state[work] = {
                    k: views[(i, k)] if k in unit.keys[i] else v for k, v in state[p].items()
                }
            params.append((i, p, local, work))
        if not params:
            return
        hparams = {k: v for k, v in group.items() if k != "params"}
        cls = type(self.optimizer)
        step = cls([torch.zeros(1, requires_grad=True)], **ctor_args(cls, hparams))
        step.param_groups[0].update(hparams)
        step.param_groups[0]["params"] = [w for *_, w in params]
        step.state.update(sub_state)
        step.step()
        for i, p, local, work in params:
            new = step.state[work]
            for k in unit.keys[i]:
                if new[k] is not views[(i, k)]:  # created by this step: move it into the store
                    views[(i, k)].copy_(new[k])
            state[p] = {k: (views[(i, k)] if k in unit.keys[i] else v) for k, v in new.items()}
            work.grad = None
            if self.copies:
                local.copy_(work, non_blocking=True)

    def _keep(self, unit: Unit, views: dict, state: Any) -> None:
        """``optimizer.state`` of the unit's parameters: DTensor views of the store."""
        for i, p in enumerate(unit.params):
            if p in state:
                state[p] = {
                    k: _wrap(p, views[(i, k)]) if k in unit.keys[i] else v for k, v in state[p].items()
                }

    @torch.no_grad()
    def _load_into_store(self) -> None:
        """Move whatever ``optimizer.state`` holds (a load, an earlier step) into the store."""
        state = self.optimizer.state
        for i, unit in enumerate(self.units):
            views = self.store.views(i)
            for j, p in enumerate(unit.params):
                if p not in state:
                    continue
                for k in unit.keys[j]:
                    if k in state[p]:
                        views[(j, k)].copy_(_local(state[p][k]))
            for j, p in enumerate(unit.params):
                if self.copies:  # the host copy the unit steps on
                    views[(j, PARAM_COPY)].copy_(_local(p))
            self._keep(unit, self.store.release(i), state)
        self.store.wait()

    def after_load(self, optimizer: torch.optim.Optimizer) -> None:
        self._load_into_store()

    def close(self) -> None:
        """Stop offloading: the state comes back into ordinary memory, the store is released."""
        if isinstance(self.store, DiskStore):
            state = self.optimizer.state
            for unit in self.units:
                for i, p in enumerate(unit.params):
                    if p in state:
                        state[p] = {
                            k: _wrap(p, _local(v).clone()) if k in unit.keys[i] else v
                            for k, v in state[p].items()
                        }
        self.store.close()


def _make_store(policy: OptimizerOffloadPolicy, layouts: list[UnitLayout]) -> HostStore | DiskStore:
    if policy.tier == "host":
        return HostStore(layouts, policy.pin_memory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return DiskStore(policy.directory, rank, layouts, policy.units_in_memory)


def _agree_on_store(make: Any) -> HostStore | DiskStore:
    """Make the store on every rank, or raise the same ``StoreError`` on every rank."""
    return agree("Cannot keep the optimizer state in its store", make, every_rank=True,
                 error_type=StoreError, undo=lambda store: store.close())


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t) if isinstance(t, DTensor) else t


def _wrap(p: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    return dtensor_like(p, view) if isinstance(p, DTensor) else view
