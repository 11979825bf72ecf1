"""The gradient-reduction half of a parameter group: reduce-scatter, HSDP all-reduce, casts.

``FSDPParamGroup`` inherits this; it is kept apart so each file reads as one
concept. The state it uses (mesh info, dtypes, offload flags, the control
settings) is set up by the group; see [Note: CPU offload] and
[Note: Gradient accumulation without sync] in param_group.py and
[Note: Gradient divide factors] in reduce_op.py.

[Note: Gradients of parameters used on some ranks]
Conditional computation (a mixture of experts routing to expert ``b`` on rank
0 only, a multi-modal branch) leaves some trainable parameters of a group
without a gradient on some ranks. Reducing only the gradients present would
give the ranks reduce-scatters of different sizes (gloo aborts, NCCL hangs or
mixes buffers). By default we give DDP's result (``find_unused_parameters``):
the mean over all ranks, counting zeros where a parameter was unused, and
``grad is None`` where it was unused on *every* rank, so optimizers skip it.

A rank that has at least one gradient of the group (it always takes part in
the reduce-scatter, as before) fills zeros for every trainable, gathered
parameter it has no gradient for, so every rank reduces the same parameters.
Whether any rank had a gradient rides in the same reduce-scatter: each rank's
block of the input ends with one presence flag per reduced parameter (1 if
this rank had a gradient, 0 if it filled zeros), so the output ends with their
mean (their sum under a ``SUM`` reduction, divided by the same factors as the
gradients), which is zero exactly when no rank had one; with HSDP the
all-reduce over the replicate group carries them too. That costs ``n``
elements per rank block for ``n`` reduced parameters, no extra collective and
no extra copy (the flags are one more input of the ``chunk_cat`` copy-in; the
all-ones flags are cached). Only a rank that filled zeros reads its flags back
(one device-to-host read, in the uncommon case) and leaves the gradient of a
parameter whose flag is zero unset; a rank that had every gradient reads
nothing, since its own gradient already makes each flag nonzero. Groups that
reduce a single parameter carry no flag: every rank taking part has that
gradient. Frozen parameters are never reduced. During gradient accumulation
without sync the unsharded gradients (or the held ones) accumulate, so "had a
gradient" means "in any micro-batch since the last reduction"; with HSDP and
the all-reduce off, the shard-reduced flags are kept with the partial
gradients and join the next all-reduce.

What this cannot repair: a rank with *no* gradient for any parameter of the
group (its module did not run, or none of its outputs reached the loss) skips
the group's reduce-scatter, as upstream: a group must take part in backward
on every rank or on none. ``set_reduce_scatter_unused_params(True)`` is
upstream's behaviour: zeros for every trainable gathered parameter, on every
rank, so a group reduces even on a rank with no gradient at all, and a
parameter unused everywhere gets a zero gradient.
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

    def fill_unused_grads(
        self, fsdp_params: list[FSDPParam], grads: list[torch.Tensor | None]
    ) -> set[FSDPParam] | None:
        """Zeros for this rank's missing gradients; returns the parameters filled.

        ``None`` (nothing filled) when this rank has no gradient in the group:
        it takes no part in the reduction. See [Note: Gradients of parameters
        used on some ranks].
        """
        missing = [i for i, grad in enumerate(grads) if grad is None]
        if not missing:
            return set()
        if len(missing) == len(grads):
            return None
        filled = set()
        for i in missing:
            grads[i] = fsdp_params[i].zero_unsharded_grad()
            if grads[i] is not None:
                filled.add(fsdp_params[i])
        return filled

    def _presence_flags(
        self, fsdp_params: list[FSDPParam], filled: set[FSDPParam], dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """The ``(world size, n)`` flags input: 1 for this rank's own gradients, 0 for zeros."""
        world_size = self.mesh_info.shard_mesh_size
        if filled:
            values = [0.0 if p in filled else 1.0 for p in fsdp_params]
            return torch.tensor(values, dtype=dtype, device=device).expand(world_size, -1)
        key = (len(fsdp_params), world_size, dtype, device)
        cached = self._presence_ones
        if cached is None or cached[0] != key:
            ones = torch.ones(len(fsdp_params), dtype=dtype, device=device)
            cached = self._presence_ones = (key, ones.expand(world_size, -1))
        return cached[1]

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

    def _reduce_scatter(
        self,
        fsdp_params: list[FSDPParam],
        grads: list[torch.Tensor],
        filled: set[FSDPParam] | None = None,
    ) -> None:
        """Reduce ``grads`` onto ``fsdp_params``' sharded gradients.

        ``filled``: with presence flags (see [Note: Gradients of parameters
        used on some ranks]), the parameters whose gradient this rank filled
        with zeros; ``None``: no flags.
        """
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
        if any(g.dtype != reduce_dtype for g in grads) and self.reduce_dtype is not None:
            grads[:] = [g.to(reduce_dtype) for g in grads]  # held (accumulated) and fresh mixed
        plan = self._plan_for(reduce_dtype)  # see [Note: Gradient divide factors]
        # One rank: SUM and AVG are the identity, so the collective can be skipped.
        identity = world_size == 1 and plan.op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
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
            flags = None
            if filled is not None and len(fsdp_params) > 1:
                flags = self._presence_flags(fsdp_params, filled, reduce_dtype, grads[0].device)
            num_flags = 0 if flags is None else flags.size(1)
            comm = effective(self.reduce_scatter_comm) if not identity else None
            out = None
            if comm is not None:  # a custom comm allocates both buffers
                numel = world_size * (sum(p.padded_shard_numel for p in fsdp_params) + num_flags)
                out = comm.allocate((numel,), dtype=reduce_dtype, device=grads[0].device)
            rs_input = collectives.reduce_scatter_input(
                grads, fsdp_params, world_size, reduce_dtype, out=out, flags=flags
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
            # the hook, the cast and the split see the gradients only, as without flags
            grads_out = output if flags is None else output[: output.numel() - num_flags]
            if self.all_reduce_hook is not None and not hsdp:
                self._call_all_reduce_hook(grads_out)
            if plan.post_factor is not None:
                output.div_(plan.post_factor)
            if hsdp:
                if not self._all_reduce(output, fsdp_params, num_flags, filled):
                    return
                if self.all_reduce_hook is not None:  # HSDP: after the all-reduce
                    self._call_all_reduce_hook(grads_out)
            unused = ()
            if flags is not None and filled:
                unused = _unused_everywhere(output[-num_flags:], fsdp_params, filled)
            grads_out = self._to_sharded_grad_storage(grads_out, fsdp_params)
            locals_ = collectives.split_sharded_grads(grads_out, fsdp_params)
            for p, local in zip(fsdp_params, locals_):
                if p not in unused:
                    p.accumulate_sharded_grad(local)

    def _all_reduce(
        self,
        output: torch.Tensor,
        fsdp_params: list[FSDPParam],
        num_flags: int = 0,
        filled: set[FSDPParam] | None = None,
    ) -> bool:
        """HSDP: average over the replicate group; returns whether gradients are final.

        With ``all_reduce_grads`` off (gradient accumulation) the shard-reduced
        gradients (in the reduce dtype) are kept aside, not set on ``.grad``,
        and folded into the next all-reduce, as upstream does; so are the
        presence flags, and which parameters had a gradient on this rank
        (removed from ``filled`` at the all-reduce).
        """
        locals_ = collectives.split_sharded_grads(output, fsdp_params)
        flags = output[output.numel() - num_flags :] if num_flags else None
        if not self.all_reduce_grads:
            for p, local in zip(fsdp_params, locals_):
                partial = self._partial_grads.get(p)
                self._partial_grads[p] = local if partial is None else partial.add_(local)
            if flags is not None:  # See [Note: Gradients of parameters used on some ranks]
                for p, flag in zip(fsdp_params, flags):
                    partial = self._partial_flags.get(p)
                    self._partial_flags[p] = flag if partial is None else partial.add_(flag)
                self._had_grad_since_all_reduce.update(p for p in fsdp_params if p not in filled)
            return False
        for p, local in zip(fsdp_params, locals_):
            partial = self._partial_grads.pop(p, None)
            if partial is not None:
                local.add_(partial)
        if flags is not None:
            for p, flag in zip(fsdp_params, flags):
                partial = self._partial_flags.pop(p, None)
                if partial is not None:
                    flag.add_(partial)
            filled.difference_update(self._had_grad_since_all_reduce)
        self._partial_flags.clear()
        self._had_grad_since_all_reduce.clear()
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


def _unused_everywhere(
    flags: torch.Tensor, fsdp_params: list[FSDPParam], filled: set[FSDPParam]
) -> set[FSDPParam]:
    """Of the parameters this rank filled zeros for, those no rank had a gradient for.

    Reads the reduced flags back (a device-to-host copy), only on a rank that
    filled zeros; see [Note: Gradients of parameters used on some ranks].
    """
    values = flags.tolist()
    return {p for i, p in enumerate(fsdp_params) if p in filled and values[i] == 0}
