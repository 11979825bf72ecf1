"""The pre-backward hooks: one on every forward output that needs grad, as upstream's.

Autograd runs the hook when the output's gradient is computed, which is when
the group must be gathered again for its backward (``FSDPState._pre_backward``).
Under ``torch.func`` transforms the outputs are hooked through an autograd
function instead (see [Note: torch.func transforms] in func_transforms.py).
An output that is a view gets upstream's warning: an in-place op on it would
replace the tensor the hook is on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..._torch_compat import functorch_active, view_base
from ..common.tensor_tree import tensors_in
from .func_transforms import hook_outputs_in_transform


def hook_outputs(
    output: Any, pre_backward: Callable[[torch.Tensor], None], modules: tuple[nn.Module, ...]
) -> Any:
    """``output`` with ``pre_backward`` hooked on each tensor in it that needs grad."""
    # dataclasses too (see tensor_tree.py), which pytree does not look into
    for t in tensors_in(output):
        if t.requires_grad:
            if view_base(t) is not None:
                _warn_view_output(modules)
            t.register_hook(pre_backward)
    if functorch_active():  # See [Note: torch.func transforms]
        output = hook_outputs_in_transform(output, pre_backward)
    return output


def _warn_view_output(modules: tuple[nn.Module, ...]) -> None:
    """Upstream's warning for an output that is a view (its text, its class)."""
    names = ", ".join(type(m).__name__ for m in modules) or "?"
    warnings.warn(
        f"FSDP2-wrapped module ({names}) returned a view tensor. An in-place op on this view "
        "(e.g., `x += y`) will silently drop the pre-backward hook and skip the all-gather, "
        "which can cause backward to fail or produce wrong gradients. Use out-of-place ops "
        "(`out = out + y`, not `out += y`) or `.clone()` the output before any in-place op.",
        UserWarning,
        stacklevel=5,
    )
