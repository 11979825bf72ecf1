"""The public functions over FSDP modules: a method that runs like ``forward``, roots sharing streams.

Upstream's ``register_fsdp_forward_method`` and ``share_comm_ctx``; both act
through each module's FSDP state, like the hooks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn

from .module import FSDPModule

__all__ = ["register_fsdp_forward_method", "share_comm_ctx"]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` unshard and reshard like ``forward``.

    For methods that run the module's parameters outside ``forward`` (e.g.
    ``generate``). A no-op for modules that are not FSDP modules.
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)
    if not callable(method):
        raise ValueError(
            f"{type(module)} does not have a method {method_name}\n"
            f"'{method_name}' is a {type(method).__name__}, not a method"
        )

    @functools.wraps(method)
    def wrapped(self: FSDPModule, *args: Any, **kwargs: Any) -> Any:
        state = self._fsdp_state()
        new = state._pre_forward(self, args, kwargs)
        if new is not None:
            args, kwargs = new
        output = method(*args, **kwargs)
        return state._post_forward(self, args, output)

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several FSDP roots (e.g. pipeline stages' model chunks) share one communication context.

    The roots then share FSDP's streams (copy-in, all-gather, reduce-scatter,
    all-reduce; on accelerators only, see "Streams and events" in
    docs/design.md) with the state that bounds in-flight all-gathers and
    reductions, and the forward order, so backward prefetching follows the
    order the chunks ran in, as upstream. Call it on the chunks' roots; a
    module's root lazy init otherwise gives it the root's context.
    """
    modules = list(modules)
    strangers = [m for m in modules if not isinstance(m, FSDPModule)]
    if strangers:
        raise ValueError(
            f"Expects list of FSDPModules but got {strangers[0]}\n"
            "share_comm_ctx: call fully_shard on every module first, or leave it out"
        )
    if modules:
        first, *others = (module._fsdp_state() for module in modules)
        for state in others:
            state.share_comm_ctx(first)
