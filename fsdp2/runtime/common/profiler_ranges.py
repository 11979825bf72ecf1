"""Profiler ranges and debug records under upstream's names (``FSDP::pre_forward (layers.0)``).

A CPU or GPU profile of fsdp2 then reads like one of upstream's: the same
range kinds, labelled with the same group names. The hooks' debug records go
to upstream's logger with upstream's labels, so ``TORCH_LOGS="+fsdp"`` (or
``logging``'s own configuration of ``torch.distributed.fsdp``) shows what it
shows for upstream.
"""

from __future__ import annotations

import contextlib
import functools
import logging
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


#: upstream's logger, which torch's ``TORCH_LOGS`` name ``fsdp`` configures
logger = logging.getLogger("torch.distributed.fsdp.fully_shard")


def log_hook(name: str, fqn: str = "", pg: int | None = None) -> None:
    """A debug record as upstream's hooks write it (``FSDP::pre_forward (layers.0)``)."""
    if logger.isEnabledFor(logging.DEBUG):
        label = f"{name} ({fqn})" if fqn else name
        logger.debug("%s", label if pg is None else f"{label} [pg={pg}]")


@functools.lru_cache(None)
def warn_once(message: str) -> None:
    """A warning on upstream's logger, once per process, as upstream's ``warning_once``."""
    logger.warning(message)
