"""The optimizer-step engine: one cut, one way to publish state, a tier for where state lives.

``StepEngine`` runs around the user's ``optimizer.step()`` (a pre- and a
post-hook). It cuts each param group once (``plan_group`` in step_plan.py:
flat runs of fsdp2's buffers, leftovers stepped per parameter) and steps the
group by one of two strategies, chosen by its tier (state_store.py):

- in memory (``MemoryTier``), ``MemoryStep`` (memory_step.py): the group's
  DTensor parameters are swapped for plain tensors the optimizer steps
  without DTensor dispatch (see [Note: Why local shards] in
  local_shard_step.py): the pieces of the flat runs (see [Note: Flat
  optimizer steps] in flat_run.py) and, as the fallback for whatever cannot
  be flat, each parameter's local shard with its local state. The user's
  optimizer steps them all in one call; then the parameters come back.
- in a store (``HostStore`` / ``DiskStore``), ``StoreStep``
  (store_step.py): the runs are cut into units (``plan_units``) and each
  unit steps on the tier's state views (see [Note: Stepping in units] in
  unit_step.py); the user's optimizer then steps empty lists.

Either way ``optimizer.state`` holds the views that state_views.py makes.
The engine is the one way through a step: it plans (step_plan.py), hands
the plans to the strategy, which steps on the storage its tier gives
(state_store.py, flat_run.py) and publishes (state_views.py); no module
below it calls back into it.

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

import itertools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from ..api import OptimizerOffloadPolicy
from . import unit_step
from .flat_run import FlatRun
from .memory_step import MemoryStep
from .replica_sharded_step import ReplicaShardedStep
from .state_store import StateTier, open_tier
from .step_plan import GroupPlan, Unit, elementwise_names, is_elementwise, plan_group, plan_units
from .store_step import StoreStep

logger = logging.getLogger("fsdp2.optim.local_shard_step")  # the name users filter on


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
        self.flat = flat_buffers and is_elementwise(optimizer)
        if flat_buffers and not self.flat:
            logger.debug(
                "enable_local_shard_step: %s is not one of the elementwise optimizers (%s); "
                "it steps on each parameter's local shard, not on flat buffers",
                type(optimizer).__name__,
                elementwise_names(),
            )
        self.plans: dict[int, GroupPlan] = {}  # id(param group) -> its cut
        self.memory = MemoryStep(self.replicas, flat_groups_only)
        self.store: StoreStep | None = None  # the unit-by-unit step, in a host or disk tier
        copies = False  # the host tier steps host copies of device parameters
        if offload is not None and offload.tier == "host":
            copies = unit_step.params_on_accelerator(optimizer)
            if not copies:  # CPU ranks: the state already is in host memory, keep it in place
                offload = None
        units: list[Unit] = []
        if offload is not None:  # planned once: the tier's layout depends on it
            plans = [self.plan_of(g) for g in optimizer.param_groups]
            units = plan_units(optimizer, plans, offload.unit_bytes, copies)
        self.tier: StateTier = open_tier(offload, [u.layout for u in units])
        if self.tier.in_units:
            self.store = StoreStep(optimizer, units, self.tier, copies)
        self._held: list[list[Any]] = []  # the groups' parameters while a store step runs
        # ``optimizer.state``'s keys before a step that may create state (see _keep_key_order)
        self._keys_before: list | None = None
        self._new_state = False  # this step may create state (some run's first step, ...)
        if self.store is not None:
            self.store.load(optimizer)  # state the optimizer has already moves into the tier

    @property
    def units(self) -> list[Unit]:
        """The store tier's units (none in memory)."""
        return self.store.units if self.store is not None else []

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
        self.memory.grad_views = []

    # ---- the hooks ----------------------------------------------------------------

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():  # See [Note: Calls the engine steps aside for]
            if self.store is not None or self.replicas is not None:
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
        if self.store is not None:
            self._new_state = True
            self._keys_before = list(state)
            self.store.step(optimizer)
            self._held = [g["params"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["params"] = []
            return
        count = len(state)
        plans = [self.plan_of(g) for g in optimizer.param_groups]
        try:
            new_state = self.memory.swap_in(optimizer, plans)
        except BaseException:  # a refusal half-way: the groups get their own parameters back
            self.memory.swap_out(state)
            raise
        self._new_state = new_state or self.replicas is not None
        if self._new_state:
            # The swap only appended keys (the stand-ins'), so the first ``count`` are the
            # keys before the step. Read only on steps that may create state: reading every
            # key touches every parameter object, about 1 us each after a backward.
            self._keys_before = list(itertools.islice(state, count))

    def after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self._give_back(optimizer)
        if self.replicas is not None:
            self.replicas.after_step()
        if self._new_state and self._keys_before is not None:
            _keep_key_order(optimizer, self._keys_before)
        self._keys_before = None
        self.memory.after_step(optimizer.state)

    def recover(self, *_: Any) -> None:
        """A ``step()`` that raised left stand-ins in the param groups: put the parameters back.

        torch runs no post-hook when the step raises (``capturable`` on CPU,
        a ``KeyboardInterrupt``), so whatever reads the groups next (the next
        step, ``zero_grad``, ``state_dict``, ``load_state_dict``) calls this
        first: the groups get their DTensor parameters back and the state
        the step left is published as after any step.
        """
        if not (self.memory.swapped or self._held):
            return
        self._give_back(self.optimizer)
        if self._new_state and self._keys_before is not None:  # state it made: torch's order
            _keep_key_order(self.optimizer, self._keys_before)
        self._keys_before = None

    def _give_back(self, optimizer: torch.optim.Optimizer) -> None:
        for g, params in zip(optimizer.param_groups, self._held):
            g["params"] = params
        self._held = []
        self.memory.swap_out(optimizer.state)

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
        self.memory.forget_state()  # holds none of the replaced state alive
        if self.replicas is not None:  # the slices take their part now: state_dict() sees it
            self.replicas.after_load(optimizer.state)
        if self.store is not None:
            self.store.load(optimizer)

    def close(self) -> None:
        """Stop: state in files comes back into ordinary memory, the tier is released."""
        self.memory.forget_state()  # holds no published view (of a mapped file) alive
        if self.replicas is not None:
            self.replicas.close()
        if self.store is not None:
            self.store.close(self.optimizer)
        else:
            self.tier.close()

    # ---- zero_grad and step, routed through the engine ---------------------------------

    def zero_grad(self, optimizer: torch.optim.Optimizer, zero_grad: Any, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad``: each flat gradient the last step used cleared at once
        (``MemoryStep.zero_grad``), the rest by the optimizer's own."""
        self.recover()
        self.memory.zero_grad(optimizer, zero_grad, set_to_none)

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
