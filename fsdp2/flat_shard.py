"""FlatShardLayout: where each parameter's padded shard sits in its group's flat buffer.

[Note: Mixed-dtype groups]
A group whose parameters share one dtype keeps their padded shards in one
flat buffer of that dtype, which is the all-gather input itself (see [Note:
Sharded parameter storage] in param.py). Upstream also lets one group hold
parameters of several dtypes (e.g. LoRA: trainable fp32 adapters next to a
frozen bf16 or int8 base) and gathers them in one collective on bytes. We do
the same with a ``uint8`` flat buffer: each parameter's slot is a byte range,
and its sharded parameter views ``slot.view(dtype)``. A typed view needs its
byte offset to be a multiple of the element size, so slots are laid out by
descending element size (8-byte dtypes first, then 4, 2, 1): every slot then
starts aligned without gaps, and the all-gather output (``W`` rank blocks of
the whole buffer) splits into each parameter's buffer, viewed as bytes, with
one ``split_with_sizes_copy`` in that same order.

Only the trainable parameters' gradients are reduced, in one reduce-scatter,
so those must share one dtype (checked by ``check_trainable_dtypes`` in
mixed_precision.py); frozen parameters may have any dtype.
"""

from __future__ import annotations

import torch

from .param import FSDPParam


class FlatShardLayout:
    """Slot offsets of a group's parameters, for the dtypes their shards have now."""

    def __init__(self, fsdp_params: list[FSDPParam], dtypes: list[torch.dtype]) -> None:
        self.dtypes = dtypes
        in_flat = [i for i, p in enumerate(fsdp_params) if p.flat_numel > 0]
        self.mixed = len({dtypes[i] for i in in_flat}) > 1
        if not self.mixed:
            # one dtype: element offsets in registration order
            self.dtype = dtypes[in_flat[0]] if in_flat else dtypes[0]
            order = list(range(len(fsdp_params)))
            sizes = [p.flat_numel for p in fsdp_params]
        else:
            # See [Note: Mixed-dtype groups]; sorted() is stable.
            self.dtype = torch.uint8
            order = sorted(range(len(fsdp_params)), key=lambda i: -dtypes[i].itemsize)
            sizes = [p.flat_numel * dtypes[i].itemsize for i, p in enumerate(fsdp_params)]
        self.order = order
        self.starts = [0] * len(fsdp_params)
        self.stops = [0] * len(fsdp_params)
        offset = 0
        for i in order:
            self.starts[i], offset = offset, offset + sizes[i]
            self.stops[i] = offset
        self.numel = offset

    def new_buffer(self, device: torch.device, pin_memory: bool) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=self.dtype, device=device, pin_memory=pin_memory)

    def slot(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s padded shard in ``flat``, in that parameter's dtype."""
        slot = flat[self.starts[index] : self.stops[index]]
        return slot.view(self.dtypes[index]) if self.mixed else slot

    def gathered_nbytes(self, fsdp_params: list[FSDPParam]) -> int:
        """Bytes per rank a mixed group gathers: each shard in its unsharded dtype."""
        return sum(
            p.flat_numel * (p.param_dtype or dtype).itemsize
            for p, dtype in zip(fsdp_params, self.dtypes)
        )

    def in_order(self, fsdp_params: list[FSDPParam]) -> list[FSDPParam]:
        """``fsdp_params`` in the order their slots sit in the buffer."""
        return fsdp_params if not self.mixed else [fsdp_params[i] for i in self.order]
