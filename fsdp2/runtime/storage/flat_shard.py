"""The flat buffer of a group's padded shards: its layout, and the parameters viewing it.

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

[Note: Materialization in any order]
``nn.Module._apply`` (``to_empty``, ``.to(dtype)``), ``load_state_dict(...,
assign=True)`` and DCP's loaders replace the sharded parameters (or their
local tensors) module by module: a group of several modules (``fully_shard([
norm, lm_head])``), or one whose root is loaded key by key, is for a while
part materialized and part on ``meta``. So nothing is adopted when a module
is touched; the group is only marked (``needs_adoption``), and ``adopt``
runs once, when the group is next needed: at lazy init, before the next
all-gather, and before ``state_dict``. Adopting takes over the registered
parameter objects, re-allocates the buffer if their device or dtypes changed
and copies the values of those that no longer view their slot. A group still
partly on ``meta`` then stays pending; using it raises an error naming those
parameters. ``FSDPModule.to_empty`` skips the copy altogether: it allocates
each whole group's buffer once (uninitialized, as ``to_empty`` promises) and
makes every parameter a view of its slot.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from ..._torch_compat import local_tensor
from .buffer_order import BufferOrder
from .param import FSDPParam


class FlatShardLayout:
    """Slot offsets of a group's parameters, for the dtypes their shards have now."""

    def __init__(
        self, fsdp_params: list[FSDPParam], dtypes: list[torch.dtype], buffer_order: BufferOrder
    ) -> None:
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
        self.starts, self.stops, self.numel = buffer_order.slot_places(sizes, order)

    def new_buffer(self, device: torch.device, pin_memory: bool, empty: bool = False) -> torch.Tensor:
        alloc = torch.empty if empty else torch.zeros
        return alloc(self.numel, dtype=self.dtype, device=device, pin_memory=pin_memory)

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


class FlatShard:
    """A group's flat buffer and the sharded parameters that view its slots.

    See [Note: Materialization in any order].
    """

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        sources: list[nn.Parameter],
        device: torch.device,
        pin_memory: bool,
        order: BufferOrder,
    ) -> None:
        self.fsdp_params = fsdp_params
        self.order = order  # where the slots sit (see [Note: Buffer orders] in buffer_order.py)
        self.pin_memory = pin_memory  # host buffers are pinned (CPU offload to an accelerator)
        self.layout = FlatShardLayout(fsdp_params, [src.dtype for src in sources], order)
        on_meta = any(src.is_meta for src in sources)
        self.buffer = self._new_buffer(torch.device("meta") if on_meta else device)
        for i, (p, src) in enumerate(zip(fsdp_params, sources)):
            p.bind_sharded(self.slot(i), src if on_meta else src.to(device))
        _register_slots(self)
        # Set when the registered parameters may no longer view the buffer.
        self.needs_adoption = False
        # Re-allocated by an adoption nobody has seen the result of yet (lazy init moves
        # such buffers into an arena: see [Note: Arenas] in arena.py)
        self.fresh = False
        # Optimizer state sharded across replicas: see [Note: Replica slices] in replica_slices.py
        self.replica_slices: object | None = None
        # The arena whose slice ``buffer`` is, if any: see [Note: Arenas] in arena.py
        self.arena: Any = None

    def pinned_on(self, device: torch.device) -> bool:
        """Whether a buffer of this group on ``device`` is pinned host memory."""
        return self.pin_memory and device.type == "cpu"

    def _new_buffer(self, device: torch.device, empty: bool = False) -> torch.Tensor:
        return self.layout.new_buffer(device, self.pinned_on(device), empty)

    def _set_buffer(self, buffer: torch.Tensor, arena: Any = None) -> None:
        """Hold ``buffer`` from now on (a slice of ``arena``, if given), leaving any other arena."""
        if self.arena is not None and self.arena is not arena:
            self.arena.leave(self)
        self.buffer, self.arena = buffer, arena

    def slot(self, index: int) -> torch.Tensor:
        return self.layout.slot(self.buffer, index)

    def padding_between(self, a: int, b: int) -> bool:
        """Whether elements ``[a, b)`` of the buffer hold no parameter's values: the padding a
        flat run may step through (zeros, stepped with zero gradients, read by nobody)."""
        if self.layout.mixed:
            return False
        for i, p in enumerate(self.fsdp_params):
            start, stop = self.layout.starts[i], self.layout.stops[i]
            if p.in_flat:  # (else its slot is not its storage: kept whole, to be safe)
                stop = start + local_tensor(p.sharded_param).numel()
            if start < b and stop > a:
                return False
        return True

    def adopt(self) -> bool:
        """Make the registered sharded parameters views of the buffer again, keeping values.

        The buffer is re-allocated when their device or dtypes changed. A
        group that is partly on ``meta`` is left pending (returns ``False``):
        the rest is adopted once it is materialized too.
        """
        for p in self.fsdp_params:
            p.adopt_registered()
        locals_ = [local_tensor(p.sharded_param) for p in self.fsdp_params]
        num_meta = sum(t.is_meta for t in locals_)
        if 0 < num_meta < len(locals_):
            self.needs_adoption = True
            return False
        # See [Note: All-gather extensions]: decided per parameter, here.
        in_flat = [p.decide_extension() for p in self.fsdp_params]
        moved = in_flat != [p.in_flat for p in self.fsdp_params]
        for p, flat in zip(self.fsdp_params, in_flat):
            p.in_flat = flat
        dtypes = [t.dtype for t in locals_]
        if self.buffer.device != locals_[0].device or dtypes != self.layout.dtypes or moved:
            self.layout = FlatShardLayout(self.fsdp_params, dtypes, self.order)
            self._set_buffer(self._new_buffer(locals_[0].device, empty=True))
            self.fresh = True  # see [Note: Arenas] in arena.py
            self._zero_padding()
        for i, p in enumerate(self.fsdp_params):
            p.rebind_sharded(self.slot(i))
        _register_slots(self)
        self.needs_adoption = False
        return True

    def prepare_empty(self) -> bool:
        """Whether ``to_empty`` can place the whole group in a new buffer; lays it out if so.

        Not where a parameter has an extension or a gradient that ``_apply``
        must move: those groups take the general path.
        """
        params = self.fsdp_params
        if any(
            p.extension is not None or not p.in_flat or p.sharded_param.grad is not None
            for p in params
        ):
            return False
        for p in params:
            p.adopt_registered()
        dtypes = [local_tensor(p.sharded_param).dtype for p in params]
        if dtypes != self.layout.dtypes:
            self.layout = FlatShardLayout(params, dtypes, self.order)
        return True

    def place_empty(self, buffer: torch.Tensor, arena: Any) -> set[nn.Parameter]:
        """After ``prepare_empty``: ``buffer`` (uninitialized, a slice of ``arena`` if given)
        becomes the group's, every parameter a view of its slot without a copy."""
        self._set_buffer(buffer, arena)
        self._zero_padding()
        for i, p in enumerate(self.fsdp_params):
            p.place_sharded(self.slot(i))
        _register_slots(self)
        self.needs_adoption = False
        return {p.sharded_param for p in self.fsdp_params}

    # ---- arenas (see [Note: Arenas] in arena.py) ----------------------------------

    def can_join(self) -> bool:
        """Whether the buffer can move into an arena: one dtype, real, adopted, not empty."""
        buffer = self.buffer
        return (
            not self.layout.mixed
            and not self.needs_adoption
            and not buffer.is_meta
            and buffer.numel() > 0
            and self.replica_slices is None  # they cut the buffer they were made on
        )

    def move_into(self, arena: Any, buffer: torch.Tensor) -> None:
        """Make ``buffer`` (``arena``'s slice, uninitialized) the group's, keeping every value."""
        self._set_buffer(buffer, arena)
        self._zero_padding()
        for i, p in enumerate(self.fsdp_params):
            p.rebind_sharded(self.slot(i))
        self.fresh = False

    def gradient_slot(self, numel: int) -> torch.Tensor | None:
        """Where this group's reduced gradient (``numel`` elements, laid out as the buffer)
        may land for good: its slice of the arena's gradient buffer, if it has an arena."""
        arena = self.arena
        if arena is None or not arena.shares_gradients or numel != self.buffer.numel():
            return None
        return arena.gradient_slot(self)

    def release_gradients(self) -> None:
        if self.arena is not None:
            self.arena.release_gradients()

    def _zero_padding(self) -> None:
        # Padding is gathered but never read; zeros keep it deterministic.
        self.order.zero_padding(self.buffer, [self.slot(i) for i in range(len(self.fsdp_params))])

    def names_on_meta(self) -> list[str]:
        return [p.fqn for p in self.fsdp_params if local_tensor(p.sharded_param).is_meta]


# ---- the flat buffer seen from a sharded parameter (for the optimizer step) ----


class FlatSlot(NamedTuple):
    """Where a sharded parameter's local tensor sits in its group's flat buffer.

    ``buffer`` is the group's whole flat buffer (``uint8`` for a mixed-dtype
    group); ``start`` / ``stop`` bound the parameter's padded slot in
    ``buffer``'s elements; ``numel`` counts the visible ones (the local
    tensor's, also in ``buffer``'s elements: bytes in a mixed group), which
    open the slot; the rest is padding.
    """

    buffer: torch.Tensor
    start: int
    stop: int
    numel: int
    group: FlatShard  # ``group.buffer`` is ``buffer`` while the slot holds
    # The layout the slot lies in, with the slot's start there: its arena (see [Note:
    # Arenas] in arena.py), else the group's ``FlatShard``. ``home.buffer`` is that layout's
    # buffer, a new object whenever the layout changes.
    home: Any
    home_start: int


# id(sharded parameter) -> (weakref to its FlatShard, slot index). No weak reference to
# the parameter itself: ``torch.utils.swap_tensors`` (``to_empty``, ``load_state_dict``
# with swapping) refuses tensors that have one. ``flat_slot_of`` checks the parameter is
# still the slot's, so a reused id never matches.
_SLOTS: dict[int, tuple[weakref.ref, int]] = {}
# Torch's threaded process group runs every rank as a thread of one process: they
# register their groups at once, so changes to the registry are serialized.
_SLOTS_LOCK = threading.Lock()


_purge_at = 1024  # purge the entries of dead groups once the registry reaches this size


def _register_slots(flat: FlatShard) -> None:
    global _purge_at
    ref = weakref.ref(flat)
    with _SLOTS_LOCK:
        if len(_SLOTS) >= _purge_at:  # amortized: a scan per call was O(groups x params)
            for key in [k for k, (old, _) in list(_SLOTS.items()) if old() is None]:
                del _SLOTS[key]  # groups that are gone
            _purge_at = 2 * len(_SLOTS) + 1024
        for i, p in enumerate(flat.fsdp_params):
            _SLOTS[id(p.sharded_param)] = (ref, i)


def flat_shard_of(param: torch.Tensor) -> FlatShard | None:
    """The ``FlatShard`` whose slot ``param`` (a sharded parameter) was bound to, or ``None``."""
    entry = _SLOTS.get(id(param))
    flat = None if entry is None else entry[0]()
    if flat is None or flat.fsdp_params[entry[1]].sharded_param is not param:
        return None
    return flat


def flat_slot_of(param: torch.Tensor) -> FlatSlot | None:
    """``param``'s slot in an fsdp2 group's flat buffer, or ``None``.

    ``None`` for anything that is not (or no longer) a sharded parameter
    viewing its slot: upstream's parameters, plain tensors, a parameter with an
    all-gather extension or one replaced since the group last adopted it.
    """
    entry = _SLOTS.get(id(param))
    if entry is None:
        return None
    flat = entry[0]()
    if flat is None or flat.needs_adoption:
        return None
    index = entry[1]
    fsdp_param = flat.fsdp_params[index]
    if fsdp_param.sharded_param is not param or not fsdp_param.in_flat:
        return None
    local = local_tensor(param)
    slot = flat.slot(index)
    if local.device != slot.device or local.numel() > slot.numel():
        return None
    if local.numel() > 0 and local.data_ptr() != slot.data_ptr():
        return None
    layout = flat.layout
    scale = local.element_size() if layout.mixed else 1
    start = layout.starts[index]
    arena = flat.arena  # runs span it only where its groups share one gradient buffer
    if arena is None or not arena.shares_gradients:
        home, home_start = flat, start
    else:
        home, home_start = arena, arena.starts[flat] + start
    return FlatSlot(
        flat.buffer, start, layout.stops[index], local.numel() * scale, flat, home, home_start
    )
