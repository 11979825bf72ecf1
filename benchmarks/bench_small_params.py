"""Many small parameters: forward + backward, optimizer step and whole step, side by side.

The model: 96 blocks of ``LayerNorm(64)`` + two ``Linear(64, 64)`` (578
parameters), one ``fully_shard`` per block and one on the root, stock
``torch.optim.AdamW`` (defaults). Implementations, interleaved step by step:
fsdp2 as installed (``fsdp2``: the flat step by default, no fsdp2 call but
``fully_shard``), fsdp2 with the default switched off (``fsdp2-dtensor``:
``disable_flat_step``, the step on the DTensors), torch's ``fully_shard``
(``torch``), FSDP1 with flat parameters per block (``fsdp1``,
``use_orig_params=False``) and DDP. Phases: forward + backward, the step,
step + ``zero_grad`` (as every training loop runs them), the whole step.
Each phase is timed on every rank; a step's time is the slowest rank's.
Each implementation runs its collectives on a process group of its own, as
in a job of its own: on one shared gloo group, another implementation's
traffic just before made fsdp2's next step 15-20% slower (its collectives'
waits), not FSDP1's or upstream's.
Every step starts from a full garbage collection: a generation-2 collection
(tens of ms with this many modules) otherwise lands on whichever
implementation's step happens to cross the threshold.

Then the demo model's optimizer step alone (gradients left in place):
DTensor step, per-parameter local step (``flat_buffers=False``) and flat
step (as installed), with the default AdamW and, under ``CPUOffloadPolicy``, with
``fused=True`` AdamW (torch's vectorised CPU kernel).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from common import cpu_mesh, max_over_ranks, rotated, settled, timed
from model import batch as demo_batch
from model import build_model, model_loss

BLOCKS, WIDTH, BATCH = 96, 64, 8
SMALL_IMPLS = ("fsdp2", "fsdp2-dtensor", "torch", "fsdp1", "ddp")


def _small_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [
        nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
        for _ in range(BLOCKS)
    ]
    return nn.Sequential(*blocks)


def _wrap_small(model: nn.Sequential, impl: str, group: dist.ProcessGroup) -> nn.Module:
    """``model`` wrapped by ``impl``, its collectives on ``group`` (one per implementation)."""
    if impl.startswith("fsdp2") or impl == "torch":
        from torch.distributed.device_mesh import DeviceMesh

        if impl == "torch":
            from torch.distributed.fsdp import fully_shard
        else:
            from fsdp2 import fully_shard
        mesh = DeviceMesh.from_group(group, "cpu")
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        cpu = torch.device("cpu")  # FSDP1 runs on CPU only when told so
        kwargs = {"use_orig_params": False, "device_id": cpu, "process_group": group}
        blocks = [FSDP(b, **kwargs) for b in model]
        return FSDP(nn.Sequential(*blocks), **kwargs)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=group)


def _optim(model: nn.Module, impl: str, **kwargs) -> torch.optim.Optimizer:
    """``fsdp2``: as installed (flat by default); ``-dtensor``: default off; ``-flat`` / ``-local``: opt-in."""
    optim = torch.optim.AdamW(model.parameters(), **kwargs)
    if impl in ("fsdp2-flat", "fsdp2-local"):
        import fsdp2

        fsdp2.enable_local_shard_step(optim, flat_buffers=impl == "fsdp2-flat")
    elif impl == "fsdp2-dtensor":
        import fsdp2

        fsdp2.disable_flat_step(optim)
    return optim


def _small_steps(warmup: int, reps: int) -> dict:
    rank = dist.get_rank()
    # a process group per implementation, as each would have in a job of its own: gloo's
    # collectives on a group run slower after another implementation's traffic on it
    # (docs/performance.md, "Many small parameters")
    ranks = list(range(dist.get_world_size()))
    groups = {impl: dist.new_group(ranks) for impl in SMALL_IMPLS}
    models = {impl: _wrap_small(_small_model(), impl, groups[impl]) for impl in SMALL_IMPLS}
    optims = {impl: _optim(m, impl) for impl, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(BATCH, WIDTH, generator=g) for _ in range(4)]
    phases = ("fwd_bwd", "optim", "step_zero", "whole")
    times = {impl: {ph: [] for ph in phases} for impl in SMALL_IMPLS}
    for i in range(warmup + reps):
        for impl in rotated(list(SMALL_IMPLS), i):
            model, optim = models[impl], optims[impl]
            settled()  # each step starts from the same heap (see the module's docstring)
            t0 = time.perf_counter()
            model(inputs[i % len(inputs)]).pow(2).mean().backward()
            t1 = time.perf_counter()
            optim.step()
            t2 = time.perf_counter()
            optim.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if i >= warmup:
                for ph, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t1, t3 - t0)):
                    times[impl][ph].append(dt)
    return {impl: {ph: max_over_ranks(v) for ph, v in t.items()} for impl, t in times.items()}


def _demo_optim_steps(cfg: dict, reps: int) -> dict:
    import fsdp2

    rank = dist.get_rank()
    out: dict = {}
    variants = {
        "dtensor": ("fsdp2-dtensor", {}, None),
        "local": ("fsdp2-local", {}, None),
        "flat": ("fsdp2", {}, None),  # as installed
        "offload-local-fused": ("fsdp2-local", {"fused": True}, fsdp2.CPUOffloadPolicy()),
        "offload-flat-fused": ("fsdp2-flat", {"fused": True}, fsdp2.CPUOffloadPolicy()),
        "offload-flat-foreach": ("fsdp2-flat", {"foreach": True}, fsdp2.CPUOffloadPolicy()),
    }
    optims, models = {}, []  # the models stay alive: a flat step steps their groups' buffers
    for name, (impl, kwargs, offload) in variants.items():
        model = build_model(0, cfg["shape"])
        extra = {"offload_policy": offload} if offload is not None else {}
        for layer in model.layers:
            fsdp2.fully_shard(layer, mesh=cpu_mesh(), **extra)
        fsdp2.fully_shard(model, mesh=cpu_mesh(), **extra)
        optim = _optim(model, impl, lr=1e-3, **kwargs)
        tokens, targets = demo_batch(0, rank, cfg["batch"], cfg["seq"], cfg["shape"]["vocab_size"])
        model_loss(model, tokens, targets).backward()
        optim.step()  # state exists from here on; gradients stay in place
        optims[name] = optim
        models.append(model)
    if fsdp2.optim.flat_step_engine(optims["flat"]) is None:  # else the row times another step
        raise RuntimeError("the demo model's 'flat' variant does not step on flat buffers")
    samples: dict[str, list[float]] = {n: [] for n in variants}
    for i in range(reps):
        for name in rotated(list(variants), i):
            samples[name].append(timed(optims[name].step))
    out = {n: max_over_ranks(v) for n, v in samples.items()}
    return out


def small_params_body(rank: int, world_size: int, cfg: dict) -> dict:
    """Runs on every rank: the small-parameter model, then the demo model's optimizer steps."""
    out = {"small": _small_steps(cfg["warmup"], cfg.get("small_reps", 6))}
    if cfg.get("profile_small"):
        out["profile"] = _profile_flat_step()
    out["demo_optim"] = _demo_optim_steps(cfg, cfg["optim_reps"])
    return out


def _profile_flat_step(reps: int = 5) -> str:
    """cProfile of AdamW's ``step()`` + ``zero_grad()`` as installed (flat) on the small model.

    Rank 0's text; ``reps`` steps after a first one, each after its own
    forward + backward (not profiled).
    """
    import cProfile
    import io
    import pstats

    model = _wrap_small(_small_model(), "fsdp2")
    optim = _optim(model, "fsdp2")
    prof = cProfile.Profile()
    for i in range(reps + 1):
        model(torch.randn(BATCH, WIDTH)).pow(2).mean().backward()
        if i:
            prof.enable()
        optim.step()
        optim.zero_grad(set_to_none=True)
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(16)
    return text.getvalue()


def small_params_rows(raw: dict) -> list[dict]:
    """Table rows: medians in ms, ratios to FSDP1 and to upstream, and the targets."""
    from common import median
    from report import row

    s = raw.get("small_params")
    if not s or "small" not in s:
        return []
    t = {impl: {ph: 1e3 * median(v) for ph, v in d.items()} for impl, d in s["small"].items()}
    rows = []
    labels = {"fwd_bwd": "forward+backward", "optim": "AdamW step",
              "step_zero": "step + zero_grad", "whole": "whole step"}
    names = {"fsdp2": "fsdp2 as installed", "fsdp2-dtensor": "fsdp2 default off"}
    for ph, label in labels.items():
        for impl in ("fsdp2", "fsdp2-dtensor"):
            rows.append(
                row(f"small params ({BLOCKS} blocks), {label}, {names[impl]} (ms; ref = FSDP1)",
                    t[impl][ph], t["torch"][ph], t["fsdp1"][ph])
            )
        rows.append(row(f"small params, {label}, DDP (ms)", t["ddp"][ph], t["torch"][ph]))
    flat = t["fsdp2"]
    step_vs_fsdp1 = flat["optim"] / t["fsdp1"]["optim"]
    step_vs_torch = flat["optim"] / t["torch"]["optim"]
    whole_vs_fsdp1 = flat["whole"] / t["fsdp1"]["whole"]
    zero_vs_fsdp1 = flat["step_zero"] / t["fsdp1"]["step_zero"]
    whole_vs_torch = flat["whole"] / t["torch"]["whole"]
    rows.append(row("small params: AdamW step as installed / FSDP1's", step_vs_fsdp1, None, None,
                    "<= 1.0", step_vs_fsdp1 <= 1.0))
    rows.append(row("small params: AdamW step as installed / torch fully_shard's", step_vs_torch,
                    None, None, "<= 0.1", step_vs_torch <= 0.1))
    rows.append(row("small params: step + zero_grad as installed / FSDP1's", zero_vs_fsdp1, None,
                    None, "<= 1.0", zero_vs_fsdp1 <= 1.0))
    rows.append(row("small params: whole step as installed / FSDP1's", whole_vs_fsdp1, None, None,
                    "<= 0.7", whole_vs_fsdp1 <= 0.7))
    rows.append(row("small params: whole step as installed / torch fully_shard's", whole_vs_torch,
                    None, None, "<= 0.5", whole_vs_torch <= 0.5))
    d = {n: 1e3 * median(v) for n, v in s.get("demo_optim", {}).items()}
    if d:
        rows.append(row("demo model AdamW step: flat as installed (ms; torch col = per-param local, ref = "
                        "DTensor)", d["flat"], d["local"], d["dtensor"], "flat <= local",
                        d["flat"] <= d["local"]))
        rows.append(row("demo model, CPUOffloadPolicy, fused AdamW step: flat (ms; torch col = "
                        "per-param local fused, ref = flat foreach)", d["offload-flat-fused"],
                        d["offload-local-fused"], d["offload-flat-foreach"],
                        "flat <= local", d["offload-flat-fused"] <= d["offload-local-fused"]))
    return rows
