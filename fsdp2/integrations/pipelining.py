"""``fsdp2.pipelining.PipelineStage``: torch's pipeline stage, aware of fsdp2's FSDP modules.

torch's ``torch.distributed.pipelining`` recognizes upstream's ``FSDPModule``
and, for a stage module that is one, accumulates gradients unsharded across
micro-batches and reduces them once per step. fsdp2's modules are a different
class, so with torch's own ``PipelineStage`` every micro-batch's backward runs
a full post-backward (a reduce-scatter per group per micro-batch). This
subclass gives fsdp2's modules the same treatment through fsdp2's public
``FSDPModule`` methods; switch by changing the import::

    from fsdp2.pipelining import PipelineStage   # was: from torch.distributed.pipelining import ...

[Note: Pipeline stages and FSDP]
torch's schedules call, per step and per stage: ``backward_maybe_with_nosync``
for every micro-batch's backward (full, input-only or weight-only), then
``perform_reduce_grad`` once after the stage's last backward, then (multi-stage
schedules) ``scale_grads``. For an fsdp2 stage module this class does what
torch's base class does for upstream's:
- each backward: ``set_is_last_backward(False)``,
  ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``
  on the stage root (recursively): gradients add up on the unsharded
  parameters and stay there, and so do the parameters, so the next
  micro-batch's forward and backward gather nothing;
- reduce: turn all three back on and call ``FSDPModule.finish_backward()``:
  one reduce-scatter per group per step, then resharding;
- after metadata inference (torch 2.13's dynamic shape inference runs one
  real forward and backward on the first step): reshard and drop gradients.
The schedule's own ``UNSHARD`` / ``RESHARD`` actions (multi-stage schedules)
recognize upstream's class only; for fsdp2 modules they are skipped, and each
forward gathers what it needs instead (see docs/pipelining.md, "Two things to know"
section).

Under ``fsdp2.patch_torch()`` torch's own ``PipelineStage`` and schedules
(their ``UNSHARD`` / ``RESHARD`` actions too) recognize fsdp2's modules: from
torch 2.15 they drive them through public methods only
(``set_manual_backward_finalization``, ``finalize_backward(async_op=True)``);
before, through upstream's private state (``fully_shard.state(module)``, its
``_state_ctx.all_states``, each state's ``_fsdp_param_groups`` and the root's
``_root_post_backward_final_callback``), which fsdp2's state answers under the
same names. This class then leaves them to torch and behaves exactly as
torch's stage.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.distributed.pipelining import stage as _torch_stage

from .._torch_compat import after_stage_metadata_inference
from ..module import FSDPModule

__all__ = ["PipelineStage"]


class PipelineStage(_TorchPipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` for stage modules sharded by fsdp2.

    Same constructor and behaviour; when the stage module is an fsdp2
    ``FSDPModule`` its gradients are reduced once per step and its parameters
    stay unsharded between micro-batches, as torch does for upstream's
    ``fully_shard``. See [Note: Pipeline stages and FSDP].
    """

    def _fsdp2_root(self) -> FSDPModule | None:
        submod = self.submod
        if not isinstance(submod, FSDPModule) or _torch_drives(submod):
            return None
        return submod

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        root = self._fsdp2_root()
        if root is not None:
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(False)
            root.set_requires_gradient_sync(False)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        root = self._fsdp2_root()
        if root is not None:
            root.set_is_last_backward(True)
            root.set_reshard_after_backward(True)
            root.set_requires_gradient_sync(True)
            root.finish_backward()
        # torch's part: gradient scaling (its FSDP branch does not apply to fsdp2's modules).
        super().perform_reduce_grad(grad_scale_factor)


def _torch_drives(module: FSDPModule) -> bool:
    """Whether torch's own stage code treats ``module`` as its FSDP module.

    Under ``patch_torch()`` torch's pipelining recognizes fsdp2's modules and
    drives them itself; this class then adds nothing.
    """
    torch_fsdp_module = getattr(_torch_stage, "FSDPModule", None)
    return torch_fsdp_module is not None and isinstance(module, torch_fsdp_module)


def _reset_after_inference(stage: PipelineStage) -> None:
    """Undo metadata inference's forward and backward on fsdp2 modules, as torch does for its own."""
    root = stage._fsdp2_root()
    if root is not None:
        root.reset_iter_state()  # also drops the inference's forward order (backward prefetching)
    for module in stage.submod.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
            for param in module.parameters():
                param.grad = None


after_stage_metadata_inference(PipelineStage, _reset_after_inference)
