"""What ``optimizer.state`` holds outside ``step``, whatever tier holds the state.

Every tier of the step engine keeps ``optimizer.state`` keyed by the
parameters the user gave the optimizer, with the values a plain step would
leave there: parameter-shaped state (moments, momentum buffers) as a DTensor
sharded like its parameter, over wherever the tier keeps it (a flat run's
buffer, a host buffer, a mapped file, the local tensor the optimizer made),
and scalar state such as Adam's ``step`` as it is. So ``state_dict()``, DCP
and ``get_optimizer_state_dict`` see the same keys, types and values on every
tier. This module is the one place that makes those views.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import dtensor_state_like, local_tensor


def local_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local tensor if it is a DTensor, else ``t``."""
    return local_tensor(t) if isinstance(t, DTensor) else t


def publish(state: dict, param: torch.Tensor, values: dict) -> dict:
    """Set ``state[param]`` to ``values``, parameter-shaped tensors wrapped like ``param``.

    ``values`` hold plain (local) tensors; a value shaped like the parameter's
    local tensor becomes a DTensor with the parameter's mesh and placements
    over the same memory (no copy). Returns the dict put in ``state``.
    """
    if isinstance(param, DTensor):
        shape = local_tensor(param).shape
        values = {
            k: dtensor_state_like(param, v)
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0
            and v.shape == shape
            else v
            for k, v in values.items()
        }
    state[param] = values
    return values


def unwrap(values: dict) -> dict[Any, Any]:
    """``values`` with DTensors replaced by their local tensors (what a local step reads)."""
    return {k: local_tensor(v) if isinstance(v, DTensor) else v for k, v in values.items()}
