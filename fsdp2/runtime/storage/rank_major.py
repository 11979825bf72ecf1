"""The rank-major order (upstream's): ``torch.chunk`` rows per rank, ``W`` blocks gathered.

See [Note: Buffer orders] in buffer_order.py and [Note: Copies around the
collectives] in collectives.py. Rank ``r``'s shard is each parameter's padded
chunk ``r`` in turn (by descending element size in a mixed-dtype group);
the all-gather output is the ``W`` shards one after another, scattered into
each parameter's own buffer by one ``split_with_sizes_copy`` (a group of one
parameter gathers straight into its buffer); the reduce-scatter input is the
gradients cut the same way, built by one ``chunk_cat``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..._torch_compat import chunk_cat
from .buffer_order import BufferOrder

if TYPE_CHECKING:
    from .param import FSDPParam


class RankMajor(BufferOrder):
    param_major = False
    ragged = False

    def slot_places(self, sizes: list[int], order: list[int]) -> tuple[list[int], list[int], int]:
        starts, stops = [0] * len(sizes), [0] * len(sizes)
        offset = 0
        for i in order:
            starts[i], offset = offset, offset + sizes[i]
            stops[i] = offset
        return starts, stops, offset

    def zero_padding(self, buffer: torch.Tensor, slots: list[torch.Tensor]) -> None:
        for p, slot in zip(self.fsdp_params, slots):
            if p.in_flat and p.local_rows < p.shard_rows:
                slot[p.local_rows * p.row_numel :].zero_()

    @property
    def output_on_compute(self) -> bool:
        return len(self.fsdp_params) == 1  # the parameter's own buffer, which compute frees

    @property
    def output_kept(self) -> bool:
        return False

    def all_gather_output(
        self, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A single parameter's own full buffer, else a flat one.

        With several parameters their unsharded buffers are allocated only at
        copy-out, so a prefetched all-gather holds one group's worth of memory,
        not two, until its consumer waits for it.
        """
        if len(self.fsdp_params) == 1:
            return self.fsdp_params[0].alloc_unsharded()
        return torch.empty(numel, dtype=dtype, device=device)

    def copy_out(self, output: torch.Tensor, params: list[FSDPParam]) -> None:
        """Scatter the ``W`` rank blocks into each parameter's buffer.

        A ``uint8`` output holds parameters of several dtypes as bytes, in
        ``params`` order (see [Note: Mixed-dtype groups] in flat_shard.py).
        """
        if len(params) == 1:
            return  # gathered straight into the parameter's buffer
        outs = [p.alloc_unsharded() for p in params]
        if output.dtype == torch.uint8:
            outs = [o.view(torch.uint8) for o in outs]
        w = self.world_size
        torch.split_with_sizes_copy(
            output.view(w, -1),
            [o.numel() // w for o in outs],
            dim=1,
            out=[o.view(w, -1) for o in outs],
        )

    def post_forward_shard(
        self, params: list[FSDPParam], first: int, count: int, as_bytes: bool
    ) -> torch.Tensor:
        blocks = [p.gathered_blocks(first, first + count) for p in params]  # in slot order
        if as_bytes:  # See [Note: Mixed-dtype groups] in flat_shard.py
            blocks = [b.view(torch.uint8) for b in blocks]
        return torch.cat(blocks, dim=1).view(-1)

    def shard_numel(self, params: list[FSDPParam]) -> int:
        return sum(p.padded_shard_numel for p in params)

    def slice_segments(self, params: list[FSDPParam]) -> list[list[int]]:
        return [[p.padded_shard_numel for p in params]] * self.world_size

    def reduce_scatter_input(
        self,
        grads: list[torch.Tensor],
        params: list[FSDPParam],
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Padded, chunked, rank-major; the gradient itself where one fits as is.

        A group of one evenly divisible parameter whose gradient is already in
        ``dtype`` and contiguous reduces that gradient; parameters sharded on a
        dim other than 0 are permuted into their blocks one copy each.
        """
        w = self.world_size
        if len(grads) == 1 and out is None:
            grad, param = grads[0], params[0]
            even = param.padded_shard_numel * w == param.numel
            if param.shard_dim == 0 and grad.dtype == dtype and grad.is_contiguous() and even:
                return grad.view(-1)
        total = self.shard_numel(params)
        if out is not None:
            flat = out.view(w, total)
        else:
            flat = torch.empty((w, total), dtype=dtype, device=grads[0].device)
        if all(p.shard_dim == 0 for p in params):
            chunk_cat(grads, w, flat)
            return flat.view(-1)
        offset = 0
        for grad, p in zip(grads, params):
            block = flat[:, offset : offset + p.padded_shard_numel]
            if p.shard_dim == 0:  # rare: dim-0 and other dims in one group
                tmp = torch.empty_like(block)
                chunk_cat([grad], w, tmp)
                block.copy_(tmp)
            else:
                block.view(p.layout.block_shape()).copy_(p.layout.rank_blocks(grad))
            offset += p.padded_shard_numel
        return flat.view(-1)

    def sharded_grads(self, output: torch.Tensor, params: list[FSDPParam]) -> list[torch.Tensor]:
        views, offset = [], 0
        for p in params:
            views.append(output[offset : offset + p.local_rows * p.row_numel].view(p.local_size))
            offset += p.padded_shard_numel
        return views

    def shard_blocks(self, output: torch.Tensor, params: list[FSDPParam]) -> list[torch.Tensor]:
        views, offset = [], 0
        for p in params:
            views.append(output[offset : offset + p.padded_shard_numel])
            offset += p.padded_shard_numel
        return views
