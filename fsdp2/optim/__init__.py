"""Optimizer helpers: the flat step by default, the local-shard step, clip_grad_norm_, whole-matrix Muon."""

from ..api import OptimizerOffloadPolicy
from .clip_grad import clip_grad_norm_
from .default_step import disable_flat_step, flat_step_engine, set_flat_step_default
from .local_shard_step import enable_local_shard_step
from .muon import Muon, MuonLoad
from .state_store import StoreError

__all__ = [
    "Muon", "MuonLoad", "OptimizerOffloadPolicy", "StoreError", "clip_grad_norm_", "disable_flat_step",
    "enable_local_shard_step", "flat_step_engine", "set_flat_step_default",
]
