"""One training step of the demo model scaled to ~1B parameters, bf16, on one GPU.

``step_body`` runs in one rank process, on torch's fake process group at W = 8
(collectives are no-ops; copies, allocations, streams and CPU overhead are
real) or on a one-rank NCCL group with ``FSDP2_FORCE_COLLECTIVES=1``, so that
fsdp2 runs the full multi-rank path, NCCL kernels included. For each
implementation in turn (``fsdp2``, ``torch``, and ``plain``, the unsharded
model in bf16, where asked) it builds the model on ``meta``, shards it with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (one
group per block, then the root), materializes it with ``to_empty`` and
``init_weights``, and measures:

- step time: forward, backward, AdamW (foreach) step and ``zero_grad``,
  between ``torch.cuda.synchronize()`` calls; median over the timed steps;
- peak memory: ``torch.cuda.max_memory_allocated()`` over the timed steps
  (reset after warm-up; the other implementations' models are freed first);
- copy kernels: one profiled step (``torch.profiler``, CUDA activity): the
  device kernels and memcpys whose names say copy (``direct_copy_kernel``,
  ``CatArrayBatchedCopy``, ``split_with_sizes_copy``, ``chunk_cat``,
  ``Memcpy ...``), by name; on CPU (``--smoke``) the copy-like aten ops;
- bytes copied: one step under ``instruments.CopyCounter`` (bytes written by
  copy-like aten ops outside the collectives).

Implementations run one after the other in the same process, each on a fresh
model; the GPU is the machine's only job, so there is nothing to interleave
with.
"""

from __future__ import annotations

import collections
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
from common import fully_shard_of, make_optim
from instruments import COPY_OPS, CopyCounter
from model import MODEL_SOURCE, batch, model_loss
from torch.distributed.device_mesh import init_device_mesh

FORCE_ENV = "FSDP2_FORCE_COLLECTIVES"
# Substrings (lower case) of the device kernels and memcpys that copy memory.
COPY_KERNEL_MARKS = ("copy", "memcpy", "chunk_cat")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(impl: str, cfg: dict, device: torch.device):
    """``impl``'s model on ``device`` (sharded with bf16 mixed precision, or plain bf16)
    and its number of parameters."""
    from model import ModelArgs, Transformer

    args = ModelArgs(**{**cfg["shape"], "max_seq_len": cfg["seq"]})
    with torch.device("meta"):
        model = Transformer(args)
    n_params = sum(p.numel() for p in model.parameters())
    if impl == "plain":
        model.to_empty(device=device)
        model.init_weights()
        return model.to(torch.bfloat16), n_params
    fully_shard = fully_shard_of(impl)
    if impl == "fsdp2":
        from fsdp2 import MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    model.init_weights()
    return model, n_params


def _copy_kernels(step, device: torch.device) -> dict:
    """Copy kernels (CUDA) or copy-like aten ops (CPU) of one profiled ``step()``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    names: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        name = event.name
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            if not any(mark in name.lower() for mark in COPY_KERNEL_MARKS) or "nccl" in name.lower():
                continue
        elif not (name.startswith("aten::") and name[len("aten::"):] in COPY_OPS):
            continue
        names[name[:120]] += 1
    return {"count": sum(names.values()), "top": names.most_common(12)}


def _measure(impl: str, cfg: dict, device: torch.device) -> dict:
    torch.manual_seed(0)
    model, n_params = _build(impl, cfg, device)
    optim = make_optim(model, impl)
    vocab = cfg["shape"]["vocab_size"]
    tokens, targets = (t.to(device) for t in batch(0, dist.get_rank(), cfg["batch"], cfg["seq"], vocab))

    def step() -> torch.Tensor:
        loss = model_loss(model, tokens, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(cfg["warmup"]):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(cfg["steps"]):
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.float().item())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    kernels = _copy_kernels(step, device)
    with CopyCounter() as copies:
        step()
        _sync(device)
    out = {
        "params": n_params,
        "step_s": times,
        "step_s_median": statistics.median(times),
        "peak_bytes": peak,
        "copy_kernels": kernels["count"],
        "copy_kernels_top": kernels["top"],
        "copy_bytes": copies.total,
        "copy_bytes_by_op": dict(copies.bytes),
        "losses": losses,
    }
    return out  # the model and optimizer go with this frame


def step_body(rank: int, world_size: int, cfg: dict, device_type: str, impls: list[str]) -> dict:
    """Measure each of ``impls`` (``fsdp2``, ``torch``, ``plain``) in turn on this rank.

    A real (non-fake) group of one rank runs fsdp2 with ``FSDP2_FORCE_COLLECTIVES=1``.
    """
    forced = world_size == 1
    if forced:
        os.environ[FORCE_ENV] = "1"
    device = torch.device(device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = True
    results = {}
    for impl in impls:
        results[impl] = _measure(impl, cfg, device)
        gc.collect()  # the previous model's memory back before the next one's peak
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "results": results,
        "forced_collectives": forced,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": MODEL_SOURCE,
    }
