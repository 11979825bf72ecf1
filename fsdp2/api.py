"""User-facing policies: mixed precision and offloading."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How parameters, gradients and activations are cast around FSDP.

    Attributes:
        param_dtype: dtype of the unsharded parameters (all-gather and
            compute). ``None`` keeps the original dtype.
        reduce_dtype: dtype of the gradient reduction. ``None`` means
            ``param_dtype`` (or the original dtype when that is ``None``).
        output_dtype: dtype the module's floating-point outputs are cast to.
            ``None`` leaves outputs alone.
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """Base offload policy: no offloading (sharded state stays on the device)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in host memory.

    Attributes:
        pin_memory: pin the host copies so host/device copies can overlap
            compute. Turn off when host memory is scarce.
    """

    pin_memory: bool = True
