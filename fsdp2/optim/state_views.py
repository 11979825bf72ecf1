"""What ``optimizer.state`` holds outside ``step``, whatever tier holds the state.

Every tier of the step engine keeps ``optimizer.state`` keyed by the
parameters the user gave the optimizer, with the values a plain step would
leave there: parameter-shaped state (moments, momentum buffers) as a DTensor
sharded like its parameter, over wherever the tier keeps it (a flat run's
buffer, a host buffer, a mapped file, the local tensor the optimizer made),
and scalar state such as Adam's ``step`` as it is. So ``state_dict()``, DCP
and ``get_optimizer_state_dict`` see the same keys, types and values on every
tier. This module is the one place that makes those views.

[Note: The state a caller holds is the state]
torch's optimizers create a parameter's state dict once and then update the
tensors in it in place, so whatever a caller took from ``optimizer.state``
(a state tensor, the per-parameter dict, ``state_dict()``, which holds those
very dicts, or DCP's ``get_state_dict``, which holds those tensors) shows the
state after every later step, also after a ``load_state_dict``. torchft and
torchtitan cache a state dict this way; async checkpoint staging, EMA
helpers and logging hold references too. So ``publish`` never replaces
what the optimizer holds: it keeps the parameter's dict and, where a held
tensor is already there, *adopts* it: ``Tensor.set_`` points the held tensor
(its local tensor, for a DTensor) at the tier's memory, the held object
stays, and its values are the tier's from then on. A value is put in only
where the dict had none (the first step's state) or held a different kind
of thing (another shape, dtype or device, or no tensor).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import dtensor_state_like, local_tensor, storage_shared


def local_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local tensor if it is a DTensor, else ``t``."""
    return local_tensor(t) if isinstance(t, DTensor) else t


def publish(state: dict, param: torch.Tensor, values: dict) -> dict:
    """Put ``values`` in ``state[param]``, keeping the dict and the tensors already there.

    ``values`` hold plain (local) tensors; a value shaped like the parameter's
    local tensor becomes a DTensor with the parameter's mesh and placements
    over the same memory (no copy). A tensor the dict already holds for a key
    adopts the new value's memory instead of being replaced (see [Note: The
    state a caller holds is the state]), a store tier's fresh mapping of its
    file included. Returns the dict in ``state``.
    """
    held = state.get(param)
    if held is values:
        return held
    shape = local_tensor(param).shape if isinstance(param, DTensor) else None
    wrapped = {}
    for key, value in values.items():
        old = None if held is None else held.get(key)
        if isinstance(old, DTensor) and local_tensor(old) is value:
            wrapped[key] = old  # the held DTensor over this very tensor (a per-parameter step's)
        elif (
            shape is not None and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor) and value.dim() > 0 and value.shape == shape
        ):
            wrapped[key] = dtensor_state_like(param, value)
        else:
            wrapped[key] = value
    if held is None:
        state[param] = wrapped
        return wrapped
    for key, value in wrapped.items():
        old = held.get(key)
        if old is value or (old is not None and _adopt(old, value)):
            continue
        held[key] = value
    for key in [k for k in held if k not in wrapped]:
        del held[key]
    return held


def _adopt(old: Any, new: Any) -> bool:
    """Point the held tensor ``old`` at ``new``'s memory; ``False`` where it cannot stand for it."""
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
        return False
    if isinstance(old, DTensor) != isinstance(new, DTensor):
        return False
    if isinstance(new, DTensor) and (
        old.placements != new.placements or old.device_mesh != new.device_mesh
    ):
        return False
    mine, theirs = local_of(old), local_of(new)
    if (
        type(mine) is not torch.Tensor
        or mine.requires_grad
        or mine.shape != theirs.shape
        or mine.dtype != theirs.dtype
        or mine.device != theirs.device
    ):
        return False
    if mine is not theirs and not _same_memory(mine, theirs):
        with torch.no_grad():
            mine.set_(theirs)
    return True


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
    )


def adoptable(value: Any, device: torch.device) -> bool:
    """Whether a held state tensor can be pointed at a flat run's memory without anyone noticing.

    It must be a plain tensor on ``device`` that is the only user of its
    whole storage: a slice of a larger tensor, or a tensor another one views,
    would stop sharing the caller's memory once adopted (the run then steps
    those parameters one by one instead, on the held tensors themselves).
    """
    t = local_of(value)
    return (
        type(t) is torch.Tensor
        and t.device == device
        and not t.requires_grad
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and not storage_shared(t)
    )


def unwrap(values: dict) -> dict[Any, Any]:
    """``values`` with DTensors replaced by their local tensors (what a local step reads)."""
    return {k: local_tensor(v) if isinstance(v, DTensor) else v for k, v in values.items()}


def same_objects(a: list, b: list) -> bool:
    """The same objects, in order, compared by identity (looped in C, never hashing one)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))
