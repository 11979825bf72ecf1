"""Per-group hook CPU overhead: many tiny layers, each its own ``fully_shard`` group.

The model is ``n_layers`` x ``Linear(16, 16)`` in an ``nn.Sequential``; every
layer is sharded, then the root (which holds no parameters of its own). One
iteration is forward + backward of a 4 x 16 batch; ``zero_grad`` runs outside
the timer. The unsharded model runs interleaved with both implementations;
overhead per layer = (time of the sharded model - time of the unsharded one)
/ ``n_layers``, from the medians and from the minimums.

At W = 1 on a real gloo group the collectives are real (but trivial). Under
torch's fake process group (W = 8) collectives do nothing at all, so what is
left is Python and dispatch cost; the gathered values are garbage there.
On a GPU (``device_type="cuda"``, benchmarks/gpu.py) the kernels of such tiny
layers take less time than launching them, so the iteration time is still
host time; each iteration ends with a synchronize outside the timer.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import time

import torch
import torch.nn as nn
from common import FSDP_IMPLS, fully_shard_of, rotated
from torch.distributed.device_mesh import init_device_mesh


def _tiny_model(impl: str, n_layers: int, mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(n_layers))).to(mesh.device_type)
    if impl != "plain":
        fully_shard = fully_shard_of(impl)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _iteration(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def hooks_body(
    rank: int,
    world_size: int,
    n_layers: int,
    reps: int,
    profile: bool,
    device_type: str = "cpu",
) -> dict:
    mesh = init_device_mesh(device_type, (world_size,))
    names = ["plain", *FSDP_IMPLS]
    models = {name: _tiny_model(name, n_layers, mesh) for name in names}
    x = torch.randn(4, 16, device=device_type)
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in names}
    for model in models.values():  # warm-up: lazy init, first-call caches
        for _ in range(3):
            _iteration(model, x)
            model.zero_grad(set_to_none=True)
    gc.collect()
    gc.disable()  # no collector pauses inside the timed iterations
    try:
        for i in range(reps):
            for name in rotated(names, i):
                model = models[name]
                sync()
                t0 = time.perf_counter()
                _iteration(model, x)
                times[name].append(time.perf_counter() - t0)
                sync()
                model.zero_grad(set_to_none=True)
    finally:
        gc.enable()
    out = {"times": times, "n_layers": n_layers}
    if profile:
        out["profile"] = _profile(models["fsdp2"], x, reps)
    return out


def _profile(model: nn.Module, x: torch.Tensor, reps: int) -> dict:
    """cProfile of the fsdp2 model's iterations: top functions by self time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        _iteration(model, x)
        model.zero_grad(set_to_none=True)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = path.split("/site-packages/")[-1].split("/work/main/")[-1]
        rows.append(
            {
                "function": f"{where}:{line}({func})",
                "calls_per_iter": ncalls / reps,
                "self_us_per_iter": 1e6 * tottime / reps,
                "cum_us_per_iter": 1e6 * cumtime / reps,
            }
        )
    rows.sort(key=lambda r: -r["self_us_per_iter"])
    total = sum(r["self_us_per_iter"] for r in rows)
    return {
        "total_us_per_iter": total,
        "top": rows[:25],
        "top_fsdp2": [r for r in rows if r["function"].startswith("fsdp2/")][:15],
    }
