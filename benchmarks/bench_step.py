"""Step time (interleaved), loss parity, and optimizer-step / grad-clip time, on W ranks.

Every implementation gets a model with identical initial values and the same
per-rank data. Step ``i`` of every implementation runs back to back, in an
order that rotates with ``i``, so machine noise hits all of them alike. A
step (forward, backward, ``AdamW.step``, ``zero_grad``) is timed from a
barrier on every rank; its time is the slowest rank's.
"""

from __future__ import annotations

import gc
import time

import torch.distributed as dist
from common import FSDP_IMPLS, Trainer, clip_grad_norm_of, max_over_ranks, rotated, timed


def _interleaved_steps(trainers: dict[str, Trainer], warmup: int, steps: int) -> dict:
    names = list(trainers)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + steps):
        for name in rotated(names, i):
            tr = trainers[name]
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(tr.step(i))
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    times = {n: max_over_ranks(v) for n, v in times.items()}
    # Largest |loss difference| to fsdp2 over every step and every rank.
    diffs = {}
    for name in names:
        if name != "fsdp2":
            d = max(abs(a - b) for a, b in zip(losses["fsdp2"], losses[name]))
            diffs[name] = max_over_ranks([d])[0]
    return {"times": times, "loss_diff": diffs, "losses_rank0": losses}


def _optim_and_clip(trainers: dict[str, Trainer], reps: int) -> dict:
    """Time ``optim.step()`` and ``clip_grad_norm_`` alone, on gradients left in place.

    fsdp2 runs its own fast paths (``enable_local_shard_step`` on the optimizer,
    ``fsdp2.clip_grad_norm_``); torch and DDP the stock ``torch.optim`` /
    ``torch.nn.utils`` ones.
    """
    names = list(trainers)
    for tr in trainers.values():
        tr.optim.zero_grad(set_to_none=True)
        tr.forward_backward(0)
        tr.optim.step()  # optimizer state exists from here on
        clip_grad_norm_of(tr.impl)(tr.model.parameters(), 1.0)  # first-call caches
    opt: dict[str, list[float]] = {n: [] for n in names}
    clip: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        for name in rotated(names, i):
            tr = trainers[name]
            opt[name].append(timed(tr.optim.step))
            clip_fn = clip_grad_norm_of(tr.impl)
            clip[name].append(timed(clip_fn, tr.model.parameters(), 1.0))
    return {
        "optim": {n: max_over_ranks(v) for n, v in opt.items()},
        "clip": {n: max_over_ranks(v) for n, v in clip.items()},
    }


def step_body(rank: int, world_size: int, cfg: dict) -> dict:
    """Runs on every rank: both reshard_after_forward settings, then optimizer + clip."""
    out: dict = {}
    trainers = {
        impl: Trainer(impl, cfg, reshard_after_forward=True) for impl in (*FSDP_IMPLS, "ddp")
    }
    out["step_raf"] = _interleaved_steps(trainers, cfg["warmup"], cfg["steps"])
    out["optim"] = _optim_and_clip(trainers, cfg["optim_reps"])
    del trainers
    gc.collect()
    trainers = {impl: Trainer(impl, cfg, reshard_after_forward=False) for impl in FSDP_IMPLS}
    out["step_noraf"] = _interleaved_steps(trainers, cfg["warmup"], cfg["steps"])
    return out
