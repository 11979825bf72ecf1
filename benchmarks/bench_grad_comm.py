"""Gradient exchange in fewer bytes (``fsdp2.GradientCommPolicy``): bytes and error, side by side.

    python benchmarks/bench_grad_comm.py            # W = 2, 4, 8 (gloo ranks on this machine)

The demo's model at the demo's size (``SHAPE``), one ``fully_shard`` per block
and the root, one backward of the same batch per variant. For each variant:

* bytes: what a rank hands the gradient collectives in one step (the
  reduce-scatter's or all-to-all's input, ``instruments.CommCounter``), against
  the fp32 reduce-scatter's;
* error: the reduced gradient's relative (Frobenius) error against the fp32
  reduce-scatter's, and the error of the sum of 8 reductions of that same
  gradient against 8 times it (what error feedback is for).

Variants: upstream's lever (``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``:
the reduce-scatter sums in bf16), and fsdp2's payloads (summed in fp32), with
and without error feedback.
"""

from __future__ import annotations

import sys

import torch
from _ranks import launch
from common import cpu_mesh
from instruments import CommCounter
from model import batch, build_model, model_loss

import fsdp2

VARIANTS = {
    "fp32 reduce-scatter": None,
    "bf16 reduce-scatter (upstream's reduce_dtype)": "bf16-sum",
    "bf16 exchange, fp32 sum": fsdp2.GradientCommPolicy(torch.bfloat16),
    "fp8 e4m3 blocks of 128": fsdp2.GradientCommPolicy(torch.float8_e4m3fn),
    "fp8 e5m2 blocks of 128": fsdp2.GradientCommPolicy(torch.float8_e5m2),
    "int8 blocks of 128": fsdp2.GradientCommPolicy(torch.int8),
    "fp8 e4m3, error feedback": fsdp2.GradientCommPolicy(torch.float8_e4m3fn, error_feedback=True),
    "int8, error feedback": fsdp2.GradientCommPolicy(torch.int8, error_feedback=True),
}
REPEATS = 8
SHAPE = {"vocab_size": 512, "dim": 128, "n_layers": 4, "n_heads": 4, "ffn_hidden_dim": 352}


def _model(variant):
    mp = fsdp2.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if variant == "bf16-sum" else None
    kw = {"mp_policy": mp} if mp is not None else {}
    model = build_model(0, SHAPE)
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=cpu_mesh(), **kw)
    fsdp2.fully_shard(model, mesh=cpu_mesh(), **kw)
    if isinstance(variant, fsdp2.GradientCommPolicy):
        for m in [*model.layers, model]:
            m.set_gradient_comm_policy(variant)
    return model


def _reduced(model, tokens, targets) -> list[torch.Tensor]:
    model_loss(model, tokens, targets).backward()
    grads = [p.grad.full_tensor().float() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((g - w).double().norm() ** 2) for g, w in zip(got, want))
    return (num / sum(float(w.double().norm() ** 2) for w in want)) ** 0.5


def body(rank: int, world_size: int) -> dict:
    tokens, targets = batch(0, rank, 4, 64, SHAPE["vocab_size"])
    rows = {}
    want = None
    for name, variant in VARIANTS.items():
        model = _model(variant)
        with CommCounter(also=("all_to_all_single",)) as sent:
            first = _reduced(model, tokens, targets)
        total = first
        for _ in range(REPEATS - 1):
            total = [t + g for t, g in zip(total, _reduced(model, tokens, targets))]
        sent_bytes = sum(n for name, n in sent.bytes.items()
                         if "reduce_scatter" in name or name == "all_to_all_single")
        if want is None:
            want, fp32_bytes = first, sent_bytes
        rows[name] = {
            "bytes": sent_bytes / fp32_bytes,
            "error": _error(first, want),
            "error_of_sum": _error(total, [REPEATS * w for w in want]),
        }
    return rows


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [2, 4, 8]
    results = {w: launch(body, w, timeout=900)[0] for w in sizes}
    print("| variant | bytes / fp32's | " + " | ".join(
        f"error W={w} | error of {REPEATS} summed W={w}" for w in sizes) + " |")
    print("|---|---:|" + "---:|---:|" * len(sizes))
    for name in VARIANTS:
        cells = [f"{results[w][name]['error']:.2e} | {results[w][name]['error_of_sum']:.2e}" for w in sizes]
        print(f"| {name} | {results[sizes[0]][name]['bytes']:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
