"""Stepping only this replica rank's slice of each flat run (HSDP, state sharded across replicas).

``enable_local_shard_step(optimizer, shard_across_replicas=True)`` marks every
group of the optimizer's parameters (runtime/group/replica_slices.py, see [Note:
Replica slices] there): the gradient is reduce-scattered over replicas, and
here each flat run (flat_run.py) steps only its part inside this rank's slice
of the group's buffer, as one tensor, holding only that part's state
(``SlicedRun``). After the step the engine starts the all-gather of the
updated slices.

Outside ``step``, ``optimizer.state[p]`` holds only the scalar state (``step``)
of a parameter, so the slices' memory is the only copy of the moments.
``optimizer.state_dict()`` (and so DCP, ``get_optimizer_state_dict``,
``save_checkpoint``) gets each parameter's rows in this rank's slice, views of
the live state, as DTensors of their true layout (see [Note: Replica slices
in state dicts] in replica_slices.py), with the scalars agreed on over
replicas (a collective: call ``state_dict()`` on every rank); a checkpoint so
saved loads into plain HSDP, FSDP, another replica count or one process, and
the other way round; ``load_state_dict`` of either layout keeps only the
slice at the next step. ``close()`` gathers the slices back into plain HSDP's
layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._torch_compat import dtensor_like, local_tensor
from ..ragged_placement import RowRuns
from ..runtime.group import replica_slices
from ..runtime.group.replica_slices import ReplicaSlices
from ..runtime.storage.flat_shard import flat_slot_of
from ..runtime.storage.shard_storage import own_storage
from .flat_run import FlatRun
from .step_plan import ctor_args, elementwise_names, is_elementwise


class SlicedRun:
    """The part of one flat run inside this replica rank's slice, stepped as one tensor.

    ``begin`` / ``end`` bound the part in the run's elements; ``param`` is that
    view of the buffer (the key the optimizer sees during ``step``) and
    ``state`` its optimizer state between steps.
    """

    def __init__(self, run: FlatRun, slices: ReplicaSlices, group: int) -> None:
        self.slices = slices
        self.group = group
        self.state: dict[str, Any] = {}
        self.rebind(run)

    def rebind(self, run: FlatRun) -> None:
        """Follow ``run`` (planned again, or its buffer re-allocated)."""
        self.run = run
        self.run_start = flat_slot_of(run.params[0]).start
        lo = max(self.run_start, self.slices.start)
        hi = max(lo, min(self.run_start + run.flat.numel(), self.slices.stop))
        self.begin, self.end = lo - self.run_start, hi - self.run_start
        self.param = run.flat[self.begin : self.end]

    def adopt(self, state: dict) -> None:
        """Take the slice of per-parameter state a ``load_state_dict`` put in ``state``."""
        loaded = [state.get(p) for p in self.run.params]
        if not any(
            v is not None and any(torch.is_tensor(x) and x.dim() > 0 for x in v.values())
            for v in loaded
        ):
            return
        for values, p in zip(loaded, self.run.params):  # on every rank, with a part or none
            for key, value in (values or {}).items():
                self._check_placement(value, p, key)
        built: dict[str, Any] = {}
        for values in loaded:
            for key, value in (values or {}).items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    built.setdefault(key, value.detach().clone() if torch.is_tensor(value) else value)
        for key in {k for v in loaded if v for k, x in v.items() if torch.is_tensor(x) and x.dim()}:
            parts = []  # (where in the part, the loaded elements there, or None)
            for values, p, off, n in zip(loaded, self.run.params, self.run.offsets, self.run.numels):
                lo, hi = max(off, self.begin), min(off + n, self.end)
                if hi > lo:
                    value = values.get(key) if values is not None else None
                    part = None if value is None else self._loaded_part(value, p, key, lo - off, hi - off)
                    parts.append((lo - self.begin, part))
            # Its own state dict loaded back: the state stays the tensor it was (a state dict
            # held meanwhile stays live), as torch's load keeps a value that is already its
            # own; any other values are new tensors, as there
            held = self.state.get(key)
            if (
                torch.is_tensor(held) and held.shape == (self.end - self.begin,)
                and all(part is not None and part.data_ptr() == held[at].data_ptr()
                        for at, part in parts)
            ):
                built[key] = held
                continue
            flat = self.param.new_zeros(self.end - self.begin)
            for at, part in parts:
                if part is not None:
                    flat[at : at + part.numel()].copy_(part)
            built[key] = flat
        self.state = built
        self._publish_scalars(state)

    def _loaded_part(self, value: torch.Tensor, p: torch.Tensor, key: str, lo: int, hi: int):
        """Elements ``[lo, hi)`` of ``p``'s local shard in a loaded state ``value``: a value
        in plain HSDP's layout holds the whole shard, one in the slices' own (``RowRuns``,
        see ``state_dict_hook``) just this rank's part of it."""
        local = local_tensor(value) if isinstance(value, DTensor) else value
        if isinstance(value, DTensor) and isinstance(value.placements[0], RowRuns):
            return local.reshape(-1)
        return local.reshape(-1)[lo:hi]

    def _check_placement(self, value: object, p: torch.Tensor, key: str) -> None:
        """A loaded value in ``RowRuns`` must name these slices' rows of ``p``."""
        if not (isinstance(value, DTensor) and isinstance(value.placements[0], RowRuns)):
            return
        ours = self.slices.placement_of(p)
        if value.placements[0] != ours:
            raise ValueError(
                f"load_state_dict: state {key!r} of a parameter of shape {tuple(p.shape)} is in "
                f"placement {value.placements[0]}, and this optimizer's slices of it are "
                f"{ours or 'not runs of rows'} (the state dict of another mesh "
                "or replica count): load it through DCP (dcp.load or fsdp2.load_checkpoint), "
                "which reshards"
            )

    def attach(self, state: dict, grad: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
        """Before the step: the slice's part with its gradient and state.

        ``grad`` is the run's flat gradient, or its per-parameter local
        gradients where they are not one region (set by hand, e.g. the zeros
        DCP's ``get_optimizer_state_dict`` steps a fresh optimizer with): the
        part's elements are then copied out of them.
        """
        self.adopt(state)
        if self.end == self.begin:
            return []
        if isinstance(grad, torch.Tensor):
            self.param.grad = grad[self.begin : self.end]
        else:
            part = self.param.new_empty(self.end - self.begin)
            for local, off, n in zip(grad, self.run.offsets, self.run.numels):
                lo, hi = max(off, self.begin), min(off + n, self.end)
                if hi > lo:
                    part[lo - self.begin : hi - self.begin].copy_(local.reshape(-1)[lo - off : hi - off])
            self.param.grad = part
        if self.state:
            state[self.param] = self.state
        return [self.param]

    def detach(self, state: dict) -> None:
        """After the step: keep the part's state; per parameter, only its scalars."""
        self.param.grad = None
        if self.end > self.begin:
            self.state = state.pop(self.param, self.state)
        self._publish_scalars(state)

    def _publish_scalars(self, state: dict) -> None:
        scalars = {k: v for k, v in self.state.items() if not (torch.is_tensor(v) and v.dim())}
        if scalars:
            for p in self.run.params:
                state[p] = dict(scalars)
        else:
            for p in self.run.params:
                state.pop(p, None)


class ReplicaShardedStep:
    """The step engine's part for parameters whose state is sharded across replicas."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, overlap: bool = False) -> None:
        if not is_elementwise(optimizer):
            raise ValueError(
                f"shard_across_replicas=True needs one of torch's elementwise optimizers "
                f"({elementwise_names()}); {type(optimizer).__name__} may read a whole "
                "parameter (fsdp2.Muon orthogonalizes whole matrices), which a replica's slice "
                "does not hold: drop the option for it"
            )
        self.optimizer = optimizer
        self.overlap = overlap  # leave the post-step all-gathers in flight after step()
        self.slices: list[ReplicaSlices] = []
        self.runs: dict[tuple[int, ...], SlicedRun] = {}
        self._stepped: list[ReplicaSlices] = []
        self._tracked = 0  # parameters seen so far (add_param_group adds more)
        self.track()

    def track(self) -> None:
        """Slice the groups of parameters added since the last call (``add_param_group``).

        Raises ``ValueError`` when a group's trainable parameter is not in this
        optimizer: its gradient holds only this replica's slice, so another
        optimizer would step it on zeros.
        """
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(params) == self._tracked:
            return
        names = _names(self.optimizer)
        ids = {id(p) for p in params}
        added: list[ReplicaSlices] = []
        first_name: dict[int, str] = {}
        try:
            for group in self.optimizer.param_groups:
                if group.get("differentiable", False):
                    raise ValueError(
                        "shard_across_replicas=True does not support differentiable=True"
                    )
                for p in group["params"]:
                    name = names.get(id(p), "<unnamed>")
                    slices = replica_slices.enable(p, name)
                    if slices is not None and slices not in self.slices and slices not in added:
                        added.append(slices)
                        first_name[id(slices)] = name
            for slices in added:
                missing = replica_slices.trainable_outside(slices, ids)
                if missing:
                    raise ValueError(
                        f"shard_across_replicas=True: parameter {missing[0]} (named inside its "
                        "fully_shard module) is in the same fully_shard group as this "
                        f"optimizer's {first_name[id(slices)]} but not in the optimizer; after "
                        "the reduce-scatter over replicas its gradient holds only this "
                        "replica's slice. Give all of a group's trainable parameters to this "
                        "optimizer (add_param_group), freeze it, or drop the option"
                    )
        except BaseException:  # nothing half-enabled: those groups stay plain HSDP
            for slices in added:
                replica_slices.disable(slices)
            raise
        self.slices += added
        self._tracked = len(params)

    def sliced(self, run: FlatRun, group: int) -> SlicedRun | None:
        """``run``'s part in this rank's slice, or ``None`` if its group is not sharded so."""
        slices = replica_slices.slices_of(run.params[0])
        if slices is None:
            return None
        key = tuple(map(id, run.params))
        sliced = self.runs.get(key)
        if sliced is None:
            sliced = self.runs[key] = SlicedRun(run, slices, group)
        elif sliced.run is not run or sliced.slices is not slices:
            sliced.slices = slices
            sliced.rebind(run)
        if slices not in self._stepped:
            self._stepped.append(slices)
        return sliced

    def check_leftovers(self, params: list) -> None:
        """A parameter of a sliced group must step in a run: its slice is all it has."""
        for p in params:
            if replica_slices.slices_of(p) is not None:
                raise RuntimeError(
                    "shard_across_replicas=True: a parameter of a group sharded across replicas "
                    "cannot step on its own (some of its run's parameters have no gradient): "
                    "give every trainable parameter of a group a gradient, or drop the option"
                )

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the slices' state this rank holds."""
        return [v for r in self.runs.values() for v in r.state.values() if torch.is_tensor(v)]

    def after_load(self, state: dict) -> None:
        """After ``load_state_dict``: each sliced run keeps its part of the loaded state."""
        for sliced in self.runs.values():
            sliced.adopt(state)

    def wait(self) -> None:
        """Finish every post-step all-gather in flight."""
        for slices in self.slices:
            slices.wait()

    def after_step(self) -> None:
        """All-gather over replicas the slices just stepped; without ``overlap``, wait for them."""
        for slices in self._stepped:
            slices.start_gather()
        if not self.overlap:
            for slices in self._stepped:
                slices.wait()
        self._stepped = []

    def close(self) -> None:
        """Back to plain HSDP: the slices' state gathered into ``optimizer.state`` (a collective)."""
        self.wait()
        for p, entry in self._gathered().values():
            self.optimizer.state[p] = entry
        self.runs = {}
        for slices in self.slices:
            replica_slices.disable(slices)

    # ---- state dicts: each rank's slice where it can be named, else plain HSDP's layout ----

    def state_dict_hook(self, optimizer: torch.optim.Optimizer, sd: dict) -> dict:
        """``optimizer.state_dict()``'s post-hook: the slices' state as DTensors of its true
        layout (see [Note: Replica slices in state dicts] in replica_slices.py)."""
        index_of = {}
        for g_sd, group in zip(sd["param_groups"], optimizer.param_groups):
            for index, p in zip(g_sd["params"], group["params"]):
                index_of[id(p)] = index
        for key, (_, entry) in self._gathered(true_layout=True).items():
            sd["state"][index_of[key]] = entry
        # A replica with no part of a parameter holds no state of it, so torch's own dict
        # (optimizer.state's order) lacked it until here: in the parameters' order, the same
        # keys in the same order on every rank (plain HSDP's, where state came in that order).
        sd["state"] = dict(sorted(sd["state"].items()))
        return sd

    def _gathered(self, true_layout: bool = False) -> dict[int, tuple[torch.Tensor, dict[str, Any]]]:
        """Each sliced parameter's state by ``id``: (parameter, state), in plain HSDP's layout
        (gathered over replicas) or, with ``true_layout``, as views of the slices' state where
        their placements are known."""
        optimizer = self.optimizer
        entries: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        tensor_keys, scalar_keys = [], []
        for group in optimizer.param_groups:
            t, s = _probe_keys(optimizer, group)
            tensor_keys += [k for k in t if k not in tensor_keys]
            scalar_keys += [k for k in s if k not in scalar_keys]
        for slices in self.slices:
            runs = [r for r in self.runs.values() if r.slices is slices]
            if not runs:
                continue
            placements = slices.state_placements if true_layout else None
            gathered = {}
            for key in tensor_keys if placements is None else ():
                mine = slices.flat.buffer.new_zeros(slices.chunk)
                for r in runs:
                    value = r.state.get(key)
                    if torch.is_tensor(value) and value.dim():
                        at = r.run_start + r.begin - slices.start
                        mine[at : at + value.numel()].copy_(value)
                out = mine.new_empty(slices.chunk * slices.num_replicas)
                dist.all_gather_into_tensor(out, mine, group=slices.group)
                gathered[key] = mine.new_empty(slices.numel)
                slices.unpadded(out, gathered[key])  # in the buffer's layout
            scalars = torch.full((len(runs), len(scalar_keys) + 1), math.nan, dtype=torch.float64)
            for i, r in enumerate(runs):
                if r.state:
                    scalars[i, -1] = 1.0  # this run has state
                for j, key in enumerate(scalar_keys):
                    if key in r.state:
                        scalars[i, j] = float(r.state[key])
            device = slices.flat.buffer.device
            all_scalars = [torch.empty_like(scalars, device=device) for _ in range(slices.num_replicas)]
            dist.all_gather(all_scalars, scalars.to(device), group=slices.group)
            known = _first_known(torch.stack([s.cpu() for s in all_scalars]))
            for i, r in enumerate(runs):
                if math.isnan(known[i, -1]):
                    continue  # no state on any replica (e.g. SGD without momentum)
                for p, off, n in zip(r.run.params, r.run.offsets, r.run.numels):
                    entry: dict[str, Any] = {}
                    for j, key in enumerate(scalar_keys):
                        if not math.isnan(known[i, j]):
                            # a tensor of its own per parameter: the run's one step count
                            # shared would be counted once per parameter by a plain step
                            entry[key] = torch.tensor(known[i, j], dtype=_scalar_dtype())
                    if placements is not None:
                        entry.update(_slice_views(slices, r, p, off, n, tensor_keys))
                    start = r.run_start + off
                    shape = local_tensor(p).shape
                    for key, full in gathered.items():
                        entry[key] = dtensor_like(p, full[start : start + n].clone().view(shape))
                    entries[id(p)] = (p, entry)
        return entries


def _slice_views(
    slices: ReplicaSlices, sliced: SlicedRun, p: torch.Tensor, off: int, n: int, keys: list[str],
) -> dict[str, DTensor]:
    """``p``'s rows in this rank's slice of each state ``key``: views of the live state, as
    DTensors on the flattened mesh with the parameter's ``RowRuns``."""
    placement = slices.placement_of(p)
    rows = placement.rows_of(slices.state_mesh.get_local_rank())[0]
    start = sliced.run_start + off
    lo, hi = (min(max(cut, start), start + n) for cut in (slices.start, slices.stop))
    base = sliced.run_start + sliced.begin  # where the part's state starts in the buffer
    rest = tuple(p.shape[1:])
    out = {}
    for key in keys:
        value = sliced.state.get(key)
        if torch.is_tensor(value) and value.dim() and hi > lo:
            # through a storage of its own (offset 0): torch.save of a DTensor whose local
            # tensor starts inside a larger storage fails (see shard_storage.py)
            local = own_storage(value[lo - base : hi - base]).view(rows, *rest)
        else:  # no rows of p here (or its part never stepped): an empty run
            local = local_tensor(p).new_zeros(rows, *rest)
        out[key] = DTensor.from_local(
            local, slices.state_mesh, (placement,), run_check=False, shape=p.shape,
            stride=p.stride(),
        )
    return out


def _first_known(stacked: torch.Tensor) -> torch.Tensor:
    """Per entry, the first replica's value that is not NaN (NaN where none is)."""
    out = stacked[0].clone()
    for other in stacked[1:]:
        out = torch.where(torch.isnan(out), other, out)
    return out


def _scalar_dtype() -> torch.dtype:
    # as torch.optim's _get_scalar_dtype
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _probe_keys(optimizer: torch.optim.Optimizer, group: dict) -> tuple[list[str], list[str]]:
    """(parameter-shaped, 0-d) state keys ``group``'s settings create, by a step on ``meta``."""
    hparams = {k: v for k, v in group.items() if k != "params"}
    probe = torch.empty(2, device="meta", requires_grad=True)
    probe.grad = torch.empty(2, device="meta")
    args = ctor_args(type(optimizer), hparams)
    args["foreach"] = False
    if "fused" in args:
        args["fused"] = None
    dry = type(optimizer)([probe], **args)
    dry.step()
    state = dry.state[probe]
    tensors = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1)
    scalars = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() == 0)
    return tensors, scalars


def _names(optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """``param_names`` where the optimizer has them (torch >= 2.6), for errors."""
    names = {}
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            given = group.get("param_names")
            names[id(p)] = given[i] if given else f"param_groups[..][{i}] of shape {tuple(p.shape)}"
    return names
