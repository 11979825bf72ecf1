"""Bytes copied, bytes communicated and peak live bytes of one training step, per rank.

Each implementation trains a few warm-up steps, then one step (forward,
backward, ``AdamW.step``, ``zero_grad``) runs under the counter. See
instruments.py for what each counter counts. DDP gets a Python all-reduce comm
hook here (DDP's own all-reduce runs in C++, where no Python counter sees it).

Memory: the tracker is on from before the model is built, so every storage
(parameters, optimizer state, FSDP's internal buffers) is known; ``peak`` is
the most bytes alive at once during the last step. The unsharded model, with
its parameters, gradients and optimizer state tagged, gives the activation
estimate used by the analytic model (its peak of untagged bytes).
"""

from __future__ import annotations

import gc
import math

import torch
import torch.distributed as dist
from common import FSDP_IMPLS, Trainer
from instruments import CommCounter, CopyCounter, LiveBytes


def _group_bytes(model: torch.nn.Module, world_size: int) -> dict:
    """Padded (dim 0 to a multiple of W) parameter bytes: per block, root and total."""

    def padded(params) -> int:
        total = 0
        for p in params:
            rows = -(-p.shape[0] // world_size) * world_size
            total += rows * math.prod(p.shape[1:]) * p.element_size()
        return total

    blocks = [padded(layer.parameters()) for layer in model.layers]
    total = padded(model.parameters())
    return {"blocks": blocks, "root": total - sum(blocks), "total": total}


def _ddp_hook(trainer: Trainer) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    trainer.model.register_comm_hook(None, allreduce_hook)


def _counted_steps(impl: str, cfg: dict, raf: bool) -> dict:
    tr = Trainer(impl, cfg, reshard_after_forward=raf)
    if impl == "ddp":
        _ddp_hook(tr)
    for i in range(cfg["warmup"]):
        tr.step(i)
    with CopyCounter() as copies:
        tr.step(100)
    with CommCounter() as comms:
        tr.step(101)
    return {
        "copy_bytes": dict(copies.bytes),
        "copy_calls": dict(copies.calls),
        "comm_bytes": dict(comms.bytes),
        "comm_calls": dict(comms.calls),
    }


def _tag_state(live: LiveBytes, tr: Trainer) -> None:
    for t in (*tr.model.buffers(), *tr.model.parameters()):
        live.tag(t)
    for p in tr.model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: live.tag(q.grad))
    for state in tr.optim.state.values():
        for t in state.values():
            live.tag(t)


def _peak_live(impl: str, cfg: dict, raf: bool) -> dict:
    gc.collect()
    with LiveBytes() as live:
        tr = Trainer(impl, cfg, reshard_after_forward=raf)
        for i in range(max(2, cfg["warmup"])):
            tr.step(i)
        out = {"start": live.current}
        if impl == "plain":  # activations = everything but params, grads, optimizer state
            _tag_state(live, tr)
        live.reset_peak()
        tr.forward_backward(100)
        out["peak_fwd_bwd"] = live.peak
        if impl == "plain":
            out["activations"] = live.peak_untagged
        tr.optim.step()
        tr.optim.zero_grad(set_to_none=True)
        out["peak"] = live.peak
        out["peak_at"] = live.peak_at
        out["end"] = live.current
        del tr
        gc.collect()
        out["leaked"] = live.current
    return out


def bytes_body(rank: int, world_size: int, cfg: dict) -> dict:
    torch.manual_seed(0)
    out: dict = {"groups": _group_bytes(Trainer("plain", cfg).model, world_size)}
    for impl in (*FSDP_IMPLS, "ddp", "plain"):
        out[f"counted/{impl}"] = _counted_steps(impl, cfg, True)
    for impl in FSDP_IMPLS:
        out[f"counted_noraf/{impl}"] = _counted_steps(impl, cfg, False)
    for impl in (*FSDP_IMPLS, "ddp", "plain"):
        out[f"memory/{impl}"] = _peak_live(impl, cfg, True)
    for impl in FSDP_IMPLS:
        out[f"memory_noraf/{impl}"] = _peak_live(impl, cfg, False)
    # Per-rank values agree up to the last few bytes; report the largest.
    for key, value in out.items():
        if key.startswith("memory"):
            for k in ("peak", "peak_fwd_bwd", "activations"):
                if k in value:
                    value[k] = int(max(_gather(value[k])))
    return out


def _gather(x: int) -> list[int]:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, x)
    return values
