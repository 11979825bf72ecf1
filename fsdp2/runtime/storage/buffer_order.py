"""Where a group's parameters sit in its collectives' buffers: one interface, three orders.

[Note: Buffer orders]
A group's shard, all-gather output and reduce-scatter input are flat buffers.
``BufferOrder`` says where each parameter sits in them and makes the copies
between them and the parameters; the group (``FSDPParamGroup``,
``GradientReduction``, ``FlatShard``) asks its order and never which one it
is. Three implementations:

- ``RankMajor`` (rank_major.py; upstream's, the default): each parameter is
  cut into ``torch.chunk``'s rows and padded to equal shards; rank ``r``'s
  shard is every parameter's chunk ``r`` in turn, and the gathered buffer is
  ``W`` such shards, so one copy scatters it into the parameters and one
  ``chunk_cat`` builds the reduce-scatter input from the gradients (see
  [Note: Copies around the collectives] in collectives.py).
- ``ParamMajor`` (ragged.py; ``RaggedShard``): the gathered buffer is the
  parameters, whole, at the planner's starts, and rank ``r`` holds the range
  ``[r * S, (r + 1) * S)``; the parameters view the all-gather output and the
  gradients are written once at their starts (see [Note: The parameter-major
  layout] in ragged.py);
- ``PackedRows`` (packed_rows.py; ``RaggedShard`` where the packed plan is
  chosen): each rank's runs of rows at their own offsets in its shard; one
  copy puts the gathered runs in the parameters, which are whole in a buffer
  of their own, and one writes the gradients at the runs' places.

Per parameter the same split holds one level down: ``ShardLayout``
(shard_layout.py) and ``RaggedRows`` (ragged.py) answer alike which rows a
rank holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .param import FSDPParam


class BufferOrder(ABC):
    """The places of ``fsdp_params`` in the flat buffers of a shard group of ``world_size``."""

    #: the all-gather output is the unsharded parameters (no copy-out)
    param_major: bool
    #: the parameters' placement is ``RaggedShard`` (runs of rows, not ``torch.chunk``'s)
    ragged: bool

    def __init__(self, fsdp_params: list[FSDPParam], world_size: int) -> None:
        self.fsdp_params = fsdp_params
        self.world_size = world_size

    # ---- the rank's shard (FlatShard's buffer) ----
    @abstractmethod
    def slot_places(self, sizes: list[int], order: list[int]) -> tuple[list[int], list[int], int]:
        """Start and stop of each parameter's slot in the shard, and the shard's numel.

        ``sizes``: the slots' sizes (elements, or bytes in a mixed-dtype
        group), ``order``: the order they are laid out in.
        """

    @abstractmethod
    def zero_padding(self, buffer: torch.Tensor, slots: list[torch.Tensor]) -> None:
        """Zero what the shard holds besides the parameters' rows (gathered, never read)."""

    def gathers(self, p: FSDPParam) -> bool:
        """Whether ``p`` is in the collectives alike on every rank (decides casts)."""
        return p.flat_numel > 0

    # ---- the all-gather output ----
    @property
    @abstractmethod
    def output_on_compute(self) -> bool:
        """The all-gather output is allocated on the compute stream (else on copy-in's)."""

    @property
    @abstractmethod
    def output_kept(self) -> bool:
        """One output kept across steps: the collective writing it waits for earlier compute."""

    @abstractmethod
    def all_gather_output(
        self, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Where the all-gather of ``numel`` elements of ``dtype`` writes."""

    @abstractmethod
    def copy_out(self, output: torch.Tensor, params: list[FSDPParam]) -> None:
        """Put the gathered ``output`` into the unsharded parameters (``params``: slot order)."""

    @abstractmethod
    def post_forward_shard(
        self, params: list[FSDPParam], first: int, count: int, as_bytes: bool
    ) -> torch.Tensor:
        """A flat copy of rank blocks ``[first, first + count)`` of the gathered parameters.

        What a rank keeps after forward with ``reshard_after_forward=<int>``;
        gathered over the post-forward group it is the whole all-gather output
        (see [Note: Resharding to a smaller group after forward] in
        param_group.py). ``as_bytes``: a mixed-dtype group's, as ``uint8``.
        """

    # ---- the reduce-scatter (of ``params``: the group's parameters with gradients) ----
    @abstractmethod
    def shard_numel(self, params: list[FSDPParam]) -> int:
        """Elements each rank's block of the reduce-scatter input holds."""

    @abstractmethod
    def slice_segments(self, params: list[FSDPParam]) -> list[list[int]]:
        """For each rank's block of the reduce-scatter input: the lengths of the runs its
        parameters' rows (and the gaps between them) make, in order."""

    @abstractmethod
    def reduce_scatter_input(
        self,
        grads: list[torch.Tensor],
        params: list[FSDPParam],
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The flat ``W * shard_numel`` input built from ``grads`` in ``dtype`` (into ``out``)."""

    @abstractmethod
    def sharded_grads(self, output: torch.Tensor, params: list[FSDPParam]) -> list[torch.Tensor]:
        """Each parameter's gradient rows in this rank's reduce-scatter output (views)."""

    @abstractmethod
    def shard_blocks(self, output: torch.Tensor, params: list[FSDPParam]) -> list[torch.Tensor]:
        """Each parameter's whole part (rows and padding) of the reduce-scatter output, flat."""
