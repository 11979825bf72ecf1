"""A run of parameters of one fsdp2 flat buffer, stepped as one tensor (in cache-sized pieces).

[Note: Flat optimizer steps]
fsdp2 keeps each group's padded shards in one flat buffer (``FlatShard`` in
runtime/storage/flat_shard.py), and the reduce-scatter output is one flat gradient
laid out the same way, of which each ``.grad`` is a view. For an elementwise
optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, also
``foreach``; ``fused`` per parameter, see below) one update of a flat tensor is, element for element,
the same arithmetic as the updates of the parameters that view it, so we step
each *run* (parameters of one optimizer param group whose slots follow each
other in one buffer, all with a gradient) as one tensor: a few kernels per
run instead of a few per parameter. Everything per run is one contiguous
region: the parameter (a view of the buffer), the gradient (a view of the
reduce-scatter output when it lines up with the buffer; otherwise the run
steps in per-parameter pieces, never copying a gradient)
and each state tensor (``exp_avg``, ...: one buffer per key per run).
Outside ``step`` the optimizer holds the per-parameter state it holds today:
DTensors whose local tensors view the run's state buffers (through
``own_storage``, so each has a storage of its own; an empty shard gets an
empty tensor of its own) and, for scalar state such as ``step``, 0-d views
of one vector per run that is refreshed after each step (each view through
a storage of its own too, so ``torch.save`` writes what a plain step's
state writes). ``optimizer.state_dict()``, DCP and ``get_optimizer_state_dict`` see
the same keys, types and values as with the per-parameter step.

Padding (the tail of a slot past the local rows) steps too: its gradient is
0, so its value stays what it was (0) for every listed optimizer, and no
visible element reads it.

[Note: State the run did not write]
The run steps its own buffers, so it must never step on a copy of state
that the optimizer no longer holds. Before every step it proves that
``optimizer.state`` holds exactly what it published, unwritten since: the
same ``optimizer.state`` dict, the same per-parameter dict for each
parameter, the same value objects in each, and each scalar's version counter
(``Tensor._version``, bumped by every in-place write) where the run's last
publish or step left it (``_seal``). The scalars (``step``) are the only
copies: every parameter-shaped value it publishes is its own buffer's memory
(``own_storage``), so a write through one (a user's ``mul_``, a transport
receiving in place, the optimizer's own step) already is the run's state,
and needs no check. Anything else rebuilds the run from the
per-parameter state before the step: ``load_state_dict`` (DCP,
``set_optimizer_state_dict``, torchft's healing), a value replaced or written
in place by the user, a step the optimizer took itself (a closure, a
compiled ``step()``, the default switched off), a checkpoint transport
receiving into the state in place. The rebuild copies the values into fresh
run buffers, which requires equal scalar state (one ``step`` count) across
the run; otherwise that run steps per parameter. The scalar views have a
storage of their own, so the run's refresh of them after a step moves no
counter it sealed; where a device gives no storage of its own, the counters
are read again after each step. The check costs 0.4-0.5 ms right after a
backward for 576 parameters in 96 runs (of a 7 ms step + ``zero_grad``, W = 2,
benchmark CPU); checking every published tensor's counter cost 0.8-1.0 ms.

On CPU the optimizer is handed the run in *pieces* of at most ``PIECE_NUMEL``
elements (views of the flat parameter, gradient and state): an unfused
optimizer runs a handful of kernels per tensor (AdamW: ~8, two of them
allocating temporaries), each streaming the whole tensor. A whole run (a
block's parameters, megabytes) falls out of the cache between kernels and
made the flat step 1.5-1.9x slower than the per-parameter step on the demo
model. Pieces of 256 Ki elements (1 MiB in fp32, a core's L2 on the
benchmark machine) were the fastest of 8 Ki - 1 Mi on the demo model at
W = 1 and 2 (0.83x and 0.96x the per-parameter step; 64 Ki: 0.93x and 1.04x)
and cost one kernel call each. Elementwise, so the bits are the same.

[Note: Fused kernels step per parameter]
A fused CPU kernel (``fused=True``: ``_fused_adam(w)_``, ``_fused_sgd_``,
``_fused_adagrad_``) runs a vectorized main loop and a scalar tail, and the
two can round differently (seen in ``exp_avg_sq``: the same inputs give
other last bits in the tail than in the main loop). Which elements
fall in the tail depends on where each tensor handed to it ends, so a run
stepped as one tensor puts other elements in the tail than the per-parameter
step does (upstream's: DTensor hands the kernel each local shard), and the
last bits differ. So under ``fused`` the pieces never span two parameters:
each parameter's slot is cut from its own start, in pieces of
``PIECE_NUMEL`` elements (a multiple of every vector width and of the
kernels' cache-line task units), so every element falls where the
per-parameter step puts it, on any number of threads. The state is still one
buffer per key per run; the fused kernel takes the whole list in one call.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import (
    fast_grad_access,
    local_tensor,
    local_tensors,
    same_dtensor_spec,
    same_dtensor_specs,
    version_counters,
    view_base,
)
from ..runtime.storage.flat_shard import flat_slot_of
from ..runtime.storage.shard_storage import can_own_storage, own_storage
from .state_views import adoptable, local_of, publish

_GRAD = operator.attrgetter("grad")  # read in one pass looped in C

# CPU: the largest tensor handed to the optimizer; see the note above.
PIECE_NUMEL = 1 << 18

class FlatRun:
    """Parameters of one param group whose slots follow each other in one flat buffer.

    ``flat`` views their slots (padding included); ``offsets`` / ``numels``
    place each local tensor in it. ``state`` is the run's optimizer state
    (``None`` before the first step; one buffer per key); ``views`` the
    per-parameter state dicts the optimizer holds outside ``step``; ``pieces``
    what the optimizer steps (see the note on pieces).
    """

    def __init__(self, params: list[DTensor], home: Any, starts: list[int], stop: int):
        """``home``: the layout the slots lie in (``FlatSlot.home`` or ``.group``);
        ``starts`` / ``stop``: the slots' bounds in ``home.buffer``'s elements."""
        local0 = local_tensor(params[0])
        self.params = params
        self.home = home
        self.buffer = buffer = home.buffer
        dtype = local0.dtype
        region = buffer[starts[0] : stop]
        self.flat = region if region.dtype == dtype else region.view(dtype)
        scale = buffer.element_size()
        self.offsets = [(s - starts[0]) * scale // local0.element_size() for s in starts]
        self.numels = [local_tensor(p).numel() for p in params]
        # where each local gradient starts when the run's gradient is one view (see flat_grads)
        self.byte_offsets = [off * local0.element_size() for off in self.offsets]
        # what the optimizer steps: the run in cache-sized pieces on CPU (see _use_layout)
        self.bounds: list[tuple[int, int]] = []
        self.pieces: list[torch.Tensor] = []
        self._piece_param: list[int] = []  # per-parameter pieces: each one's parameter
        self._flat_layout: str | None = None
        self.state: dict | None = None
        self.views: list[dict] | None = None
        self._piece_states: list[dict] = []
        self._first_values: dict[Any, Any] = {}  # piece 0's state values after the last step
        self._scalars: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._state_of: dict | None = None  # the optimizer.state the views were put in
        # what the views held when published or last stepped (see _seal)
        self._sealed_values: list = []
        self._sealed_tensors: list[torch.Tensor] = []
        self._sealed_versions: list[int] = []
        self._counters_own = True
        # steps taken as one tensor, and whether the last one's gradient was a view (no copy)
        self.flat_steps = 0
        self.grad_was_view = False

    def still_flat(self) -> bool:
        if self.home.buffer is not self.buffer:  # re-allocated, or a group left the arena
            return False
        local = local_tensor(self.params[0])
        if local.numel():
            return local.data_ptr() == self.flat.data_ptr()
        return flat_slot_of(self.params[0]) is not None

    # ---- gradients ------------------------------------------------------------

    def _as_view(self, grads: list[torch.Tensor], ptrs: list[int]) -> torch.Tensor | None:
        """The run's gradient as one view of the reduction's output, if ``grads`` lie as its slots.

        ``grads``: the local tensors of the run's DTensor gradients, each
        contiguous and carrying its parameter's spec (so its dtype and shape);
        ``ptrs``: their addresses.
        """
        g0, flat = grads[0], self.flat
        base, numel = ptrs[0], flat.numel()
        output = view_base(g0)
        if (
            output is None
            or g0.dtype != flat.dtype
            or output.dim() != 1
            or not output.is_contiguous()
            or output.device != flat.device
            or list(map(base.__rsub__, ptrs)) != self.byte_offsets
        ):
            return None
        start = g0.storage_offset() - output.storage_offset()
        if start < 0 or start + numel > output.numel():
            return None
        self.grad_was_view = True
        return output if start == 0 and numel == output.numel() else output.narrow(0, start, numel)

    def _checked_grad(self, objects: list) -> torch.Tensor | list[torch.Tensor] | None:
        """``flat_grads`` for this run, parameter by parameter: other specs, empty shards, copies."""
        flat, grads = self.flat, []
        dtype, numel = flat.dtype, flat.numel()
        base = size = 0
        aligned = True
        for g, p, off in zip(objects, self.params, self.offsets):
            if not isinstance(g, DTensor) or not (same_dtensor_spec(g, p) or _same_layout(g, p)):
                return None
            local = local_tensor(g)
            if local.dtype != dtype:
                return None
            if not grads:
                g0 = local
                base, size = g0.data_ptr(), g0.element_size()
                if g0.device != flat.device:
                    return None
                aligned = g0.untyped_storage().nbytes() >= (g0.storage_offset() + numel) * size
            elif aligned and local.numel() and (
                local.data_ptr() - base != off * size or not local.is_contiguous()
            ):  # inside g0's storage (checked above), so on its device
                aligned = False
            grads.append(local)
        self.grad_was_view = aligned
        if aligned:
            return g0.as_strided((numel,), (1,), g0.storage_offset())
        return grads

    # ---- state ----------------------------------------------------------------

    def adopt_state(self, state: dict, entries_unchanged: bool = False) -> bool:
        """Make the run's state agree with the optimizer's per-parameter state.

        Returns ``False`` where the run cannot step as one tensor this time
        (some parameters have state and some not, or their scalars differ).
        ``entries_unchanged``: the caller saw ``state`` hold the same keys and
        per-parameter dicts (the same objects, in order) as after the last step.
        """
        # See [Note: State the run did not write]
        if self.views is not None and self._sealed(state, entries_unchanged):
            return True
        per_param = [state.get(p) for p in self.params]
        if not any(per_param):
            self.state, self.views, self._piece_states = None, None, []
            return True
        if not all(per_param) or len({tuple(s) for s in per_param}) != 1:
            return False
        if not self._adoptable(per_param):
            return False
        built: dict[Any, Any] = {}
        for key in per_param[0]:
            values = [s[key] for s in per_param]
            first = values[0]
            if isinstance(first, torch.Tensor) and first.dim() == 0:
                if not all(isinstance(v, torch.Tensor) and torch.equal(v, first) for v in values):
                    return False
                built[key] = first.detach().clone()
            elif isinstance(first, torch.Tensor):
                locals_ = [local_tensor(v) if isinstance(v, DTensor) else v for v in values]
                if any(v.numel() != n for v, n in zip(locals_, self.numels)):
                    return False
                flat = torch.zeros(self.flat.numel(), dtype=locals_[0].dtype, device=self.flat.device)
                for v, off, n in zip(locals_, self.offsets, self.numels):
                    flat[off : off + n].copy_(v.reshape(-1))
                built[key] = flat
            elif all(v == first for v in values):
                built[key] = first
            else:
                return False
        self._set_state(built, None)
        self._publish(state)
        return True

    def _adoptable(self, per_param: list[dict]) -> bool:
        """Whether every state tensor held for the run can move into its buffers in place.

        See [Note: The state a caller holds is the state] in state_views.py: the
        rebuilt run's buffers take the held tensors' values and the held
        tensors then point into them. Each must be a tensor of its own (see
        ``adoptable``), one dtype per key; otherwise the parameters step one by
        one on the held tensors.
        """
        seen: set[int] = set()
        for key, first in per_param[0].items():
            if not isinstance(first, torch.Tensor):
                continue
            scalar = first.dim() == 0
            device = first.device if scalar else self.flat.device
            for values in per_param:
                value = values[key]
                if (
                    not isinstance(value, torch.Tensor)
                    or (value.dim() == 0) != scalar
                    or value.dtype != first.dtype
                    or not adoptable(value, device)
                ):
                    return False
                seen.add(id(local_of(value)))
        tensors = sum(isinstance(v, torch.Tensor) for v in per_param[0].values())
        return len(seen) == tensors * len(per_param)

    def forget(self) -> None:
        """These parameters stepped one by one: rebuild the run from their state next time."""
        self.views = None

    def _seal(self) -> None:
        """Remember what the optimizer holds now: the published dicts, values and versions.

        Versions of the scalar views only: the other published tensors are the
        run's own memory (``own_storage``), so a write through them is the run's.
        """
        values = list(itertools.chain.from_iterable(map(dict.values, self.views)))
        scalars = [v for v in values if isinstance(v, torch.Tensor) and v.dim() == 0]
        self._sealed_values = values
        self._sealed_tensors = scalars
        self._sealed_versions = version_counters(scalars)

    def _sealed(self, state: dict, entries_unchanged: bool) -> bool:
        """Whether ``state`` holds exactly what the run published, unwritten since."""
        if state is not self._state_of:
            return False
        views = self.views
        if not entries_unchanged and not all(map(operator.is_, map(state.get, self.params), views)):
            return False
        values = list(itertools.chain.from_iterable(map(dict.values, views)))
        return (
            len(values) == len(self._sealed_values)
            and all(map(operator.is_, values, self._sealed_values))
            and version_counters(self._sealed_tensors) == self._sealed_versions
        )

    # ---- the step, in pieces --------------------------------------------------

    def attach(
        self, state: dict, grad: torch.Tensor | list[torch.Tensor], *, per_parameter: bool = False
    ) -> list[torch.Tensor]:
        """Before the step: the pieces to hand the optimizer, with their gradients and state.

        ``per_parameter``: pieces never span two parameters, even where the
        gradient is one flat tensor (see [Note: Fused kernels step per parameter]).
        """
        flat_grad = isinstance(grad, torch.Tensor)
        if flat_grad and not per_parameter:
            # a first step makes its state in one piece: no second copy of it (see _use_layout)
            self._use_layout("whole" if self.state is None else "pieces")
        else:
            self._use_layout("per_parameter")
        pieces = self.pieces
        if flat_grad and len(pieces) == 1 and self.bounds[0] == (0, grad.numel()):
            pieces[0].grad = grad
        elif flat_grad:  # bounds are offsets in the run, whichever layout cut them
            for piece, (start, stop) in zip(pieces, self.bounds):
                piece.grad = grad[start:stop]
        else:  # per-parameter pieces: (start, stop) inside parameter i's slot
            for piece, (start, stop), i in zip(pieces, self.bounds, self._piece_param):
                off = self.offsets[i]
                piece.grad = grad[i].reshape(-1)[start - off : stop - off]
        if self.state is not None:
            for piece, piece_state in zip(pieces, self._piece_states):
                state[piece] = piece_state
        return pieces

    def _use_layout(self, layout: str) -> None:
        """Cut the run for the optimizer: ``"pieces"`` over the whole run (cache-sized on
        CPU), ``"per_parameter"`` within each parameter's slot, or ``"whole"``: one piece.

        ``"whole"`` is for a run's first step on CPU: the optimizer then makes
        each state tensor as one buffer, the run's, where pieces would make one
        per piece and ``detach`` would copy them into one: state twice over, at
        once. One piece or several, the update is elementwise: the same bits.
        """
        if layout == self._flat_layout:
            return
        self._flat_layout = layout
        numel = self.flat.numel()
        if layout == "whole":
            self.bounds, self._piece_param = [(0, numel)], []
        elif layout == "pieces":
            self.bounds = _piece_bounds(0, numel, self.flat.device)
            self._piece_param = []
        else:
            self.bounds, self._piece_param = [], []
            for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
                # an empty shard is an empty piece: the optimizer makes its state and
                # counts its steps, as it does for the empty local tensor upstream steps
                bounds = _piece_bounds(off, off + n, self.flat.device)
                self.bounds += bounds
                self._piece_param += [i] * len(bounds)
        self.pieces = [self.flat[start:stop] for start, stop in self.bounds]
        if self.state is not None:  # the same state, cut the new way
            self._set_state(self.state, None)

    def detach(self, state: dict) -> None:
        """After the step: take the pieces' state back; publish views of new tensors only."""
        if not self.pieces:
            self.flat_steps += 1
            return
        stepped = []
        for piece in self.pieces:
            piece.grad = None
            stepped.append(state.pop(piece, None))
        self.flat_steps += 1
        if not stepped[0]:  # the optimizer keeps no state (SGD without momentum)
            return
        first = stepped[0]
        if (
            self.views is not None
            and all(s is mine for s, mine in zip(stepped, self._piece_states))
            and len(first) == len(self._first_values)
            and all(self._first_values.get(k) is v for k, v in first.items())
        ):
            for vector, scalar in self._scalars:  # the usual step: only scalars moved
                vector.copy_(scalar)
            if not self._counters_own:  # the scalar views share the vectors' counters
                self._sealed_versions = version_counters(self._sealed_tensors)
            return
        # the first step (or a new state object): one buffer per key for the whole run
        built: dict[Any, Any] = {}
        for key, value in first.items():
            whole = self.bounds == [(0, self.flat.numel())]  # one piece, the whole run
            if isinstance(value, torch.Tensor) and value.dim() > 0 and not whole:
                built[key] = torch.zeros(self.flat.numel(), dtype=value.dtype, device=value.device)
                for s, (start, stop) in zip(stepped, self.bounds):
                    built[key][start:stop].copy_(s[key])
            else:
                built[key] = value
        self._set_state(built, stepped)
        self._publish(state)

    def _set_state(self, built: dict, stepped: list[dict] | None) -> None:
        """The run's state and its pieces' (each piece keeps 0-d state such as ``step`` its own)."""
        self.state = built
        if not self.bounds:  # no layout yet: the first attach cuts the pieces
            self._piece_states, self._first_values = [], {}
            return
        single = len(self.pieces) == 1 and self.bounds[0] == (0, self.flat.numel())
        piece_states = []
        for i, (start, stop) in enumerate(self.bounds):
            piece_state = {}
            for key, value in built.items():
                if isinstance(value, torch.Tensor) and value.dim() == 0:
                    if i == 0:
                        piece_state[key] = value
                    elif stepped is not None:
                        piece_state[key] = stepped[i][key]
                    else:
                        piece_state[key] = value.clone()
                elif isinstance(value, torch.Tensor) and not single:
                    piece_state[key] = value[start:stop]
                else:
                    piece_state[key] = value
            piece_states.append(piece_state)
        self._piece_states = piece_states
        self._first_values = dict(piece_states[0])

    def _publish(self, state: dict) -> None:
        """The per-parameter state the optimizer holds outside ``step``: views of the run's."""
        views: list[dict] = [{} for _ in self.params]
        scalars = []
        for key, value in self.state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                vector = value.detach().reshape(1).repeat(len(self.params))
                scalars.append((vector, value))
                for i, view in enumerate(views):  # each its own storage, as a plain step's
                    view[key] = own_storage(vector[i : i + 1]).view(())
            elif isinstance(value, torch.Tensor) and value.shape == self.flat.shape:
                for p, view, off, n in zip(self.params, views, self.offsets, self.numels):
                    shape = local_tensor(p).shape
                    if n:
                        view[key] = own_storage(value[off : off + n]).view(shape)
                    else:  # an empty shard: a tensor of its own (torch.save reads its storage)
                        view[key] = value.new_zeros(shape)
            else:  # shared as it is (e.g. a Python number)
                for view in views:
                    view[key] = value
        self._scalars = scalars
        self.views = [publish(state, p, view) for p, view in zip(self.params, views)]
        self._state_of = state
        # scalar views with storages of their own have counters of their own: the
        # refresh of ``vector`` after a step moves none of them (See [Note: State ...])
        self._counters_own = all(can_own_storage(vector) for vector, _ in scalars)
        self._seal()


def flat_grads(runs: list[FlatRun]) -> list[tuple[Any, list[DTensor] | None]]:
    """Each run's gradient, and the ``.grad`` objects it is one view of (else ``None``).

    The gradient: one tensor when the local gradients lie in one region laid
    out like the buffer (the reduce-scatter output); otherwise the local
    gradients, and the run steps in per-parameter pieces (no copy); ``None``
    if some parameter has none. The objects let ``zero_grad`` check the
    ``.grad``s are still those views without a second read per step. The
    usual step: every ``.grad`` is one fsdp2's reduction set, a view of its
    output at its slot's offset, checked in whole-list operations looped in C
    (a model of many small parameters has hundreds of runs, and per-parameter
    Python here cost more than the optimizer's kernels).
    """
    params = [p for run in runs for p in run.params]
    with fast_grad_access():
        objects = list(map(_GRAD, params))
    usual = all(isinstance(g, DTensor) for g in objects) and same_dtensor_specs(objects, params)
    if usual:  # the parameters' specs: their dtypes and shapes, so only where they lie is checked
        grads = local_tensors(objects)
        usual = all(map(torch.Tensor.is_contiguous, grads))
        ptrs = list(map(torch.Tensor.data_ptr, grads))
    if not usual and len(runs) > 1:  # e.g. one parameter without a gradient: run by run
        return [result for run in runs for result in flat_grads([run])]
    results: list[tuple[Any, list[DTensor] | None]] = []
    i = 0
    for run in runs:
        j = i + len(run.params)
        mine = objects[i:j]
        grad = run._as_view(grads[i:j], ptrs[i:j]) if usual else None
        if grad is None:
            grad = run._checked_grad(mine)
        results.append((grad, mine if isinstance(grad, torch.Tensor) else None))
        i = j
    return results


def _same_layout(grad: DTensor, param: DTensor) -> bool:
    # fsdp2's gradients share their parameter's spec objects: identity first, cheap
    gp, pp = grad.placements, param.placements
    if gp is not pp and gp != pp:
        return False
    gm, pm = grad.device_mesh, param.device_mesh
    return gm is pm or gm == pm


def _piece_bounds(begin: int, end: int, device: torch.device) -> list[tuple[int, int]]:
    if device.type != "cpu" or end - begin <= PIECE_NUMEL:
        return [(begin, end)]
    return [(start, min(start + PIECE_NUMEL, end)) for start in range(begin, end, PIECE_NUMEL)]
