"""The one cut: which optimizers step exactly in pieces, and how a param group is cut for a step.

An elementwise optimizer's update of an element reads only that element's
parameter, gradient and state (and group-wide scalars), so any grouping of
elements into tensors gives the same bits. Every tier of the step engine
(step_engine.py) cuts a param group the same way:

- ``plan_group``: the parameters whose slots follow each other in one fsdp2
  flat buffer (same dtype, same ``requires_grad``) form a ``FlatRun`` (see
  [Note: Flat optimizer steps] in flat_run.py); the others are leftovers,
  stepped per parameter (the fallback). The in-memory tier steps each run as
  one tensor.
- ``plan_units``: a store tier (host, disk) holds state in *units* of about
  ``unit_bytes``, made from those runs: a run, or a run split at parameter
  boundaries where it exceeds ``unit_bytes``; the leftovers are cut the same
  way, in param-group order (see [Note: Stepping in units] in unit_step.py).
  So where a parameter's state lives is decided on the runs the in-memory
  tier steps.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import local_tensor
from ..runtime.storage.flat_shard import flat_slot_of
from .flat_run import FlatRun
from .state_store import UnitLayout

# Optimizers whose update of an element reads only that element's parameter,
# gradient and state (and group-wide scalars): stepping a flat run is exact.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
)

# [Note: The C++ loop on CPU]
# On CPU an optimizer left at ``foreach=None`` takes its per-tensor Python
# loop, and on a model of many small parameters that loop's Python (about
# 10 kernel calls and some float math per tensor) costs as much as the
# kernels. torch's CPU ``_foreach_*`` ops loop over the tensors in C++ calling
# the very kernels the per-tensor loop calls, and for these optimizers the
# foreach implementation calls them in the same order with the same scalars
# (NAdam and RAdam's do not: excluded), so the two give the same bits, and
# which one runs is a matter of speed only. The C++ loop takes about half the
# time on small tensors. But it runs each kernel over every tensor before the
# next kernel (and holds a temporary the size of a state for all of them), so
# a tensor no longer stays in the cache across its ~8 kernels (the reason flat
# runs step in pieces, see flat_run.py): from 8 Ki elements on, the per-tensor
# loop is as fast or faster, and leaner. So for a group it steps as plain CPU
# tensors the engine takes ``foreach=True`` where they average fewer than
# ``CPP_LOOP_MEAN_NUMEL`` elements and the user left ``foreach`` to torch,
# and ``foreach=False`` where they are larger and the user asked for
# ``foreach=True`` (a user's ``foreach=False`` stays: it may be for memory).
# The group shows the user's value again after the step. Checked on torch
# 2.13 and 2.15 (test_flat_step.py compares each optimizer, with and without
# ``foreach=True``, bit for bit with the unsharded and the DTensor step).
# One side effect differs: SGD's foreach path with nesterov momentum (and no
# weight decay, no maximize) adds the momentum into the gradients in place,
# where the per-tensor loop leaves ``p.grad`` as autograd wrote it. Such a
# group keeps the loop its user chose (``_foreach_writes_grads``; the
# differential test, test_call_sequences.py, compares ``.grad`` after every step).
SAME_BITS_FOREACH_ON_CPU: tuple[type, ...] = tuple(
    c for c in ELEMENTWISE_OPTIMIZERS if c not in (torch.optim.NAdam, torch.optim.RAdam)
)


CPP_LOOP_MEAN_NUMEL = 8192


def cpu_loop_choice(
    optimizer: torch.optim.Optimizer, group: dict, tensors: list[torch.Tensor]
) -> bool | None:
    """The ``foreach`` value ``group`` should step ``tensors`` with, or ``None`` to keep its own.

    See [Note: The C++ loop on CPU].
    """
    asked = group.get("foreach")
    if type(optimizer) not in SAME_BITS_FOREACH_ON_CPU or asked is False or not tensors:
        return None
    if group.get("fused") or group.get("differentiable") or group.get("capturable"):
        return None
    if _foreach_writes_grads(optimizer, group):
        return None
    small = sum(t.numel() for t in tensors) < CPP_LOOP_MEAN_NUMEL * len(tensors)
    if small == bool(asked) or any(t.device.type != "cpu" for t in tensors):
        return None
    for key, value in group.items():  # tensor hyperparameters take other code paths
        if key != "params" and (
            isinstance(value, torch.Tensor)
            or (isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value))
        ):
            return None
    return small


def _foreach_writes_grads(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Whether ``group``'s foreach step writes into its gradients (see [Note: The C++ loop on CPU])."""
    return (
        type(optimizer) is torch.optim.SGD
        and bool(group.get("nesterov"))
        and group.get("momentum", 0) != 0
        and group.get("weight_decay", 0) == 0
        and not group.get("maximize", False)
    )


PARAM_COPY = "__param__"  # a unit's host copy of a device parameter (host tier)


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s own class is one of ``ELEMENTWISE_OPTIMIZERS`` (not a subclass)."""
    return type(optimizer) in ELEMENTWISE_OPTIMIZERS


def elementwise_names() -> str:
    return ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)


@dataclass
class GroupPlan:
    """One param group cut into flat runs and leftovers (stepped per parameter)."""

    param_ids: tuple[int, ...]  # the group's parameters when it was planned
    runs: list[FlatRun]
    leftovers: list

    def holds(self, params: list) -> bool:
        """Whether the plan still describes ``params`` (same list, every run still flat)."""
        return self.param_ids == tuple(map(id, params)) and all(r.still_flat() for r in self.runs)


def plan_group(params: list, flat: bool, across_groups: bool = True) -> GroupPlan:
    """Cut one param group's parameters into flat runs (``flat``) and leftovers.

    ``across_groups``: a run may span the buffers of several fsdp2 groups
    that lie side by side in one arena (see [Note: Arenas] in
    runtime/storage/arena.py); otherwise each run stays in one group's buffer.
    """
    runs, leftovers = plan_runs(params, across_groups) if flat else ([], list(params))
    return GroupPlan(tuple(map(id, params)), runs, leftovers)


def plan_runs(params: list, across_groups: bool = True) -> tuple[list[FlatRun], list]:
    """Split one param group's parameters into flat runs and leftovers (stepped per parameter).

    Runs come in the order of their buffers' first parameter in ``params``, so
    every rank and every restart cuts alike (a disk tier's layout fingerprint).
    """
    placed = []
    leftovers = []
    first_seen: dict[int, int] = {}  # id(buffer) -> its first parameter's index in params
    for i, p in enumerate(params):
        slot = flat_slot_of(p) if isinstance(p, DTensor) else None
        if slot is None:
            leftovers.append(p)
            continue
        home, start = (slot.home, slot.home_start) if across_groups else (slot.group, slot.start)
        order = first_seen.setdefault(id(home.buffer), i)
        placed.append((order, start, p, home, start + slot.stop - slot.start))
    placed.sort(key=lambda e: (e[0], e[1], e[4]))  # an empty slot before one at its start
    runs: list[FlatRun] = []
    current: list = []

    def close() -> None:
        if current:
            home = current[0][3]
            starts = [e[1] for e in current]
            runs.append(FlatRun([e[2] for e in current], home, starts, current[-1][4]))
            current.clear()

    for entry in placed:
        _, start, p, home, _ = entry
        if current:
            _, _, prev, prev_home, prev_stop = current[-1]
            if (
                prev_home is not home
                or (prev_stop != start and not _padding(home, prev_stop, start))
                or local_tensor(prev).dtype != local_tensor(p).dtype
                or prev.requires_grad != p.requires_grad
            ):
                close()
        current.append(entry)
    close()
    return runs, leftovers


def _padding(home: Any, stop: int, start: int) -> bool:
    """Whether a run may go on across ``[stop, start)``: padding of its layout, no parameter's
    (the parameter-major layout's gaps between parameters and between groups)."""
    return stop < start and home.padding_between(stop, start)


@dataclass
class Unit:
    """Consecutive parameters of one run (or of the leftovers) whose state is one region of a tier."""

    group: int  # index into optimizer.param_groups
    params: list[torch.Tensor]
    layout: UnitLayout
    # the parameter-shaped state keys of each parameter (not the host copy)
    keys: list[list[str]] = field(init=False)

    def __post_init__(self) -> None:
        self.keys = [
            sorted({s.key for s in self.layout.slots if s.param == i and s.key != PARAM_COPY})
            for i in range(len(self.params))
        ]


def plan_units(
    optimizer: torch.optim.Optimizer, plans: list[GroupPlan], unit_bytes: int, copies: bool
) -> list[Unit]:
    """Units of about ``unit_bytes`` of state made from each group's runs, then its leftovers.

    ``plans[i]`` is ``optimizer.param_groups[i]``'s cut; ``copies``: each unit
    also holds a host copy of its parameters.
    """
    units = []
    for gi, (group, plan) in enumerate(zip(optimizer.param_groups, plans)):
        keys = state_keys(optimizer, group)
        for params in [run.params for run in plan.runs] + [plan.leftovers]:
            units += _cut(gi, params, keys, unit_bytes, copies)
    return units


def _cut(group: int, params: list, keys: list[str], unit_bytes: int, copies: bool) -> list[Unit]:
    """``params`` split at parameter boundaries into units of at most ``unit_bytes`` (or one parameter)."""
    units = []
    run: list[torch.Tensor] = []
    entries: list = []
    nbytes = 0
    for p in params:
        local = local_tensor(p) if isinstance(p, DTensor) else p
        shape, dtype = tuple(local.shape), local.dtype
        mine = [(len(run), k, dtype, shape) for k in keys]
        if copies:
            mine.append((len(run), PARAM_COPY, dtype, shape))
        size = local.numel() * dtype.itemsize * len(mine)
        if run and nbytes + size > unit_bytes:
            units.append(Unit(group, run, UnitLayout.of(entries)))
            run, entries, nbytes = [], [], 0
            mine = [(0, k, d, s) for _, k, d, s in mine]
        run.append(p)
        entries += mine
        nbytes += size
    if run:
        units.append(Unit(group, run, UnitLayout.of(entries)))
    return units

def state_keys(optimizer: torch.optim.Optimizer, group: dict) -> list[str]:
    """The parameter-shaped state keys ``group``'s settings create, found by a step on ``meta``."""
    hparams = {k: v for k, v in group.items() if k != "params"}
    probe = torch.empty(2, device="meta", requires_grad=True)
    probe.grad = torch.empty(2, device="meta")
    args = ctor_args(type(optimizer), hparams)
    args["foreach"] = False  # the meta probe needs the plain loop
    if "fused" in args:
        args["fused"] = None
    dry = type(optimizer)([probe], **args)
    dry.step()
    return sorted(k for k, v in dry.state[probe].items() if torch.is_tensor(v) and v.shape == (2,))


def ctor_args(cls: type, hparams: dict) -> dict:
    """The hyperparameters ``cls``'s constructor takes; the others (schedulers', users') are set after."""
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in hparams.items() if k in accepted and k != "params"}
