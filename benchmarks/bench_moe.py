"""A mixture-of-experts model sharded as torchtitan shards one (issue 40), W=4 gloo.

``examples/moe.py``'s model: top-1 routing, experts a ``DTensor`` ``Shard(0)`` on
``ep`` (2 ranks) with all-to-all dispatch, and per block one ``fully_shard``
whose ``shard_placement_fn`` returns a ``ShardPlacementResult`` per parameter:
experts over ``efsdp`` (2 ranks), the rest over ``dp`` (4 ranks). Every block
then has two groups, the root one. fsdp2 and torch's ``fully_shard`` run
interleaved on the same meshes, values and data; the reference (``ref``) is
the same model with expert parallelism and no FSDP at all (dense weights
replicated, no gradient sync), the floor of a step. Gradient division is off
and the loss is summed over the global tokens, as torchtitan (and the example).

- step time: forward, backward, ``AdamW.step``, ``zero_grad``; the slowest
  rank's; implementations take turns going first.
- FSDP cost per group: (median forward + backward of the sharded model - the
  reference's) / number of groups. On a real gloo group this includes the
  collectives (all-gathers and reduce-scatters), not only the hooks' CPU.
- bytes communicated per step (``instruments.CommCounter``, logical bytes:
  all-gather output + reduce-scatter input) against the analytic count: every
  group all-gathered in forward, the blocks' groups again in backward
  (``reshard_after_forward=True``; the root keeps its parameters), every group
  reduce-scattered once, each tensor padded on its shard dim to a multiple of
  its group's size. The routing all-to-alls are not counted (``CommCounter``
  does not wrap ``all_to_all_single``; they are the same for all three).
- peak live bytes of one step (``instruments.LiveBytes``, tensor storages the
  step touches).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import max_over_ranks, median, rotated
from instruments import CommCounter, LiveBytes
from model import REPO

IMPLS = ("fsdp2", "torch", "ep_only")
EP = 2


def _moe_module():
    """``examples/moe.py``, loaded by path (it is not a package)."""
    name = "_fsdp2_examples_moe"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(REPO, "examples", "moe.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _build(impl: str, shape: dict, dp, sparse):
    moe = _moe_module()
    model = moe.build_moe(seed=0, **shape)
    moe.expert_parallel(model, sparse["ep"])
    if impl == "ep_only":
        return model
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    if impl == "fsdp2":
        from fsdp2 import ShardPlacementResult, fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    moe.shard_moe(model, fully_shard, ShardPlacementResult, FSDPMeshInfo, dp, sparse)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)  # summed; the loss is over global tokens
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


def _forward_backward(model, step: int, tokens_per_rank: int, vocab: int) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (tokens_per_rank,), generator=g)
    targets = (tokens * 7 + 3) % vocab
    loss = F.cross_entropy(model(tokens), targets, reduction="sum") / (tokens.numel() * world_size)
    loss.backward()


def _padded_bytes(shape: tuple[int, ...], dim: int, size: int) -> int:
    padded = list(shape)
    padded[dim] = -(-padded[dim] // size) * size
    return 4 * math.prod(padded)  # fp32


def _analytic(model, world_size: int, sparse) -> dict:
    """Bytes one step communicates by the count in the module docstring, per rank."""
    placement = _moe_module().expert_placement(model.layers[0].moe.num_experts, sparse)
    efsdp = sparse["efsdp"].size()
    blocks = 0
    for layer in model.layers:
        experts = set(layer.moe.experts.parameters())
        for p in layer.parameters():
            if p in experts:  # this rank's experts (ep), split over efsdp
                local = (p.shape[0] // EP, *p.shape[1:])
                blocks += _padded_bytes(local, placement.dim, efsdp)
            else:
                blocks += _padded_bytes(tuple(p.shape), 0, world_size)
    in_blocks = {id(p) for layer in model.layers for p in layer.parameters()}
    root = sum(_padded_bytes(tuple(p.shape), 0, world_size)
               for p in model.parameters() if id(p) not in in_blocks)
    return {"blocks": blocks, "root": root, "step": 3 * blocks + 2 * root}


def moe_body(rank: int, world_size: int, cfg: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    shape, tokens = cfg["moe_shape"], cfg["moe_tokens"]
    dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (world_size // EP, EP), mesh_dim_names=("efsdp", "ep"))
    models = {impl: _build(impl, shape, dp, sparse) for impl in IMPLS}
    optims = {impl: torch.optim.AdamW(m.parameters(), lr=1e-3) for impl, m in models.items()}
    vocab = shape["vocab"]
    n_groups = 2 * shape["n_layers"] + 1

    def step(impl: str, i: int) -> None:
        _forward_backward(models[impl], i, tokens, vocab)
        optims[impl].step()
        optims[impl].zero_grad(set_to_none=True)

    for i in range(cfg["warmup"]):
        for impl in IMPLS:
            step(impl, i)
    step_times: dict[str, list[float]] = {n: [] for n in IMPLS}
    fb_times: dict[str, list[float]] = {n: [] for n in IMPLS}
    for i in range(cfg["moe_steps"]):
        for impl in rotated(list(IMPLS), i):
            dist.barrier()
            t0 = time.perf_counter()
            step(impl, 100 + i)
            step_times[impl].append(time.perf_counter() - t0)
        for impl in rotated(list(IMPLS), i + 1):
            dist.barrier()
            t0 = time.perf_counter()
            _forward_backward(models[impl], 200 + i, tokens, vocab)
            fb_times[impl].append(time.perf_counter() - t0)
            optims[impl].zero_grad(set_to_none=True)
    comm: dict[str, dict] = {}
    peak: dict[str, float] = {}
    for impl in IMPLS:
        with CommCounter() as counter:
            step(impl, 300)
        comm[impl] = {"fsdp": max_over_ranks([float(counter.total)])[0],
                      "calls": dict(counter.calls), "bytes": dict(counter.bytes)}
        with LiveBytes() as live:
            step(impl, 301)
        peak[impl] = max_over_ranks([float(live.peak)])[0]
    return {
        "world_size": world_size,
        "n_groups": n_groups,
        "step": {n: max_over_ranks(v) for n, v in step_times.items()},
        "forward_backward": {n: max_over_ranks(v) for n, v in fb_times.items()},
        "comm": comm,
        "analytic": _analytic(models["ep_only"], world_size, sparse),
        "peak": peak,
    }


def moe_rows(raw: dict) -> list[dict]:
    """Rows for run.py: fsdp2, torch, ref = expert parallelism without FSDP."""
    from report import MB, ratio_row, row

    r = raw.get("moe")
    if not r:
        return []
    where = f"W={r['world_size']} gloo, ep={EP}"
    t = {n: 1e3 * median(v) for n, v in r["step"].items()}
    rows = [ratio_row(f"MoE step time, {where} (ms)", t["fsdp2"], t["torch"], t["ep_only"], 1.0)]
    fb = {n: median(v) for n, v in r["forward_backward"].items()}
    per = {n: 1e6 * (fb[n] - fb["ep_only"]) / r["n_groups"] for n in ("fsdp2", "torch")}
    rows.append(ratio_row(f"MoE FSDP cost per group incl. collectives, {where} (us)",
                          per["fsdp2"], per["torch"], None, 1.0))
    want = r["analytic"]["step"] / MB
    got = {n: r["comm"][n]["fsdp"] / MB for n in ("fsdp2", "torch")}
    rows.append(row(f"MoE FSDP bytes communicated per step, {where} (MB)", got["fsdp2"],
                    got["torch"], want, "= analytic (ref)", abs(got["fsdp2"] - want) < 1e-6))
    m = {n: v / MB for n, v in r["peak"].items()}
    rows.append(ratio_row(f"MoE step peak live, {where} (MB)", m["fsdp2"], m["torch"],
                          m["ep_only"], 1.0))
    return rows


NOTES = """- MoE rows (bench_moe.py): examples/moe.py's model, experts on (efsdp=2, ep=2), the rest on
  dp=4, two groups per block; DDP/ref = the same model with expert parallelism and no FSDP
  (step time, peak) or the analytic byte count; the FSDP cost per group includes gloo's
  collectives."""
