"""The packed plan's buffer order: each rank's runs of rows at their own offsets in its shard.

[Note: The packed order]
Where ``choose_plan`` (ragged_rows.py) packs a ``RaggedShard`` group (see
[Note: Packed blocks] in block_packing.py), rank ``r``'s shard holds a run of
rows of some parameters, each at the offset the plan gives, and nothing of
the others. The shard, its slots and the sharded parameters are as in the
contiguous parameter-major layout (``ParamMajor``); what differs is that a
parameter's runs are not next to each other in the gathered ``W * S``
buffer, so

- the unsharded parameters view a kept buffer of their own, whole and back
  to back in registration order (``RaggedRows.start``), and one ``cat``
  copies every gathered run into it (the runs in that buffer's order);
- the reduce-scatter input is zeros with each gradient's runs written at
  their places (its cast to the reduce dtype included);
- what a rank keeps after forward with ``reshard_after_forward=<int>`` is
  rebuilt from the unsharded parameters.

The staged all-gather of hooked parameters (ragged_staged.py) already copies
rows by their place in the unsharded buffer, so it runs unchanged on this
buffer (``unsharded_output``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .ragged import ParamMajor

if TYPE_CHECKING:
    from .param import FSDPParam


class PackedRows(ParamMajor):
    """Runs of rows at the packed plan's offsets; the parameters whole in a buffer of their own."""

    param_major = False

    def __init__(self, fsdp_params: list[FSDPParam], world_size: int) -> None:
        super().__init__(fsdp_params, world_size)
        self.numel = sum(lay.size.numel() for lay in self.layouts)
        share = self.layouts[0].shard_numel if self.layouts else 0
        # each parameter's runs: (place in the gathered buffer, in the unsharded one, numel)
        self._runs: dict[int, list[tuple[int, int, int]]] = {}
        for p, lay in zip(fsdp_params, self.layouts):
            runs = []
            for r in range(world_size):
                rows = lay.row_bounds[r + 1] - lay.row_bounds[r]
                if rows:
                    at = lay.start + lay.row_bounds[r] * lay.row_numel
                    runs.append((r * share + lay.rank_offsets[r], at, rows * lay.row_numel))
            self._runs[id(p)] = runs
        self._in_order = [run for p in fsdp_params for run in self._runs[id(p)]]
        # what no parameter's run covers (each rank's tail): zeroed in the reduce-scatter input
        self._gaps, cursor = [], 0
        for a, _, n in sorted(self._in_order):
            if a > cursor:
                self._gaps.append((cursor, a - cursor))
            cursor = max(cursor, a + n)
        if cursor < world_size * share:
            self._gaps.append((cursor, world_size * share - cursor))

    @property
    def output_on_compute(self) -> bool:
        return False  # a staging buffer, freed after the copy-out

    @property
    def output_kept(self) -> bool:
        return False

    def all_gather_output(
        self, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def unsharded_output(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._kept(self.numel, dtype, device)

    def copy_out(self, output: torch.Tensor, params: list[FSDPParam]) -> None:
        out = self.unsharded_output(output.dtype, output.device)
        if self._in_order:
            torch.cat([output[a : a + n] for a, _, n in self._in_order], out=out)

    def post_forward_shard(
        self, params: list[FSDPParam], first: int, count: int, as_bytes: bool
    ) -> torch.Tensor:
        share = self.layouts[0].shard_numel
        full = self._gathered
        lo, hi = first * share, (first + count) * share
        out = torch.zeros(hi - lo, dtype=full.dtype, device=full.device)
        for a, at, n in self._in_order:
            if lo <= a < hi:
                out[a - lo : a - lo + n].copy_(full[at : at + n])
        return out

    def slice_segments(self, params: list[FSDPParam]) -> list[list[int]]:
        # every run's edges (a run lies inside the block of the rank holding it)
        return self._segments(e for p in params for a, _, n in self._runs[id(p)] for e in (a, a + n))

    def reduce_scatter_input(
        self,
        grads: list[torch.Tensor],
        params: list[FSDPParam],
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each gradient's runs at their places (cast to ``dtype``), zeros elsewhere."""
        flat = self._input_buffer(params, dtype, grads[0].device, out)
        for grad, p in zip(grads, params):
            whole = grad.reshape(-1)
            base = p.layout.start
            for a, at, n in self._runs[id(p)]:
                flat[a : a + n].copy_(whole[at - base : at - base + n])
        for a, n in self._gaps:
            flat[a : a + n].zero_()
        if len(params) < len(self.fsdp_params):  # the runs of parameters with no gradient
            reduced = {id(p) for p in params}
            for p in self.fsdp_params:
                if id(p) not in reduced:
                    for a, _, n in self._runs[id(p)]:
                        flat[a : a + n].zero_()
        return flat
