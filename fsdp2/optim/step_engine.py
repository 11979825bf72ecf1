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

[Note: Calls the engine steps aside for]
The engine owns only what it wrote, and only calls it foresaw step on it;
every other call runs the optimizer's own step on the DTensors, with
upstream's bits, and the runs rebuild from the state that step leaves (see
[Note: State the run did not write] in flat_run.py):

- ``torch.compile`` of ``step()`` (or of a function that calls it): while
  Dynamo traces, the hooks do nothing (``torch.compiler.is_compiling()``), so
  the graph is torch's own step, and a compiled step runs no hook at all.
  Tracing the swap of a group's parameters for plain stand-ins broke
  Dynamo's graph ("Tried to erase Node param"). The eager steps around a
  compiled one stay flat. A store tier or replica slices cannot step aside
  (the optimizer does not hold their state): their compiled ``step()`` is
  refused when it runs (a ``NotImplementedError`` raised from eager code:
  Dynamo swallows an exception raised while it traces and runs the frame
  again, and the engine's eager step inside a compiled remainder gave
  wrong values).
- ``step(closure)``: the closure would run forward and backward after the
  engine had taken the gradients, so the optimizer steps the DTensors
  itself; with ``OptimizerOffloadPolicy`` or ``shard_across_replicas`` it is
  refused at the call, before anything moves, whatever the gradients.
- ``capturable=True`` (CUDA-graph steps) in the default step: never proven
  on runs, so torch's own.
- A step that raises (``capturable`` on CPU, an interrupt): torch runs no
  post-hook, so ``recover`` gives the groups their parameters back at the
  next call that reads them (``step``, ``zero_grad``, ``state_dict``,
  ``load_state_dict``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import fast_grad_access, local_tensor
from ..api import OptimizerOffloadPolicy
from . import unit_step
from .flat_run import FlatRun, flat_grads
from .replica_sharded_step import ReplicaShardedStep, SlicedRun
from .state_store import DiskStore, open_tier, release_free_heap
from .state_views import publish, unwrap
from .step_plan import (
    GroupPlan,
    Unit,
    cpu_loop_choice,
    elementwise_names,
    is_elementwise,
    plan_group,
    plan_units,
)

logger = logging.getLogger("fsdp2.optim.local_shard_step")  # the name users filter on


class _Swapped:
    """One param group during an in-memory ``step``: what it held, and what stands in for it."""

    def __init__(self, group: dict, params: list) -> None:
        self.group = group
        self.params = params  # the group's own list, put back after the step
        self.runs: list[FlatRun] = []  # stepped as flat runs
        self.singles: list[tuple[DTensor, torch.Tensor]] = []  # (parameter, its local tensor)
        self.sliced: list[SlicedRun] = []  # HSDP, state sharded across replicas
        # (the user's foreach,) when this step takes another (see [Note: The C++ loop on CPU])
        self.foreach: tuple = ()


class StepEngine:
    """Steps ``optimizer`` on flat runs and local shards, with its state in a tier.

    ``flat_buffers``: cut groups into flat runs (elementwise optimizers only);
    ``offload``: ``None`` keeps the state in memory, else the host or disk tier
    it names (elementwise optimizers only; the parameters are planned now and
    must not change); ``flat_groups_only``: step only the param groups that are
    wholly flat runs (every parameter in an fsdp2 flat buffer), the others as
    the optimizer would without the engine (the default step, default_step.py).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        flat_buffers: bool,
        offload: OptimizerOffloadPolicy | None = None,
        shard_across_replicas: bool = False,
        overlap_replica_gather: bool = False,
        flat_groups_only: bool = False,
    ) -> None:
        if shard_across_replicas and (offload is not None or not flat_buffers):
            raise NotImplementedError(
                "shard_across_replicas=True steps flat runs in memory: it cannot be combined "
                "with offload=... or flat_buffers=False"
            )
        # ---- HSDP, state sharded across replicas: see [Note: Replica slices]
        self.replicas = (
            ReplicaShardedStep(optimizer, overlap=overlap_replica_gather)
            if shard_across_replicas else None
        )
        if offload is not None and not is_elementwise(optimizer):
            raise ValueError(
                f"OptimizerOffloadPolicy needs an elementwise optimizer ({elementwise_names()}); "
                f"{type(optimizer).__name__} may mix elements across a parameter: step it "
                "without offload=..."
            )
        self.optimizer = optimizer
        self.offload_requested = offload is not None  # even where the state stays in place
        self.flat_groups_only = flat_groups_only
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
        self._planned = [tuple(map(id, g["params"])) for g in optimizer.param_groups]
        self.tier = open_tier(offload, [u.layout for u in self.units])
        self._swapped: list[_Swapped] = []
        self._held: list[list[Any]] = []
        # the last in-memory step's runs whose gradients were views of one flat
        # gradient: (param group, its run's parameters, their .grad objects, the flat gradient)
        self._grad_views: list[tuple[dict, list, list, torch.Tensor]] = []
        self._half_stepped: int | None = None  # the unit a failed store step stopped at
        # each unit's state tensors as last published (``unit_step.held``), by identity
        self._published: list[list | None] = [None] * len(self.units)
        self._in_place: Any = None  # the tier's in-place test during a step, made on demand
        self._failure = ""
        # ``optimizer.state``'s keys before a step that may create state (see _keep_key_order)
        self._keys_before: list | None = None
        self._new_state = False  # this step may create state (some run's first step, ...)
        self._entries: _Entries | None = None  # optimizer.state's entries after the last step
        if self.tier.in_units:
            self.after_load(optimizer)  # state the optimizer has already moves into the tier

    def plan_of(self, group: dict) -> GroupPlan:
        """``group``'s cut, planned again when its parameters or their buffers changed."""
        plan = self.plans.get(id(group))
        if plan is None or not plan.holds(group["params"]):
            flat = self.flat and not group.get("differentiable", False)
            # replica slices cut each group's buffer: their runs stay inside one
            plan = plan_group(group["params"], flat, across_groups=self.replicas is None)
            self.plans[id(group)] = plan
        return plan

    def runs(self) -> list[FlatRun]:
        """Every flat run planned so far."""
        return [run for plan in self.plans.values() for run in plan.runs]

    def forget_runs(self) -> None:
        """The optimizer stepped without the engine: each run rebuilds from its state next time."""
        for run in self.runs():
            run.forget()
        self._grad_views = []

    # ---- the hooks ----------------------------------------------------------------

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():  # See [Note: Calls the engine steps aside for]
            if self.tier.in_units or self.replicas is not None:
                _refuse_compiled_step(optimizer, self._kept_where())
            return
        self.recover()
        self._keys_before, self._new_state = None, False
        if has_closure(args, kwargs):
            if self.offload_requested or self.replicas is not None:
                raise ValueError(
                    f"optimizer.step(closure) is not supported with the state "
                    f"{self._kept_where()}: the engine steps before the closure could run; "
                    "call the closure (zero_grad, forward, backward), then step()"
                )
            self.forget_runs()  # the optimizer steps the DTensors; the runs rebuild after
            return
        if self.replicas is not None:
            self.replicas.wait()  # the last step's all-gather lands before this one steps
            self.replicas.track()  # param groups added since
        state = optimizer.state
        self._new_state = self.tier.in_units or self.replicas is not None
        self._keys_before = list(state) if self._new_state else None
        if self.tier.in_units:
            self._step_units(optimizer, args, kwargs)
            return
        count = len(state)
        try:
            self._swap_in(optimizer)
        except BaseException:  # a refusal half-way: the groups get their own parameters back
            self._swap_out(state)
            raise
        if self._new_state and self._keys_before is None:
            # The swap only appended keys (the stand-ins'), so the first ``count`` are the
            # keys before the step. Read only on steps that may create state: reading every
            # key touches every parameter object, about 1 us each after a backward.
            self._keys_before = list(itertools.islice(state, count))

    def after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        for g, params in zip(optimizer.param_groups, self._held):
            g["params"] = params
        self._held = []
        self._swap_out(optimizer.state)
        if self.replicas is not None:
            self.replicas.after_step()
        if self._new_state and self._keys_before is not None:
            _keep_key_order(optimizer, self._keys_before)
        self._keys_before = None
        self._entries = _Entries(optimizer.state)

    def recover(self, *_: Any) -> None:
        """A ``step()`` that raised left stand-ins in the param groups: put the parameters back.

        torch runs no post-hook when the step raises (``capturable`` on CPU,
        a ``KeyboardInterrupt``), so whatever reads the groups next (the next
        step, ``zero_grad``, ``state_dict``, ``load_state_dict``) calls this
        first: the groups get their DTensor parameters back and the state
        the step left is published as after any step.
        """
        if not (self._swapped or self._held):
            return
        optimizer = self.optimizer
        for g, params in zip(optimizer.param_groups, self._held):
            g["params"] = params
        self._held = []
        self._swap_out(optimizer.state)
        self._keys_before = None

    def _kept_where(self) -> str:
        if self.replicas is not None:
            return "sharded across replicas (shard_across_replicas=True)"
        return "offloaded (OptimizerOffloadPolicy)"

    def after_load(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``load_state_dict``: a store tier copies the loaded state in.

        In memory there is nothing to do here: each flat run sees the new
        ``optimizer.state`` before its next step and rebuilds from it
        (``FlatRun.adopt_state``); leftovers read it as it is.
        """
        self._entries = None  # holds none of the replaced state alive
        if self.replicas is not None:  # the slices take their part now: state_dict() sees it
            self.replicas.after_load(optimizer.state)
        if not self.tier.in_units:
            return
        state, tier = optimizer.state, self.tier
        in_place = tier.in_place_test()
        for i, unit in enumerate(self.units):
            test = functools.partial(in_place, i)
            if not unit_step.loaded_in_place(unit, state, test):
                tier.renew(i)  # a state dict taken before the load keeps what it showed
                test = None
            unit_step.load_unit(unit, tier.views(i), state, self.copies, test)
            unit_step.keep(unit, tier.release(i), state)
            self._published[i] = unit_step.held(unit, state)
        self.tier.wait()
        self._half_stepped = None  # every unit holds the loaded state now

    def close(self) -> None:
        """Stop: state in files comes back into ordinary memory, the tier is released."""
        self._entries = None  # holds no published view (of a mapped file) alive
        if self.replicas is not None:
            self.replicas.close()
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
        self._grad_views = []
        # the same keys and per-parameter dicts as the last step left: one pass looped in C,
        # where each run would look its parameters up (a Python hash per parameter)
        entries_unchanged = _Entries(state) == self._entries
        for gi, group in enumerate(optimizer.param_groups):
            params = group["params"]
            plan = self.plan_of(group)
            if self.replicas is not None:
                self.replicas.check_leftovers(plan.leftovers)
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
                sliced = self.replicas.sliced(run, gi) if self.replicas is not None else None
                if sliced is not None:  # only this replica rank's slice of the run
                    if grad is None:
                        self.replicas.check_leftovers([p for p in run.params if p.grad is not None])
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
                self._new_state |= run.views is None  # its first step: state published after
                if grad_objects is not None:  # views of one flat gradient
                    self._grad_views.append((group, run.params, grad_objects, grad))
            for p in singles:  # the per-parameter fallback
                local = local_tensor(p).detach()
                grad = p.grad
                local.grad = None if grad is None else local_tensor(grad)
                if p in state:  # p's key stays where it is: replaced after the step
                    state[local] = unwrap(state[p])
                else:
                    self._new_state = True
                swapped.singles.append((p, local))
                stand_ins.append(local)
            group["params"] = stand_ins
            foreach = cpu_loop_choice(optimizer, group, stand_ins)
            if foreach is not None:
                swapped.foreach = (group["foreach"],)
                group["foreach"] = foreach
            self._swapped.append(swapped)

    def _swap_out(self, state: dict) -> None:
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

    # ---- zero_grad: one fill per flat gradient ------------------------------------

    def zero_grad(self, optimizer: torch.optim.Optimizer, zero_grad: Any, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad``: each flat gradient the last step used cleared at once.

        Where a run's ``.grad`` objects are still the views of one flat gradient
        the last step found, ``set_to_none=False`` is one ``zero_()`` of that
        gradient (padding included, which is zero already) and ``set_to_none=True``
        drops every view, so the flat gradient is freed at once. The other
        parameters go to ``zero_grad`` (the optimizer's own), as without the engine.
        """
        self.recover()
        cleared: dict[int, set[int]] = {}  # id(param group) -> ids of its cleared parameters
        with fast_grad_access():
            for group, params, grads, flat in self._grad_views:
                if set_to_none:  # None whatever they hold now: no check needed
                    for p in params:
                        p.grad = None
                elif all(p.grad is g for p, g in zip(params, grads)):
                    flat.zero_()
                else:
                    continue
                cleared.setdefault(id(group), set()).update(map(id, params))
        if set_to_none:
            self._grad_views = []  # holds no flat gradient alive
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

    def wrap_zero_grad(self) -> Callable[[], None]:
        """Route ``optimizer.zero_grad`` through ``zero_grad`` above; returns the undo."""
        optimizer = self.optimizer
        own = optimizer.zero_grad  # the class's (or whatever stood there before)

        def zero_grad(set_to_none: bool = True) -> None:
            self.zero_grad(optimizer, own, set_to_none)

        optimizer.zero_grad = zero_grad  # an instance attribute: never pickled (__getstate__)

        def unwrap() -> None:
            if optimizer.__dict__.get("zero_grad") is zero_grad:
                del optimizer.__dict__["zero_grad"]

        return unwrap

    def wrap_step(self) -> Callable[[], None]:
        """Route ``optimizer.step`` through a guard that recovers a step that raised; returns the undo.

        torch runs no post-hook when a step raises, so the stand-ins the
        pre-hook swapped in would stay in ``optimizer.param_groups`` and
        ``optimizer.state`` until the next call that reads them (``recover``).
        A caller that catches the exception (a skipped batch after an OOM)
        and looks at the optimizer must see what upstream leaves: its
        parameters. An instance attribute, a bound method as torch's LR
        schedulers expect (they wrap ``optimizer.step`` the same way); never
        pickled (``Optimizer.__getstate__``).
        """
        optimizer = self.optimizer
        own = optimizer.__dict__.get("step")  # a scheduler's wrapper, or None: the class's
        inner = optimizer.step

        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except BaseException:
                self.recover()
                raise

        bound = types.MethodType(step, optimizer)
        optimizer.step = bound

        def unwrap() -> None:
            if optimizer.__dict__.get("step") is bound:
                if own is None:
                    del optimizer.__dict__["step"]
                else:
                    optimizer.step = own

        return unwrap

    # ---- in a store: unit by unit ---------------------------------------------------

    def _load_replaced(self, i: int, unit: Unit, state: dict) -> bool:
        """A state tensor of the unit replaced by a caller's own (``state[p][k] = t``): the
        unit gets fresh storage, loaded from ``state``; returns whether it did.

        As in torch, the replacing tensor is stepped from now on and the replaced
        one, wherever it is held, keeps its values: it stays on the old storage,
        and the tensors ``state`` holds adopt the new (``publish``'s ``adopt``).
        Every step asks; the answer is one identity check per state tensor, and
        only where an object changed is its memory looked at (a disk tier reads
        the process's mappings for that).
        """
        published = self._published[i]
        if published is not None and _same_objects(published, unit_step.held(unit, state)):
            return False
        if self._in_place is None:  # one per step, until a renewal
            self._in_place = self.tier.in_place_test()
        if unit_step.loaded_in_place(unit, state, functools.partial(self._in_place, i)):
            return False
        self.tier.renew(i)
        self._in_place = None
        unit_step.load_unit(unit, self.tier.views(i), state, self.copies)
        return True

    def _step_units(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Step every unit, then leave the optimizer's own step nothing to do."""
        if self._half_stepped is not None:
            raise RuntimeError(
                f"The optimizer state is half stepped: an earlier step failed at unit "
                f"{self._half_stepped} of {len(self.units)} ({self._failure}), so some units "
                "stepped and others did not; load a checkpoint (model and optimizer) before "
                "stepping again"
            )
        # the units hold the state of the parameters planned at enable time, no others
        if self._planned != [tuple(map(id, g["params"])) for g in optimizer.param_groups]:
            raise ValueError(
                f"{type(optimizer).__name__}'s parameters changed after "
                "enable_local_shard_step(offload=...) planned where their state lives (a param "
                "group added, or a group's parameter list edited): call remove() on its handle "
                "and enable_local_shard_step again, or add the param groups before enabling it"
            )
        state, tier = optimizer.state, self.tier
        disk = isinstance(tier, DiskStore)
        i, begun, clean = 0, False, False
        self._in_place = None
        try:  # See [Note: Overlapping the disk with the step] in state_store.py
            tier.prefetch(0)  # read during backward by the last step's end, or now
            for i, unit in enumerate(self.units):
                tier.prefetch(i + 1)  # read while this unit steps
                renewed = self._load_replaced(i, unit, state)
                views = tier.views(i)
                begun = True
                try:
                    unit_step.step_unit(
                        optimizer, unit, views, state, self.copies, tier.live.hold, adopt=renewed
                    )
                except Exception:
                    # The optimizer raised in its group's first unit: torch checks a group
                    # before it changes anything (Adam with amsgrad turned on mid-training
                    # has no 'max_exp_avg_sq'), so whole groups stepped and the rest did not,
                    # as the optimizer's own loop over its groups leaves them.
                    clean = i == 0 or self.units[i - 1].group != unit.group
                    raise
                del views  # the mapping it stepped on goes (the store keeps a fresh one)
                if disk:
                    # What the unit's kernels allocated (and the state a first step created
                    # before it moved to disk) is freed, but glibc keeps such blocks in its
                    # heap, resident, and they pile up unit after unit: hand them back now.
                    release_free_heap()
                unit_step.keep(unit, tier.release(i), state, adopt=renewed)
                self._published[i] = unit_step.held(unit, state)
            tier.prefetch(0)  # the next step's first unit, read during forward and backward
        except BaseException as e:
            if begun and not clean:  # some units may have stepped: no later step builds on it
                self._half_stepped, self._failure = i, f"{type(e).__name__}: {e}"
            raise
        self._held = [g["params"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["params"] = []


@torch.compiler.disable
def _refuse_compiled_step(optimizer: torch.optim.Optimizer, kept_where: str) -> None:
    """Raised at run time, outside the graph (see [Note: Calls the engine steps aside for])."""
    raise NotImplementedError(
        f"torch.compile of {type(optimizer).__name__}.step() with the state {kept_where}: "
        "the engine steps outside torch's step; call optimizer.step() uncompiled "
        "(compiling the model is fine)"
    )


def has_closure(args: tuple, kwargs: dict) -> bool:
    """Whether a step pre-hook's ``(optimizer, closure?)`` arguments carry a closure."""
    return (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None


def _keep_key_order(optimizer: torch.optim.Optimizer, before: list) -> None:
    """Put ``optimizer.state``'s keys in the order the optimizer's own step leaves them.

    A plain step creates a parameter's state at its first step with a
    gradient, param group by param group, parameter by parameter, after the
    keys already there; the engine publishes a run's state after the step,
    run by run (and runs follow their buffers, not the group). Full state
    dicts, ``torch.save`` and DCP keep this order, so it is restored here, on
    the steps that created state (a dict's order changes only by re-inserting).
    """
    state = optimizer.state
    had = set(before)
    order = [k for k in before if k in state]
    order += [p for g in optimizer.param_groups for p in g["params"] if p in state and p not in had]
    if len(order) == len(state) and all(a is b for a, b in zip(order, state)):
        return
    placed = set(order)
    order += [k for k in state if k not in placed]  # not a parameter: left last, as found
    values = [(k, state.pop(k)) for k in order]
    for k, v in values:
        state[k] = v


def _same_objects(a: list, b: list) -> bool:
    """The same objects, in order, compared by identity (looped in C)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


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
            and len(self.keys) == len(other.keys)
            and all(map(operator.is_, self.keys, other.keys))
            and all(map(operator.is_, self.values, other.values))
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
