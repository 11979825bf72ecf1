"""One allocation for the flat shards of many groups, and one for their reduced gradients.

[Note: Arenas]
Each group keeps its padded shards in one flat buffer (flat_shard.py), so a
model of 96 blocks has 96 buffers, and an elementwise optimizer steps them as
96 runs (flat_run.py): its kernels launched 96 times over 96 gradients and 96
sets of state. An *arena* lays the buffers of the groups of one (process
groups, dtype, device) side by side in one allocation. Each group's buffer is
a view of its slice and stays its all-gather input, so the collectives do not
change. The reduced gradients go to one gradient buffer laid out the same
way, so a param group whose parameters fill an arena steps as one run: one
gradient view, one state buffer per key, a few kernels per step however many
groups, and ``zero_grad`` one fill or one release.

Parameter-major groups (``RaggedShard``) join too. Their parameters lie with
gaps of padding between them and at each group's end, so a run goes on
across padding (``padding_between``: elements no parameter holds, zeros
stepped with zero gradients, as a dim-0 slot's padding rows are). A rank
holding no row of a parameter holds no memory for it (``FSDPParam.local_view``):
a view of its empty slot kept the whole old buffer alive after the move.

When. Groups move into an arena only where nothing outside fsdp2 can hold
their local tensors yet: at the end of a ``fully_shard`` call on a module that
holds other groups (the root's, at wrap time), in ``FSDPModule.to_empty``
(allocated there in one piece, nothing copied), and at lazy init for the
groups whose buffers that lazy init re-allocated (adopting replaced
parameters). A state dict taken later views the arena, so it stays live. A
group that re-allocates its buffer afterwards (``.to()``,
``load_state_dict(assign=True)``) leaves its arena: the arena's ``buffer``
becomes a new tensor object over the same memory, so runs cut across the
old layout see it changed (``FlatRun.still_flat``) and are cut again, and the
group steps as a run of its own. Moving a group copies its shard once; its
parameters stay the same objects.

Gradients. A group reduces straight into its slice of the arena's gradient
buffer (the reduce-scatter's output, or the destination of its cast) when
its gradients are final this backward and none of its parameters has a
gradient to add to; otherwise into a buffer of its own, as without an arena.
A slice is handed out once per gradient buffer: a second reduction of a group
within one buffer's life (gradients set to ``None`` by hand in between)
starts a fresh buffer, so no gradient a caller still holds is overwritten.
The arena drops its reference once every member has written, and at the end
of each step's backward (``release_gradients``): the gradients' views alone
then keep the buffer alive, and ``zero_grad(set_to_none=True)`` frees it at
once. The price: the buffer is allocated at a backward's first reduction, so
every group's gradient is allocated from there on, where without an arena
they appear group by group. In host memory that costs nothing resident: the
kernel commits an allocation's pages as they are first written, so the pages
of the groups still to reduce stay uncommitted (docs/performance.md measures
both). An accelerator's caching allocator commits the bytes at once, and
there the backward's peak (activations at their largest) would grow by the
gradients of every group not yet reduced; so on an accelerator each group
reduces into a buffer of its own, as without an arena, and its parameters
step as a run of their own (``shares_gradients``; ``flat_slot_of`` then names
the group, not the arena, as the slot's layout). The same holds where the
groups are large (a mean shard over ``SHARED_GRADIENTS_MEAN_NBYTES``, 1 MiB):
a run per group then costs little next to its kernels, while a fresh buffer
of the whole arena's size each backward is mapped and faulted in page by
page (the demo model's 60 MB per rank: its whole step 4-8% slower on CPU).
The gain is where the groups are many and small: 96 blocks of 17 KB shards
step as one run (docs/performance.md, "Arenas").
"""

from __future__ import annotations

import torch

from .flat_shard import FlatShard

# The largest mean group shard (bytes) whose arena shares one gradient buffer; see the note.
SHARED_GRADIENTS_MEAN_NBYTES = 1 << 20


class Arena:
    """The flat buffers of several groups in one allocation, and their gradients in another.

    ``buffer`` is the allocation; its identity is the arena's layout: it is
    replaced by a new tensor object over the same memory when a member leaves.
    """

    def __init__(self, buffer: torch.Tensor, members: list[FlatShard], sizes: list[int]) -> None:
        self.buffer = buffer
        # One gradient buffer for every group: where it adds nothing resident (host memory
        # is committed page by page as it is first written; an accelerator's allocator
        # commits it whole at the first reduction) and where the groups are small enough
        # that one run gains more than a fresh buffer's first-touch costs (see the note).
        mean_nbytes = buffer.numel() * buffer.element_size() / max(len(members), 1)
        self.shares_gradients = (
            buffer.device.type == "cpu" and mean_nbytes <= SHARED_GRADIENTS_MEAN_NBYTES
        )
        self.starts: dict[FlatShard, int] = {}
        start = 0
        for flat, size in zip(members, sizes):
            self.starts[flat] = start
            start += size
        self._grads: torch.Tensor | None = None
        self._written: set[FlatShard] = set()

    def slice_of(self, flat: FlatShard, size: int) -> torch.Tensor:
        start = self.starts[flat]
        return self.buffer[start : start + size]

    def padding_between(self, a: int, b: int) -> bool:
        """``FlatShard.padding_between`` in the arena's elements (a left member's slice too)."""
        for flat, start in self.starts.items():
            lo, hi = max(a, start), min(b, start + flat.buffer.numel())
            if lo < hi and not flat.padding_between(lo - start, hi - start):
                return False
        return True

    def leave(self, flat: FlatShard) -> None:
        """``flat`` re-allocated its buffer: it is no longer in this arena's layout."""
        if self.starts.pop(flat, None) is not None:
            self.buffer = self.buffer.view(self.buffer.shape)  # a new layout token
            self._written.discard(flat)

    def gradient_slot(self, flat: FlatShard) -> torch.Tensor:
        """``flat``'s slice of the gradient buffer, handed out once per buffer (see the note)."""
        if self._grads is None or flat in self._written:
            self._grads = torch.empty_like(self.buffer)
            self._written = set()
        self._written.add(flat)
        start = self.starts[flat]
        slot = self._grads[start : start + flat.buffer.numel()]
        if len(self._written) == len(self.starts):
            self._grads = None  # every member has its slice: the gradients keep it alive
        return slot

    def release_gradients(self) -> None:
        """End of a step's backward: the gradient buffer lives on through the gradients only."""
        self._grads = None


def join(flats: list[FlatShard]) -> list[Arena]:
    """Move ``flats`` (the groups of one set of process groups) into new arenas, one per kind.

    A kind is a buffer dtype, device and pinning; kinds of fewer than two
    buffers stay as they are. Each buffer keeps its values; its sharded
    parameters become views of its slice.
    """
    arenas = []
    for members in _by_kind([f for f in flats if f.can_join()]):
        if len(members) < 2:
            continue
        sizes = [f.layout.numel for f in members]
        arena = Arena(_allocate(members[0], sum(sizes), members[0].buffer.device), members, sizes)
        for flat, size in zip(members, sizes):
            flat.move_into(arena, arena.slice_of(flat, size))
        arenas.append(arena)
    return arenas


def materialize(flats: list[FlatShard], device: torch.device) -> set:
    """``to_empty`` for ``flats`` (one set of process groups): one allocation per kind.

    Returns the parameters placed: those of the buffers that can be placed
    whole (``FlatShard.prepare_empty``). Mixed-dtype buffers get one each.
    """
    placed: set = set()
    for members in _by_kind([f for f in flats if f.prepare_empty()], device):
        sizes = [f.layout.numel for f in members]
        if len(members) == 1 or members[0].layout.mixed:
            for flat, size in zip(members, sizes):
                placed |= flat.place_empty(_allocate(flat, size, device), None)
            continue
        arena = Arena(_allocate(members[0], sum(sizes), device), members, sizes)
        for flat, size in zip(members, sizes):
            placed |= flat.place_empty(arena.slice_of(flat, size), arena)
    return placed


def _by_kind(flats: list[FlatShard], device: torch.device | None = None) -> list[list[FlatShard]]:
    """``flats`` by the buffer they need: dtype, mixed or not, device, pinned."""
    kinds: dict[tuple, list[FlatShard]] = {}
    for flat in flats:
        where = flat.buffer.device if device is None else device
        key = (flat.layout.dtype, flat.layout.mixed, where, flat.pinned_on(where))
        kinds.setdefault(key, []).append(flat)
    return list(kinds.values())


def _allocate(flat: FlatShard, numel: int, device: torch.device) -> torch.Tensor:
    return torch.empty(
        numel, dtype=flat.layout.dtype, device=device, pin_memory=flat.pinned_on(device)
    )
