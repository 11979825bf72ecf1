"""Gradient reduction of one parameter group: reduce-scatter, HSDP all-reduce, casts back.

``FSDPParamGroup`` owns one ``GradientReduction`` (``group.reduction``) and
calls it from its backward hooks. The reduction keeps what only reductions
read: the settings ``FSDPModule``'s gradient setters choose
(``ReductionSettings`` in group_settings.py, replaced through its ``set_*``
methods only) and the state kept between reductions (HSDP partial sums, the
pending gradient offload, the cached reduce plan). Everything else is handed
to it: the group's parameters, mesh, device, offload flags and (as a
callable: they are resolved again when parameters are replaced) dtypes at
construction; the shards' device and the group's name with each reduction.
See [Note: CPU offload] in param_group.py and [Note: Gradient divide
factors] in reduce_op.py.

[Note: Gradient accumulation without sync]
With ``reduce_grads`` off (``set_requires_gradient_sync(False)``) the
post-backward skips the reduce-scatter and leaves each gradient on its
unsharded parameter's ``.grad``: the unsharded parameter object is reused
across unshards, so the next backward's autograd adds into the same tensor.
The first post-backward with ``reduce_grads`` on reduces the accumulated sum
in one reduce-scatter. Gradients accumulate in the parameter dtype; with a
different reduce dtype ``hold_unsharded_grads`` moves them aside into that
dtype (once per micro-batch), as upstream accumulates them.

[Note: Gradient accumulation dtype]
From torch 2.15 upstream makes autograd accumulate an unsharded gradient in
the reduce dtype (``Tensor.grad_dtype``) when that is wider than the compute
dtype: a gradient held across backwards (no sync, chunked losses) is upcast
once and every later contribution is added to it in that dtype, in autograd's
order; a gradient about to be reduced takes autograd's output as it comes
(the reduce-scatter copy-in upcasts it). Before 2.15 gradients accumulate in
the compute dtype within a backward and are moved aside into the reduce dtype
after it. fsdp2 follows the installed torch (``versions.ACCUMULATE_IN_GRAD_DTYPE``),
so its sums round exactly as upstream's do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ...errors import FSDPAssertionError
from ...versions import ACCUMULATE_IN_GRAD_DTYPE
from ..comm import collectives
from ..comm.comm_context import CommContext
from ..comm.comm_memory import effective
from ..comm.quantized_reduce import QuantizedReduceScatter
from ..comm.staged_collectives import ReduceScatter
from ..common.mixed_precision import GroupDtypes
from ..meshes.mesh import FSDPMeshInfo
from ..storage.buffer_order import BufferOrder
from ..storage.param import FSDPParam
from ..storage.sharded_grad import accumulate_sharded_grad, set_grad_dtype
from . import replica_slices, unused_grads
from .group_settings import ReductionSettings
from .reduce_op import ReducePlan, backend_supports_premul_sum, plan_gradient_reduction

_BOTH_COMMS = (
    "a GradientCommPolicy and a custom reduce-scatter comm both replace the gradient "
    "reduce-scatter: set one (set_gradient_comm_policy(None) or set_custom_reduce_scatter "
    "on a fresh module)"
)


class GradientReduction:
    """Reduce a group's unsharded gradients onto its sharded parameters."""

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        mesh_info: FSDPMeshInfo,
        device: torch.device,
        dtypes: Callable[[], GroupDtypes],
        comm_ctx: CommContext,
        alone: bool,
        offload: bool,
        pin_memory: bool,
        order: BufferOrder,
        gradient_slot: Callable[[int], torch.Tensor | None] = lambda numel: None,
    ) -> None:
        self.fsdp_params = fsdp_params
        # The group's slice (of ``numel`` elements) of its arena's gradient buffer, where
        # reduced gradients may land for good (see [Note: Arenas] in arena.py); None: none
        self._gradient_slot = gradient_slot
        self.order = order  # where the gradients go (see [Note: Buffer orders] in buffer_order.py)
        self.mesh_info = mesh_info
        self.device = device
        # The group's dtypes as they are now: it resolves them again whenever its
        # parameters are replaced (e.g. module.to(torch.bfloat16)).
        self._dtypes = dtypes
        # One rank, nothing to communicate: see [Note: Forcing collectives on one rank]
        self.alone = alone
        # Reduced gradients go back to the host, asynchronously where pinned: see
        # [Note: CPU offload] in param_group.py.
        self.offload = offload
        self.pin_memory = pin_memory
        self.settings = ReductionSettings()
        self._reduce_plan: ReducePlan | None = None  # for the last reduce dtype
        # HSDP with the all-reduce off: shard-reduced gradients waiting for it.
        self._partial_grads: dict[FSDPParam, torch.Tensor] = {}
        self._grad_offload_event: torch.Event | None = None
        # The root's streams and reductions in flight: see [Note: Streams] in comm_context.py
        self.comm_ctx = comm_ctx

    def set_comm_ctx(self, comm_ctx: CommContext) -> None:
        """Reduce on ``comm_ctx``'s streams (the group's, handed at the root's lazy init)."""
        self.comm_ctx = comm_ctx

    # ---- settings ----------------------------------------------------------------

    def set_requires_gradient_sync(self, enabled: bool) -> None:
        self.settings = replace(self.settings, reduce_grads=enabled)

    def set_requires_all_reduce(self, enabled: bool) -> None:
        self.settings = replace(self.settings, all_reduce_grads=enabled)

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        self.settings = replace(self.settings, gradient_divide_factor=factor)
        self._reduce_plan = None

    def set_force_sum_reduction(self, enable: bool) -> None:
        self.settings = replace(self.settings, force_sum_reduction=enable)
        self._reduce_plan = None

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None] | None, stream: torch.Stream | None
    ) -> None:
        """Set (``None``: remove) the hook; ``stream=None`` keeps a stream given before, as upstream."""
        if stream is None:
            stream = self.settings.all_reduce_hook_stream
        self.settings = replace(self.settings, all_reduce_hook=hook, all_reduce_hook_stream=stream)

    def set_reduce_scatter_comm(self, comm: ReduceScatter | None) -> None:
        """A custom or built-in reduce-scatter comm; ``None``: the default collective."""
        if comm is not None and self.settings.grad_comm is not None:
            raise ValueError(_BOTH_COMMS)
        self.settings = replace(self.settings, reduce_scatter_comm=comm)

    def set_grad_comm(self, policy: Any) -> None:
        """``GradientCommPolicy``: reduce-scatter through encoded slices; ``None``: off."""
        if policy is not None and self.settings.reduce_scatter_comm is not None:
            raise ValueError(_BOTH_COMMS)
        comm = None if policy is None else QuantizedReduceScatter(
            policy.payload, policy.block_size, policy.error_feedback)
        self.settings = replace(self.settings, grad_comm=comm)

    def set_reduce_scatter_unused_params(self, enabled: bool) -> None:
        self.settings = replace(self.settings, reduce_scatter_unused_params=enabled)

    def set_reduce_scatter_max_input_buffers(self, count: int) -> None:
        self.settings = replace(self.settings, reduce_scatter_max_input_buffers=count)

    @property
    def reduce_scatter_group(self) -> dist.ProcessGroup:
        """The reduce-scatter's group: the shard group, or its own (see below)."""
        group = self.settings.reduce_scatter_process_group
        return group if group is not None else self.mesh_info.shard_process_group

    def set_separate_reduce_scatter_group(
        self, enable: bool, new_groups: dict[tuple[int, ...], dist.ProcessGroup]
    ) -> None:
        """Reduce-scatter over a process group of its own, over the same ranks as the shard group.

        On NCCL one communicator runs one collective at a time, so a second one
        lets backward's reduce-scatters overlap its all-gathers. Groups are
        shared by rank set through ``new_groups`` (one per call of the
        ``FSDPModule`` method); only the members create it.
        """
        if not enable:
            self.settings = replace(self.settings, reduce_scatter_process_group=None)
            return
        ranks = tuple(dist.get_process_group_ranks(self.mesh_info.shard_process_group))
        if ranks not in new_groups:
            existing = self.settings.reduce_scatter_process_group  # already separate: keep it
            new_groups[ranks] = existing if existing is not None else dist.new_group(
                list(ranks), use_local_synchronization=True
            )
        self.settings = replace(self.settings, reduce_scatter_process_group=new_groups[ranks])

    # ---- the gradients of a backward ---------------------------------------------

    def hold_unsharded_grads(self) -> None:
        """Keep the unsharded gradients for the next backward to add to.

        See [Note: Gradient accumulation without sync]. They stay in the
        parameter dtype on the unsharded parameters' ``.grad``, unless a
        different reduce dtype is set: then they are kept in it (see
        [Note: Gradient accumulation dtype]).
        """
        dtypes = self._dtypes()
        if dtypes.reduce is None or dtypes.reduce == (dtypes.param or dtypes.orig):
            return
        if ACCUMULATE_IN_GRAD_DTYPE:
            self.set_grad_dtypes(defer=False)
            return
        for p in self.fsdp_params:
            p.hold_grad_in(dtypes.reduce)

    def set_grad_dtypes(self, defer: bool) -> None:
        """Set each unsharded parameter's ``grad_dtype``; see [Note: Gradient accumulation dtype]."""
        reduce_dtype = self._dtypes().reduce
        if not ACCUMULATE_IN_GRAD_DTYPE or reduce_dtype is None:
            return
        for p in self.fsdp_params:
            set_grad_dtype(p.unsharded_param, reduce_dtype, defer, self.settings.reduce_grads)

    def take_grads(
        self, ran: Collection[nn.Module] | None
    ) -> tuple[list[FSDPParam], list[torch.Tensor], set[FSDPParam]]:
        """Take the unsharded gradients to reduce off the parameters.

        Returns the parameters with a gradient, their gradients, and those
        whose gradient this rank filled with ``-0.0`` (see [Note: Gradients of
        parameters used on some ranks] in unused_grads.py; ``ran`` as ``fill_unused``
        takes it).
        """
        taken = [p.take_unsharded_grad() for p in self.fsdp_params]
        self.set_grad_dtypes(defer=False)
        filled: set[FSDPParam] = set()
        if self.settings.reduce_scatter_unused_params:
            unused_grads.zero_unused(self.fsdp_params, taken)
        elif self.mesh_info.shard_mesh_size > 1 or self.mesh_info.is_hsdp:
            filled = unused_grads.fill_unused(self.fsdp_params, taken, ran)
        with_grad = [p for p, grad in zip(self.fsdp_params, taken) if grad is not None]
        return with_grad, [grad for grad in taken if grad is not None], filled

    def _plan_for(self, dtype: torch.dtype) -> ReducePlan:
        plan = self._reduce_plan
        if plan is None or plan.dtype != dtype:
            group = self.reduce_scatter_group
            plan = plan_gradient_reduction(
                dtype,
                self.mesh_info.shard_mesh_size,
                self.settings.gradient_divide_factor,
                self.settings.force_sum_reduction,
                backend_supports_premul_sum(group, self.device),
                self.mesh_info.replicate_mesh_size if self.mesh_info.is_hsdp else 1,
            )
            self._reduce_plan = plan
        return plan

    def reduce_scatter(
        self,
        fsdp_params: list[FSDPParam],
        grads: list[torch.Tensor],
        filled: set[FSDPParam],
        shard_device: torch.device,
        module_fqn: str,
    ) -> None:
        """Reduce ``grads`` onto ``fsdp_params``' sharded gradients.

        With FSDP's streams (accelerators) the whole reduction runs on the
        reduce-scatter stream and ``grads`` are held while it is in flight
        (see [Note: Streams] in comm_context.py).

        ``grads`` is emptied once copied in, so the gradients are freed early.
        ``filled``: the parameters whose gradient this rank filled with
        ``-0.0`` (see [Note: Gradients of parameters used on some ranks] in
        unused_grads.py).
        ``shard_device``: where the sharded parameters are (CPU offload);
        ``module_fqn``: the group's name, for errors.
        """
        hsdp = self.mesh_info.is_hsdp
        settings = self.settings
        if (
            not hsdp
            and settings.all_reduce_hook is None
            and settings.all_reduce_hook_stream is not None
        ):
            raise FSDPAssertionError(
                "all reduce hook stream is specified but hook itself is missing.\n"
                f"{repr(module_fqn) if module_fqn else 'The root module'} has an "
                "all-reduce hook stream (set_all_reduce_hook(..., stream=...)) but its hook is "
                "None; set a hook again before backward"
            )
        group_dtypes = self._dtypes()
        dtypes = {g.dtype for g in grads}
        reduce_dtype = group_dtypes.reduce or functools.reduce(torch.promote_types, dtypes)
        if len(dtypes) > 1:  # held (accumulated) and fresh ones, or kept and cast parameters
            # one dtype for chunk_cat, which itself converts them to the reduce dtype
            grads[:] = [g.to(reduce_dtype) for g in grads]
        plan = self._plan_for(reduce_dtype)  # see [Note: Gradient divide factors]
        ctx = self.comm_ctx
        if not ctx.active:
            self._reduce(fsdp_params, grads, filled, shard_device, plan, reduce_dtype)
            ctx.hold_reduction([], None, self.offload)  # counted, as upstream's CPU path
            return
        ctx.wait_stream("compute->reduce_scatter", ctx.reduce_scatter, ctx.current())
        held = list(grads)  # read on the reduce-scatter stream: freed after its event
        with ctx.use(ctx.reduce_scatter):
            self._reduce(fsdp_params, grads, filled, shard_device, plan, reduce_dtype)
        ctx.hold_reduction(held, ctx.record(ctx.reduce_scatter), self.offload)

    def _reduce(
        self,
        fsdp_params: list[FSDPParam],
        grads: list[torch.Tensor],
        filled: set[FSDPParam],
        shard_device: torch.device,
        plan: ReducePlan,
        reduce_dtype: torch.dtype,
    ) -> None:
        world_size = self.mesh_info.shard_mesh_size
        hsdp = self.mesh_info.is_hsdp
        group_dtypes = self._dtypes()
        # One rank: SUM and AVG are the identity, so the collective can be skipped
        # (see [Note: Forcing collectives on one rank]).
        identity = self.alone and plan.op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
        with torch.no_grad():
            if (
                identity
                and not hsdp
                and not self.offload
                and self.settings.all_reduce_hook is None
                and plan.pre_factor is None
                and plan.post_factor is None
                and all(g.dtype == group_dtypes.orig for g in grads)
            ):  # the mean over one rank is the gradient itself
                for p, grad in zip(fsdp_params, grads):
                    accumulate_sharded_grad(
                        p.sharded_param, grad if grad.is_contiguous() else grad.contiguous(), p.fqn
                    )
                return
            comm = effective(self.settings.reduce_scatter_comm) if not identity else None
            encoded = self.settings.grad_comm if not identity else None
            out = slot = None
            if comm is not None:  # a custom comm allocates both buffers
                numel = world_size * self.order.shard_numel(fsdp_params)
                out = comm.allocate((numel,), dtype=reduce_dtype, device=grads[0].device)
            rs_input = self.order.reduce_scatter_input(grads, fsdp_params, reduce_dtype, out=out)
            grads.clear()  # the copy-in is done: let the unsharded gradients go
            if plan.pre_factor is not None:
                rs_input.div_(plan.pre_factor)
            if identity:
                output = rs_input
            elif encoded is not None:  # see [Note: Quantized gradient exchange]
                output = rs_input.new_empty(rs_input.numel() // world_size)
                segments = self.order.slice_segments(fsdp_params)
                encoded(output, rs_input, self.reduce_scatter_group, plan.op, segments)
            elif comm is not None:
                output = comm.allocate(
                    (rs_input.numel() // world_size,), dtype=reduce_dtype, device=rs_input.device
                )
                group = self.reduce_scatter_group
                comm(output_tensor=output, input_tensor=rs_input, group=group, op=plan.op)
            else:
                slot = self._final_slot(fsdp_params, rs_input.numel() // world_size, hsdp)
                output = (
                    slot if slot is not None and slot.dtype == rs_input.dtype
                    else rs_input.new_empty(rs_input.numel() // world_size)
                )
                collectives.reduce_scatter(output, rs_input, self.reduce_scatter_group, plan.op)
            if self.settings.all_reduce_hook is not None and not hsdp:
                self._call_all_reduce_hook(output)
            if hsdp:
                if not self._all_reduce(output, fsdp_params, filled, plan.all_reduce_op):
                    return
                if self.settings.all_reduce_hook is not None:  # HSDP: after the all-reduce
                    self._call_all_reduce_hook(output)
            if plan.post_factor is not None:  # once, after both groups (HSDP) summed
                output.div_(plan.post_factor)
            blocks = self.order.shard_blocks(output, fsdp_params) if filled else ()
            unused = unused_grads.unused_everywhere(blocks, fsdp_params, filled) if filled else ()
            if slot is not None and slot.device == output.device:
                if output is not slot:  # the cast to the parameters' dtype lands in the slot
                    slot.copy_(output)
                output = slot
            else:
                output = self._to_sharded_grad_storage(output, fsdp_params, shard_device)
            for p, local in zip(fsdp_params, self.order.sharded_grads(output, fsdp_params)):
                if p not in unused:
                    accumulate_sharded_grad(p.sharded_param, local, p.fqn)

    def _final_slot(
        self, fsdp_params: list[FSDPParam], numel: int, hsdp: bool
    ) -> torch.Tensor | None:
        """The arena slice these gradients land in for good, where they may; see [Note: Arenas].

        Only the whole group's gradients, final this backward (HSDP: the
        all-reduce on) and with nothing to add to: otherwise they are added or
        held elsewhere, and a slice once handed out is never written again.
        """
        if (
            len(fsdp_params) != len(self.fsdp_params)
            or (hsdp and not self.settings.all_reduce_grads)
            or (self.offload and self.device.type != "cpu")  # copied to the host as before
            or any(p.sharded_param.grad is not None for p in fsdp_params)
        ):
            return None
        return self._gradient_slot(numel)

    def _all_reduce(
        self,
        output: torch.Tensor,
        fsdp_params: list[FSDPParam],
        filled: set[FSDPParam] = frozenset(),
        op: object = dist.ReduceOp.AVG,
    ) -> bool:
        """HSDP: reduce over the replicate group with ``op``; returns whether gradients are final.

        With ``all_reduce_grads`` off (gradient accumulation) the shard-reduced
        gradients (in the reduce dtype) are kept aside, not set on ``.grad``,
        and folded into the next all-reduce, as upstream does; the padding is
        kept with them (see [Note: Gradients of parameters used on some ranks] in
        unused_grads.py).
        """
        blocks = self.order.shard_blocks(output, fsdp_params)
        if not self.settings.all_reduce_grads:
            for p, block in zip(fsdp_params, blocks):
                partial = self._partial_grads.get(p)
                self._partial_grads[p] = block if partial is None else partial.add_(block)
            return False
        for p, block in zip(fsdp_params, blocks):
            partial = self._partial_grads.pop(p, None)
            if partial is not None:
                block.add_(partial)
        ctx = self.comm_ctx
        # HSDP's all-reduce on its own stream, after the reduce-scatter (no-ops without streams)
        ctx.wait_stream(None, ctx.all_reduce, ctx.reduce_scatter)
        # ---- optimizer state sharded across replicas: see [Note: Replica slices]
        slices = replica_slices.of_params(self.fsdp_params)
        with ctx.use(ctx.all_reduce):
            if slices is not None and slices.covers(output):
                slices.reduce(output, op)  # a reduce-scatter in place of the all-reduce
            else:
                collectives.all_reduce(output, self.mesh_info.replicate_process_group, op)
        # the views and casts after it run on the reduce-scatter stream
        ctx.wait_stream(None, ctx.reduce_scatter, ctx.all_reduce)
        return True

    @property
    def holds_partial_reduction(self) -> bool:
        """HSDP with all-reduce off: reduce-scattered gradients wait for their all-reduce."""
        return bool(self._partial_grads)

    def _to_sharded_grad_storage(
        self, reduced: torch.Tensor, fsdp_params: list[FSDPParam], shard_device: torch.device
    ) -> torch.Tensor:
        """The reduced flat gradient in the sharded parameters' dtype and device.

        One cast (mixed precision) and, with CPU offload, one device-to-host copy
        for the whole group; no-ops when nothing differs. See [Note: CPU offload].
        """
        orig_dtype = self._dtypes().orig
        device = shard_device if self.offload else reduced.device
        if reduced.dtype == orig_dtype and reduced.device == device:
            return reduced
        non_blocking = (
            self.pin_memory
            and reduced.device != device
            and all(p.sharded_param.grad is None for p in fsdp_params)
        )
        result = reduced.to(device=device, dtype=orig_dtype, non_blocking=non_blocking)
        if self.comm_ctx.active and self.offload:
            self._grad_offload_event = self.comm_ctx.record()
        elif non_blocking:
            self._grad_offload_event = torch.Event(device=reduced.device)
            self._grad_offload_event.record()
        return result

    def wait_for_grad_offload(self) -> None:
        """Block until asynchronous device-to-host gradient copies have landed."""
        event, self._grad_offload_event = self._grad_offload_event, None
        self.comm_ctx.synchronize("offload->optimizer", event)

    def _call_all_reduce_hook(self, output: torch.Tensor) -> None:
        hook, stream = self.settings.all_reduce_hook, self.settings.all_reduce_hook_stream
        if self.comm_ctx.active:
            with self.comm_ctx.hook_stream(stream):
                hook(output)
            return
        if stream is None:
            hook(output)
            return
        # The hook sees its stream as the current one, as upstream (on CPU too, where
        # torch.cpu's stream context only sets what current_stream() returns).
        device_module = torch.get_device_module(self.device)
        ordered = self.device.type != "cpu"  # CPU has one stream: nothing to order
        current = device_module.current_stream()
        if ordered:
            stream.wait_stream(current)
        with device_module.stream(stream):
            hook(output)
        if ordered:
            current.wait_stream(stream)

