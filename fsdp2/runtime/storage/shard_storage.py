"""A slot of a group's flat buffer as a tensor with a storage of its own.

See [Note: Sharded parameter storage] in param.py for why. The naive way, a
view ``buffer[start:stop]``, shares the buffer's storage: whatever works per
storage (``torch.save``, ``pickle``, ``copy.deepcopy``, a transport sending
``untyped_storage()``) then handles the whole buffer for each parameter, and
torch 2.13's DTensor copies the view's offset onto its wrapper, which makes
``torch.save`` fail outright. DLPack (a public, zero-copy exchange format)
gives the same memory a new storage: ``from_dlpack(to_dlpack(view))`` builds a
tensor whose storage starts at the view's first byte, is exactly as long as
the view and cannot be resized, and whose deleter keeps the buffer alive.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.dlpack import from_dlpack, to_dlpack

# Devices whose tensors torch exports through DLPack (CUDA covers ROCm).
_DLPACK_DEVICES = frozenset({"cpu", "cuda"})


def can_own_storage(slot: torch.Tensor) -> bool:
    """Whether ``slot`` can get a storage of its own.

    Not on ``meta`` (no memory), nor for tensor subclasses such as the
    planner's fake tensors (they have no memory either; DLPack would crash).
    """
    return type(slot) is torch.Tensor and slot.device.type in _DLPACK_DEVICES


def own_storage(slot: torch.Tensor) -> torch.Tensor:
    """``slot`` (1-D, contiguous) through a storage of its own over the same memory.

    Exported as bytes, so every dtype works, then viewed back. Returns
    ``slot`` itself where that is not possible (see ``can_own_storage``).
    """
    if not can_own_storage(slot):
        return slot
    return from_dlpack(to_dlpack(slot.view(torch.uint8))).view(slot.dtype)


def alias_parameter(
    like: torch.Tensor, offset: int, size: torch.Size, stride: tuple[int, ...]
) -> nn.Parameter:
    """A parameter viewing ``like``'s storage through ``Tensor.set_`` (own version counter)."""
    storage = like.untyped_storage()
    alias = torch.empty(0, dtype=like.dtype, device=like.device)
    alias.set_(storage, offset, size, stride)
    return nn.Parameter(alias, requires_grad=False)
