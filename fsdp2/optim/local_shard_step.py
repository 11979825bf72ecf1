"""The optimizer step on the local shards of DTensor parameters.

[Note: Why local shards]
``torch.optim`` and ``torch.nn.utils.clip_grad_norm_`` work on sharded
``DTensor`` parameters as they are, but every foreach kernel then goes
through DTensor's dispatcher (sharding propagation, unwrapping, rewrapping)
once per op. For elementwise optimizers (SGD, Adam, AdamW, ...) the result on
a ``Shard`` placement is exactly the same math on each rank's local tensor,
so we run the step on the plain local tensors and only rewrap the optimizer
state. The state stays keyed by the DTensor parameters with DTensor values,
so ``optimizer.state_dict()`` and ``torch.distributed.checkpoint`` see the
same thing as without the fast path. It works on any DTensor parameters
(ours or upstream's ``fully_shard``); ``clip_grad.py`` does the same for the
gradient norm.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

from ..api import OptimizerOffloadPolicy
from .default_step import disable_flat_step
from .step_engine import StepEngine

__all__ = ["enable_local_shard_step"]


class LocalShardStepHandle:
    """Returned by :func:`enable_local_shard_step`; ``remove()`` turns the fast path off.

    ``engine`` is the ``StepEngine`` that steps (its ``tier`` says where the
    state lives; ``remove()`` brings state in a host or disk tier back into
    memory).
    """

    def __init__(self, engine: StepEngine, hooks: list[RemovableHandle]) -> None:
        self.engine = engine
        self._hooks = hooks
        in_place = not engine.tier.in_units and engine.replicas is None
        self._unwrap_zero_grad = engine.wrap_zero_grad() if in_place else None
        self._unwrap_step = engine.wrap_step()

    def wait_for_parameters(self) -> None:
        """``shard_across_replicas``: finish the post-step all-gathers; parameters are current."""
        if self.engine.replicas is not None:
            self.engine.replicas.wait()

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer-state tensors this rank holds outside ``optimizer.state``.

        ``shard_across_replicas``: the slices' state (``optimizer.state`` keeps
        only each parameter's scalars between steps); otherwise empty.
        """
        replicas = self.engine.replicas
        return [] if replicas is None else replicas.state_tensors()

    def remove(self) -> None:
        """Unregister the hooks; state in a host or disk tier comes back into ordinary memory.

        ``shard_across_replicas``: the slices' state is gathered back into
        ``optimizer.state`` in plain HSDP's layout (a collective: call it on
        every rank) and the groups all-reduce again.
        """
        for hook in self._hooks:
            hook.remove()
        if self._hooks:
            self.engine.close()
        self._hooks = []
        if self._unwrap_zero_grad is not None:
            self._unwrap_zero_grad()
            self._unwrap_zero_grad = None
        self._unwrap_step()


def enable_local_shard_step(
    optimizer: torch.optim.Optimizer,
    *,
    flat_buffers: bool = True,
    offload: OptimizerOffloadPolicy | None = None,
    shard_across_replicas: bool = False,
    overlap_replica_gather: bool = False,
) -> LocalShardStepHandle:
    """Make ``optimizer.step()`` run on the plain local shards of its DTensor parameters.

    The same updates, bit for bit, as stepping on the DTensors, with far less
    CPU overhead per step. Only for elementwise optimizers (SGD, Adam, AdamW,
    Adagrad, RMSprop, ...): an optimizer that mixes elements across a
    parameter (e.g. one that takes a matrix norm of the whole parameter) must
    not use it. Parameter groups holding anything but DTensor parameters whose
    gradients share the parameter's placements are stepped as usual.

    With fsdp2's ``fully_shard`` and one of torch's elementwise optimizers
    (``ELEMENTWISE_OPTIMIZERS`` in step_plan.py: SGD, Adam, AdamW, Adagrad,
    RMSprop, Adamax, NAdam, RAdam, in any of their implementations) the step
    runs on each group's flat shard buffer, a few kernels per run of
    parameters instead of per parameter (see [Note: Flat optimizer steps]);
    ``flat_buffers=False`` keeps the per-parameter local step.
    The stepping itself is ``StepEngine`` in step_engine.py. Without this
    call such an optimizer already steps on the flat buffers by default (see
    [Note: The flat step by default] in default_step.py); this call replaces
    that default, for its options. Any other
    optimizer, and parameters sharded by upstream's ``fully_shard``, step on
    each local shard.

    ``offload``: an :class:`~fsdp2.OptimizerOffloadPolicy` moves the
    optimizer's state to host memory or to files on a local disk and steps
    unit by unit there (units cut from the same flat runs), with the same
    updates, bit for bit (see [Note: Stepping in units] in ``unit_step.py``).
    Only for the same elementwise optimizers (their own classes, not
    subclasses); the parameters must not change after this call. ``remove()`` brings the state
    back into ordinary memory.

    ``shard_across_replicas``: HSDP (a 2-D ``(replicate, shard)`` mesh) with
    the optimizer state sharded across replicas too: each replica rank steps
    and keeps the state of only its 1/R slice of each group's flat shard; the
    gradients are reduce-scattered over ``replicate`` instead of all-reduced
    and the updated slices all-gathered over ``replicate`` at the end of
    ``step()``. Same parameters as plain HSDP (bit for bit at R = 2; at R > 2
    within one rounding of the gradient, as the backend may sum the
    reduce-scatter in another order than its all-reduce), state memory / R,
    bytes communicated unchanged. Elementwise optimizers and fsdp2's
    ``fully_shard`` only (``fsdp2.Muon``, LBFGS, upstream's parameters, a
    1-D mesh are refused), and every trainable parameter of a group sliced so
    must be in this optimizer; not with ``offload=`` or
    ``flat_buffers=False``. ``optimizer.state_dict()`` then gives each rank's
    slice (``RowRuns`` DTensors on the flattened mesh; call it on every rank:
    the scalars are agreed on over replicas), which DCP reshards. See
    [Note: Replica slices] in ``runtime/group/replica_slices.py`` and
    docs/meshes.md.

    ``overlap_replica_gather`` (with ``shard_across_replicas``): ``step()``
    returns with the all-gathers in flight, to run behind the next forward;
    fsdp2 waits for a group's before its next unshard, its ``state_dict``
    and the next step. Parameters read any other way before the next forward
    (an EMA, a norm logged after the step, ``full_tensor()``) are stale
    outside this rank's slice until ``handle.wait_for_parameters()``.

    Example::

        optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
        fsdp2.enable_local_shard_step(optim)
        ...
        optim.step()  # unchanged call sites; state_dict() still holds DTensors
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"enable_local_shard_step expects a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if overlap_replica_gather and not shard_across_replicas:
        raise ValueError(
            "overlap_replica_gather=True overlaps the all-gather over replicas that "
            "shard_across_replicas=True adds: pass both, or neither"
        )
    disable_flat_step(optimizer)  # this engine replaces the default one
    engine = StepEngine(
        optimizer,
        flat_buffers=flat_buffers,
        offload=offload,
        shard_across_replicas=shard_across_replicas,
        overlap_replica_gather=overlap_replica_gather,
    )
    hooks = [
        optimizer.register_step_pre_hook(engine.before_step),
        optimizer.register_step_post_hook(engine.after_step),
        optimizer.register_load_state_dict_post_hook(engine.after_load),
        optimizer.register_state_dict_pre_hook(engine.recover),  # see StepEngine.recover
        optimizer.register_load_state_dict_pre_hook(engine.recover),
    ]
    if engine.replicas is not None:
        replicas = engine.replicas
        hooks.append(optimizer.register_state_dict_pre_hook(lambda _: replicas.wait()))
        hooks.append(optimizer.register_state_dict_post_hook(replicas.state_dict_hook))
    return LocalShardStepHandle(engine, hooks)
