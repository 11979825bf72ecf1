"""Full (unsharded) state dicts of a model and its optimizer, gathered to and loaded from rank 0.

[Note: Full state dicts]
``get_full_state_dict`` turns the sharded state (DTensor parameters and
optimizer states) into plain CPU tensors on rank 0, one tensor at a time (see
[Note: Full tensors through rank 0] in rank0.py), ready for ``torch.save`` and
for the plain, unsharded model. Optimizer state is keyed by parameter name,
the format of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
with ``full_state_dict=True``, so it loads into an optimizer over the unsharded
model and back.

``set_full_state_dict`` is the reverse, and only rank 0 needs the dicts. Rank 0
checks them against the model and the optimizer (keys, shapes, parameter
groups) and every rank gets one small plan: either the error, raised on every
rank before a single value is written, or what to load plus the optimizer's
scalars. Then every tensor goes from rank 0 straight into the shards. A model
still on ``meta`` is materialized (``to_empty``) once the check has passed.

Both are collectives over the default process group when the model holds
DTensors (call them on every rank, in the same order); for a plain model they
are local: every process reads and writes its own dicts.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime.common.tensor_tree import map_tensors
from .optim_keys import keyed_by_name
from .rank0 import (
    MeshCopies,
    check_placements,
    comm_device,
    copies_by_mesh,
    gather_to_rank0,
    meshes_of,
    rank,
    scatter_from_rank0,
)

__all__ = ["IncompatibleKeys", "get_full_state_dict", "set_full_state_dict"]

StateDict = dict[str, Any]
_MAX_LISTED = 10  # keys named per category in an error message


class IncompatibleKeys(NamedTuple):
    """Keys skipped by ``set_full_state_dict(..., strict=False)``."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def get_full_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer | None = None
) -> tuple[StateDict, StateDict]:
    """Gather the model's (and optimizer's) full state dict as CPU tensors on rank 0.

    Returns ``(model_state_dict, optim_state_dict)``: plain CPU tensors under
    the usual ``model.state_dict()`` keys, and the optimizer state keyed by
    parameter name (``{"state": {name: {...}}, "param_groups": [{..., "params":
    [names]}]}``; ``{}`` without ``optim``). Other ranks get ``({}, {})``.

    Tensors are gathered one at a time, point-to-point into rank 0's output, so
    no rank holds more than one full tensor beyond its shards. Collective over
    the default process group when the model holds DTensors; for a plain model
    it is local and every process gets its own copy.
    """
    targets = model.state_dict(keep_vars=True)  # also reshards FSDP modules
    names = _param_names(model)
    collective = _is_collective(targets)
    if collective:
        _, copies = _exchange(_layout(targets, optim, names), None, targets)
        device = comm_device()

        def full_of(value: torch.Tensor, name: str) -> torch.Tensor | None:
            return gather_to_rank0(value, device, name, copies)
    else:

        def full_of(value: torch.Tensor, name: str) -> torch.Tensor | None:
            return value.detach().to("cpu", copy=True)

    on_rank0 = not collective or rank() == 0
    model_sd: StateDict = {}
    done: dict[int, torch.Tensor | None] = {}  # tied tensors are gathered once
    with torch.no_grad():
        for key, value in targets.items():
            if not isinstance(value, torch.Tensor):
                model_sd[key] = copy.deepcopy(value)  # extra state: the same on every rank
                continue
            if id(value) not in done:
                done[id(value)] = full_of(value, key)
            model_sd[key] = done[id(value)]
        optim_sd = _gather_optim(optim, names, full_of) if optim is not None else {}
    return (model_sd, optim_sd) if on_rank0 else ({}, {})


def set_full_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    model_state_dict: Mapping[str, Any] | None,
    optim_state_dict: Mapping[str, Any] | None = None,
    strict: bool = True,
) -> IncompatibleKeys:
    """Load a full state dict held by rank 0 into a sharded (or plain) model and optimizer.

    Only rank 0's ``model_state_dict`` / ``optim_state_dict`` are read (pass
    ``{}`` or ``None`` elsewhere); both are in the format of
    :func:`get_full_state_dict`, e.g. a plain model's ``state_dict()``, or
    FSDP1's ``FULL_STATE_DICT`` model dict and ``FSDP.optim_state_dict``. An
    optimizer state keyed by parameter index (a plain ``optimizer.state_dict()``,
    or FSDP1's ``rekey_optim_state_dict(..., OptimStateKeyType.PARAM_ID, ...)``)
    is accepted too: the indices of each saved parameter group name the
    optimizer's parameters of that group, in order. Every
    key and shape is checked first: on any mismatch every rank raises the same
    ``ValueError`` naming the keys, and nothing is written. Then each tensor is
    sent from rank 0 into the shards (or broadcast, for plain tensors such as
    buffers), one at a time. A model on ``meta`` is materialized with
    ``to_empty`` on its mesh's device first.

    Args:
        strict: ``False`` skips missing and unexpected model keys (returned)
            instead of raising; shapes must match either way.

    Returns:
        The model keys skipped (non-empty only with ``strict=False``).
    """
    targets = model.state_dict(keep_vars=True)  # also reshards FSDP modules
    names = _param_names(model)
    _check_loadable(model, targets)
    if optim is not None:
        _optim_params(optim, names)  # raises on every rank alike
    collective = _is_collective(targets)
    on_rank0 = not collective or rank() == 0
    plan, copies = None, None
    if on_rank0:
        try:
            if optim is not None:  # See [Note: Index-keyed optimizer state] in optim_keys.py
                optim_state_dict = keyed_by_name(optim_state_dict, optim, names)
            plan = _plan(targets, model_state_dict, strict, optim, optim_state_dict, names)
        except Exception as e:  # noqa: BLE001 - the other ranks must hear about it
            if not collective:
                raise
            plan = {"error": f"set_full_state_dict could not read the state dict: {e!r}"}
    if collective:
        plan, copies = _exchange(_layout(targets, optim, names), plan, targets)
    if plan["error"]:
        raise ValueError(plan["error"])

    if any(t.is_meta for t in targets.values() if isinstance(t, torch.Tensor)):
        model.to_empty(device=_materialize_device(targets))
        targets = model.state_dict(keep_vars=True)
        names = _param_names(model)
    device = comm_device() if collective else torch.device("cpu")

    def load(source: torch.Tensor | None, target: torch.Tensor, name: str) -> None:
        if collective:
            scatter_from_rank0(source, target, device, name, copies)
        else:
            target.copy_(source)

    with torch.no_grad():
        for key in plan["keys"]:
            load(model_state_dict[key] if on_rank0 else None, targets[key], key)
        if plan["optim"] is not None:
            _load_optim(optim, plan["optim"], optim_state_dict if on_rank0 else None, names, load)
    return IncompatibleKeys(plan["missing"], plan["unexpected"])


# ---- optimizer ------------------------------------------------------------------


def _gather_optim(
    optim: torch.optim.Optimizer,
    names: dict[nn.Parameter, str],
    full_of: Callable[[torch.Tensor, str], torch.Tensor | None],
) -> StateDict:
    params = _optim_params(optim, names)
    osd = optim.state_dict()  # ids are positions in `params`
    state = {}
    for i, entry in osd["state"].items():
        fqn = names[params[i]]
        state[fqn] = {
            key: map_tensors(lambda t, n=f"{fqn}.{key}": full_of(t, n), value)
            for key, value in entry.items()
        }
    groups = []
    for group in osd["param_groups"]:
        saved = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        saved["params"] = [names[params[i]] for i in group["params"]]
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def _load_optim(
    optim: torch.optim.Optimizer,
    plan: dict[str, Any],
    optim_sd: Mapping[str, Any] | None,
    names: dict[nn.Parameter, str],
    load: Callable[[torch.Tensor | None, torch.Tensor, str], None],
) -> None:
    params = _optim_params(optim, names)
    index = {p: i for i, p in enumerate(params)}
    by_name = {names[p]: p for p in params}
    state: dict[int, dict[str, Any]] = {}
    for fqn, items in plan["state"]:
        param = by_name[fqn]
        current = optim.state.get(param, {})
        entry = {}
        for key, kind, meta in items:
            if kind == "object":
                entry[key] = meta
                continue
            dtype, shape = meta
            target = _optim_target(param, current.get(key), dtype, shape)
            source = optim_sd["state"][fqn][key] if optim_sd is not None else None
            load(source, target, f"{fqn}.{key}")
            entry[key] = target
        state[index[param]] = entry
    groups = []
    for saved, group in zip(plan["param_groups"], optim.param_groups):
        groups.append({**saved, "params": [index[p] for p in group["params"]]})
    optim.load_state_dict({"state": state, "param_groups": groups})


def _optim_target(
    param: torch.Tensor, existing: Any, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """Where one optimizer state tensor is loaded: the existing one if it fits, else a new one.

    A state of the parameter's shape is sharded like the parameter; anything
    else (``step``) is a replicated plain tensor.
    """
    if isinstance(existing, torch.Tensor) and existing.dtype == dtype:
        if isinstance(param, DTensor) and isinstance(existing, DTensor):
            if (
                tuple(existing.shape) == tuple(param.shape) == shape
                and existing.placements == param.placements
                and existing.device_mesh == param.device_mesh
            ):
                return existing  # loaded in place: no second copy of the state
        elif not isinstance(existing, DTensor) and tuple(existing.shape) == shape:
            return existing
    if shape and tuple(param.shape) == shape:
        if isinstance(param, DTensor):
            local = torch.empty_like(param.to_local(), dtype=dtype)
            return DTensor.from_local(
                local, param.device_mesh, param.placements,
                run_check=False, shape=param.shape, stride=param.stride(),
            )
        return torch.empty(shape, dtype=dtype, device=param.device)
    return torch.empty(shape, dtype=dtype)  # e.g. Adam's step lives on CPU


def _optim_params(optim: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> list:
    params = [p for group in optim.param_groups for p in group["params"]]
    unknown = [tuple(p.shape) for p in params if p not in names]
    if unknown:
        raise ValueError(
            f"The optimizer holds {len(unknown)} parameter(s) that are not parameters of the "
            f"model (shapes {unknown[:_MAX_LISTED]}); build the optimizer on "
            "model.parameters() after fully_shard"
        )
    return params


# ---- checks -----------------------------------------------------------------------


def _plan(
    targets: Mapping[str, Any],
    model_sd: Any,
    strict: bool,
    optim: torch.optim.Optimizer | None,
    optim_sd: Any,
    names: dict[nn.Parameter, str],
) -> dict[str, Any]:
    """Check the dicts against the model and optimizer; what to load, or the error."""
    if not isinstance(model_sd, Mapping):
        return {"error": f"model_state_dict must be a dict on rank 0, got {type(model_sd).__name__}"}
    missing = [k for k in targets if k not in model_sd]
    unexpected = [str(k) for k in model_sd if k not in targets]
    problems = []
    if strict and missing:
        problems.append(_listing("missing keys (in the model, not in the state dict)", missing))
    if strict and unexpected:
        problems.append(_listing("unexpected keys (in the state dict, not in the model)", unexpected))
    unfilled = [k for k in missing if _is_meta(targets[k])]
    if not strict and unfilled:
        problems.append(_listing("keys missing for a model on meta (cannot stay empty)", unfilled))
    bad = [_tensor_problem(k, model_sd[k], tuple(targets[k].shape)) for k in targets if k in model_sd]
    bad = [b for b in bad if b]
    if bad:
        problems.append(_listing("mismatched values", bad))
    optim_plan = _optim_plan(optim, optim_sd, names, problems)
    if problems:
        return {
            "error": "set_full_state_dict: the state dict does not match the model; nothing was "
            "loaded.\n  " + "\n  ".join(problems) + "\nIs it a checkpoint of another model? "
            "strict=False skips missing/unexpected model keys (never shape mismatches)."
        }
    return {
        "error": None,
        "keys": [k for k in targets if k in model_sd],
        "missing": missing,
        "unexpected": unexpected,
        "optim": optim_plan,
    }


def _optim_plan(
    optim: torch.optim.Optimizer | None,
    optim_sd: Any,
    names: dict[nn.Parameter, str],
    problems: list[str],
) -> dict[str, Any] | None:
    if optim is None:
        if optim_sd:
            problems.append("an optim_state_dict was given without the optimizer to load it into")
        return None
    if not optim_sd:
        return None  # load the model only
    if not isinstance(optim_sd, Mapping) or "state" not in optim_sd or "param_groups" not in optim_sd:
        problems.append("optim_state_dict must have 'state' and 'param_groups' (the format of "
                        "get_full_state_dict)")
        return None
    groups = optim.param_groups
    saved_groups = list(optim_sd["param_groups"])
    if len(saved_groups) != len(groups):
        problems.append(f"the optimizer has {len(groups)} parameter group(s), the state dict "
                        f"{len(saved_groups)}")
        return None
    for i, (saved, group) in enumerate(zip(saved_groups, groups)):
        expected = [names[p] for p in group["params"]]
        got = list(saved.get("params", []))
        lost = [n for n in expected if n not in got]
        extra = [str(n) for n in got if n not in expected]
        if lost:
            problems.append(_listing(f"optimizer group {i}: parameters missing", lost))
        if extra:
            problems.append(_listing(f"optimizer group {i}: unknown parameters", extra))
    shapes = {names[p]: tuple(p.shape) for group in groups for p in group["params"]}
    state_plan = []
    bad = []
    for fqn, entry in optim_sd["state"].items():
        if fqn not in shapes or not isinstance(entry, Mapping):
            bad.append(f"{fqn}: not a parameter of the optimizer")
            continue
        items = []
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                items.append((key, "object", value))
                continue
            shape = tuple(value.shape)
            problem = _tensor_problem(f"{fqn}.{key}", value, shapes[fqn] if shape else ())
            if problem:
                bad.append(problem)
            items.append((key, "tensor", (value.dtype, shape)))
        state_plan.append((fqn, items))
    if bad:
        problems.append(_listing("mismatched optimizer state", bad))
    hyper = [{k: v for k, v in saved.items() if k != "params"} for saved in saved_groups]
    return {"state": state_plan, "param_groups": hyper}


def _tensor_problem(key: str, value: Any, shape: tuple[int, ...]) -> str | None:
    if not isinstance(value, torch.Tensor):
        return f"{key}: a {type(value).__name__}, not a tensor"
    if isinstance(value, DTensor):
        return (f"{key}: a DTensor; pass a full state dict of plain tensors (sharded state "
                "dicts load with model.load_state_dict or torch.distributed.checkpoint)")
    if value.is_meta:
        return f"{key}: on the meta device (no values)"
    if tuple(value.shape) != shape:
        return f"{key}: shape {tuple(value.shape)} in the state dict, {shape} in the model"
    return None


def _check_loadable(model: nn.Module, targets: Mapping[str, Any]) -> None:
    """Refuse models whose loading would leave something unset (same verdict on every rank)."""
    for key, value in targets.items():
        if not isinstance(value, torch.Tensor):
            raise NotImplementedError(
                f"'{key}' is extra state ({type(value).__name__}); set_full_state_dict loads "
                "tensors only: load it with model.load_state_dict({key: value}, strict=False)"
            )
        if isinstance(value, DTensor):
            check_placements(key, value)
    saved = {id(t) for t in targets.values()}
    lost = [n for n, b in model.named_buffers() if b.is_meta and id(b) not in saved]
    if lost:
        raise ValueError(
            f"Buffers {lost} are on meta but not in the state dict (non-persistent), so "
            "loading cannot fill them. Materialize and initialize them first: "
            "model.to_empty(device=...), then your init (e.g. reset_parameters())"
        )


def _listing(what: str, items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = f" ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"{what}: {shown}{more}"


# ---- helpers ----------------------------------------------------------------------


def _param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: name for name, p in model.named_parameters()}


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _is_collective(targets: Mapping[str, Any]) -> bool:
    return any(isinstance(v, DTensor) for v in targets.values())


def _materialize_device(targets: Mapping[str, Any]) -> torch.device:
    for value in targets.values():
        if isinstance(value, DTensor):
            device_type = value.device_mesh.device_type
            if device_type == "cpu":
                return torch.device("cpu")
            return torch.device(device_type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _layout(
    targets: Mapping[str, Any], optim: torch.optim.Optimizer | None, names: dict[nn.Parameter, str]
) -> str:
    """A digest of what every rank will iterate over, to catch ranks that disagree."""
    items: list[Any] = []
    for key, value in targets.items():
        if isinstance(value, torch.Tensor):
            placements = getattr(value, "placements", None)
            items.append((key, tuple(value.shape), str(value.dtype), str(placements)))
    if optim is not None:
        for group in optim.param_groups:
            items.append([names.get(p, "?") for p in group["params"]])
        for p, entry in optim.state.items():
            items.append((names.get(p, "?"), sorted(entry)))
    return hashlib.sha256(repr(items).encode()).hexdigest()


def _exchange(
    layout: str, payload: Any, targets: Mapping[str, Any]
) -> tuple[Any, MeshCopies]:
    """Check every rank has the same layout; rank 0's ``payload`` and every rank's meshes.

    The meshes tell each rank who else holds what (see [Note: Full tensors
    through rank 0] in rank0.py).
    """
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (layout, payload, meshes_of(targets.values())))
    differ = [r for r, (digest, _, _) in enumerate(gathered) if digest != gathered[0][0]]
    if differ:
        raise ValueError(
            f"Ranks {differ} hold a model or optimizer that differs from rank 0's (keys, "
            "shapes, placements or optimizer state); every rank must pass the same model"
        )
    return gathered[0][1], copies_by_mesh([meshes for _, _, meshes in gathered])
