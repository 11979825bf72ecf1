"""FSDPParamGroup: unshard, reshard and reduce the parameters of one fully_shard call.

A group owns one flat buffer holding every parameter's padded shard (see
[Note: Sharded parameter storage] in param.py); that buffer is the all-gather
input. Each use of the group costs one all-gather and, in backward, one
reduce-scatter (see [Note: Copies around the collectives]), plus one
all-reduce over the replicate group for HSDP.

[Note: Resharding to a smaller group after forward]
With ``reshard_after_forward=k`` the post-forward reshard keeps, instead of
nothing, this rank's share of the gathered parameters over its post-forward
group of ``k`` ranks (see [Note: Meshes] in mesh.py): the ``W / k``
consecutive rank blocks ``[j * W/k, (j+1) * W/k)`` for post-forward rank
``j``, laid out ``(W/k, group shard numel)``. Gathering those blocks over the
``k`` ranks yields exactly the ``(W, group shard numel)`` rank-major buffer a
full all-gather would, so copy-out is unchanged.
"""

from __future__ import annotations

import logging
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives, staged_collectives
from ._torch_compat import local_tensor
from .mesh import FSDPMeshInfo, PostForwardMeshInfo
from .param import FSDPParam, ShardedState

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
        post_forward_mesh_info: PostForwardMeshInfo | None = None,
    ) -> None:
        self.fsdp_params = fsdp_params
        self.modules = modules
        self.mesh_info = mesh_info
        self.device = device
        self.reshard_after_forward = reshard_after_forward
        # Set only for reshard_after_forward=int: see [Note: Resharding to a smaller group ...]
        self.post_forward_mesh_info = post_forward_mesh_info
        self._post_forward_flat: torch.Tensor | None = None
        self.reshard_after_backward = True
        # HSDP: all-reduce gradients over the replicate group (off while accumulating)
        self.all_reduce_grads = True
        self._partial_grads: dict[FSDPParam, torch.Tensor] = {}
        self.training_state = TrainingState.IDLE
        self.module_fqn = ""
        self.ctx = IterContext()
        self._post_forward_indices: list[int] = []
        self._pending_unshard: tuple[dist.Work | None, torch.Tensor] | None = None
        self._pending_staged: staged_collectives.StagedAllGather | None = None
        self._is_unsharded = False
        # Set by FSDPModule.set_custom_all_gather / set_custom_reduce_scatter.
        self.all_gather_comm: staged_collectives.AllGather | None = None
        self.reduce_scatter_comm: staged_collectives.ReduceScatter | None = None
        self._has_extensions = any(p.extension is not None for p in fsdp_params)
        if self._has_extensions and post_forward_mesh_info is not None:
            raise NotImplementedError(
                "reshard_after_forward=<int> is not supported with all-gather extensions "
                f"({', '.join(p.fqn for p in fsdp_params if p.extension is not None)}); "
                "pass True or False"
            )
        self._offsets = []
        offset = 0
        for p in fsdp_params:
            self._offsets.append(offset)
            offset += p.flat_numel
        self._total_shard_numel = offset
        on_meta = any(src.is_meta for src in sources)
        buffer_device = torch.device("meta") if on_meta else device
        self._sharded_flat = torch.zeros(offset, dtype=sources[0].dtype, device=buffer_device)
        for i, (p, src) in enumerate(zip(fsdp_params, sources)):
            p.bind_sharded(self._slot(i), src if on_meta else src.to(buffer_device))

    # ---- buffers ------------------------------------------------------------

    def _slot(self, index: int) -> torch.Tensor:
        start = self._offsets[index]
        return self._sharded_flat[start : start + self.fsdp_params[index].flat_numel]

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
        if self._is_unsharded or self._pending_unshard is not None or self._pending_staged:
            return
        world_size = self.mesh_info.shard_mesh_size
        if self._has_extensions or (self.all_gather_comm is not None and world_size > 1):
            self._unshard_staged(async_op)
            return
        if world_size == 1:  # the shards are the parameters: nothing to gather
            for p in self.fsdp_params:
                p.alias_shard()
                p.to_unsharded()
            self._is_unsharded = True
            return
        output = collectives.all_gather_output(self.fsdp_params, self._sharded_flat, world_size)
        if self._post_forward_flat is not None:
            # kept (and freed) until wait_for_unshard: the collective reads it
            input, group = self._post_forward_flat, self.post_forward_mesh_info.process_group
        else:
            input, group = self._sharded_flat, self.mesh_info.shard_process_group
        work = collectives.all_gather(output, input, group, async_op)
        self._pending_unshard = (work, output)
        if not async_op:
            self.wait_for_unshard()

    def _unshard_staged(self, async_op: bool) -> None:
        """All-gather through a copy-in (see [Note: Staged all-gather])."""
        inputs = []
        for i, p in enumerate(self.fsdp_params):
            if p.extension is None:
                inputs.append([self._slot(i)])
                continue
            local = local_tensor(p.sharded_param)
            inputs.append(
                p.extension.pre_all_gather(
                    local, p.orig_size, p.orig_stride,
                    torch.Size([p.shard_rows, *p.orig_size[1:]]), p.fqn,
                )
            )
        self._pending_staged = staged_collectives.all_gather(
            self.fsdp_params,
            inputs,
            self.mesh_info.shard_process_group,
            self.mesh_info.shard_mesh_rank,
            self.mesh_info.shard_mesh_size,
            self.all_gather_comm,
            async_op,
        )
        if not async_op:
            self.wait_for_unshard()

    def _wait_for_staged(self) -> None:
        staged, self._pending_staged = self._pending_staged, None
        if staged.work is not None:
            staged.work.wait()
        staged_collectives.copy_out(staged, self.fsdp_params, self.mesh_info.shard_mesh_size)
        for p in self.fsdp_params:
            if p.extension is not None:
                p.unshard_extension(p.dtype)
            else:
                p.finish_copy_out()
            p.to_unsharded()
        self._is_unsharded = True

    def wait_for_unshard(self) -> None:
        """Finish an in-flight all-gather and register the unsharded parameters."""
        if self._pending_staged is not None:
            self._wait_for_staged()
            return
        if self._pending_unshard is None:
            return
        work, output = self._pending_unshard
        self._pending_unshard = None
        if work is not None:
            work.wait()
        self._post_forward_flat = None
        collectives.copy_out(output, self.fsdp_params, self.mesh_info.shard_mesh_size)
        for p in self.fsdp_params:
            p.finish_copy_out()
            p.to_unsharded()
        self._is_unsharded = True

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded storage."""
        self._post_forward_flat = None
        if self._pending_staged is not None:
            staged, self._pending_staged = self._pending_staged, None
            if staged.work is not None:
                staged.work.wait()
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

    def reshard_to_post_forward(self) -> None:
        """Free the unsharded parameters but keep this rank's share over the smaller group.

        See [Note: Resharding to a smaller group after forward].
        """
        self.wait_for_unshard()
        if not self._is_unsharded:
            return
        info = self.post_forward_mesh_info
        num_blocks = self.mesh_info.shard_mesh_size // info.size
        start = info.rank * num_blocks
        kept = torch.cat(
            [p.gathered_blocks(start, start + num_blocks) for p in self.fsdp_params], dim=1
        )
        self.reshard()
        self._post_forward_flat = kept.view(-1)
        for p in self.fsdp_params:
            p.state = ShardedState.SHARDED_POST_FORWARD

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
        if grad_enabled and self.reshard_after_forward and self.post_forward_mesh_info:
            self.reshard_to_post_forward()
        elif self.reshard_after_forward or not grad_enabled:
            self.reshard()
        if grad_enabled:
            order = self.ctx.post_forward_order
            self._post_forward_indices.append(len(order))
            order.append(self)
        self.training_state = TrainingState.IDLE

    def pre_backward(self) -> None:
        if self.training_state == TrainingState.PRE_BACKWARD:
            return  # another output of the same use already triggered it
        logger.debug("pre_backward %s", self.module_fqn)
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()
        self.wait_for_unshard()
        self._prefetch_previous()

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
            target.unshard(async_op=True)

    def post_backward(self) -> None:
        """Reshard and reduce-scatter the gradients of this use of the group."""
        logger.debug("post_backward %s", self.module_fqn)
        self.training_state = TrainingState.POST_BACKWARD
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

    def _reduce_scatter(self, fsdp_params: list[FSDPParam], grads: list[torch.Tensor]) -> None:
        world_size = self.mesh_info.shard_mesh_size
        hsdp = self.mesh_info.is_hsdp
        if world_size == 1 and not hsdp:  # the mean over one rank is the gradient itself
            for p, grad in zip(fsdp_params, grads):
                p.accumulate_sharded_grad(grad if grad.is_contiguous() else grad.contiguous())
            return
        with torch.no_grad():
            if world_size == 1:  # HSDP without sharding: only the all-reduce remains
                output = torch.cat([g.reshape(-1) for g in grads])
                grads.clear()
            elif self.reduce_scatter_comm is not None:
                output = staged_collectives.reduce_scatter(
                    self.reduce_scatter_comm, grads, fsdp_params, world_size,
                    self.mesh_info.shard_process_group, dist.ReduceOp.AVG,
                )
            else:
                rs_input = collectives.reduce_scatter_input(grads, fsdp_params, world_size)
                grads.clear()  # the unsharded gradients die here, before the collective
                output = rs_input.new_empty(rs_input.numel() // world_size)
                collectives.reduce_scatter(
                    output, rs_input, self.mesh_info.shard_process_group, dist.ReduceOp.AVG
                )
            locals_ = collectives.split_sharded_grads(output, fsdp_params)
            if hsdp and not self._all_reduce(output, fsdp_params, locals_):
                return
            for p, local in zip(fsdp_params, locals_):
                p.accumulate_sharded_grad(local)

    def _all_reduce(
        self, output: torch.Tensor, fsdp_params: list[FSDPParam], locals_: list[torch.Tensor]
    ) -> bool:
        """HSDP: average over the replicate group; returns whether gradients are final.

        With ``all_reduce_grads`` off (gradient accumulation) the shard-reduced
        gradients are kept aside, not set on ``.grad``, and folded into the
        next all-reduce, as upstream does.
        """
        if not self.all_reduce_grads:
            for p, local in zip(fsdp_params, locals_):
                partial = self._partial_grads.get(p)
                self._partial_grads[p] = local if partial is None else partial.add_(local)
            return False
        for p, local in zip(fsdp_params, locals_):
            partial = self._partial_grads.pop(p, None)
            if partial is not None:
                local.add_(partial)
        collectives.all_reduce(output, self.mesh_info.replicate_process_group, dist.ReduceOp.AVG)
        return True

    def finish_iteration(self) -> None:
        """End-of-backward cleanup: reduce what is left, reshard, reset state."""
        if (
            self.training_state != TrainingState.POST_BACKWARD
            or self._is_unsharded
            or self._pending_unshard is not None
            or self._pending_staged is not None
        ):
            self.post_backward()
            self.reshard()
        self.training_state = TrainingState.IDLE
        self._post_forward_indices.clear()

    def reset_iter_state(self) -> None:
        """Drop every per-iteration trace after a failed forward or backward."""
        self.reshard()
        for p in self.fsdp_params:
            p.take_unsharded_grad()
        self.training_state = TrainingState.IDLE
        self._post_forward_indices.clear()

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.module_fqn or '<root>'}, {len(self.fsdp_params)} params)"

