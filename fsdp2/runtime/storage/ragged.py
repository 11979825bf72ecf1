"""The parameter-major layout's buffer order (no copies around the collectives), and its load.

[Note: The parameter-major layout]
With ``RaggedShard`` a group is one flat buffer of whole parameters
(``plan_blocks``: see [Note: Block-aligned shards] in block_plan.py) and
rank ``r`` holds the range ``[r * S, (r + 1) * S)`` of it. What a rank holds
of a parameter is a run of whole rows (``RaggedRows``), at the place the plan
gives in its shard; a parameter it holds nothing of has an empty run there.
The rank's shard is the group's flat buffer, as in the dim-0 layout, so the
sharded parameters are views of the all-gather input. Two copies of the
dim-0 layout disappear (``ParamMajor``, the group's ``BufferOrder``: see
[Note: Buffer orders] in buffer_order.py):

- the all-gather output is the group's buffer itself: each unsharded
  parameter views it at the plan's start (no ``split_with_sizes_copy``);
- the reduce-scatter input is the gradients in the same order: one pass
  writes each gradient at its start (its cast to the reduce dtype included)
  and zeros the gaps, no rank-major reordering (``reduce_scatter_input``).
  The gradients are not made views of that input: autograd hands each over
  as a tensor of its own, and accumulating into a pre-set view would be a
  zeroing and an add instead of one copy.

[Note: Model-parallel parameters on the parameter-major layout]
A tensor-parallel parameter (a DTensor on a tp mesh) or one on a
``dp_mesh_dims`` mesh is planned by its *local* rows, as the dim-0 layout
shards its local tensor: the group's buffer holds model-parallel shards
whole, and the sharded DTensor lives on the (data-parallel, model-parallel)
mesh with the ``RaggedShard`` on the data-parallel dim beside the
parameter's own placements. DTensor applies a mesh's placements in mesh
order, and the rows are rows of the model-parallel shard: nested sharding
in that order. So where a model-parallel placement after the data-parallel
one splits dim 0 (``ColwiseParallel``; on a ``dp_mesh_dims`` mesh, after the
(flattened) shard dim), that dim moves first, on the same ranks' mesh
(``rows_within_model_shards`` in dp_mesh_dims.py, ``reordered_mesh``:
``DeviceMesh.from_group`` over the existing process groups, none made):
placements ``(Shard(0), ..., RaggedShard)``; otherwise ``(RaggedShard, ...)``
on the (dp, tp) mesh. ``full_tensor()``, DCP's offsets and redistribution
then need nothing new (upstream names the same layout with its strided
placement on (dp, tp)). Loading a value of another layout takes this rank's
model-parallel part of the full value first (``_model_parallel_local``, cut
locally), then its rows.

``RaggedRows`` (ragged_rows.py) answers what ``ShardLayout`` answers for
``torch.chunk`` (local rows, local size, the slot size) so ``FSDPParam``
reads either alike; this module, above ``FSDPParam``, orders and loads a
group of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ...ragged_placement import RaggedShardBase
from .buffer_order import BufferOrder
from .ragged_rows import RaggedRows, same_placements

if TYPE_CHECKING:
    from .param import FSDPParam


class ParamMajor(BufferOrder):
    """The parameters whole at the plan's starts; rank ``r`` holds ``[r * S, (r + 1) * S)``."""

    param_major = True
    ragged = True

    def __init__(self, fsdp_params: list[FSDPParam], world_size: int) -> None:
        super().__init__(fsdp_params, world_size)
        self.layouts: list[RaggedRows] = [p.layout for p in fsdp_params]
        self._gathered: torch.Tensor | None = None  # the kept all-gather output

    def slot_places(self, sizes: list[int], order: list[int]) -> tuple[list[int], list[int], int]:
        starts = [lay.shard_offset for lay in self.layouts]  # gaps between: the plan's padding
        return starts, [s + n for s, n in zip(starts, sizes)], self.layouts[0].shard_numel

    def zero_padding(self, buffer: torch.Tensor, slots: list[torch.Tensor]) -> None:
        buffer.zero_()  # the gaps between parameters (values are written after)

    def gathers(self, p: FSDPParam) -> bool:
        return True  # every rank alike, also one holding no rows of ``p``

    @property
    def output_on_compute(self) -> bool:
        return True

    @property
    def output_kept(self) -> bool:
        return True

    def all_gather_output(
        self, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The group's one output, which its unsharded parameters view at the plan's starts.

        Kept: resharding frees its storage and the next unshard grows it back,
        as each parameter's ``padded_full`` in the rank-major order. It lives
        on the compute stream, which reads and frees it: with streams, the
        collective that writes it waits for the compute queued before the
        unshard (the block before a prefetched one), never for the block it
        overlaps (``FSDPParamGroup.unshard``).
        """
        return self._kept(numel, dtype, device)

    def unsharded_output(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer the unsharded parameters view (here: the all-gather output)."""
        return self._kept(self.world_size * self.layouts[0].shard_numel, dtype, device)

    def _kept(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The group's one kept buffer of ``numel``, each parameter viewing it at its start."""
        out = self._gathered
        if out is None or out.dtype != dtype or out.device != device or out.numel() != numel:
            out = self._gathered = torch.empty(numel, dtype=dtype, device=device)
        storage = out.untyped_storage()
        if storage.size() != numel * out.element_size():
            storage.resize_(numel * out.element_size())
        for p in self.fsdp_params:
            if p.in_flat:  # a subclass's unsharded tensor is its post hook's own
                p.view_gathered(out, p.layout.start)
        return out

    def copy_out(self, output: torch.Tensor, params: list[FSDPParam]) -> None:
        return  # the parameters view the output

    def post_forward_shard(
        self, params: list[FSDPParam], first: int, count: int, as_bytes: bool
    ) -> torch.Tensor:
        share = self.layouts[0].shard_numel  # rank blocks are consecutive ranges of the output
        return self._gathered[first * share : (first + count) * share].clone()

    def shard_numel(self, params: list[FSDPParam]) -> int:
        return self.layouts[0].shard_numel  # S: the plan's, whichever parameters have gradients

    def slice_segments(self, params: list[FSDPParam]) -> list[list[int]]:
        return self._segments(
            e for p in params for e in (p.layout.start, p.layout.start + p.layout.size.numel())
        )

    def _segments(self, edges: Iterable[int]) -> list[list[int]]:
        """Each rank's block of the ``W * S`` buffer cut at ``edges`` (offsets in the buffer):
        the lengths of its pieces, in order."""
        share = self.layouts[0].shard_numel
        cuts = [{0, share} for _ in range(self.world_size)]
        for edge in edges if share else ():
            rank, at = divmod(edge, share)
            if rank < self.world_size:  # (the buffer's end is every block's end already)
                cuts[rank].add(at)
        return [[b - a for a, b in zip(c, c[1:]) if b > a] for c in map(sorted, cuts)]

    def reduce_scatter_input(
        self,
        grads: list[torch.Tensor],
        params: list[FSDPParam],
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The gradients at their plan's starts in one buffer of ``dtype``, zeros between."""
        flat = self._input_buffer(params, dtype, grads[0].device, out)
        cursor = 0
        for grad, p in zip(grads, params):  # registration order: the starts ascend
            start = p.layout.start
            if start > cursor:
                flat[cursor:start].zero_()
            flat[start : start + grad.numel()].view(grad.shape).copy_(grad)
            cursor = start + grad.numel()
        if cursor < flat.numel():
            flat[cursor:].zero_()
        return flat

    def _input_buffer(
        self, params: list[FSDPParam], dtype: torch.dtype, device: torch.device,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The flat reduce-scatter input: ``out`` (a custom comm's), else a new one."""
        if out is not None:
            return out.view(-1)
        return torch.empty(self.world_size * self.shard_numel(params), dtype=dtype, device=device)

    def sharded_grads(self, output: torch.Tensor, params: list[FSDPParam]) -> list[torch.Tensor]:
        blocks = self.shard_blocks(output, params)
        return [block.view(p.layout.local_size) for p, block in zip(params, blocks)]

    def shard_blocks(self, output: torch.Tensor, params: list[FSDPParam]) -> list[torch.Tensor]:
        return [
            output[p.layout.shard_offset : p.layout.shard_offset + p.layout.padded_shard_numel]
            for p in params
        ]


def _model_parallel_local(full: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """``full``'s part on this rank's model-parallel dims (tensor parallelism, an SPMD
    mesh): the tensor the plan's rows index; ``full`` itself without any."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    placements = [Replicate() if isinstance(pl, RaggedShardBase) else pl
                  for pl in sharded.placements]
    if all(pl.is_replicate() for pl in placements):
        return full
    # each rank cuts its own part (src_data_rank=None: nothing is sent)
    return distribute_tensor(full, sharded.device_mesh, placements, src_data_rank=None).to_local()


def load_rows(
    module: torch.nn.Module,
    fsdp_params: list[FSDPParam],
    state_dict: dict,
    prefix: str,
    error_msgs: list[str],
) -> list[str]:
    """``load_state_dict`` of ``module``'s parameter-major parameters: each rank's rows copied in.

    DTensor's in-place ops have no ragged rule (its sharding propagation
    knows ``torch.chunk``'s layout only), so the module's own ``copy_`` would
    fail: the values are taken out of ``state_dict`` and written into the
    local rows here (a value in the same layout as is; any other DTensor
    gathered whole first, a collective every rank makes in the same order; a
    plain tensor read as the full value). Returns the keys it loaded.
    """
    from torch.distributed.tensor import DTensor

    loaded = []
    for p in fsdp_params:
        for holder, name in p.module_infos:
            key = prefix + name
            if holder is not module or key not in state_dict:
                continue
            value = state_dict.pop(key)
            loaded.append(key)
            if tuple(value.shape) != tuple(p.global_size):
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} "
                    f"from checkpoint, the shape in current model is {tuple(p.global_size)}."
                )
                continue
            local = p.sharded_param.to_local()
            with torch.no_grad():
                if isinstance(value, DTensor):
                    same = same_placements(value.placements, p.sharded_param.placements)
                    rows = value.to_local() if same else p.layout.local_rows_of(
                        _model_parallel_local(value.full_tensor(), p.sharded_param))
                else:
                    rows = p.layout.local_rows_of(_model_parallel_local(value, p.sharded_param))
                local.copy_(rows)
    return loaded
