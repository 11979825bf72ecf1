"""FSDPParamGroup: unshard, reshard and reduce the parameters of one fully_shard call.

A group owns one flat buffer holding every parameter's padded shard (see
[Note: Sharded parameter storage] in param.py); that buffer is the all-gather
input. Each use of the group costs one all-gather and, in backward, one
reduce-scatter (see [Note: Copies around the collectives]).

[Note: Gradient accumulation without sync]
With ``reduce_grads`` off (``set_requires_gradient_sync(False)``) the
post-backward skips the reduce-scatter and leaves each gradient on its
unsharded parameter's ``.grad``: the unsharded parameter object is reused
across unshards, so the next backward's autograd adds into the same tensor.
The first post-backward with ``reduce_grads`` on reduces the accumulated sum
in one reduce-scatter. Gradients accumulate in the parameter dtype; with a
reduce dtype, ``_hold_unsharded_grads`` is the one place that would cast them
(once, so later micro-batches accumulate in the reduce dtype).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives
from ._torch_compat import local_tensor
from .mesh import FSDPMeshInfo
from .param import FSDPParam
from .reduce_op import ReducePlan, backend_supports_premul_sum, plan_gradient_reduction

logger = logging.getLogger("fsdp2.param_group")


class TrainingState(Enum):
    IDLE = auto()  # between uses
    FORWARD = auto()  # inside the forward of one of the group's modules
    PRE_BACKWARD = auto()  # unsharded for backward, gradients being computed
    POST_BACKWARD = auto()  # gradients reduced (for this use)


class IterContext:
    """Per-root state shared by all groups under it for one iteration."""

    def __init__(self) -> None:
        self.post_forward_order: list[FSDPParamGroup] = []


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call, gathered and reduced together."""

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        sources: list[nn.Parameter],
        modules: tuple[nn.Module, ...],
        mesh_info: FSDPMeshInfo,
        device: torch.device,
        reshard_after_forward: bool,
    ) -> None:
        self.fsdp_params = fsdp_params
        self.modules = modules
        self.mesh_info = mesh_info
        self.device = device
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        # Control surface (FSDPModule.set_*); see module.py.
        self.reduce_grads = True
        self.unshard_in_backward = True
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: torch.Stream | None = None
        self._gradient_divide_factor: float | None = None
        self._force_sum_reduction = False
        self._reduce_plan: ReducePlan | None = None
        self.training_state = TrainingState.IDLE
        self.module_fqn = ""
        self.ctx = IterContext()
        self._post_forward_indices: list[int] = []
        self._pending_unshard: tuple[dist.Work | None, torch.Tensor] | None = None
        self._is_unsharded = False
        self._offsets = []
        offset = 0
        for p in fsdp_params:
            self._offsets.append(offset)
            offset += p.padded_shard_numel
        self._total_shard_numel = offset
        on_meta = any(src.is_meta for src in sources)
        buffer_device = torch.device("meta") if on_meta else device
        self._sharded_flat = torch.zeros(offset, dtype=sources[0].dtype, device=buffer_device)
        for i, (p, src) in enumerate(zip(fsdp_params, sources)):
            p.bind_sharded(self._slot(i), src if on_meta else src.to(buffer_device))

    # ---- buffers ------------------------------------------------------------

    def _slot(self, index: int) -> torch.Tensor:
        start = self._offsets[index]
        return self._sharded_flat[start : start + self.fsdp_params[index].padded_shard_numel]

    def reset_sharded_params(self) -> None:
        """Re-establish the sharded parameters as views of the flat buffer.

        ``nn.Module._apply`` (``to_empty``, ``.to(dtype)``) and
        ``load_state_dict(assign=True)`` give parameters new local tensors;
        their values are copied back into a (possibly new) flat buffer.
        """
        for p in self.fsdp_params:
            p.adopt_registered()
        first = local_tensor(self.fsdp_params[0].sharded_param)
        if self._sharded_flat.device != first.device or self._sharded_flat.dtype != first.dtype:
            self._sharded_flat = torch.zeros(
                self._total_shard_numel, dtype=first.dtype, device=first.device
            )
        for i, p in enumerate(self.fsdp_params):
            p.rebind_sharded(self._slot(i))

    @property
    def sharded_flat(self) -> torch.Tensor:
        return self._sharded_flat

    def check_materialized(self) -> None:
        """Fail clearly if any parameter is still on ``meta``."""
        for p in self.fsdp_params:
            if p.sharded_param.is_meta:
                raise RuntimeError(
                    f"Parameter '{p.fqn}' is still on the meta device. Materialize the "
                    "model before the first forward: model.to_empty(device=...) and then "
                    "initialize it (e.g. reset_parameters() or load_state_dict())."
                )

    # ---- unshard / reshard --------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self._is_unsharded

    def unshard(self, async_op: bool = False) -> None:
        """All-gather the group's parameters; no-op if unsharded or in flight."""
        if self._is_unsharded or self._pending_unshard is not None:
            return
        world_size = self.mesh_info.shard_mesh_size
        output = collectives.all_gather_output(self.fsdp_params, world_size)
        work = collectives.all_gather(
            output, self._sharded_flat, self.mesh_info.shard_process_group, async_op
        )
        self._pending_unshard = (work, output)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish an in-flight all-gather and register the unsharded parameters."""
        if self._pending_unshard is None:
            return
        work, output = self._pending_unshard
        self._pending_unshard = None
        if work is not None:
            work.wait()
        collectives.copy_out(output, self.fsdp_params, self.mesh_info.shard_mesh_size)
        for p in self.fsdp_params:
            p.to_unsharded()
        self._is_unsharded = True

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded storage."""
        if self._pending_unshard is not None:
            work, _ = self._pending_unshard
            self._pending_unshard = None
            if work is not None:
                work.wait()
            for p in self.fsdp_params:
                p.free_unsharded()
        if not self._is_unsharded:
            return
        for p in self.fsdp_params:
            p.to_sharded()
        self._is_unsharded = False

    # ---- reduction settings ---------------------------------------------------

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        self._gradient_divide_factor = factor
        self._reduce_plan = None

    def set_force_sum_reduction(self, enable: bool) -> None:
        self._force_sum_reduction = enable
        self._reduce_plan = None

    def _plan_for(self, dtype: torch.dtype) -> ReducePlan:
        plan = self._reduce_plan
        if plan is None or plan.dtype != dtype:
            group = self.mesh_info.shard_process_group
            plan = plan_gradient_reduction(
                dtype,
                self.mesh_info.shard_mesh_size,
                self._gradient_divide_factor,
                self._force_sum_reduction,
                backend_supports_premul_sum(group, self.device),
            )
            self._reduce_plan = plan
        return plan

    # ---- hooks ----------------------------------------------------------------

    def pre_forward(self) -> None:
        logger.debug("pre_forward %s", self.module_fqn)
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()

    def post_forward(self) -> None:
        logger.debug("post_forward %s", self.module_fqn)
        grad_enabled = torch.is_grad_enabled()
        # Without autograd no backward will need the parameters: always free.
        if self.reshard_after_forward or not grad_enabled:
            self.reshard()
        if grad_enabled:
            order = self.ctx.post_forward_order
            self._post_forward_indices.append(len(order))
            order.append(self)
        self.training_state = TrainingState.IDLE

    def pre_backward(self, default_prefetch: bool = True) -> bool:
        """Unshard for this use's backward; returns False if this use already started it."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            return False  # another output of the same use already triggered it
        logger.debug("pre_backward %s", self.module_fqn)
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard()
            self.wait_for_unshard()
        if default_prefetch:
            self._prefetch_previous()
        return True

    def prefetch(self, in_backward: bool) -> None:
        """Start this group's all-gather early; its pre-forward/pre-backward waits for it."""
        if in_backward and not self.unshard_in_backward:
            return
        self.unshard(async_op=True)

    def _prefetch_previous(self) -> None:
        # Backward runs groups in reverse forward order: start the all-gather
        # of the group that ran just before this use so it overlaps compute.
        if not self._post_forward_indices:
            return
        index = self._post_forward_indices.pop()
        if index == 0:
            return
        target = self.ctx.post_forward_order[index - 1]
        if target is not self:
            target.prefetch(in_backward=True)

    def post_backward(self) -> None:
        """Reshard and reduce-scatter the gradients of this use of the group."""
        logger.debug("post_backward %s", self.module_fqn)
        self.training_state = TrainingState.POST_BACKWARD
        if not self.reduce_grads:
            self._hold_unsharded_grads()
            if self.reshard_after_backward:
                self.reshard()
            return
        with_grad: list[FSDPParam] = []
        grads: list[torch.Tensor] = []
        for p in self.fsdp_params:
            grad = p.take_unsharded_grad()
            if grad is not None:
                with_grad.append(p)
                grads.append(grad)
        if self.reshard_after_backward:
            self.reshard()
        if grads:
            self._reduce_scatter(with_grad, grads)

    def _hold_unsharded_grads(self) -> None:
        """Keep the unsharded gradients for the next backward to add to.

        See [Note: Gradient accumulation without sync]. They stay in the
        parameter dtype on the unsharded parameters' ``.grad``; a reduce dtype
        would be applied here.
        """

    def _reduce_scatter(self, fsdp_params: list[FSDPParam], grads: list[torch.Tensor]) -> None:
        world_size = self.mesh_info.shard_mesh_size
        plan = self._plan_for(grads[0].dtype)  # see [Note: Gradient divide factors]
        with torch.no_grad():
            rs_input = collectives.reduce_scatter_input(grads, fsdp_params, world_size)
            if plan.pre_factor is not None:
                rs_input.div_(plan.pre_factor)
            rs_output = rs_input.new_empty(rs_input.numel() // world_size)
            collectives.reduce_scatter(
                rs_output, rs_input, self.mesh_info.shard_process_group, plan.op
            )
            if self.all_reduce_hook is not None:
                self._call_all_reduce_hook(rs_output)
            if plan.post_factor is not None:
                rs_output.div_(plan.post_factor)
            for p, local in zip(
                fsdp_params, collectives.split_sharded_grads(rs_output, fsdp_params)
            ):
                p.accumulate_sharded_grad(local)

    def _call_all_reduce_hook(self, output: torch.Tensor) -> None:
        hook, stream = self.all_reduce_hook, self.all_reduce_hook_stream
        if stream is None or self.device.type == "cpu":
            hook(output)  # CPU has a single stream: nothing to order
            return
        device_module = torch.get_device_module(self.device)
        current = device_module.current_stream()
        stream.wait_stream(current)
        with device_module.stream(stream):
            hook(output)
        current.wait_stream(stream)

    def finish_iteration(self, is_last_backward: bool = True) -> None:
        """End-of-backward cleanup: reduce what is left, reset state.

        Groups whose post-backward did not run (inputs that needed no grad,
        outputs unused by the loss, modules not run) run it now. After the
        last backward of a step, all-gathers prefetched for a use that never
        came are dropped and the backward bookkeeping is cleared; with
        ``is_last_backward=False`` it is kept for the next backward.
        """
        if self.training_state != TrainingState.POST_BACKWARD:
            self.post_backward()
        self.training_state = TrainingState.IDLE
        if is_last_backward:
            self._post_forward_indices.clear()
            if self.reshard_after_backward or not self._is_unsharded:
                self.reshard()  # also waits for and drops an unused prefetch

    def reset_iter_state(self) -> None:
        """Drop every per-iteration trace after a failed forward or backward."""
        self.reshard()
        for p in self.fsdp_params:
            p.take_unsharded_grad()
        self.training_state = TrainingState.IDLE
        self._post_forward_indices.clear()

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.module_fqn or '<root>'}, {len(self.fsdp_params)} params)"

