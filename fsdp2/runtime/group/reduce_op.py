"""How a group's gradients are scaled around the reduce-scatter, and with which op.

[Note: Gradient divide factors]
The reduced gradient is ``sum over ranks / factor``, over every
data-parallel rank (with HSDP: the shard group times the replicate group, as
upstream); ``factor`` is that number of ranks (a mean, like DDP) unless the
user set one with ``set_gradient_divide_factor``. The naive way is to sum, then divide. In
float32/bfloat16 the sum cannot overflow, so the backend does the division
inside the collective: ``AVG`` when ``factor`` is the world size, otherwise
NCCL's pre-multiplied sum (``PREMUL_SUM(1 / factor)``); backends without it
(gloo) divide the input first and sum. Other dtypes (float16, float64, ...)
divide before *and* after the sum, by a power of two close to
``sqrt(factor)`` and by the rest, so the partial sums stay in range.
``set_force_sum_reduction_for_comms(True)`` asks for a plain ``SUM`` on the
wire (e.g. for zero-copy transports) and divides afterwards instead. With
HSDP the replicate all-reduce is an ``AVG`` only in the default case (the
mean); with a factor, or with a ``SUM`` on the wire, it is a ``SUM`` and the
division by the factor happens once for both groups: in the reduce-scatter,
or after the all-reduce (``post_factor``). Dividing per group instead (the
shard group by the factor, then a mean over replicas) would make the
gradient ``sum / (factor * replicas)``.

The all-reduce hook (``set_all_reduce_hook``) runs on the reduce-scatter output
(HSDP: the all-reduce output) before the post-division, so with ``SUM`` it
sees the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..._torch_compat import premul_sum_op

# Dtypes in which a sum over ranks cannot overflow or lose the small values.
_SAFE_SUM_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class ReducePlan:
    """The op and the divisions of one gradient reduction (``None``: no division)."""

    dtype: torch.dtype
    op: object  # dist.ReduceOp.RedOpType, or a ReduceOp carrying a factor
    pre_factor: float | None
    post_factor: float | None
    all_reduce_op: object = dist.ReduceOp.SUM  # HSDP's replicate all-reduce


def plan_gradient_reduction(
    dtype: torch.dtype,
    world_size: int,
    divide_factor: float | None,
    force_sum: bool,
    supports_premul_sum: bool,
    replicas: int = 1,
) -> ReducePlan:
    """Choose op and divide factors for reducing ``dtype`` gradients over ``world_size`` ranks.

    ``world_size`` is the shard group's size, ``replicas`` HSDP's replicate
    group's. See [Note: Gradient divide factors].
    """
    overflow_risk = dtype not in _SAFE_SUM_DTYPES
    if not overflow_risk and not force_sum:
        if divide_factor is None:
            op = dist.ReduceOp.SUM if world_size == 1 else dist.ReduceOp.AVG
            replicate_op = dist.ReduceOp.SUM if replicas == 1 else dist.ReduceOp.AVG
            return ReducePlan(dtype, op, None, None, replicate_op)
        if divide_factor == world_size:
            return ReducePlan(dtype, dist.ReduceOp.AVG, None, None)
        if supports_premul_sum:
            return ReducePlan(dtype, premul_sum_op(1.0 / divide_factor), None, None)
        return ReducePlan(dtype, dist.ReduceOp.SUM, float(divide_factor), None)
    factor = float(world_size * replicas if divide_factor is None else divide_factor)
    if not overflow_risk:
        return ReducePlan(dtype, dist.ReduceOp.SUM, None, _or_none(factor))
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return ReducePlan(dtype, dist.ReduceOp.SUM, _or_none(float(pre)), _or_none(factor / pre))


def _or_none(factor: float) -> float | None:
    return None if factor == 1 else factor


def backend_supports_premul_sum(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` reduces ``device`` tensors with NCCL (the one backend with PREMUL_SUM)."""
    return device.type == "cuda" and "nccl" in str(dist.get_backend(group)).lower()
