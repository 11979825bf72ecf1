"""``summon_full_params``: the full parameters of a sharded model, to read or edit, FSDP1-style.

[Note: Summoning full parameters]
FSDP1's ``FullyShardedDataParallel.summon_full_params`` registers every
wrapped parameter at its full shape for the duration of a ``with`` block; the
usual uses are inspecting weights, editing them in place (re-initializing a
layer, surgery on an embedding) or exporting them. Upstream ``fully_shard``
has no equivalent: ``unshard()`` gathers in ``param_dtype`` and registers
parameters that the next ``reshard()`` silently frees, and writing into them
changes nothing.

Here each summoned group is gathered with one all-gather of its flat shard
buffer (see [Note: Sharded parameter storage] in param.py), in the sharded
parameters' own dtype (the flat buffer is what the optimizer steps on, so
mixed precision's ``param_dtype`` never enters), over the shard dim only (on an
HSDP mesh every replica already holds the same shards). Each parameter's full
tensor is copied out of the gathered rank blocks into a fresh contiguous
``nn.Parameter`` registered on every module that holds it (tied weights
stay tied). The group itself stays sharded: its sharded parameters, their
gradients and the optimizer state are untouched while the block runs. On
exit, with ``writeback``, each rank copies its own rows of the (possibly
edited) full tensor back into its shard, in place; the sharded parameters are
registered again in every case, also when the block raised. With
``with_grads`` the sharded gradients are gathered the same way (one more
collective per group) and set as the full parameters' ``.grad``.

Nothing else of FSDP runs inside the block: a forward of a summoned FSDP module
raises, and summoning a group that is mid-step (inside forward or backward,
gathered between forward and backward, or kept gathered by
``reshard_after_backward=False`` / ``unshard()``) raises before anything is
gathered, on every rank alike (the groups' states are the same everywhere).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._torch_compat import in_backward, local_tensor
from ..errors import FSDPAssertionError, FSDPNotImplementedError
from ..runtime.comm import collectives
from ..runtime.group.param_group import FSDPParamGroup
from ..runtime.group.step_state import TrainingState
from ..runtime.hooks.state import state_of
from ..runtime.storage.param import FSDPParam

__all__ = ["summon_full_params"]

# Groups inside a summon_full_params block right now (nested blocks are refused).
_ACTIVE: weakref.WeakSet[FSDPParamGroup] = weakref.WeakSet()


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module, *, recurse: bool = True, writeback: bool = True,
    rank0_only: bool = False, offload_to_cpu: bool = False, with_grads: bool = False,
) -> Iterator[None]:  # FSDP1's keyword names and defaults, so calls port unchanged
    """Register the full parameters of ``module``'s FSDP groups for the duration of a ``with``.

    FSDP1's ``FullyShardedDataParallel.summon_full_params`` for ``fully_shard``
    models. Inside the block every parameter managed by an FSDP group of
    ``module`` (and, with ``recurse``, of the FSDP modules below it) is a plain
    full-shape ``nn.Parameter`` registered on its module, in the sharded
    parameter's original dtype (never the mixed precision ``param_dtype``).
    Parameters of modules without ``fully_shard`` are left as they are.

    Collective: call it on every rank of the groups' meshes. Each group costs
    one all-gather (two with ``with_grads``), never one per parameter.

    Every summoned group's full tensors are alive at once inside the block, as
    in FSDP1: summoning a whole large model needs its full size in memory on
    every rank (use ``rank0_only`` and ``offload_to_cpu`` to export it, or
    summon one block at a time with ``recurse=False``).

    Args:
        module: a module returned by ``fully_shard``, or any module holding
            some (with ``recurse``). With ``recurse=False`` and a module that is
            not an FSDP module, nothing is summoned (as FSDP1).
        recurse: also summon the FSDP modules below ``module``.
        writeback: on exit, in-place changes to the full parameters are
            written back to the shards (each rank writes its own rows); with
            ``False`` they are discarded.
        rank0_only: only global rank 0 gets the full parameters; the other
            ranks take part in the collectives and keep their sharded
            parameters registered. Cannot be combined with ``writeback=True``
            (``NotImplementedError``, as FSDP1).
        offload_to_cpu: the full parameters (and gradients) live on the CPU.
        with_grads: also gather the sharded gradients as the full
            parameters' ``.grad`` (``None`` where the sharded parameter has
            none). With ``writeback``, in-place changes to a gradient are
            written back where the sharded gradient exists.

    Raises:
        NotImplementedError: ``rank0_only`` with ``writeback``; tensor-parallel
            (DTensor) parameters or all-gather extensions in a summoned group.
        AssertionError: (``fsdp2.FSDPAssertionError``) called inside forward or
            backward, or inside another ``summon_full_params`` of the same group.
        RuntimeError: a group is gathered mid-step (between forward and
            backward, or kept unsharded): call it outside the training step or
            ``reshard()`` first. Also raised by a forward of a summoned FSDP
            module inside the block.
    """
    if writeback and rank0_only:
        raise NotImplementedError(
            "writeback=True and rank0_only=True is not supported yet\n"
            "summon_full_params: only rank 0 would hold the edited parameters; pass "
            "writeback=False with rank0_only=True (or rank0_only=False to edit them)"
        )
    groups = _groups_of(module, recurse)
    for group in groups:
        _check_can_summon(group)
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    summoned: list[_Summoned] = []
    hooks = []
    try:
        for group in groups:
            _ACTIVE.add(group)
            summoned.append(_summon_group(group, keep, offload_to_cpu, with_grads))
        for group in groups:
            for holder in group.modules:
                hooks.append(holder.register_forward_pre_hook(_refuse_forward, prepend=True))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        errors = []
        for entry in summoned:
            errors += entry.restore(writeback)
        for group in groups:
            _ACTIVE.discard(group)
        if errors:
            raise ValueError(
                "summon_full_params: could not write back "
                + "; ".join(errors)
                + "; edit the full parameters in place (same shape) inside the block"
            )


class _Summoned:
    """One group's full parameters while summoned, and how to put its shards back."""

    def __init__(self, group: FSDPParamGroup) -> None:
        self.group = group
        self.fulls: list[tuple[FSDPParam, nn.Parameter]] = []

    def restore(self, writeback: bool) -> list[str]:
        """Write back (optionally) and register the sharded parameters again; problems found."""
        problems = []
        with torch.no_grad():
            for p, full in self.fulls:
                module, name = p.module_infos[0]
                current = module._parameters.get(name, full)
                if writeback:
                    problem = _write_back(p, current)
                    if problem:
                        problems.append(problem)
                p.register(p.sharded_param)
        return problems


def _write_back(p: FSDPParam, current: torch.Tensor | None) -> str | None:
    if not isinstance(current, torch.Tensor) or tuple(current.shape) != tuple(p.orig_size):
        shape = tuple(current.shape) if isinstance(current, torch.Tensor) else None
        return f"'{p.fqn}' (replaced by {shape}, expected {tuple(p.orig_size)})"
    local = local_tensor(p.sharded_param)
    if local.numel():
        local.copy_(p.layout.local_rows_of(current.detach()))
    sharded_grad = p.sharded_param.grad
    if current.grad is not None and sharded_grad is not None:
        grad_local = local_tensor(sharded_grad)
        if grad_local.numel():
            grad_local.copy_(p.layout.local_rows_of(current.grad))
    return None


def _groups_of(module: nn.Module, recurse: bool) -> list[FSDPParamGroup]:
    if not recurse:
        state = state_of(module)
        return list(state.param_groups) if state is not None else []
    groups: dict[FSDPParamGroup, None] = {}
    for sub in module.modules():
        state = state_of(sub)
        if state is not None:
            for group in state.param_groups:
                groups.setdefault(group)
    return list(groups)


def _check_can_summon(group: FSDPParamGroup) -> None:
    where = f"'{group.module_fqn}'" if group.module_fqn else repr(type(group.modules[0]).__name__)
    if group in _ACTIVE:
        raise FSDPAssertionError(
            "Cannot manually unshard parameters when already unsharding parameters\n"
            f"summon_full_params: the group of {where} is already summoned by an enclosing "
            "summon_full_params; use the outer block's parameters"
        )
    if group.step.training_state != TrainingState.IDLE or in_backward():
        raise FSDPAssertionError(
            "Cannot manually unshard parameters during forward/backward\n"
            f"summon_full_params was called inside the forward or backward of {where}; "
            "call it outside the training step (e.g. after optimizer.step())"
        )
    if group.holds_gathered:
        raise RuntimeError(
            f"summon_full_params: the group of {where} holds gathered parameters (between "
            "forward and backward, kept by set_reshard_after_backward(False), or after "
            "unshard()); call it before forward or after backward, or call reshard() on the "
            "module first"
        )
    group.wait_for_replica_gather()  # see [Note: Replica slices] in runtime/group/replica_slices.py
    group.adopt_params()
    group.check_materialized()
    for p in group.fsdp_params:
        if p.tp_spec is not None or not p.in_flat:
            what = "tensor-parallel (DTensor)" if p.tp_spec is not None else "all-gather extension"
            raise FSDPNotImplementedError(
                f"summon_full_params does not support {what} parameters: '{p.fqn}'; use "
                "DTensor.full_tensor() on it, or get_full_state_dict(model) to read the "
                "full values"
            )


def _summon_group(
    group: FSDPParamGroup, keep: bool, offload_to_cpu: bool, with_grads: bool
) -> _Summoned:
    """Gather one group (one collective, two with gradients) and register its full parameters."""
    entry = _Summoned(group)
    layout = group.layout
    with torch.no_grad():
        blocks = _all_gather(group, group.sharded_flat)
        grad_blocks, grad_offsets = None, {}
        if with_grads:
            grad_blocks, grad_offsets = _gather_grads(group)
        if not keep:
            return entry  # rank0_only: the collectives ran; keep the shards registered
        device = torch.device("cpu") if offload_to_cpu else blocks.device
        fulls = []
        for i, p in enumerate(group.fsdp_params):
            seg = blocks[:, layout.starts[i] : layout.stops[i]]
            if layout.mixed:
                seg = seg.contiguous().view(layout.dtypes[i])
            full = nn.Parameter(
                _unpack(p, seg, device), requires_grad=p.sharded_param.requires_grad
            )
            if p in grad_offsets and p.sharded_param.grad is not None:
                start = grad_offsets[p]
                seg = grad_blocks[:, start : start + p.padded_shard_numel]
                full.grad = _unpack(p, seg, device)
            fulls.append((p, full))
        del blocks, grad_blocks
    for p, full in fulls:
        p.register(full)
        entry.fulls.append((p, full))
    return entry


def _gather_grads(group: FSDPParamGroup) -> tuple[torch.Tensor, dict[FSDPParam, int]]:
    """The trainable parameters' sharded gradients as ``(W, padded numel)`` blocks (zeros if none).

    Every trainable parameter gets a slot whether or not this rank has its
    gradient, so the collective has the same size on every rank.
    """
    trainable = [p for p in group.fsdp_params if p.sharded_param.requires_grad]
    offsets, total = {}, 0
    for p in trainable:
        offsets[p], total = total, total + p.padded_shard_numel
    flat = torch.zeros(total, dtype=group.dtypes.orig, device=group.device)
    for p in trainable:
        grad = p.sharded_param.grad
        if grad is None:
            continue
        local = local_tensor(grad) if isinstance(grad, DTensor) else grad
        flat[offsets[p] : offsets[p] + local.numel()].copy_(local.reshape(-1))
    return _all_gather(group, flat), offsets


def _all_gather(group: FSDPParamGroup, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` from every rank of the shard group, ``(W, flat numel)``, on the group's device."""
    world_size = group.mesh_info.shard_mesh_size
    flat = flat.to(group.device)
    if group.alone:  # one rank (see [Note: Forcing collectives on one rank])
        return flat.view(1, -1)
    output = torch.empty(world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
    collectives.all_gather(output, flat, group.mesh_info.shard_process_group)
    return output.view(world_size, -1)


def _unpack(p: FSDPParam, seg: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The full tensor of ``p`` from its ``(W, padded shard numel)`` rank blocks, a new tensor."""
    full = torch.empty(p.orig_size, dtype=seg.dtype, device=device)
    if p.shard_dim == 0:
        rows = seg.reshape(-1, *p.orig_size[1:])[: p.orig_size[0]]
        full.copy_(rows)
    else:  # Shard(k > 0) divides evenly: block r is rank r's slice along dim k
        p.layout.rank_blocks(full).copy_(seg.reshape(p.layout.block_shape()))
    return full


def _refuse_forward(module: nn.Module, args: tuple) -> None:
    raise RuntimeError(
        f"{type(module).__name__}.forward ran inside summon_full_params: FSDP cannot gather "
        "or free parameters while they are summoned. Run forward after the with block (or "
        "call the module's plain layers on the summoned parameters)"
    )
