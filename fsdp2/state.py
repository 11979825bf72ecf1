"""FSDPState: the hooks of one fully_shard call, root lazy init, end of backward.

[Note: One training step]
root pre-forward   lazy init once (root, FQNs, meta check, root keeps its
                   parameters unsharded after forward unless told otherwise)
pre-forward        unshard the group; wrap inputs that need grad in a
                   function whose backward is this group's post-backward
post-forward       reshard if asked; record the forward order; hook outputs
pre-backward       (first gradient reaching an output) unshard again if
                   needed, prefetch the group that ran before in forward
post-backward      reshard, reduce-scatter, accumulate sharded gradients
final callback     (queued once per backward on the autograd engine) finish
                   groups whose inputs needed no grad, reset per-step state
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn

from ._torch_compat import in_backward, queue_backward_callback, tree_flatten, tree_unflatten
from .param_group import FSDPParamGroup, IterContext

logger = logging.getLogger("fsdp2.state")

_STATE_ATTR = "_fsdp2_state"


def state_of(module: nn.Module) -> FSDPState | None:
    """The FSDP state attached to ``module`` by ``fully_shard``, if any."""
    return module.__dict__.get(_STATE_ATTR)


class _RootContext:
    """Shared by every state under one root: what one iteration needs."""

    def __init__(self, root: FSDPState) -> None:
        self.root = root
        self.all_states: list[FSDPState] = []
        self.iter_ctx = IterContext()
        self.callback_queued = False


class FSDPState:
    """Forward/backward hooks for the modules of one ``fully_shard`` call."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        param_group: FSDPParamGroup | None,
        auto_reshard_after_forward: bool,
    ) -> None:
        self.modules = modules
        self.param_group = param_group
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root: bool | None = None
        self.root_ctx: _RootContext | None = None
        self._modules_to_run: set[nn.Module] = set()
        # Hooks stay eager under torch.compile (they swap parameters and run
        # collectives): dynamo skips them, so a compiled block traces only its
        # own compute. Instance attributes, so every caller gets these.
        self._pre_forward = torch.compiler.disable(self._pre_forward)
        self._post_forward = torch.compiler.disable(self._post_forward)
        self._pre_backward = torch.compiler.disable(self._pre_backward)
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward, prepend=False)
        if param_group is not None:
            _register_state_dict_hooks(param_group)

    # ---- lazy init ------------------------------------------------------------

    def _lazy_init(self) -> None:
        """Runs on the first forward: this state is the root of everything below it."""
        if len(self.modules) != 1:
            names = ", ".join(type(m).__name__ for m in self.modules)
            raise RuntimeError(
                f"The first FSDP forward ran on a group of several modules ({names}); "
                "call fully_shard on the model's root module and run forward through it"
            )
        root_module = self.modules[0]
        ctx = _RootContext(self)
        module_fqns: dict[nn.Module, str] = {}
        for name, module in root_module.named_modules():
            module_fqns.setdefault(module, name)
            state = state_of(module)
            if state is None or state in ctx.all_states:
                continue
            if state is not self and state.is_root is not None:
                raise RuntimeError(
                    f"FSDP module '{name}' already ran forward as its own root before "
                    f"'{type(root_module).__name__}'; run the first forward through the root module"
                )
            state.is_root = state is self
            state.root_ctx = ctx
            ctx.all_states.append(state)
        self.is_root = True
        self.root_ctx = ctx
        if self.auto_reshard_after_forward and self.param_group is not None:
            # The root is needed first in backward; resharding it would only
            # cost an extra all-gather.
            self.param_group.reshard_after_forward = False
        for state in ctx.all_states:
            group = state.param_group
            if group is None:
                continue
            group.ctx = ctx.iter_ctx
            group.module_fqn = ", ".join(module_fqns.get(m, "?") for m in state.modules)
            for p in group.fsdp_params:
                module, name = p.module_infos[0]
                prefix = module_fqns.get(module, "")
                p.fqn = f"{prefix}.{name}" if prefix else name
            group.reset_sharded_params()
            group.check_materialized()
        logger.debug("lazy init: root %s with %d FSDP states", type(root_module).__name__,
                     len(ctx.all_states))

    # ---- forward hooks --------------------------------------------------------

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        group = self.param_group
        if in_backward():
            # Activation-checkpoint recompute: only make the parameters available.
            if group is not None:
                group.unshard()
                group.wait_for_unshard()
            return None
        if self.is_root is None:
            self._lazy_init()
        first_in_group = not self._modules_to_run
        if len(self.modules) > 1:
            if not first_in_group:
                return None
            self._modules_to_run.update(self.modules)
        if group is None:
            return None
        group.pre_forward()
        if torch.is_grad_enabled():
            return _register_post_backward(group, args, kwargs)
        return None

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():
            return output
        if len(self.modules) > 1:
            self._modules_to_run.discard(module)
            if self._modules_to_run:
                return output  # other modules of this group still have to run
        output = self._finish_forward(output)
        if self.is_root:
            # Groups of several modules that did not all run: finish them now.
            for state in self.root_ctx.all_states:
                if state._modules_to_run:
                    state._modules_to_run.clear()
                    output = state._finish_forward(output)
        return output

    def _finish_forward(self, output: Any) -> Any:
        if self.param_group is not None:
            self.param_group.post_forward()
        if torch.is_grad_enabled():
            leaves = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            for t in leaves:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    # ---- backward hooks -------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> None:
        ctx = self.root_ctx
        if ctx is not None and not ctx.callback_queued:
            ctx.callback_queued = True
            queue_backward_callback(ctx.root._final_callback)
        if self.param_group is not None:
            self.param_group.pre_backward()
        return None

    def _final_callback(self) -> None:
        """After the whole backward: reduce what is left and reset for the next step."""
        ctx = self.root_ctx
        for state in reversed(ctx.all_states):
            if state.param_group is not None:
                state.param_group.finish_iteration()
        ctx.iter_ctx.post_forward_order.clear()
        ctx.callback_queued = False

    def reset_iter_state(self) -> None:
        """Drop every per-iteration trace (after an exception in forward or backward)."""
        if self.is_root is False:
            raise RuntimeError("reset_iter_state() must be called on the root FSDP module")
        if self.root_ctx is None:
            return
        for state in self.root_ctx.all_states:
            state._modules_to_run.clear()
            if state.param_group is not None:
                state.param_group.reset_iter_state()
        self.root_ctx.iter_ctx.post_forward_order.clear()
        self.root_ctx.callback_queued = False


class _PostBackward(torch.autograd.Function):
    """Identity on the group's forward inputs; its backward is the post-backward."""

    @staticmethod
    def forward(ctx: Any, group: FSDPParamGroup, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.group.post_backward()
        return (None, *grads)


def _register_post_backward(
    group: FSDPParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    flat = not kwargs and all(isinstance(x, torch.Tensor) for x in args)
    leaves, spec = (list(args), None) if flat else tree_flatten((args, kwargs))
    positions = [
        i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad
    ]
    if not positions:
        return None
    outputs = _PostBackward.apply(group, *(leaves[i] for i in positions))
    for i, out in zip(positions, outputs, strict=True):
        leaves[i] = out
    return (tuple(leaves), kwargs) if flat else tree_unflatten(leaves, spec)


def _register_state_dict_hooks(group: FSDPParamGroup) -> None:
    """Keep ``state_dict`` / ``load_state_dict`` on the sharded parameters.

    Saving or loading between forward and backward would otherwise see the
    unsharded parameters of a group kept unsharded after forward; and
    ``load_state_dict(assign=True)`` registers new parameter objects, which
    must become the group's sharded parameters (views of its flat buffer)
    before the next all-gather reads that buffer.
    """

    def to_sharded(*args: Any, **kwargs: Any) -> None:
        group.reshard()

    def adopt_loaded(*args: Any, **kwargs: Any) -> None:
        group.reset_sharded_params()

    holders = {module: None for p in group.fsdp_params for module, _ in p.module_infos}
    for module in holders:
        module.register_state_dict_pre_hook(to_sharded)
        module.register_load_state_dict_pre_hook(to_sharded)
        module.register_load_state_dict_post_hook(adopt_loaded)
