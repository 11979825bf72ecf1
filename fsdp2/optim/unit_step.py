"""One unit's step on a store tier's state views (the step engine's unit-by-unit strategy).

[Note: Stepping in units]
``enable_local_shard_step(optim, offload=OptimizerOffloadPolicy(...))``
keeps the state in a host or disk tier (state_store.py) and replaces
``optim.step()``'s work by a loop over *units*: the flat runs of the one cut
(step_plan.py), split at parameter boundaries into about ``unit_bytes`` of
state, and the leftovers cut the same way. Each unit is stepped by a private
optimizer of the same class with the group's current hyperparameters, on the
parameters' local shards, their gradients and the unit's state tensors,
which are views of the unit's region in the tier. The optimizers this
accepts are elementwise, so each element's update is the same computation
whichever tensors share a kernel call: the result is bit for bit the step the
optimizer would take on its own. The optimizer's own ``step`` then runs on
empty parameter lists (its hooks run once, as before) and the lists come back
after it.

A parameter's state is first created by the unit's step (so its values are
the optimizer's own initial state), then copied into the tier and replaced
by views of it. ``optimizer.state`` keeps DTensor-wrapped views of the tier
(state_views.py), so ``state_dict()``, DCP and ``save_checkpoint`` read the
state wherever it lives, and ``load_state_dict`` (DCP's load goes through it)
copies the loaded values into the tier. Scalar state (Adam's ``step``) stays
in memory.

With parameters on an accelerator the ``host`` tier keeps an fp32-exact
host copy of each parameter shard in the unit's region too: the gradient
shard is copied down, the unit steps on the host, and the parameter shard
is copied back up. On CPU ranks nothing moves (tests take the copying path
on CPU by standing in for ``params_on_accelerator``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime.storage.shard_storage import can_own_storage, own_storage
from .state_views import local_of, publish
from .step_plan import PARAM_COPY, Unit, ctor_args


def params_on_accelerator(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter's local shard is off the host (the host tier then copies)."""
    return any(
        local_of(p).device.type != "cpu" for g in optimizer.param_groups for p in g["params"]
    )


@torch.no_grad()
def step_unit(
    optimizer: torch.optim.Optimizer,
    unit: Unit,
    views: dict,
    state: dict,
    copies: bool,
    hold: Callable[[torch.Tensor], None] | None = None,
) -> bool:
    """One unit's step on its tier's ``views``; what the step creates moves into the tier.

    ``copies``: the unit steps on the host copies in ``views`` and copies the
    parameters back. ``hold``: told of every state tensor the step created
    (a first step's), which lives only until it is copied into ``views``.
    The tensors ``state`` holds adopt the views' memory (``publish``): they
    stay the objects a caller holds, as the tensors a plain step updates.
    Returns whether the step created state (freed now, in the C heap).
    """
    created = False
    group = optimizer.param_groups[unit.group]
    params, sub_state = [], {}
    for i, p in enumerate(unit.params):
        if p.grad is None:
            continue
        local = local_of(p).detach()
        work = views[(i, PARAM_COPY)] if copies else local
        work.grad = local_of(p.grad).to("cpu") if copies else local_of(p.grad)
        if p in state:
            # a key planned after the fact (amsgrad turned on after enable_local_shard_step:
            # its state was made by a step, in memory) is stepped where it is, as a local tensor
            sub_state[work] = {
                k: views[(i, k)] if k in unit.keys[i] else local_of(v) for k, v in state[p].items()
            }
        params.append((i, p, local, work))
    if not params:
        return False
    hparams = {k: v for k, v in group.items() if k != "params"}
    cls = type(optimizer)
    step = cls([torch.zeros(1, requires_grad=True)], **ctor_args(cls, hparams))
    step.param_groups[0].update(hparams)
    step.param_groups[0]["params"] = [w for *_, w in params]
    step.state.update(sub_state)
    step.step()
    for i, p, local, work in params:
        new = step.state.get(work)
        for k in unit.keys[i] if new else ():
            if k not in new:  # planned with a flag the group no longer has (amsgrad turned off)
                continue
            if new[k] is not views[(i, k)]:  # created by this step: move it into the tier
                created = True
                if hold is not None:
                    hold(new[k])
                views[(i, k)].copy_(new[k])
        if new:  # (a stateless step, SGD without momentum, makes no entry: as torch's)
            values = {k: (_own(views[(i, k)]) if k in unit.keys[i] else v) for k, v in new.items()}
            publish(state, p, values)
        work.grad = None
        if copies:
            local.copy_(work, non_blocking=True)
    # The private optimizer may outlive this call (an optimizer can sit in a reference
    # cycle, freed only by the garbage collector): drop its hold on the unit's tensors.
    step.state.clear()
    step.param_groups.clear()
    return created


def keep(unit: Unit, views: dict, state: dict) -> None:
    """``optimizer.state`` of the unit's parameters: views of the tier (DTensors where sharded),
    the tensors it holds adopting them, as in ``step_unit``."""
    for i, p in enumerate(unit.params):
        if p in state:
            publish(state, p, {
                k: _own(views[(i, k)]) if k in unit.keys[i] else v for k, v in state[p].items()
            })


def held(unit: Unit, state: dict) -> list:
    """The state tensors ``optimizer.state`` holds for the unit's parameters, in order."""
    return [
        state[p].get(k) for i, p in enumerate(unit.params) if p in state for k in unit.keys[i]
    ]


def _own(view: torch.Tensor) -> torch.Tensor:
    """A tier's view through a storage of its own (offset 0), as a plain step's state has.

    ``torch.save`` of a DTensor whose local tensor starts inside a larger
    storage (a unit's region) fails ("invalid python storage"), and would
    write the whole region for each tensor anyway. Not a view of another
    tensor either: a held state tensor that later adopts other memory
    (``Tensor.set_``) must let go of this one, and a view's base would keep
    it, and a mapping of the unit's file with it, alive.
    """
    flat = view.reshape(-1)
    if not can_own_storage(flat):
        return view
    memory = own_storage(flat).untyped_storage()
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(memory, 0, view.shape)


def loaded_in_place(unit: Unit, state: dict, in_place: Callable[[int, str, torch.Tensor], bool]) -> bool:
    """Whether every value ``state`` holds for the unit already is the tier's (loaded in place)."""
    return all(
        in_place(j, k, local_of(state[p][k]))
        for j, p in enumerate(unit.params) if p in state
        for k in unit.keys[j] if k in state[p]
    )


@torch.no_grad()
def load_unit(
    unit: Unit,
    views: dict,
    state: dict,
    copies: bool,
    in_place: Callable[[int, str, torch.Tensor], bool] | None = None,
) -> None:
    """Copy whatever ``state`` holds for the unit (a load, an earlier step) into ``views``.

    ``in_place(param, key, value)``: whether ``value`` already is the bytes
    the view holds (a DCP load wrote them into the files): not copied, so
    neither side is paged in.
    """
    for j, p in enumerate(unit.params):
        for k in unit.keys[j] if p in state else ():
            if k in state[p]:
                value = local_of(state[p][k])
                if in_place is None or not in_place(j, k, value):
                    views[(j, k)].copy_(value)
        if copies:  # the host copy the unit steps on
            views[(j, PARAM_COPY)].copy_(local_of(p))
