"""The post-backward node: an identity on a group's forward inputs whose backward reduces.

Autograd reaches it once the gradients of every input of one use of the group
are computed, which is when the group's parameters got theirs; its backward is
``FSDPParamGroup.post_backward`` for that use (see [Note: One training step]
in hooks.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .._torch_compat import functorch_active, tree_flatten, tree_unflatten
from .param_group import FSDPParamGroup


class _PostBackward(torch.autograd.Function):
    """Identity on the group's forward inputs; its backward is the post-backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, group: FSDPParamGroup, use: set[nn.Module] | None, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.use = group, use
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.group.post_backward(ctx.use)
        return (None, None, *grads)


class _PostBackwardInTransform(torch.autograd.Function):
    """``_PostBackward`` in the ``setup_context`` form (with vmap and forward-mode rules).

    ``torch.func`` transforms need this form; see [Note: torch.func transforms]
    in func_transforms.py. Only used while a transform runs: ``apply`` of this
    form binds its arguments through ``inspect.signature`` (tens of us a call).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        group: FSDPParamGroup, use: set[nn.Module] | None, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group, ctx.use = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.group.post_backward(ctx.use)
        return (None, None, *grads)

    @staticmethod
    def jvp(  # type: ignore[override]
        ctx: Any, _group: Any, _use: Any, *tangents: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return tangents


def register_post_backward(
    group: FSDPParamGroup,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    use: set[nn.Module] | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Hook the post-backward of this use on its inputs; ``None`` if none needs grad.

    ``use``: the modules run in this use (groups of several), handed to the
    post-backward; see [Note: Gradients of parameters used on some ranks].
    """
    flat = not kwargs and all(isinstance(x, torch.Tensor) for x in args)
    leaves, spec = (list(args), None) if flat else tree_flatten((args, kwargs))
    positions = [
        i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad
    ]
    if not positions:
        return None
    function = _PostBackwardInTransform if functorch_active() else _PostBackward
    outputs = function.apply(group, use, *(leaves[i] for i in positions))
    for i, out in zip(positions, outputs, strict=True):
        leaves[i] = out
    return (tuple(leaves), kwargs) if flat else tree_unflatten(leaves, spec)
