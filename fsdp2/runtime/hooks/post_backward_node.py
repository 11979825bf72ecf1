"""The post-backward node: an identity on a state's forward inputs whose backward reduces.

Autograd reaches it once the gradients of every input of one use of the
state's groups are computed, which is when their parameters got theirs; its
backward is ``FSDPParamGroup.post_backward`` for that use of each group, the
last group first (see [Note: One training step] in hooks.py; upstream chains
one node per group, which autograd reaches in that order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..._torch_compat import functorch_active, tree_flatten, tree_unflatten
from ..group.param_group import FSDPParamGroup

# each group of a state with the modules run in one use (None: a group of one module)
GroupUses = tuple[tuple[FSDPParamGroup, "set[nn.Module] | None"], ...]


class _PostBackward(torch.autograd.Function):
    """Identity on the group's forward inputs; its backward is the post-backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, uses: GroupUses, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.uses = uses
        return inputs

    @staticmethod
    @torch.compiler.disable  # eager, like the other hooks (it swaps parameters, reduces)
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        _post_backward(ctx.uses)
        return (None, *grads)


class _PostBackwardInTransform(torch.autograd.Function):
    """``_PostBackward`` in the ``setup_context`` form (with vmap and forward-mode rules).

    ``torch.func`` transforms need this form; see [Note: torch.func transforms]
    in func_transforms.py. Only used while a transform runs: ``apply`` of this
    form binds its arguments through ``inspect.signature`` (tens of us a call).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        uses: GroupUses, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.uses = inputs[0]

    @staticmethod
    @torch.compiler.disable  # eager, like the other hooks (it swaps parameters, reduces)
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        _post_backward(ctx.uses)
        return (None, *grads)

    @staticmethod
    def jvp(  # type: ignore[override]
        ctx: Any, _uses: Any, *tangents: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return tangents


def _post_backward(uses: GroupUses) -> None:
    for group, use in reversed(uses):  # the last group first, as upstream's chained nodes
        group.post_backward(use)


def register_post_backward(
    uses: GroupUses,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Hook the post-backward of this use of a state's groups on its inputs.

    ``uses``: each group with the modules run in this use (groups of several
    modules; else ``None``), handed to its post-backward; see [Note: Gradients
    of parameters used on some ranks]. Returns ``None`` if no input needs grad.
    """
    flat = not kwargs and all(isinstance(x, torch.Tensor) for x in args)
    leaves, spec = (list(args), None) if flat else tree_flatten((args, kwargs))
    positions = [
        i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad
    ]
    if not positions:
        return None
    function = _PostBackwardInTransform if functorch_active() else _PostBackward
    outputs = function.apply(uses, *(leaves[i] for i in positions))
    for i, out in zip(positions, outputs, strict=True):
        leaves[i] = out
    return (tuple(leaves), kwargs) if flat else tree_unflatten(leaves, spec)
