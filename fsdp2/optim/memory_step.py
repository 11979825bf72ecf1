"""The in-memory strategy of the step engine: the optimizer steps stand-ins for its DTensors.

``MemoryStep.swap_in`` replaces each param group's DTensor parameters by
plain tensors the optimizer steps without DTensor dispatch (see [Note: Why
local shards] in local_shard_step.py): the pieces of the group's flat runs
(see [Note: Flat optimizer steps] in flat_run.py), this replica rank's
slices of them (replica_sharded_step.py) and, as the fallback for whatever
cannot be flat, each parameter's local shard with its local state. The
user's optimizer steps them all in one call; ``swap_out`` gives the groups
their parameters back and publishes the state the step left (state_views.py).
``zero_grad`` clears each flat gradient the last step found at once.

It is told what it needs: the groups' cuts (``GroupPlan``, from the engine's
``plan_of``) and the replica slices, if any; it reaches back to nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import fast_grad_access, local_tensor
from .flat_run import FlatRun, flat_grads
from .replica_sharded_step import ReplicaShardedStep, SlicedRun
from .state_views import publish, same_objects, unwrap
from .step_plan import GroupPlan, cpu_loop_choice


class _Swapped:
    """One param group during a ``step``: what it held, and what stands in for it."""

    def __init__(self, group: dict, params: list) -> None:
        self.group = group
        self.params = params  # the group's own list, put back after the step
        self.runs: list[FlatRun] = []  # stepped as flat runs
        self.singles: list[tuple[DTensor, torch.Tensor]] = []  # (parameter, its local tensor)
        self.sliced: list[SlicedRun] = []  # HSDP, state sharded across replicas
        # (the user's foreach,) when this step takes another (see [Note: The C++ loop on CPU])
        self.foreach: tuple = ()


class MemoryStep:
    """Swaps param groups for stand-ins around the optimizer's own step, and back.

    ``replicas``: the replica slices (``shard_across_replicas=True``) or
    ``None``; ``flat_groups_only``: step only the groups that are wholly flat
    runs with every gradient in place, the others on their DTensors as the
    optimizer would without the engine (the default step, default_step.py).
    """

    def __init__(self, replicas: ReplicaShardedStep | None, flat_groups_only: bool) -> None:
        self.replicas = replicas
        self.flat_groups_only = flat_groups_only
        self._swapped: list[_Swapped] = []
        # the last step's runs whose gradients were views of one flat gradient:
        # (param group, its run's parameters, their .grad objects, the flat gradient)
        self.grad_views: list[tuple[dict, list, list, torch.Tensor]] = []
        self._entries: _Entries | None = None  # optimizer.state's entries after the last step

    @property
    def swapped(self) -> bool:
        """Whether stand-ins are in some param group (a step is running, or raised)."""
        return bool(self._swapped)

    def forget_state(self) -> None:
        """``optimizer.state`` was replaced (a load): hold none of the old state alive."""
        self._entries = None

    def after_step(self, state: dict) -> None:
        """Remember ``state``'s entries: the next step finds them unchanged in one C loop."""
        self._entries = _Entries(state)

    def swap_in(self, optimizer: torch.optim.Optimizer, plans: list[GroupPlan]) -> bool:
        """Stand-ins into the groups (``plans[i]`` is group ``i``'s cut); returns whether
        this step may create state (a run's first step, a parameter without state)."""
        state = optimizer.state
        replicas = self.replicas
        self.grad_views = []
        new_state = False
        # the same keys and per-parameter dicts as the last step left: one pass looped in C,
        # where each run would look its parameters up (a Python hash per parameter)
        entries_unchanged = _Entries(state) == self._entries
        for gi, (group, plan) in enumerate(zip(optimizer.param_groups, plans)):
            params = group["params"]
            if replicas is not None:
                replicas.check_leftovers(plan.leftovers)
            # runs are DTensors; their gradients are checked as they are gathered
            if not _all_local_steppable(plan.leftovers):
                continue
            if self.flat_groups_only and group.get("capturable"):
                # CUDA-graph steps: torch's own, on the DTensors (never proven on runs)
                for run in plan.runs:
                    run.forget()
                continue
            # each run's gradient, and the .grad objects it views (or None): the runs hold neither
            grads, objects = zip(*flat_grads(plan.runs)) if plan.runs else ((), ())
            if self.flat_groups_only and (
                plan.leftovers
                or not plan.runs
                or not all(
                    g is not None or _all_local_steppable(r.params) for r, g in zip(plan.runs, grads)
                )
            ):  # stepped by the optimizer as it is, on the DTensors
                for run in plan.runs:
                    run.forget()  # its state moves without the run (see FlatRun.adopt_state)
                continue
            swapped = _Swapped(group, params)
            stand_ins: list[torch.Tensor] = []
            singles = list(plan.leftovers)
            for run, grad, grad_objects in zip(plan.runs, grads, objects):
                sliced = replicas.sliced(run, gi) if replicas is not None else None
                if sliced is not None:  # only this replica rank's slice of the run
                    if grad is None:
                        replicas.check_leftovers([p for p in run.params if p.grad is not None])
                        continue
                    stand_ins += sliced.attach(state, grad)
                    swapped.sliced.append(sliced)
                    continue
                if grad is None or not run.adopt_state(state, entries_unchanged):
                    # some gradients missing, or state the run cannot hold: one by one
                    # (which rewrites the per-parameter state, so the run rebuilds next time)
                    run.forget()
                    singles.extend(run.params)
                    continue
                # See [Note: Fused kernels step per parameter] in flat_run.py
                stand_ins += run.attach(state, grad, per_parameter=bool(group.get("fused")))
                swapped.runs.append(run)
                new_state |= run.views is None  # its first step: state published after
                if grad_objects is not None:  # views of one flat gradient
                    self.grad_views.append((group, run.params, grad_objects, grad))
            for p in singles:  # the per-parameter fallback
                local = local_tensor(p).detach()
                grad = p.grad
                local.grad = None if grad is None else local_tensor(grad)
                if p in state:  # p's key stays where it is: replaced after the step
                    state[local] = unwrap(state[p])
                else:
                    new_state = True
                swapped.singles.append((p, local))
                stand_ins.append(local)
            group["params"] = stand_ins
            foreach = cpu_loop_choice(optimizer, group, stand_ins)
            if foreach is not None:
                swapped.foreach = (group["foreach"],)
                group["foreach"] = foreach
            self._swapped.append(swapped)
        return new_state

    def swap_out(self, state: dict) -> None:
        """The groups' own parameters back; the state the step left published on them."""
        for swapped in self._swapped:
            for run in swapped.runs:
                run.detach(state)
            for sliced in swapped.sliced:
                sliced.detach(state)
            for p, local in swapped.singles:
                local.grad = None
                if local in state:
                    publish(state, p, state.pop(local))
            swapped.group["params"] = swapped.params
            if swapped.foreach:
                swapped.group["foreach"] = swapped.foreach[0]
        self._swapped = []

    def zero_grad(self, optimizer: torch.optim.Optimizer, zero_grad: Callable[[bool], Any],
                  set_to_none: bool) -> None:
        """``optimizer.zero_grad``: each flat gradient the last step used cleared at once.

        Where a run's ``.grad`` objects are still the views of one flat gradient
        the last step found, ``set_to_none=False`` is one ``zero_()`` of that
        gradient (padding included, which is zero already) and ``set_to_none=True``
        drops every view, so the flat gradient is freed at once. The other
        parameters go to ``zero_grad`` (the optimizer's own), as without the engine.
        """
        cleared: dict[int, set[int]] = {}  # id(param group) -> ids of its cleared parameters
        with fast_grad_access():
            for group, params, grads, flat in self.grad_views:
                if set_to_none:  # None whatever they hold now: no check needed
                    for p in params:
                        p.grad = None
                elif all(p.grad is g for p, g in zip(params, grads)):
                    flat.zero_()
                else:
                    continue
                cleared.setdefault(id(group), set()).update(map(id, params))
        if set_to_none:
            self.grad_views = []  # holds no flat gradient alive
        if not cleared:
            zero_grad(set_to_none)
            return
        groups = optimizer.param_groups
        held = [g["params"] for g in groups]
        try:
            for g in groups:
                mine = cleared.get(id(g))
                if mine is None:
                    continue
                params = g["params"]
                g["params"] = [p for p in params if id(p) not in mine] if len(mine) < len(params) else []
            zero_grad(set_to_none)
        finally:
            for g, params in zip(groups, held):
                g["params"] = params


class _Entries:
    """A dict's keys and values as objects, compared by identity (never by hashing a key)."""

    def __init__(self, d: dict) -> None:
        self.owner = d
        self.keys = list(d)
        self.values = list(d.values())

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Entries)
            and self.owner is other.owner
            and same_objects(self.keys, other.keys)
            and same_objects(self.values, other.values)
        )

    __hash__ = None  # type: ignore[assignment]


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
