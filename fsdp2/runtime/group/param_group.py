"""FSDPParamGroup: unshard, reshard and reduce the parameters of one fully_shard call.

A group owns one flat buffer holding every parameter's padded shard (see
[Note: Sharded parameter storage] in param.py, and [Note: Mixed-dtype groups]
in flat_shard.py for groups of several dtypes); that buffer is the all-gather
input. Each use of the group costs one all-gather and, in backward, one
reduce-scatter (see [Note: Copies around the collectives]), plus one
all-reduce over the replicate group for HSDP.

The group holds what it *is*: its parameters and flat buffer, modules,
meshes, device, policies and the dtypes resolved from them, and when and how
it gathers (``UnshardSettings``, group_settings.py). What forward and
backward do to it is its ``StepState`` (step_state.py); reducing its
gradients is its ``GradientReduction`` (``group.reduction``, reduction.py),
which keeps the gradient settings. ``FSDPModule``'s setters go through the
group's ``update_settings`` and ``set_*`` methods, and its reduction's.

[Note: Resharding to a smaller group after forward]
With ``reshard_after_forward=k`` the post-forward reshard keeps, instead of
nothing, this rank's share of the gathered parameters over its post-forward
group of ``k`` ranks (see [Note: Meshes] in mesh.py): the ``W / k``
consecutive rank blocks ``[j * W/k, (j+1) * W/k)`` for post-forward rank
``j``, laid out ``(W/k, group shard numel)``. Gathering those blocks over the
``k`` ranks yields exactly the ``(W, group shard numel)`` rank-major buffer a
full all-gather would, so copy-out is unchanged. In the parameter-major order
the rank blocks are the ranges ``[r * S, (r + 1) * S)`` of the output: the
same cut keeps one contiguous range (``BufferOrder.post_forward_shard``).

[Note: CPU offload]
With ``CPUOffloadPolicy`` the flat buffer (hence every sharded parameter, and
the optimizer state built on them) lives in host memory, pinned when the
device is an accelerator. Each all-gather copies the flat shard to the device
in one copy (the same copy-in that casts for mixed precision); each
reduction copies the flat reduced gradient back to the host in one copy.
Gradient copies from an accelerator are asynchronous into pinned memory when
nothing on the host reads them before the end of backward (no gradient to
accumulate into); the end-of-backward callback waits for them, so the
optimizer never sees a half-written gradient. On a CPU mesh every one of
these copies is a no-op and the code path is the same.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from ..._torch_compat import outside_functorch
from ...api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ...errors import FSDPNotImplementedError
from ...versions import ACCUMULATE_PROFILER_RANGE
from ..comm import collectives
from ..comm.comm_context import CommContext
from ..comm.comm_memory import effective
from ..comm.force_collectives import skips_collectives
from ..common.mixed_precision import check_grad_dtypes, check_trainable_dtypes
from ..common.profiler_ranges import log_hook, record_function
from ..meshes.mesh import FSDPMeshInfo, PostForwardMeshInfo
from ..storage.flat_shard import FlatShard, FlatShardLayout
from ..storage.packed_rows import PackedRows
from ..storage.param import FSDPParam, ShardedState
from ..storage.ragged import ParamMajor
from ..storage.rank_major import RankMajor
from . import staged_gather
from .backward_prefetch import prefetch_previous
from .gather_plan import plan_gather
from .group_settings import UnshardSettings
from .placement_checks import check_materialized, check_on_host
from .reduction import GradientReduction
from .step_state import PendingAllGather, StepState, TrainingState


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call, gathered and reduced together."""

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        sources: list[nn.Parameter],
        modules: tuple[nn.Module, ...],
        mesh_info: FSDPMeshInfo,
        device: torch.device,
        comm_ctx: CommContext,
        reshard_after_forward: bool,
        post_forward_mesh_info: PostForwardMeshInfo | None = None,
        mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
        offload_policy: OffloadPolicy = OffloadPolicy(),
    ) -> None:
        self.fsdp_params = fsdp_params
        self.modules = modules
        self.module_fqn = ""  # named under its root at lazy init (set_fqns)
        self.mesh_info = mesh_info
        # One rank, nothing to communicate: see [Note: Forcing collectives on one rank]
        self.alone = skips_collectives(mesh_info.shard_mesh_size)
        # Set only for reshard_after_forward=int: see [Note: Resharding to a smaller group ...]
        self.post_forward_mesh_info = post_forward_mesh_info
        self.device = device
        self.settings = UnshardSettings(reshard_after_forward)
        # This call's own until the root's lazy init hands the root's (set_comm_ctx)
        self.comm_ctx = comm_ctx
        self.step = StepState()
        # This group's place among its state's groups (upstream's _param_group_index and
        # _num_param_groups); see [Note: Per-parameter meshes] in param_meshes.py
        self.index, self.count = 0, 1
        self.range_pg: int | None = None  # the shard size profiler ranges name, if several
        tp_names = [p.fqn for p in fsdp_params if p.tp_spec is not None]
        if tp_names and post_forward_mesh_info is not None:  # upstream: at the first forward
            raise FSDPNotImplementedError(
                "Resharding to smaller mesh is not supported for DTensor parameters yet\n"
                "reshard_after_forward=<int> with tensor-parallel (DTensor) parameters "
                f"({', '.join(tp_names)}); pass True or False"
            )
        # See [Note: CPU offload]
        self.mp_policy = mp_policy
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        pin_memory = self.offload and offload_policy.pin_memory and device.type != "cpu"
        buffer_device = torch.device("cpu") if self.offload else device
        # See [Note: Buffer orders]: RaggedShard's parameter-major order, else upstream's
        world_size = mesh_info.shard_mesh_size
        ragged = bool(fsdp_params) and fsdp_params[0].ragged
        packed = ragged and fsdp_params[0].layout.packed
        self.order = (PackedRows if packed else ParamMajor if ragged else RankMajor)(
            fsdp_params, world_size
        )
        self._flat = FlatShard(fsdp_params, sources, buffer_device, pin_memory, self.order)
        self._init_dtypes()  # sets self.dtypes (GroupDtypes) and self._gather (GatherPlan)
        self.reduction = GradientReduction(
            fsdp_params, mesh_info, device, lambda: self.dtypes, comm_ctx,
            alone=self.alone, offload=self.offload, pin_memory=pin_memory, order=self.order,
            gradient_slot=self._flat.gradient_slot,
        )

    # ---- settings (FSDPModule's setters) -------------------------------------------

    def update_settings(self, **changes: Any) -> None:
        """FSDPModule's setters: new values for ``UnshardSettings``' fields (group_settings.py)."""
        self.settings = replace(self.settings, **changes)

    def _unshard_for_use(self, prefetch: bool = False) -> None:
        """The hooks' unshard: on the all-gather streams, or (``unshard_async_op``) as an
        async collective on the current stream; a prefetch is always async."""
        on_current = self.settings.unshard_async_op
        self.unshard(async_op=prefetch or on_current, on_comm_streams=not on_current)

    def set_keep_unsharded_storage(self, keep: bool) -> None:
        for p in self.fsdp_params:
            p.keep_unsharded_storage = keep

    def set_comm_ctx(self, comm_ctx: CommContext) -> None:
        """Use ``comm_ctx`` (the root's, or one ``share_comm_ctx`` shares), reduction included."""
        self.comm_ctx = comm_ctx
        self.reduction.set_comm_ctx(comm_ctx)
        comm_ctx.init_streams(self.device)

    def set_fqns(self, module_fqns: dict[nn.Module, str]) -> None:
        """Name the group and its parameters by their FQNs under the root (lazy init)."""
        self.module_fqn = ", ".join(module_fqns.get(m, "?") for m in self.modules)
        for p in self.fsdp_params:
            module, name = p.module_infos[0]
            prefix = module_fqns.get(module, "")
            p.fqn = f"{prefix}.{name}" if prefix else name

    # ---- buffers ------------------------------------------------------------

    @property
    def layout(self) -> FlatShardLayout:
        """Where each parameter's shard sits in the group's flat buffer."""
        return self._flat.layout

    def _init_dtypes(self) -> None:
        """Resolve the dtypes and the all-gather input; again whenever parameters are replaced."""
        self.dtypes, self._gather = plan_gather(
            self.fsdp_params, self.layout, self.order, self.mp_policy, self.device, self.offload,
            self.post_forward_mesh_info is not None,
        )

    def _slot(self, index: int) -> torch.Tensor:
        return self._flat.slot(index)

    @property
    def sharded_flat(self) -> torch.Tensor:
        return self._flat.buffer

    # ---- materialization (see [Note: Materialization in any order]) ----------

    def mark_params_replaced(self) -> None:
        """The registered parameters may have been replaced: adopt them when next needed."""
        self._flat.needs_adoption = True

    @outside_functorch
    def adopt_params(self, force: bool = False) -> None:
        """Adopt replaced parameters (if marked, or ``force``); a group partly on meta stays pending."""
        if (force or self._flat.needs_adoption) and self._flat.adopt():
            self._init_dtypes()

    def layout_changed(self) -> None:
        """The flat buffer was laid out again (``to_empty`` in an arena): resolve the dtypes."""
        self._init_dtypes()

    @property
    def flat_shard(self) -> FlatShard:
        """The group's flat buffer and the parameters viewing it."""
        return self._flat

    def check_dtypes(self) -> None:
        """Fail clearly unless the trainable parameters share one dtype.

        At lazy init, as upstream: the dtypes may still change between
        ``fully_shard`` and the first forward (e.g. ``model.float()``).
        """
        check_trainable_dtypes((p.fqn, p.sharded_param) for p in self.fsdp_params)

    def check_materialized(self) -> None:
        """Fail clearly, naming them, if any parameter is still on ``meta``."""
        check_materialized(self._flat.names_on_meta(), self.module_fqn)

    def check_offloaded(self) -> None:
        """With CPU offload, fail clearly if any sharded parameter is not on the CPU."""
        if self.offload:
            check_on_host(self.fsdp_params, self.device)

    def wait_for_replica_gather(self, on_comm_streams: bool = False) -> None:
        """Finish the post-step all-gather across replicas, if any (see [Note: Replica slices]).

        ``on_comm_streams``: an unshard's, on the copy-in stream that reads the buffer next.
        """
        slices = self._flat.replica_slices
        if slices is None or not slices.gathering:
            return
        ctx = self.comm_ctx
        with ctx.use(ctx.copy_in if ctx.active and on_comm_streams else None):
            slices.wait(ctx)

    # ---- unshard / reshard --------------------------------------------------

    @property
    def holds_gathered(self) -> bool:
        """Unsharded, or an all-gather in flight, or some parameter not back on its shard."""
        step = self.step
        return (
            step.is_unsharded
            or step.pending_unshard is not None
            or step.pending_staged is not None
            or any(p.state != ShardedState.SHARDED for p in self.fsdp_params)
        )

    @outside_functorch
    def unshard(self, async_op: bool = False, on_comm_streams: bool = False) -> None:
        """All-gather the group's parameters; no-op if unsharded or in flight.

        ``on_comm_streams``: the hooks' all-gathers, which run on FSDP's
        streams where there are any (see [Note: Streams] in comm_context.py); the
        user's ``unshard`` runs on the current stream, as upstream.
        """
        step = self.step
        if step.is_unsharded or step.pending_unshard is not None or step.pending_staged:
            return
        self.wait_for_replica_gather(on_comm_streams)
        if self._flat.needs_adoption:
            self.adopt_params()
            self.check_materialized()
        world_size = self.mesh_info.shard_mesh_size
        layout, gather = self.layout, self._gather
        if (
            gather.extensions
            or (effective(self.settings.all_gather_comm) is not None and not self.alone)
            or ((layout.mixed or gather.partly_cast) and gather.copy_in and step.post_forward_flat is None)
        ):  # mixed dtypes cast per parameter: see [Note: Mixed-dtype groups]
            self._unshard_staged(async_op, on_comm_streams)
            return
        if self.alone and not gather.copy_in:
            # the shards are the parameters: nothing to gather
            for p in self.fsdp_params:
                p.alias_shard()
                p.to_unsharded()
            step.is_unsharded = True
            return
        if layout.mixed:  # gathered as bytes, in slot order
            dtype, shard_numel = torch.uint8, layout.gathered_nbytes(self.fsdp_params)
        else:
            dtype, shard_numel = self.dtypes.param or layout.dtype, layout.numel
        ctx = self.comm_ctx
        streams = ctx.active and on_comm_streams
        if streams:  # the stream's own wait orders the collective: see [Note: Streams]
            ctx.release_all_gather()
            async_op = False
            # the kept post-forward shard was written ('cat') on the compute stream
            ctx.wait_all_gather_streams("post_forward_shard->all_gather", step.post_forward_event)
        step.post_forward_event = None
        order, numel = self.order, world_size * shard_numel
        with record_function("FSDP::all_gather", self.module_fqn, pg=self.range_pg):
            if order.output_on_compute:  # compute frees it
                output = order.all_gather_output(numel, dtype, self.device)
                if streams and order.output_kept:  # its gather waits for the compute queued
                    ctx.wait_stream("compute->kept_output", ctx.copy_in, ctx.current())
            with ctx.use(ctx.copy_in if streams else None):
                if not order.output_on_compute:
                    output = order.all_gather_output(numel, dtype, self.device)
                if step.post_forward_flat is not None:
                    # kept (and freed) until wait_for_unshard: the collective reads it
                    ag_input = step.post_forward_flat
                    group = self.post_forward_mesh_info.process_group
                else:
                    ag_input, group = self._flat.buffer, self.mesh_info.shard_process_group
                    if gather.copy_in:  # See [Note: Copies around the collectives]
                        ag_input = collectives.copy_in(
                            output, ag_input, self.mesh_info.shard_mesh_rank, self._flat.pin_memory
                        )
            if streams:
                ctx.wait_stream(None, ctx.all_gather, ctx.copy_in)
            with ctx.use(ctx.all_gather if streams else None):
                work = collectives.all_gather(output, ag_input, group, async_op)
            step.unshard_event = ctx.record(ctx.all_gather) if streams else None
        step.pending_unshard = PendingAllGather(work, output, ag_input)
        if not async_op and not streams:
            self.wait_for_unshard()

    def _unshard_staged(self, async_op: bool, on_comm_streams: bool = False) -> None:
        """All-gather through a copy-in (see [Note: Staged all-gather])."""
        gather = self._gather
        staged_gather.check_one_dtype(
            self.order, self.layout.mixed or gather.partly_cast, self.module_fqn
        )
        ctx = self.comm_ctx
        if ctx.active and on_comm_streams:  # copy-in and collective on the copy-in stream
            ctx.release_all_gather()
            with ctx.use(ctx.copy_in):
                self._unshard_staged(True, on_comm_streams=False)
                self.step.unshard_event = ctx.record(ctx.copy_in)
            return
        slots = [self._slot(i) for i in range(len(self.fsdp_params))]
        self.step.pending_staged = staged_gather.start(
            self.fsdp_params, slots, self.order, self.dtypes.param or self.layout.dtype,
            self.device, self.mesh_info, effective(self.settings.all_gather_comm),
            pin_memory=self._flat.pin_memory, offload=self.offload, async_op=async_op,
            alone=self.alone,
        )
        if not async_op:
            self.wait_for_unshard()

    def _wait_for_staged(self) -> None:
        staged, self.step.pending_staged = self.step.pending_staged, None
        staged_gather.wait(staged)
        event, self.step.unshard_event = self.step.unshard_event, None
        ctx = self.comm_ctx
        ctx.wait_event("all_gather->copy_out", ctx.current() if event else None, event)
        staged_gather.finish(
            staged, self.fsdp_params, self.order, self.dtypes.param or self.layout.dtype,
            self.device, self.mesh_info.shard_mesh_size,
        )
        if event is not None:  # held until the next all-gather, after this copy-out
            ctx.hold_all_gather(staged)
        self.step.is_unsharded = True

    @outside_functorch
    def wait_for_unshard(self) -> None:
        """Finish an in-flight all-gather and register the unsharded parameters."""
        step = self.step
        if step.pending_staged is not None:
            self._wait_for_staged()
            return
        if step.pending_unshard is None:
            return
        pending, step.pending_unshard = step.pending_unshard, None
        if pending.work is not None:
            pending.work.wait()
        ctx = self.comm_ctx
        event, step.unshard_event = step.unshard_event, None
        if event is not None:  # issued on FSDP's streams
            ctx.wait_event("all_gather->copy_out", ctx.current(), event)
        step.post_forward_flat = None
        if not self.order.param_major:  # else the output is the parameters already
            with record_function("FSDP::all_gather_copy_out", self.module_fqn, pg=self.range_pg):
                self.order.copy_out(pending.output, self.layout.in_order(self.fsdp_params))
        for p in self.fsdp_params:
            p.finish_copy_out()
            p.to_unsharded()
        if event is not None:  # dropped by the next all-gather, after this copy-out
            ctx.hold_all_gather(pending)
        step.is_unsharded = True

    @outside_functorch
    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded storage."""
        step = self.step
        step.post_forward_flat = step.post_forward_event = None
        if step.pending_staged is not None:
            staged, step.pending_staged = step.pending_staged, None
            staged_gather.wait(staged)
        event, step.unshard_event = step.unshard_event, None
        if event is not None:  # a prefetch never consumed: let it land before dropping it
            ctx = self.comm_ctx
            ctx.wait_event(None, ctx.current(), event)
            ctx.wait_event(None, ctx.copy_in, event)
        if step.pending_unshard is not None:
            pending, step.pending_unshard = step.pending_unshard, None
            if pending.work is not None:
                pending.work.wait()
            for p in self.fsdp_params:
                p.free_unsharded()
        if not step.is_unsharded:
            return
        for p in self.fsdp_params:
            p.to_sharded()
        step.is_unsharded = False

    @outside_functorch
    def reshard_to_post_forward(self) -> None:
        """Free the unsharded parameters but keep this rank's share over the smaller group.

        See [Note: Resharding to a smaller group after forward].
        """
        self.wait_for_unshard()
        if not self.step.is_unsharded:
            return
        info = self.post_forward_mesh_info
        num_blocks = self.mesh_info.shard_mesh_size // info.size
        start = info.rank * num_blocks
        params = self.layout.in_order(self.fsdp_params)
        kept = self.order.post_forward_shard(params, start, num_blocks, self.layout.mixed)
        self.reshard()
        self.step.post_forward_flat = kept
        self.step.post_forward_event = self.comm_ctx.record()
        for p in self.fsdp_params:
            p.state = ShardedState.SHARDED_POST_FORWARD

    # ---- hooks ----------------------------------------------------------------

    def pre_forward(self) -> None:
        log_hook("FSDP::pre_forward", self.module_fqn, self.range_pg)
        self.step.training_state = TrainingState.FORWARD
        with record_function("FSDP::pre_forward", self.module_fqn, pg=self.range_pg):
            self._unshard_for_use()
            self.wait_for_unshard()

    def post_forward(self) -> None:
        log_hook("FSDP::post_forward", self.module_fqn, self.range_pg)
        with record_function("FSDP::post_forward", self.module_fqn, pg=self.range_pg):
            self._post_forward()

    def _post_forward(self) -> None:
        grad_enabled = torch.is_grad_enabled()
        reshard = self.settings.reshard_after_forward
        # Without autograd no backward will need the parameters: always free.
        if grad_enabled and reshard and self.post_forward_mesh_info:
            self.reshard_to_post_forward()
        elif reshard or not grad_enabled:
            self.reshard()
        if grad_enabled:
            order = self.comm_ctx.post_forward_order
            self.step.post_forward_indices.append(len(order))
            order.append(self)
        self.step.training_state = TrainingState.IDLE

    def pre_backward(self, default_prefetch: bool = True) -> bool:
        """Unshard for this use's backward; returns False if this use already started it."""
        if self.step.training_state == TrainingState.PRE_BACKWARD:
            return False  # another output of the same use already triggered it
        log_hook("FSDP::pre_backward", self.module_fqn, self.range_pg)
        self.step.training_state = TrainingState.PRE_BACKWARD
        if self.settings.unshard_in_backward:
            with record_function("FSDP::pre_backward", self.module_fqn, pg=self.range_pg):
                self._unshard_for_use()
                self.wait_for_unshard()
        self.reduction.set_grad_dtypes(defer=True)
        if default_prefetch:  # See [Note: Default backward prefetch] in backward_prefetch.py
            prefetch_previous(self)
        return True

    def place(self, index: int, count: int) -> None:
        """This group is ``index`` of its state's ``count``; with several, upstream's profiler
        ranges name each group's shard size (``FSDP::pre_forward (layers.0) [pg=2]``)."""
        self.index, self.count = index, count
        self.range_pg = self.mesh_info.shard_mesh_size if count > 1 else None

    def prefetch(self, in_backward: bool) -> None:
        """Start this group's all-gather early; its pre-forward/pre-backward waits for it."""
        if in_backward and not self.settings.unshard_in_backward:
            return
        name = "FSDP::backward_prefetch" if in_backward else "FSDP::forward_prefetch"
        with record_function(name, self.module_fqn):
            self._unshard_for_use(prefetch=True)

    def post_backward(self, use: set[nn.Module] | None = None, keep_prefetch: bool = False) -> None:
        """Reshard and reduce-scatter the gradients of this use of the group.

        ``use``: the modules run in the use whose backward this is (groups of
        several modules; ``None``: every use not reduced yet). ``keep_prefetch``:
        an all-gather prefetched for a use that did not come stays in flight.
        """
        log_hook("FSDP::post_backward", self.module_fqn, self.range_pg)
        ran = self.step.take_use(use, several=len(self.modules) > 1)
        self.step.training_state = TrainingState.POST_BACKWARD
        reduce_grads = self.reduction.settings.reduce_grads
        fqn = self.module_fqn
        # Held gradients wait for a reducing post-backward (see end_backward); see
        # [Note: Gradient accumulation without sync] in reduction.py.
        self.step.post_backward_pending = not reduce_grads
        # Upstream's ranges: an accumulate range and a reshard range where the installed
        # torch's upstream has both, else one reshard range around the whole.
        split = ACCUMULATE_PROFILER_RANGE
        with record_function("FSDP::post_backward_reshard", fqn, when=not split, pg=self.range_pg):
            with record_function("FSDP::post_backward_accumulate", fqn, when=split, pg=self.range_pg):
                if not reduce_grads:
                    self.reduction.hold_unsharded_grads()
                else:  # only these lists hold the gradients: the reduce-scatter frees each
                    with_grad, grads, filled = self.reduction.take_grads(ran)
            step = self.step
            prefetched = not step.is_unsharded and (
                step.pending_unshard is not None or step.pending_staged is not None
            )
            if self.settings.reshard_after_backward and not (keep_prefetch and prefetched):
                with record_function("FSDP::post_backward_reshard", fqn, when=split, pg=self.range_pg):
                    self.reshard()
        if not reduce_grads:
            return
        # Bounds the gradients held by reductions in flight; in a state of several groups
        # only the first to reduce (the last index) waits, as upstream
        if self.index == self.count - 1:
            self.comm_ctx.make_room_for_reduction(fqn)
        if self.layout.mixed:  # requires_grad may have changed since lazy init
            check_grad_dtypes([(p.fqn, p.dtype) for p in with_grad], self.dtypes.orig)
        if grads:
            with record_function("FSDP::post_backward_reduce", self.module_fqn, pg=self.range_pg):
                self.reduction.reduce_scatter(
                    with_grad, grads, filled, self.sharded_flat.device, self.module_fqn
                )

    def end_backward(self, defer_reduction: bool = False) -> None:
        """Autograd finished a backward: run the post-backward it did not reach.

        Groups whose post-backward did not run (inputs that needed no grad,
        outputs unused by the loss, modules not run) run it now, or, with
        ``defer_reduction`` (manual backward finalization) and gradient sync
        on, are only marked ``post_backward_pending`` for ``finalize_backward``.
        """
        if self.step.training_state != TrainingState.POST_BACKWARD:
            if defer_reduction and self.reduction.settings.reduce_grads:
                self.step.post_backward_pending = True
            else:
                # A backward prefetch no use of this backward took (the previous group in
                # forward order, not run here) stays in flight for the next backward, as
                # upstream's; the end of the step drops it (end_step)
                self.post_backward(keep_prefetch=True)
        self.reduction.wait_for_grad_offload()
        self.step.training_state = TrainingState.IDLE

    def finalize_backward(self) -> None:
        """``finalize_backward``: reduce held gradients now (pending), else reshard if asked."""
        if self.step.post_backward_pending:
            self.post_backward()
        elif self.settings.reshard_after_backward:
            self.reshard()
        self.step.training_state = TrainingState.IDLE

    def end_step(self) -> None:
        """After the last backward of a step: wait for offloads, clear the backward bookkeeping.

        All-gathers prefetched for a use that never came are dropped.
        """
        self.reduction.wait_for_grad_offload()
        self._flat.release_gradients()  # see [Note: Arenas] in arena.py
        self.step.training_state = TrainingState.IDLE
        self.step.post_forward_indices.clear()
        if self.settings.reshard_after_backward or not self.step.is_unsharded:
            self.reshard()  # also waits for and drops an unused prefetch

    def reset_iter_state(self) -> None:
        """Drop every per-iteration trace after a failed forward or backward."""
        self.reshard()
        self.reduction.wait_for_grad_offload()
        for p in self.fsdp_params:
            p.take_unsharded_grad()
        self.reduction.set_grad_dtypes(defer=False)
        step = self.step
        step.training_state = TrainingState.IDLE
        step.post_backward_pending = False
        step.post_forward_indices.clear()
        step.use = None
        step.uses_without_node.clear()

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.module_fqn or '<root>'}, {len(self.fsdp_params)} params)"
