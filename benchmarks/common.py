"""What every benchmark shares: building one model per implementation, one training step.

Implementations: ``fsdp2`` (this repository), ``torch``
(``torch.distributed.fsdp.fully_shard``), ``ddp``
(``DistributedDataParallel``) and ``plain`` (the unsharded model, no wrapper).
FSDP models get one ``fully_shard`` per block, then one on the root; the root
keeps the default ``reshard_after_forward=None`` (not resharded after forward).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from model import REPO, batch, build_model, model_loss

if REPO not in sys.path:  # fsdp2 without `pip install -e .`
    sys.path.insert(1, REPO)

FSDP_IMPLS = ("fsdp2", "torch")


def fully_shard_of(impl: str):
    if impl == "fsdp2":
        from fsdp2 import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    return fully_shard


def cpu_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def wrap(model: nn.Module, impl: str, reshard_after_forward: bool = True, mesh=None) -> nn.Module:
    """Shard (or DDP-wrap, or leave alone) ``model`` the way ``impl`` does it."""
    if impl in FSDP_IMPLS:
        fully_shard = fully_shard_of(impl)
        mesh = mesh or cpu_mesh()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh)
        return model
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if impl == "plain":
        return model
    raise ValueError(f"unknown implementation {impl!r}")


def make_optim(model: nn.Module, impl: str) -> torch.optim.Optimizer:
    # foreach=True is AdamW's default on GPUs (CPU tensors default to a Python loop).
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    if impl == "fsdp2":  # fsdp2's optimizer fast path (same updates, bit for bit)
        from fsdp2 import enable_local_shard_step

        enable_local_shard_step(optim)
    return optim


def clip_grad_norm_of(impl: str):
    """The grad-clipping function a user of ``impl`` calls."""
    if impl == "fsdp2":
        from fsdp2 import clip_grad_norm_

        return clip_grad_norm_
    return torch.nn.utils.clip_grad_norm_


class Trainer:
    """One model + optimizer of one implementation; ``step(i)`` trains on batch ``i``."""

    def __init__(self, impl: str, cfg: dict, reshard_after_forward: bool = True, seed: int = 0):
        self.impl = impl
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        raw = build_model(seed, cfg.get("shape"))
        self.model = wrap(raw, impl, reshard_after_forward)
        self.optim = make_optim(self.model, impl)

    def data(self, i: int):
        c = self.cfg
        return batch(i, self.rank, c["batch"], c["seq"], c["shape"]["vocab_size"])

    def forward_backward(self, i: int) -> torch.Tensor:
        tokens, targets = self.data(i)
        loss = model_loss(self.model, tokens, targets)
        loss.backward()
        return loss.detach()

    def step(self, i: int) -> float:
        loss = self.forward_backward(i)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return loss.item()


def settled() -> None:
    """Every rank collected its garbage, then met the others: a timed call starts here.

    A generation-2 collection (tens to 150 ms with this many Python objects)
    otherwise lands on whichever variant's call crosses the threshold, and
    with variants taking turns, on the same one each time.
    """
    gc.collect()
    dist.barrier()


def timed(fn, *args) -> float:
    """Seconds ``fn(*args)`` took, after a barrier so all ranks start together."""
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def rotated(items: list, i: int) -> list:
    """``items`` rotated by ``i``: interleaved runs take turns being first."""
    k = i % len(items)
    return items[k:] + items[:k]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max over ranks (a step is as slow as its slowest rank)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
