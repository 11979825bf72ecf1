"""What one simulated step allocates, communicates and computes, op by op.

``StepTracker`` is a dispatch mode that sees every aten op on local tensors
(a ``DTensor`` unwraps itself first, as in ``benchmarks/instruments.py``), so
it counts the same storages a real run allocates: each storage an op reads or
writes, plus storages resized with ``UntypedStorage.resize_`` (how fsdp2 and
upstream free and re-allocate unsharded parameters). A weakref finalizer
drops a storage when it dies. Under ``FakeTensorMode`` storages have sizes
but no memory, so a 70B model at W = 1024 costs nothing to track.

[Note: categories are assigned after the step]
Every storage gets a serial number when first seen, and every size change is
one event ``(serial, delta)`` in phase order. Which *kind* of memory a
storage is (sharded parameter, gradient, optimizer state, unsharded
parameter, collective buffer, activation) is often known only later: a
reduce-scatter output becomes a gradient when the step assigns it to
``.grad``. So ``tag`` only records ``serial -> category`` (the most specific
tag wins, see ``CATEGORIES``) and ``timeline()`` replays the events at the
end to split live bytes by category at every point, including the peak.

Collectives are counted as ``benchmarks/instruments.CommCounter`` counts them,
through the same wrappers (``collective_calls.py``: the *logical* bytes on this
rank: all-gather output, reduce-scatter input, all-reduce tensor), with the
ranks of the group each one ran over (for the cost model). FLOPs per phase
come from ``torch.utils.flop_counter``'s formulas, applied to local shapes.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import flop_registry

from fsdp2._torch_compat import dispatch_mode_base, local_tensor

from .collective_calls import KIND, CollectiveCalls, call_group, call_tensors, nbytes

# Most specific first: a storage tagged with several keeps the first of these.
CATEGORIES = (
    "parameters",  # sharded parameters (and buffers)
    "gradients",  # sharded gradients
    "optimizer",  # optimizer state
    "unsharded",  # unsharded (all-gathered) parameters in flight
    "comm",  # other collective buffers: all-gather outputs, reduce-scatter inputs
    "activations",  # everything else: saved activations and temporaries
)
_RANK = {name: i for i, name in enumerate(CATEGORIES)}
PHASES = ("setup", "forward", "backward", "optimizer")


@dataclass
class Collective:
    """One collective call: kind, logical bytes on this rank, the group's ranks, the phase."""

    kind: str
    nbytes: int
    ranks: tuple[int, ...]
    phase: str


@dataclass
class Timeline:
    """Live bytes by category after each event, and where the peak is."""

    phases: list[tuple[int, str]]  # (first event index, phase)
    totals: list[int]  # live bytes after each event
    by_category: dict[str, list[int]]
    peak: int
    peak_index: int
    peak_phase: str
    peak_breakdown: dict[str, int] = field(default_factory=dict)


class StepTracker(dispatch_mode_base()):
    """Live storage bytes, collectives and FLOPs of the ops run inside it (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._serial: dict[int, int] = {}  # id(storage) -> serial, while it lives
        self._size: dict[int, int] = {}  # serial -> bytes now
        self._category: dict[int, str] = {}
        self._next = 0
        self.events: list[tuple[int, int]] = []
        self.phase = "setup"
        self.phases: list[tuple[int, str]] = [(0, "setup")]
        self.current = 0
        self.flops: Counter[str] = Counter()
        self.bytes_touched: Counter[str] = Counter()
        self.collectives: list[Collective] = []
        self._calls = CollectiveCalls(self._record)
        self._orig_resize: Any = None
        self._comm_tag = True

    # ---- phases and tags --------------------------------------------------

    def set_phase(self, phase: str) -> None:
        """Events from now on belong to ``phase`` (one of ``PHASES``)."""
        self.phase = phase
        self.phases.append((len(self.events), phase))

    def tag(self, t: torch.Tensor | None, category: str) -> None:
        """Mark ``t``'s storage as ``category`` (a more specific earlier tag wins)."""
        if t is None:
            return
        serial = self.see(t)
        if serial is None:
            return
        old = self._category.get(serial)
        if old is None or _RANK[category] < _RANK[old]:
            self._category[serial] = category

    # ---- storages ---------------------------------------------------------

    def see(self, t: torch.Tensor) -> int | None:
        if isinstance(t, DTensor):
            t = local_tensor(t)
        if t.device.type == "meta":  # real meta tensors (fake tensors report their fake device)
            return None
        return self._see_storage(t.untyped_storage())

    def _see_storage(self, st: torch.UntypedStorage) -> int:
        key, size = id(st), st.nbytes()
        serial = self._serial.get(key)
        if serial is None:
            serial = self._serial[key] = self._next
            self._next += 1
            self._size[serial] = 0
            weakref.finalize(st, self._drop, key, serial)
        old = self._size[serial]
        if old != size:
            self._size[serial] = size
            self.current += size - old
            self.events.append((serial, size - old))
        return serial

    def _drop(self, key: int, serial: int) -> None:
        if self._serial.get(key) == serial:
            del self._serial[key]
        size = self._size.get(serial, 0)
        if size:
            self._size[serial] = 0
            self.current -= size
            self.events.append((serial, -size))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        touched = 0
        for t in _tensors((args, kwargs.values(), out)):
            self.see(t)
            touched += nbytes(t)
        self.bytes_touched[self.phase] += touched
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops[self.phase] += formula(*args, **kwargs, out_val=out)
        return out

    # ---- collectives ------------------------------------------------------

    def _record(self, name: str, args: tuple, kwargs: dict) -> None:
        tensors, size = call_tensors(name, args, kwargs)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.tag(t, "comm")
        ranks = tuple(dist.get_process_group_ranks(call_group(args, kwargs)))
        self.collectives.append(Collective(KIND[name], size, ranks, self.phase))

    # ---- context ----------------------------------------------------------

    def __enter__(self) -> StepTracker:
        self._calls.__enter__()
        orig_resize = self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            result = orig_resize(st, size)
            tracker._see_storage(st)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._calls.__exit__(*exc)

    # ---- results ----------------------------------------------------------

    def timeline(self, start_phase: str = "forward") -> Timeline:
        """Replay the events; the peak is taken from the first ``start_phase`` event on."""
        starts = [i for i, p in self.phases if p == start_phase]
        first = starts[0] if starts else 0
        live: Counter[str] = Counter()
        totals: list[int] = []
        by_cat: dict[str, list[int]] = {c: [] for c in CATEGORIES}
        total = peak = 0
        peak_index, peak_live = first, Counter()
        for i, (serial, delta) in enumerate(self.events):
            category = self._category.get(serial, "activations")
            live[category] += delta
            total += delta
            if i >= first:
                totals.append(total)
                for c in CATEGORIES:
                    by_cat[c].append(live[c])
                if total > peak or i == first:
                    peak, peak_index, peak_live = total, i, Counter(live)
        phase_at = "setup"
        for index, phase in self.phases:
            if index <= peak_index:
                phase_at = phase
        phases = [(max(0, i - first), p) for i, p in self.phases if i >= first]
        return Timeline(
            phases=phases,
            totals=totals,
            by_category=by_cat,
            peak=peak,
            peak_index=peak_index - first,
            peak_phase=phase_at,
            peak_breakdown={c: peak_live[c] for c in CATEGORIES},
        )

    def comm_bytes(self) -> dict[str, int]:
        """Logical bytes per collective kind over the whole recording."""
        out: Counter[str] = Counter()
        for c in self.collectives:
            out[c.kind] += c.nbytes
        return dict(out)


def _tensors(tree: Any):
    """The tensors in nested tuples, lists and dict values (what aten ops take and return)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)) or type(tree).__name__ == "dict_values":
        for item in tree:
            yield from _tensors(item)
