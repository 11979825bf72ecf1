"""fsdp2: per-parameter fully sharded data parallelism for PyTorch.

A drop-in for ``torch.distributed.fsdp.fully_shard``: change the import and
keep the rest of the training script.
"""

from .api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .fully_shard import fully_shard
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
]
__version__ = "0.1.0"
