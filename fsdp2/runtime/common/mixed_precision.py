"""Mixed precision: the dtypes a group computes and reduces in, and module I/O casts.

[Note: Mixed precision cast points]
With ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on fp32
parameters, one training step casts at exactly these points:

1. all-gather copy-in: the group's flat fp32 shard is cast into this rank's
   slot of the bf16 all-gather output (one copy for the whole group), so the
   collective carries bf16 and the unsharded parameters are bf16;
2. forward inputs: floating-point tensors among the module's forward
   arguments are cast to ``param_dtype`` (``cast_forward_inputs``);
3. forward outputs: floating-point outputs are cast to ``output_dtype``;
4. reduce-scatter copy-in: the bf16 unsharded gradients are written into a
   ``reduce_dtype`` buffer (the chunking kernel converts as it copies);
5. after the reduction the flat result is cast to the original dtype and
   becomes the sharded gradients, so the optimizer sees fp32 only.

Everything else (sharded parameters, optimizer state, buffers) keeps its
dtype. Non-floating-point parameters are never cast. In a group of several
dtypes (see [Note: Mixed-dtype groups] in flat_shard.py) each parameter is
cast on its own: floating ones to ``param_dtype``, others kept; the group's
gradients are those of its trainable parameters, which share one dtype.

The reduce dtype a policy leaves unset (``reduce_dtype=None``) follows the
installed torch: see [Note: What changed by torch version] in versions.py.
``param_dtype_override_fn`` keeps chosen parameters in their own dtype
(``FSDPParam.keeps_dtype``): they are gathered uncast beside the cast ones, as
a mixed-dtype group gathers, and their gradients keep that dtype until the
reduction, which then runs in the promoted dtype when ``reduce_dtype`` is unset.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ...api import MixedPrecisionPolicy
from ...errors import FSDPAssertionError
from ...versions import REDUCE_IN_PARAM_DTYPE_BY_DEFAULT
from .tensor_tree import map_tensors


@dataclass(frozen=True)
class GroupDtypes:
    """The dtypes one parameter group works in; ``None``: no cast.

    Resolved by the group from its policy and its parameters, again whenever
    those are replaced; see [Note: Mixed precision cast points].
    """

    orig: torch.dtype  # the trainable parameters', so their sharded gradients'
    param: torch.dtype | None  # the unsharded parameters' (``resolve_dtypes``)
    reduce: torch.dtype | None  # the reduction's (``resolve_dtypes``)


def resolve_dtypes(
    policy: MixedPrecisionPolicy, orig_dtype: torch.dtype
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` of a group whose parameters are ``orig_dtype``.

    ``None`` means "no cast": ``param_dtype`` is ``None`` when it equals the
    original dtype or the parameters are not floating point; ``reduce_dtype``
    is ``None`` when the gradients (computed in the policy's ``param_dtype``)
    are already in it.
    """
    reduce_dtype = policy.reduce_dtype
    if (
        reduce_dtype is None
        and REDUCE_IN_PARAM_DTYPE_BY_DEFAULT
        and orig_dtype.is_floating_point
        and policy.param_dtype not in (None, orig_dtype)
    ):
        reduce_dtype = orig_dtype  # torch >= 2.15: gradients follow the parameter's dtype
    if reduce_dtype == policy.param_dtype:
        reduce_dtype = None
    param_dtype = policy.param_dtype
    if param_dtype == orig_dtype or not orig_dtype.is_floating_point:
        param_dtype = None
    return param_dtype, reduce_dtype


def keeps_own_dtype(policy: MixedPrecisionPolicy, param: nn.Parameter, fqn: str) -> bool:
    """Whether ``policy.param_dtype_override_fn`` keeps ``param`` in its own dtype.

    Called once per parameter by ``fully_shard``; a bad answer is a
    ``ValueError`` with upstream's message and the parameter's name.
    """
    override_fn = policy.param_dtype_override_fn
    if override_fn is None:
        return False
    dtype = override_fn(param)
    if dtype is None:
        return False
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"param_dtype_override_fn must return a torch.dtype or None but got {type(dtype)}\n"
            f"MixedPrecisionPolicy.param_dtype_override_fn returned {dtype!r} for parameter "
            f"'{fqn}'; return None, the policy's param_dtype, or the parameter's own dtype"
        )
    if dtype not in (policy.param_dtype, param.dtype):
        raise ValueError(
            "param_dtype_override_fn must return None, param_dtype, or the parameter's original "
            f"dtype but got {dtype} for a parameter with dtype {param.dtype} and param_dtype "
            f"{policy.param_dtype}\n"
            f"Parameter '{fqn}': a parameter can only be cast to the policy's param_dtype or "
            "kept in its own dtype; use another fully_shard call with its own policy for other "
            "dtypes"
        )
    return dtype == param.dtype and dtype != policy.param_dtype


def check_trainable_dtypes(named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fail clearly unless the parameters that require grad share one dtype.

    A group reduces its gradients in one reduce-scatter of one dtype; frozen
    parameters are only gathered (as bytes when dtypes differ), so any dtype
    is fine for them. Upstream asserts the same at lazy init (see [Note: Exceptions
    compatible with upstream] in errors.py).
    """
    trainable = [(name, p.dtype) for name, p in named_params if p.requires_grad]
    dtypes = {dtype for _, dtype in trainable}
    if len(dtypes) <= 1:
        return
    listing = ", ".join(f"'{name}': {str(dtype).removeprefix('torch.')}" for name, dtype in trainable)
    raise FSDPAssertionError(
        f"FSDP expects uniform original parameter dtype but got {dtypes}\n"
        "The parameters of one fully_shard group that require grad must share one dtype "
        f"(their gradients are reduced together), got {listing}. Cast them to one dtype "
        "(e.g. module.float()), freeze the ones you do not train (requires_grad_(False); "
        "frozen parameters may have any dtype), or shard the differently typed submodule "
        "with its own fully_shard call first."
    )


def check_grad_dtypes(named_dtypes: list[tuple[str, torch.dtype]], dtype: torch.dtype) -> None:
    """Fail clearly if parameters not of the group's gradient ``dtype`` got gradients.

    Catches parameters of another dtype unfrozen after the first forward,
    which fixed the group's gradient dtype.
    """
    odd = [(name, d) for name, d in named_dtypes if d != dtype]
    if odd:
        listing = ", ".join(f"'{name}' ({str(d).removeprefix('torch.')})" for name, d in odd)
        raise ValueError(
            f"{listing} got gradients, but their group reduces gradients in "
            f"{str(dtype).removeprefix('torch.')}, the dtype of its parameters that required "
            "grad at the first forward. Set requires_grad before the first forward, keeping "
            "one dtype among the trainable parameters of a fully_shard group."
        )


def input_cast_dtype(policy: MixedPrecisionPolicy) -> torch.dtype | None:
    """The dtype forward inputs are cast to, or ``None`` for no cast."""
    return policy.param_dtype if policy.cast_forward_inputs else None


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor inside it cast to ``dtype``.

    Any nesting ``map_tensors`` walks (see tensor_tree.py). Tensors already in
    ``dtype`` and non-floating tensors are returned unchanged (no copy).
    """

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    if isinstance(value, tuple) and type(value) is tuple:
        # Fast path for the common flat argument tuple.
        if all(isinstance(x, torch.Tensor) for x in value):
            return tuple(cast(x) for x in value)
    return map_tensors(cast, value)


def cast_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward ``args`` and ``kwargs`` with their floating-point tensors cast to ``dtype``."""
    return cast_floating(args, dtype), cast_floating(kwargs, dtype) if kwargs else kwargs
