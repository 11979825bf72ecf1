"""The gradient-reduction half of a parameter group: reduce-scatter, HSDP all-reduce, casts.

``FSDPParamGroup`` inherits this; it is kept apart so each file reads as one
concept. The state it uses (mesh info, dtypes, offload flags, the control
settings) is set up by the group; see [Note: CPU offload] and
[Note: Gradient accumulation without sync] in param_group.py and
[Note: Gradient divide factors] in reduce_op.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives
from .comm_memory import effective
from .errors import FSDPAssertionError
from .param import FSDPParam
from .reduce_op import ReducePlan, backend_supports_premul_sum, plan_gradient_reduction


class GradientReduction:
    """Reduce a group's unsharded gradients onto its sharded parameters."""

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        self._gradient_divide_factor = factor
        self._reduce_plan = None

    def set_force_sum_reduction(self, enable: bool) -> None:
        self._force_sum_reduction = enable
        self._reduce_plan = None

    @property
    def reduce_scatter_group(self) -> dist.ProcessGroup:
        """The reduce-scatter's group: the shard group, or its own (see below)."""
        group = self.reduce_scatter_process_group
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
            self.reduce_scatter_process_group = None
            return
        ranks = tuple(dist.get_process_group_ranks(self.mesh_info.shard_process_group))
        if ranks not in new_groups:
            existing = self.reduce_scatter_process_group  # already separate: keep it
            new_groups[ranks] = existing if existing is not None else dist.new_group(
                list(ranks), use_local_synchronization=True
            )
        self.reduce_scatter_process_group = new_groups[ranks]

    def zero_unused_grads(
        self, fsdp_params: list[FSDPParam], grads: list[torch.Tensor | None]
    ) -> None:
        """``set_reduce_scatter_unused_params(True)``: zeros for trainable params with no grad.

        Every rank then reduce-scatters the same parameters, whichever ones its
        own backward reached (conditional computation: mixture of experts,
        multi-modal branches), as DDP's ``find_unused_parameters``. A parameter
        never all-gathered has nothing to reduce.
        """
        for i, (p, grad) in enumerate(zip(fsdp_params, grads)):
            if grad is None:
                grads[i] = p.zero_unsharded_grad()

    def _plan_for(self, dtype: torch.dtype) -> ReducePlan:
        plan = self._reduce_plan
        if plan is None or plan.dtype != dtype:
            group = self.reduce_scatter_group
            plan = plan_gradient_reduction(
                dtype,
                self.mesh_info.shard_mesh_size,
                self._gradient_divide_factor,
                self._force_sum_reduction,
                backend_supports_premul_sum(group, self.device),
            )
            self._reduce_plan = plan
        return plan

    def _reduce_scatter(self, fsdp_params: list[FSDPParam], grads: list[torch.Tensor]) -> None:
        world_size = self.mesh_info.shard_mesh_size
        hsdp = self.mesh_info.is_hsdp
        if not hsdp and self.all_reduce_hook is None and self.all_reduce_hook_stream is not None:
            raise FSDPAssertionError(
                "all reduce hook stream is specified but hook itself is missing.\n"
                f"{repr(self.module_fqn) if self.module_fqn else 'The root module'} has an "
                "all-reduce hook stream (set_all_reduce_hook(..., stream=...)) but its hook is "
                "None; set a hook again before backward"
            )
        reduce_dtype = self.reduce_dtype or grads[0].dtype
        if len({g.dtype for g in grads}) > 1:  # held (accumulated) and fresh ones mixed
            # one dtype for chunk_cat, which itself converts them to the reduce dtype
            grads[:] = [g.to(reduce_dtype) for g in grads]
        plan = self._plan_for(reduce_dtype)  # see [Note: Gradient divide factors]
        # One rank: SUM and AVG are the identity, so the collective can be skipped
        # (see [Note: Forcing collectives on one rank]).
        identity = self.alone and plan.op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
        with torch.no_grad():
            if (
                identity
                and not hsdp
                and not self.offload
                and self.all_reduce_hook is None
                and plan.pre_factor is None
                and plan.post_factor is None
                and all(g.dtype == self.orig_dtype for g in grads)
            ):  # the mean over one rank is the gradient itself
                for p, grad in zip(fsdp_params, grads):
                    p.accumulate_sharded_grad(grad if grad.is_contiguous() else grad.contiguous())
                return
            comm = effective(self.reduce_scatter_comm) if not identity else None
            out = None
            if comm is not None:  # a custom comm allocates both buffers
                numel = world_size * sum(p.padded_shard_numel for p in fsdp_params)
                out = comm.allocate((numel,), dtype=reduce_dtype, device=grads[0].device)
            rs_input = collectives.reduce_scatter_input(
                grads, fsdp_params, world_size, reduce_dtype, out=out
            )
            grads.clear()  # the copy-in is done: let the unsharded gradients go
            if plan.pre_factor is not None:
                rs_input.div_(plan.pre_factor)
            if identity:
                output = rs_input
            elif comm is not None:
                output = comm.allocate(
                    (rs_input.numel() // world_size,), dtype=reduce_dtype, device=rs_input.device
                )
                group = self.reduce_scatter_group
                comm(output_tensor=output, input_tensor=rs_input, group=group, op=plan.op)
            else:
                output = rs_input.new_empty(rs_input.numel() // world_size)
                collectives.reduce_scatter(output, rs_input, self.reduce_scatter_group, plan.op)
            if self.all_reduce_hook is not None and not hsdp:
                self._call_all_reduce_hook(output)
            if plan.post_factor is not None:
                output.div_(plan.post_factor)
            if hsdp:
                if not self._all_reduce(output, fsdp_params):
                    return
                if self.all_reduce_hook is not None:  # HSDP: after the all-reduce
                    self._call_all_reduce_hook(output)
            output = self._to_sharded_grad_storage(output, fsdp_params)
            for p, local in zip(fsdp_params, collectives.split_sharded_grads(output, fsdp_params)):
                p.accumulate_sharded_grad(local)

    def _all_reduce(self, output: torch.Tensor, fsdp_params: list[FSDPParam]) -> bool:
        """HSDP: average over the replicate group; returns whether gradients are final.

        With ``all_reduce_grads`` off (gradient accumulation) the shard-reduced
        gradients (in the reduce dtype) are kept aside, not set on ``.grad``,
        and folded into the next all-reduce, as upstream does.
        """
        locals_ = collectives.split_sharded_grads(output, fsdp_params)
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

    def _to_sharded_grad_storage(
        self, reduced: torch.Tensor, fsdp_params: list[FSDPParam]
    ) -> torch.Tensor:
        """The reduced flat gradient in the sharded parameters' dtype and device.

        One cast (mixed precision) and, with CPU offload, one device-to-host copy
        for the whole group; no-ops when nothing differs. See [Note: CPU offload].
        """
        device = self.sharded_flat.device if self.offload else reduced.device
        if reduced.dtype == self.orig_dtype and reduced.device == device:
            return reduced
        non_blocking = (
            self._pin_memory
            and reduced.device != device
            and all(p.sharded_param.grad is None for p in fsdp_params)
        )
        result = reduced.to(device=device, dtype=self.orig_dtype, non_blocking=non_blocking)
        if non_blocking:
            self._grad_offload_event = torch.Event(device=reduced.device)
            self._grad_offload_event.record()
        return result

    def wait_for_grad_offload(self) -> None:
        """Block until asynchronous device-to-host gradient copies have landed."""
        if self._grad_offload_event is not None:
            self._grad_offload_event.synchronize()
            self._grad_offload_event = None

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
