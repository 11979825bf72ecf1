"""fsdp2: per-parameter fully sharded data parallelism for PyTorch.

A drop-in for ``torch.distributed.fsdp.fully_shard``: change the import and
keep the rest of the training script.
"""

from . import (
    api,
    upstream_names,  # noqa: F401 (gives fsdp2's objects upstream's private names)
)
from .checkpoint.errors import CheckpointDamagedError, CheckpointError, CheckpointLockedError
from .checkpoint.integrity import verify_checkpoint
from .checkpoint.save_load import load_checkpoint, load_latest, save_checkpoint
from .checkpoint.state_dict import IncompatibleKeys, get_full_state_dict, set_full_state_dict
from .errors import FSDPAssertionError, FSDPNotImplementedError
from .fsdp1.summon import summon_full_params
from .fsdp1.wrap import shard_model
from .fully_shard import fully_shard
from .handles import GradientReductionHandle, UnshardHandle
from .integrations.patch import TorchPatch, patch_torch
from .module import FSDPModule
from .module_functions import register_fsdp_forward_method, share_comm_ctx
from .optim import OptimizerOffloadPolicy
from .optim.clip_grad import clip_grad_norm_
from .optim.default_step import disable_flat_step, set_flat_step_default
from .optim.local_shard_step import enable_local_shard_step
from .optim.muon import Muon, MuonLoad

# Plain values users pass to fully_shard: its policies, and where parameters are sharded.
CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy = (
    api.CPUOffloadPolicy, api.MixedPrecisionPolicy, api.OffloadPolicy)
DataParallelMeshDims, ShardPlacementResult = api.DataParallelMeshDims, api.ShardPlacementResult
GradientCommPolicy = api.GradientCommPolicy
RaggedShard = api.RaggedShard

__all__ = [
    # torch.distributed.fsdp's public API, same names and signatures
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    # torch's (private there, from 2.12); fsdp2's own dataclass on an older torch
    "ShardPlacementResult",
    # fsdp2's own tools
    "CheckpointDamagedError",
    "CheckpointError",
    "CheckpointLockedError",
    "FSDPAssertionError",
    "FSDPNotImplementedError",
    "GradientCommPolicy",
    "IncompatibleKeys",
    "Muon",
    "MuonLoad",
    "OptimizerOffloadPolicy",
    "RaggedShard",
    "TorchPatch",
    "clip_grad_norm_",
    "disable_flat_step",
    "enable_local_shard_step",
    "get_full_state_dict",
    "load_checkpoint",
    "load_latest",
    "patch_torch",
    "save_checkpoint",
    "set_flat_step_default",
    "set_full_state_dict",
    "shard_model",
    "summon_full_params",
    "verify_checkpoint",
]
__version__ = "0.2.0"
