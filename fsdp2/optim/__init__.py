"""Optimizer helpers: the local-shard step, clip_grad_norm_, whole-matrix Muon."""

from .local_shard import clip_grad_norm_, enable_local_shard_step
from .muon import Muon, MuonLoad

__all__ = ["Muon", "MuonLoad", "clip_grad_norm_", "enable_local_shard_step"]
