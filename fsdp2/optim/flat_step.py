"""Elementwise optimizers stepping on fsdp2's flat shard buffers.

[Note: Flat optimizer steps]
fsdp2 keeps each group's padded shards in one flat buffer (``FlatShard`` in
runtime/flat_shard.py), and the reduce-scatter output is one flat gradient
laid out the same way, of which each ``.grad`` is a view. For an elementwise
optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, also
``foreach`` / ``fused``) one update of a flat tensor is, element for element,
the same arithmetic as the updates of the parameters that view it, so we step
each *run* (parameters of one optimizer param group whose slots follow each
other in one buffer, all with a gradient) as one tensor: a few kernels per
run instead of a few per parameter. Everything per run is one contiguous
region: the parameter (a view of the buffer), the gradient (a view of the
reduce-scatter output when it lines up with the buffer, one copy otherwise)
and each state tensor (``exp_avg``, ...: one buffer per key per run).
Outside ``step`` the optimizer holds the per-parameter state it holds today:
DTensors whose local tensors view the run's state buffers (through
``own_storage``, so each has a storage of its own) and, for scalar state such
as ``step``, 0-d views of one vector per run that is refreshed after each
step. ``optimizer.state_dict()``, DCP and ``get_optimizer_state_dict`` see
the same keys, types and values as with the per-parameter step.

Padding (the tail of a slot past the local rows) steps too: its gradient is
0, so its value stays what it was (0) for every listed optimizer, and no
visible element reads it. A run whose per-parameter state was replaced
(``load_state_dict``, DCP) is rebuilt from it before the step: the values are
copied into fresh run buffers, which requires equal scalar state (one ``step``
count) across the run; otherwise that run steps per parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import dtensor_like, local_tensor, same_dtensor_spec
from ..runtime.flat_shard import flat_slot_of
from ..runtime.shard_storage import own_storage

# Optimizers whose update of an element reads only that element's parameter,
# gradient and state (and group-wide scalars): stepping a flat run is exact.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
)


def steps_flat(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s own class is one of ``ELEMENTWISE_OPTIMIZERS`` (not a subclass)."""
    return type(optimizer) in ELEMENTWISE_OPTIMIZERS


class FlatRun:
    """Parameters of one param group whose slots follow each other in one flat buffer.

    ``flat`` views their slots (padding included); ``offsets`` / ``numels``
    place each local tensor in it. ``state`` is the run's optimizer state
    (``None`` before the first step); ``views`` the per-parameter state dicts
    the optimizer holds outside ``step``.
    """

    def __init__(self, params: list[DTensor], buffer: torch.Tensor, starts: list[int], stop: int):
        local0 = local_tensor(params[0])
        self.params = params
        self.buffer = buffer
        dtype = local0.dtype
        region = buffer[starts[0] : stop]
        self.flat = region if region.dtype == dtype else region.view(dtype)
        scale = buffer.element_size()
        self.offsets = [(s - starts[0]) * scale // local0.element_size() for s in starts]
        self.numels = [local_tensor(p).numel() for p in params]
        self.state: dict | None = None
        self.views: list[dict] | None = None
        self._derived: dict[Any, Any] = {}
        self._scalars: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._state_of: dict | None = None  # the optimizer.state the views were put in
        # steps taken as one tensor, and whether the last one's gradient was a view (no copy)
        self.flat_steps = 0
        self.grad_was_view = False

    def still_flat(self) -> bool:
        local = local_tensor(self.params[0])
        if local.numel():  # a re-allocated buffer moves every local tensor
            return local.data_ptr() == self.flat.data_ptr()
        slot = flat_slot_of(self.params[0])
        return slot is not None and slot.buffer is self.buffer

    # ---- gradients ------------------------------------------------------------

    def flat_grad(self) -> torch.Tensor | None:
        """The run's gradient as one tensor, or ``None`` if some parameter has none.

        A view when the gradients' local tensors lie in one region laid out
        like the buffer (the reduce-scatter output); one copy otherwise.
        """
        # one pass, no helper calls on the usual path: this runs for every parameter
        flat, grads = self.flat, []
        dtype, numel = flat.dtype, flat.numel()
        base = size = 0
        aligned = True
        for p, off in zip(self.params, self.offsets):
            g = p.grad
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
        flat = torch.zeros_like(self.flat)  # padding: a zero gradient keeps it unchanged
        for g, off, n in zip(grads, self.offsets, self.numels):
            flat[off : off + n].copy_(g.reshape(-1))
        return flat

    # ---- state ----------------------------------------------------------------

    def adopt_state(self, state: dict) -> bool:
        """Make the run's state agree with the optimizer's per-parameter state.

        Returns ``False`` where the run cannot step as one tensor this time
        (some parameters have state and some not, or their scalars differ).
        """
        # ``load_state_dict`` (DCP, set_optimizer_state_dict too) replaces ``optimizer.state``
        # as a whole; so do per-parameter steps of these parameters (``views`` is reset).
        if self.views is not None and state is self._state_of:
            return True
        per_param = [state.get(p) for p in self.params]
        if not any(per_param):
            self.state, self.views, self._derived, self._scalars = None, None, {}, []
            return True
        if not all(per_param) or len({tuple(s) for s in per_param}) != 1:
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
        self.state, self._derived, self._scalars = built, {}, []
        self.publish(state, built)
        return True

    def publish(self, state: dict, run_state: dict) -> None:
        """After a step: the per-parameter state views of ``run_state`` (new tensors only)."""
        if self.views is not None and run_state is self.state and all(
            self._derived.get(k) is v for k, v in run_state.items()
        ) and len(self._derived) == len(run_state):
            for vector, scalar in self._scalars:  # the usual step: only scalars moved
                vector.copy_(scalar)
            return
        self.state = run_state
        views: list[dict] = [{} for _ in self.params]
        scalars = []
        for key, value in run_state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                vector = value.detach().reshape(1).repeat(len(self.params))
                scalars.append((vector, value))
                for i, view in enumerate(views):
                    view[key] = vector[i]
            elif isinstance(value, torch.Tensor) and value.shape == self.flat.shape:
                for p, view, off, n in zip(self.params, views, self.offsets, self.numels):
                    local = local_tensor(p)
                    piece = value[off : off + n]
                    piece = own_storage(piece) if n else piece
                    view[key] = dtensor_like(p, piece.view(local.shape))
            else:  # shared as it is (e.g. a Python number)
                for view in views:
                    view[key] = value
        self._derived, self._scalars = dict(run_state), scalars
        self.views = views
        self._state_of = state
        for p, view in zip(self.params, views):
            state[p] = view


def _same_layout(grad: DTensor, param: DTensor) -> bool:
    # fsdp2's gradients share their parameter's spec objects: identity first, cheap
    gp, pp = grad.placements, param.placements
    if gp is not pp and gp != pp:
        return False
    gm, pm = grad.device_mesh, param.device_mesh
    return gm is pm or gm == pm


def plan_runs(params: list) -> tuple[list[FlatRun], list]:
    """Split one param group's parameters into flat runs and the rest (stepped per parameter)."""
    placed = []
    rest = []
    for i, p in enumerate(params):
        slot = flat_slot_of(p) if isinstance(p, DTensor) else None
        if slot is None:
            rest.append(p)
        else:
            placed.append((id(slot.buffer), slot.start, i, p, slot))
    placed.sort(key=lambda e: (e[0], e[1]))
    runs: list[FlatRun] = []
    current: list = []

    def close() -> None:
        if current:
            first = current[0][4]
            runs.append(
                FlatRun([e[3] for e in current], first.buffer, [e[4].start for e in current],
                        current[-1][4].stop)
            )
            current.clear()

    for entry in placed:
        slot = entry[4]
        if current:
            prev = current[-1]
            if (
                prev[4].buffer is not slot.buffer
                or prev[4].stop != slot.start
                or local_tensor(prev[3]).dtype != local_tensor(entry[3]).dtype
                or prev[3].requires_grad != entry[3].requires_grad
            ):
                close()
        current.append(entry)
    close()
    return runs, rest
