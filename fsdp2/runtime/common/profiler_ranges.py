"""Profiler ranges under upstream's names (``FSDP::pre_forward (layers.0)``, ...), in one place.

A CPU or GPU profile of fsdp2 then reads like one of upstream's: the same
range kinds, labelled with the same group names.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..._torch_compat import profiler_enabled

NO_RANGE = contextlib.nullcontext()  # reusable: it holds no state

# Labelled even for the root (whose name is empty), as upstream: "... ()"
_ALWAYS_LABELLED = frozenset({"FSDP::post_backward_rs_wait"})


def record_function(name: str, fqn: str = "", when: bool = True, pg: int | None = None) -> Any:
    """A profiler range named as upstream's (``FSDP::pre_forward (layers.0)``), if ``when``.

    ``pg``: the group's shard size, which upstream appends (`` [pg=2]``) when
    one ``fully_shard`` call made several groups (per-parameter meshes).
    Free when no profiler runs: the label is only built while one does, and
    the no-op context is one shared object.
    """
    if when and profiler_enabled():
        if fqn or name in _ALWAYS_LABELLED:  # upstream names a prefetch "for" its target
            name = f"{name} for {fqn}" if name.endswith("_prefetch") else f"{name} ({fqn})"
        if pg is not None:
            name = f"{name} [pg={pg}]"
        return torch.profiler.record_function(name)
    return NO_RANGE
