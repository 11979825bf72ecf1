"""Which torch is installed, and every behaviour of fsdp2 that follows its version.

fsdp2 behaves like the upstream ``fully_shard`` of the installed torch. Where
upstream changed behaviour between releases, the switch is decided here, once,
and the rest of the package reads the named flag (never ``torch.__version__``).

[Note: What changed by torch version]
torch 2.15:
- ``MixedPrecisionPolicy(reduce_dtype=None)`` reduces gradients in the
  parameter's own dtype (fp32 for fp32 parameters under ``param_dtype=bf16``);
  before, it reduced in ``param_dtype``. See ``REDUCE_IN_PARAM_DTYPE_BY_DEFAULT``.
- Gradients accumulated across backwards (no sync, chunked losses) add up in
  the reduce dtype as autograd produces them (``ACCUMULATE_IN_GRAD_DTYPE``).
- New public API: ``GradientReductionHandle``,
  ``FSDPModule.set_manual_backward_finalization``,
  ``FSDPModule.finalize_backward(async_op=...)``,
  ``FSDPModule.set_keep_unsharded_storage`` and
  ``MixedPrecisionPolicy(param_dtype_override_fn=...)``. fsdp2 offers them on
  every torch it supports (they change nothing unless called); the API-surface
  test compares names with the installed torch and allows exactly these
  additions on older ones (``ADDED_IN``).
- ``torch.distributed.pipelining`` drives FSDP modules through
  ``set_manual_backward_finalization`` and ``finalize_backward(async_op=True)``.

torch 2.13: ``PipelineStage`` infers shapes with one real forward/backward
(see ``after_stage_metadata_inference`` in _torch_compat).
"""

from __future__ import annotations

import re

import torch


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``2.15.0+cu132`` or ``2.16.0a0``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"fsdp2 cannot read the torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


#: ``(major, minor)`` of the installed torch.
TORCH_RELEASE: tuple[int, int] = _release(torch.__version__)

#: The releases CI runs the whole suite on (see the README, "Supported torch versions").
TESTED_RELEASES: tuple[tuple[int, int], ...] = ((2, 13), (2, 15))

#: With ``reduce_dtype=None`` and a ``param_dtype`` set, gradients are reduced in the
#: parameter's original dtype (torch >= 2.15) rather than in ``param_dtype``.
REDUCE_IN_PARAM_DTYPE_BY_DEFAULT: bool = TORCH_RELEASE >= (2, 15)

#: Unsharded gradients accumulate across backwards in the reduce dtype through
#: ``Tensor.grad_dtype`` (torch >= 2.15); before, in the compute dtype within a
#: backward. See [Note: Gradient accumulation dtype] in reduction.py.
ACCUMULATE_IN_GRAD_DTYPE: bool = TORCH_RELEASE >= (2, 15)

#: Upstream's post-backward profiler ranges: ``FSDP::post_backward_accumulate`` around
#: taking the gradients, then ``FSDP::post_backward_reshard`` (torch < 2.15); one
#: ``FSDP::post_backward_reshard`` range around both (torch >= 2.15).
ACCUMULATE_PROFILER_RANGE: bool = TORCH_RELEASE < (2, 15)

#: Public FSDP2 API fsdp2 offers on every torch, by the release whose upstream added it.
ADDED_IN: dict[str, tuple[int, int]] = {
    "DataParallelMeshDims": (2, 12),
    "ShardPlacementResult": (2, 12),
    "fully_shard.dp_mesh_dims": (2, 12),
    "FSDPModule.set_symm_mem_for_comm": (2, 12),
    "FSDPModule.reset_iter_state": (2, 13),
    "FSDPModule.set_reduce_scatter_max_input_buffers": (2, 13),
    "FSDPModule.set_reduce_scatter_unused_params": (2, 13),
    "FSDPModule.set_separate_reduce_scatter_group": (2, 13),
    "GradientReductionHandle": (2, 15),
    "FSDPModule.set_manual_backward_finalization": (2, 15),
    "FSDPModule.finalize_backward": (2, 15),
    "FSDPModule.set_keep_unsharded_storage": (2, 15),
    "MixedPrecisionPolicy.param_dtype_override_fn": (2, 15),
}


def upstream_has(name: str) -> bool:
    """Whether the installed torch's upstream FSDP2 has ``name`` (a key of ``ADDED_IN``)."""
    return TORCH_RELEASE >= ADDED_IN[name]
