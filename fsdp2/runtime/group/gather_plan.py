"""What a group gathers: its dtypes, and where its all-gather input comes from.

Decided when a group is made and again whenever its sharded parameters were
replaced (their dtype may have changed, e.g. ``module.to(torch.bfloat16)``),
never per step. See [Note: Mixed precision cast points] in mixed_precision.py
and [Note: Mixed-dtype groups] in flat_shard.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...api import MixedPrecisionPolicy
from ...errors import FSDPNotImplementedError
from ...versions import ACCUMULATE_IN_GRAD_DTYPE
from ..common.mixed_precision import GroupDtypes, resolve_dtypes
from ..storage.buffer_order import BufferOrder
from ..storage.flat_shard import FlatShardLayout
from ..storage.param import FSDPParam


@dataclass(frozen=True)
class GatherPlan:
    """Where ``FSDPParamGroup.unshard``'s all-gather input comes from."""

    extensions: bool = False  # some parameters gather through all-gather extensions
    copy_in: bool = False  # a cast or a move; otherwise the flat buffer is the input itself
    partly_cast: bool = False  # some cast, others kept (param_dtype_override_fn): per parameter


def plan_gather(
    fsdp_params: list[FSDPParam],
    layout: FlatShardLayout,
    order: BufferOrder,
    mp_policy: MixedPrecisionPolicy,
    device: torch.device,
    offload: bool,
    reshards_to_smaller_group: bool,
) -> tuple[GroupDtypes, GatherPlan]:
    """Resolve the group's dtypes and each parameter's gathered dtype; plan the all-gather input.

    Sets each parameter's ``param_dtype``, ``unsharded_device``, ``grad_dtype``
    (and its extension's policy). ``order`` says which parameters every rank
    gathers alike (their casts decide the copy-in). ``reshards_to_smaller_group``:
    ``reshard_after_forward`` is an int, which extensions and parameters kept
    in their own dtype do not support (``FSDPNotImplementedError``).
    """
    with_ext = [p.fqn for p in fsdp_params if p.extension is not None]
    if with_ext and reshards_to_smaller_group:
        # Upstream raises a bare NotImplementedError at the backward all-gather.
        raise FSDPNotImplementedError(
            "reshard_after_forward=<int> is not supported with all-gather extensions "
            f"({', '.join(with_ext)}); pass True or False"
        )
    # Gradients are the trainable parameters' (see [Note: Mixed-dtype groups])
    trainable = [p.sharded_param.dtype for p in fsdp_params if p.sharded_param.requires_grad]
    # Nothing trainable yet (a frozen first forward): the parameters that can train later are
    # floating point, so their dtype, not an int64 table's
    floating = [d for d in layout.dtypes if d.is_floating_point]
    fallback = floating[0] if floating else layout.dtypes[layout.order[0]] if layout.mixed else layout.dtype
    orig_dtype = trainable[0] if trainable else fallback
    dtypes = GroupDtypes(orig_dtype, *resolve_dtypes(mp_policy, orig_dtype))
    for p, dtype in zip(fsdp_params, layout.dtypes):
        # floating ones only, unless param_dtype_override_fn kept the parameter's dtype
        p.param_dtype = None if p.keeps_dtype else resolve_dtypes(mp_policy, dtype)[0]
        p.unsharded_device = device if offload else None
        if p.extension is not None:  # upstream resolves these per parameter
            p.extension.mp_policy = mp_policy
            p.extension.param_dtype = p.param_dtype or p.dtype
    for p in fsdp_params:  # See [Note: Gradient accumulation dtype] in reduction.py
        p.grad_dtype = dtypes.reduce if ACCUMULATE_IN_GRAD_DTYPE else None
    cast = [p.param_dtype is not None for p in fsdp_params if order.gathers(p)]
    plan = GatherPlan(
        extensions=bool(with_ext),
        copy_in=(offload and device.type != "cpu") or any(cast),
        partly_cast=any(cast) and not all(cast),
    )
    if plan.partly_cast and reshards_to_smaller_group:
        kept = [p.fqn for p in fsdp_params if p.keeps_dtype]
        raise FSDPNotImplementedError(
            "reshard_after_forward=<int> is not supported with parameters that "
            f"param_dtype_override_fn keeps in their own dtype ({', '.join(kept)}); pass "
            "True or False, or shard those parameters' modules with their own fully_shard"
        )
    return dtypes, plan
