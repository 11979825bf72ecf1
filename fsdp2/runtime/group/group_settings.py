"""What ``FSDPModule``'s setters chose for one parameter group, as frozen values.

A group's settings are read by its hooks at the next use. Each is replaced
only through the ``set_*`` methods of its owner (``FSDPParamGroup`` for
``UnshardSettings``, ``GradientReduction`` for ``ReductionSettings``), so a
setter that must do more (drop a cached reduce plan, make a process group)
is never bypassed by a plain assignment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.quantized_reduce import QuantizedReduceScatter
from ..comm.staged_collectives import AllGather, ReduceScatter


@dataclass(frozen=True)
class UnshardSettings:
    """When a group gathers and frees its parameters, and through which comm."""

    reshard_after_forward: bool
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True  # False: backward reads no parameter (e.g. an embedding)
    # True: hooks and prefetches gather on the current stream as async collectives, as
    # upstream's FSDPModule._set_unshard_async_op (no all-gather streams)
    unshard_async_op: bool = False
    # Set by FSDPModule.set_custom_all_gather, or to a built-in comm (see
    # [Note: Communication memory] in comm_memory.py).
    all_gather_comm: AllGather | None = None


@dataclass(frozen=True)
class ReductionSettings:
    """How a group reduces its gradients (``FSDPModule``'s gradient setters)."""

    # set_requires_gradient_sync; see [Note: Gradient accumulation without sync] in reduction.py
    reduce_grads: bool = True
    # set_requires_all_reduce: HSDP all-reduces over the replicate group (off while accumulating)
    all_reduce_grads: bool = True
    # set_gradient_divide_factor / set_force_sum_reduction_for_comms; see
    # [Note: Gradient divide factors] in reduce_op.py
    gradient_divide_factor: float | None = None
    force_sum_reduction: bool = False
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: torch.Stream | None = None
    # set_custom_reduce_scatter, or a built-in comm (see [Note: Communication memory])
    reduce_scatter_comm: ReduceScatter | None = None
    # set_gradient_comm_policy: the reduce-scatter through encoded slices (quantized_reduce.py)
    grad_comm: QuantizedReduceScatter | None = None
    reduce_scatter_unused_params: bool = False
    reduce_scatter_max_input_buffers: int = 1  # read at the root's lazy init (CommContext)
    # set_separate_reduce_scatter_group; None: the shard group
    reduce_scatter_process_group: dist.ProcessGroup | None = None
