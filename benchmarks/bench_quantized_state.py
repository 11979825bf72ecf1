"""Low-bit optimizer state, W=2: state bytes per rank and step time, fsdp2 next to upstream.

    python benchmarks/bench_quantized_state.py [--quick]

One launch of W = 2 gloo ranks holds, side by side, the same model
(``--quick``: 4 x ``Linear(512, 512)``; default 8 x ``Linear(1024, 1024)``,
no biases, each layer its own group) sharded five ways and stepped with
random gradients: torch's fp32 ``AdamW`` on fsdp2 (the flat
step), torchao's ``AdamW8bit`` on upstream's ``fully_shard`` (dim-0 shards),
and torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8`` on fsdp2's
block-aligned layout (``RaggedShard(256)``). Per rank: the bytes of the
optimizer state (codes, scales, fp32 values, step counters; one rank's
shard) against fp32 AdamW's, and the median ``optimizer.step()`` time over
interleaved steps (the slowest rank's), after two steps that compile
torchao's step.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
from _ranks import launch
from common import cpu_mesh, max_over_ranks, median, rotated, timed
from model import REPO
from torch.distributed.tensor import DTensor

if REPO not in sys.path:
    sys.path.insert(1, REPO)

SHAPES = {"full": (8, 1024), "quick": (4, 512)}
SETUPS = (  # (label, sharding, optimizer)
    ("AdamW fp32, fsdp2", "fsdp2", "AdamW"),
    ("AdamW8bit, torch fully_shard", "torch", "AdamW8bit"),
    ("AdamW8bit, fsdp2 RaggedShard(256)", "ragged", "AdamW8bit"),
    ("AdamW4bit, fsdp2 RaggedShard(256)", "ragged", "AdamW4bit"),
    ("AdamWFp8, fsdp2 RaggedShard(256)", "ragged", "AdamWFp8"),
)


def _build(sharding: str, optimizer: str, shape: tuple[int, int]):
    import torchao.optim

    import fsdp2

    layers, dim = shape
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    if sharding == "torch":
        from torch.distributed.fsdp import fully_shard
        kwargs = {}
    else:
        fully_shard = fsdp2.fully_shard
        kwargs = {"shard_placement_fn": lambda p: fsdp2.RaggedShard(256)} if sharding == "ragged" else {}
    for layer in model:
        fully_shard(layer, mesh=cpu_mesh(), **kwargs)
    fully_shard(model, mesh=cpu_mesh(), **kwargs)
    cls = torch.optim.AdamW if optimizer == "AdamW" else getattr(torchao.optim, optimizer)
    return model, cls(model.parameters(), lr=1e-3)


def _set_grads(model: nn.Module, step: int) -> None:
    """Random gradients of each parameter's local shape (the step's work, not its values, counts)."""
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        grad = torch.randn(p.to_local().shape, generator=gen)
        p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride())


def _state_bytes(optim: torch.optim.Optimizer) -> int:
    """Bytes of one rank's optimizer state: every tensor inside a quantized state counts."""
    total = 0
    for state in optim.state.values():
        for value in state.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            inner = [getattr(local, name) for name in getattr(local, "tensor_attrs", ())]
            for t in inner or [local]:
                total += t.numel() * t.element_size()
    return total


def body(rank: int, world_size: int, shape: tuple[int, int], steps: int) -> dict:
    setups = {label: _build(sharding, name, shape) for label, sharding, name in SETUPS}
    for step in range(2):  # state made, torchao's step compiled
        for model, optim in setups.values():
            _set_grads(model, step)
            optim.step()
    times: dict[str, list[float]] = {label: [] for label in setups}
    for step in range(steps):
        for label in rotated(list(setups), step):
            model, optim = setups[label]
            _set_grads(model, 2 + step)
            times[label].append(timed(optim.step))
    return {label: {"bytes": _state_bytes(optim),
                    "step_ms": median(max_over_ranks(times[label])) * 1e3}
            for label, (_, optim) in setups.items()}


def table(rows: dict) -> str:
    base = rows[SETUPS[0][0]]["bytes"]
    ref = rows[SETUPS[1][0]]["step_ms"]
    lines = ["| optimizer, sharding | state bytes / rank | vs fp32 AdamW | step ms | vs torchao on upstream |",
             "|---|---:|---:|---:|---:|"]
    for label, row in rows.items():
        lines.append(f"| {label} | {row['bytes']:,} | {row['bytes'] / base:.3f}x | "
                     f"{row['step_ms']:.1f} | {row['step_ms'] / ref:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps")
    args = parser.parse_args()
    shape = SHAPES["quick" if args.quick else "full"]
    per_rank = launch(body, 2, shape, 5 if args.quick else 15, timeout=1800)
    layers, dim = shape
    print(f"{layers} x Linear({dim}, {dim}), W=2 gloo, 1 thread per rank; rank 0's state")
    print(table(per_rank[0]))


if __name__ == "__main__":
    main()
