"""Sharded modules under ``torch.func`` transforms (``jvp``, ``vmap``, ``jacfwd``, ``grad``).

[Note: torch.func transforms]
``torch.func.jvp(model, (x,), (t,))`` runs the model's forward, hooks and all,
inside a functorch transform, and may be the very first forward (lazy init
then runs inside it too). Two things differ there from a plain forward:

1. Every op's output is wrapped for the transform (a ``TensorWrapper``, whose
   storage cannot be read or resized). FSDP's own bookkeeping (adopting the
   parameters into the flat shard, all-gathers, copy-out, views, resharding)
   works on plain tensors that outlive the transform, so the group methods
   that make tensors run with the transform switched off
   (``outside_functorch`` in _torch_compat, on ``FSDPParamGroup.unshard``,
   ``wait_for_unshard``, ``reshard``, ``reshard_to_post_forward`` and
   ``adopt_params``). The unsharded parameters are then plain tensors that
   the transformed forward uses like any other parameter: the primal output
   and the tangent are the unsharded model's.
2. Inside the transform, outputs that depend on parameters report
   ``requires_grad=False``, although outside it the returned primal and
   tangent do take part in ordinary autograd (e.g. a loss on ``jvp``'s
   outputs, then ``backward()``). A tensor hook cannot be registered on them,
   so the pre-backward (the all-gather again, for a group resharded after
   forward) would never run. Each such floating output goes through
   ``_PreBackward``, an identity function whose backward runs the
   pre-backward and whose forward-mode rule passes the tangent on through the
   same identity, so a backward reaching the tangent output gathers the
   parameters as well. This is upstream's behaviour; its post-backward runs
   at the end of backward like any group whose inputs needed no gradient.
3. Under a reverse-mode transform (``torch.func.grad`` with respect to the
   inputs) the inputs do report ``requires_grad`` and go through
   ``_PostBackward`` (hooks.py), which therefore has the ``setup_context``
   form (with vmap and forward-mode rules) that functorch requires.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..common.tensor_tree import map_tensors

PreBackward = Callable[[torch.Tensor], None]


class _PreBackward(torch.autograd.Function):
    """Identity on one forward output; its backward runs a group's pre-backward first."""

    generate_vmap_rule = True

    @staticmethod
    def forward(pre_backward: PreBackward, output: torch.Tensor) -> torch.Tensor:  # type: ignore
        return output

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pre_backward = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore
        ctx.pre_backward(grad)
        return None, grad

    @staticmethod
    def jvp(ctx: Any, _: Any, tangent: torch.Tensor | None) -> torch.Tensor | None:  # type: ignore
        if tangent is None:
            return None
        return _PreBackward.apply(ctx.pre_backward, tangent)


def hook_outputs_in_transform(output: Any, pre_backward: PreBackward) -> Any:
    """Route the floating outputs that report no grad through ``_PreBackward``.

    Only called while a ``torch.func`` transform runs, with grad enabled; see
    [Note: torch.func transforms].
    """

    def hook(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad or not (t.is_floating_point() or t.is_complex()):
            return t
        return _PreBackward.apply(pre_backward, t)

    return map_tensors(hook, output)
