"""Block-scaled fp8 all-gather against fp32 and bf16 all-gathers, side by side.

    python benchmarks/bench_fp8_tiles.py [--quick]

One launch of W = 2 gloo ranks trains an MLP stack (fp32 master weights,
every block its own ``fully_shard``) four ways: fp32 gathered as is, bf16
gathered (``MixedPrecisionPolicy(param_dtype=bf16)``), and
``fsdp2.quant.gather_fp8_tiles`` (computing in fp32, and in bf16). It prints
per step and rank the bytes every all-gather carries in one forward (counted
at the collective, against the analytic figure: one byte per element plus 4
per 128 x 128 tile for fp8; 2 or 4 per element otherwise) and the median
step time over interleaved steps (the slowest rank's). On gloo the fp8
codes travel as ``uint8`` and quantizing costs CPU time; the bytes are what
carries over to an accelerator's interconnect.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
from _ranks import launch
from common import cpu_mesh, max_over_ranks, median, rotated, timed
from instruments import CommCounter
from model import REPO

if REPO not in sys.path:
    sys.path.insert(1, REPO)

SHAPES = {"full": {"dim": 1024, "blocks": 4}, "quick": {"dim": 512, "blocks": 2}}
VARIANTS = ("fp32", "bf16", "fp8 tiles (fp32 compute)", "fp8 tiles (bf16 compute)")
TILE = 128


def _build(variant: str, shape: dict):
    from fsdp2 import MixedPrecisionPolicy, fully_shard
    from fsdp2.quant import gather_fp8_tiles

    torch.manual_seed(0)
    d = shape["dim"]
    model = nn.Sequential(*[
        nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))
        for _ in range(shape["blocks"])
    ])
    bf16 = variant in ("bf16", "fp8 tiles (bf16 compute)")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    for block in model:
        fully_shard(block, mesh=cpu_mesh(), mp_policy=mp)
    fully_shard(model, mesh=cpu_mesh(), mp_policy=mp)
    if variant.startswith("fp8"):
        gather_fp8_tiles(model, TILE)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, optim, i: int, rank: int, d: int) -> None:
    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randn(8, d, generator=g)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _analytic(model, variant: str) -> int:
    """All-gather bytes of one forward: every weight once."""
    total = 0
    for p in model.parameters():
        rows, cols = p.shape
        if variant.startswith("fp8"):
            total += rows * cols + 4 * (-(-rows // TILE)) * (-(-cols // TILE))
        else:
            total += rows * cols * (2 if variant == "bf16" else 4)
    return total


def body(rank: int, world_size: int, cfg: dict) -> dict:
    shape = SHAPES[cfg["size"]]
    d = shape["dim"]
    runs, out = {}, {}
    for variant in VARIANTS:
        model, optim = _build(variant, shape)
        for i in range(cfg["warmup"]):
            _step(model, optim, i, rank, d)
        with CommCounter() as comms, torch.no_grad():
            model(torch.zeros(2, d))
        gathered = sum(v for k, v in comms.bytes.items() if "all_gather" in k)
        out[variant] = {"gathered": gathered, "analytic": _analytic(model, variant)}
        runs[variant] = (model, optim)
    times: dict = {v: [] for v in VARIANTS}
    for i in range(cfg["steps"]):
        for variant in rotated(list(VARIANTS), i):
            times[variant].append(timed(_step, *runs[variant], 100 + i, rank, d))
    for variant in VARIANTS:
        out[variant]["step_ms"] = 1e3 * median(max_over_ranks(times[variant]))
    return out


def table(result: dict) -> str:
    rows = ["| all-gather | bytes per forward (MB) | analytic (MB) | ratio to bf16 | step (ms) |",
            "|---|---:|---:|---:|---:|"]
    bf16 = result["bf16"]["gathered"]
    for variant in VARIANTS:
        r = result[variant]
        rows.append(f"| {variant} | {r['gathered'] / 1e6:.3f} | {r['analytic'] / 1e6:.3f} | "
                    f"{r['gathered'] / bf16:.3f} | {r['step_ms']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cfg = {"size": "quick" if args.quick else "full", "warmup": 2, "steps": 4 if args.quick else 10}
    print(table(launch(body, 2, cfg, timeout=1800)[0]))


if __name__ == "__main__":
    main()
