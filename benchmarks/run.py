"""fsdp2 vs torch.distributed.fsdp.fully_shard (and DDP), side by side, in one launch.

    python benchmarks/run.py            # everything, ~5-8 minutes on 2 CPU cores
    python benchmarks/run.py --quick    # smaller model, fewer repetitions: ~1 minute
    python benchmarks/run.py --profile  # also cProfile fsdp2 in the W=1 hook benchmark

Prints one markdown table (medians, ratios fsdp2 / torch, DDP or unsharded
reference, target), writes benchmarks/out/results.json (rows, raw samples,
configuration) and benchmarks/out/results.png (the ratios). Every multi-rank
part runs in forked gloo processes (``torch.set_num_threads(1)`` each) with a
timeout; see the module docstrings of bench_*.py and instruments.py for what
each number measures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _ranks import launch  # noqa: E402
from bench_bytes import bytes_body  # noqa: E402
from bench_checkpoint import checkpoint_body  # noqa: E402
from bench_divergence import store_body  # noqa: E402
from bench_hooks import hooks_body  # noqa: E402
from bench_hsdp_optim import hsdp_optim_body  # noqa: E402
from bench_materialize import LLAMA_70B, materialize_body  # noqa: E402
from bench_moe import moe_body  # noqa: E402
from bench_muon import muon_body  # noqa: E402
from bench_offload import offload_body_all  # noqa: E402
from bench_pipeline import pipeline_body  # noqa: E402
from bench_small_params import small_params_body  # noqa: E402
from bench_step import step_body  # noqa: E402
from model import BENCH_SHAPE, MODEL_SOURCE  # noqa: E402
from report import markdown, write_json, write_png  # noqa: E402
from summary import NOTES, build_rows, profile_text  # noqa: E402

FULL = {
    "shape": BENCH_SHAPE,
    "batch": 1,
    "seq": 64,
    "warmup": 2,
    "steps": 24,
    "optim_reps": 15,
    "hook_layers": 128,
    "hook_reps": 100,
    "materialize_shape": LLAMA_70B,
    "materialize_reps": 5,
    "ckpt_reps": 6,
    "ckpt_integrity_reps": 6,
    "muon_shape": {
        "vocab_size": 1024, "dim": 256, "n_layers": 4, "n_heads": 4, "ffn_hidden_dim": 704,
    },
    "muon_reps": 5,
    "hsdp_shape": {
        "vocab_size": 1024, "dim": 256, "n_layers": 4, "n_heads": 4, "ffn_hidden_dim": 704,
    },
    "hsdp_reps": 10,
    "moe_shape": {"vocab": 512, "dim": 128, "hidden": 256, "num_experts": 8, "n_layers": 4},
    "moe_tokens": 256,
    "moe_steps": 12,
    "divergence_world_size": 16384,
    "small_reps": 8,
    "offload": {
        "shape": BENCH_SHAPE, "batch": 2, "seq": 64, "warmup": 1, "steps": 6,
        "unit_bytes": 8 << 20, "timeout": 420,
    },
    "timeout": 420,
}
QUICK = {
    "shape": {"vocab_size": 1024, "dim": 256, "n_layers": 4, "n_heads": 4, "ffn_hidden_dim": 704},
    "batch": 1,
    "seq": 32,
    "warmup": 1,
    "steps": 4,
    "optim_reps": 3,
    "hook_layers": 64,
    "hook_reps": 15,
    "materialize_shape": {**LLAMA_70B, "n_layers": 8},
    "materialize_reps": 1,
    "ckpt_reps": 2,
    "ckpt_integrity_reps": 2,
    "muon_shape": {
        "vocab_size": 256, "dim": 128, "n_layers": 2, "n_heads": 4, "ffn_hidden_dim": 352,
    },
    "muon_reps": 2,
    "hsdp_shape": {
        "vocab_size": 256, "dim": 128, "n_layers": 2, "n_heads": 4, "ffn_hidden_dim": 352,
    },
    "hsdp_reps": 3,
    "moe_shape": {"vocab": 64, "dim": 32, "hidden": 64, "num_experts": 4, "n_layers": 2},
    "moe_tokens": 64,
    "moe_steps": 3,
    "divergence_world_size": 1024,
    "small_reps": 2,
    "offload": {
        "shape": {"vocab_size": 1024, "dim": 256, "n_layers": 4, "n_heads": 4, "ffn_hidden_dim": 704},
        "batch": 2, "seq": 64, "warmup": 1, "steps": 3, "unit_bytes": 8 << 20, "timeout": 120,
    },
    "timeout": 120,
}
WORLD_SIZE = 2
FAKE_WORLD_SIZE = 8
MUON_WORLD_SIZE = 4
MOE_WORLD_SIZE = 4
MATERIALIZE_WORLD_SIZE = 1024
HSDP_FAKE_MESH = (8, 128)  # (replicate, shard) for the optimizer-state memory rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~1 minute smoke run")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile fsdp2 in the W=1 hook benchmark, print top self times",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "out"), help="output folder")
    args = parser.parse_args()
    cfg = dict(QUICK if args.quick else FULL, profile_small=args.profile)
    torch.set_num_threads(1)
    import fsdp2  # noqa: F401  - imported once here, inherited by every forked rank

    started = time.monotonic()
    raw: dict = {
        "config": cfg,
        "model": MODEL_SOURCE,
        "world_size": WORLD_SIZE,
        "torch": torch.__version__,
        "load_average_at_start": os.getloadavg(),
    }
    stages = [
        ("step", lambda: launch(step_body, WORLD_SIZE, cfg, timeout=cfg["timeout"])[0]),
        (
            "hooks_w1",
            lambda: launch(
                hooks_body,
                1,
                cfg["hook_layers"],
                cfg["hook_reps"],
                args.profile,
                timeout=cfg["timeout"],
            )[0],
        ),
        (
            "hooks_fake",
            lambda: launch(
                hooks_body,
                FAKE_WORLD_SIZE,
                cfg["hook_layers"],
                cfg["hook_reps"],
                False,
                backend="fake",
                timeout=cfg["timeout"],
            )[0],
        ),
        ("bytes", lambda: launch(bytes_body, WORLD_SIZE, cfg, timeout=cfg["timeout"])[0]),
        (
            "materialize",
            lambda: launch(
                materialize_body,
                MATERIALIZE_WORLD_SIZE,
                cfg["materialize_shape"],
                cfg["materialize_reps"],
                backend="fake",
                timeout=cfg["timeout"],
            )[0],
        ),
        ("pipeline", lambda: launch(pipeline_body, 4, cfg, timeout=cfg["timeout"])),
        ("checkpoint", lambda: launch(checkpoint_body, WORLD_SIZE, cfg, timeout=cfg["timeout"])[0]),
        ("muon", lambda: launch(muon_body, MUON_WORLD_SIZE, cfg, timeout=cfg["timeout"])[0]),
        (
            "muon_fake",
            lambda: launch(
                muon_body, FAKE_WORLD_SIZE, cfg, backend="fake", timeout=cfg["timeout"]
            )[0],
        ),
        (
            "hsdp_optim",
            lambda: launch(hsdp_optim_body, 4, cfg, (2, 2), timeout=cfg["timeout"])[0],
        ),
        (
            "hsdp_optim_fake",
            lambda: launch(hsdp_optim_body, HSDP_FAKE_MESH[0] * HSDP_FAKE_MESH[1], cfg,
                           HSDP_FAKE_MESH, backend="fake", timeout=cfg["timeout"])[0],
        ),
        ("moe", lambda: launch(moe_body, MOE_WORLD_SIZE, cfg, timeout=cfg["timeout"])[0]),
        ("offload", lambda: offload_body_all(cfg["offload"], WORLD_SIZE)),
        (
            "small_params",
            lambda: launch(small_params_body, WORLD_SIZE, cfg, timeout=cfg["timeout"])[0],
        ),
        (
            "divergence",
            lambda: launch(store_body, 1, cfg["divergence_world_size"],
                           timeout=cfg["timeout"])[0],
        ),
    ]
    only = os.environ.get("FSDP2_BENCH_ONLY")  # e.g. "pipeline": run one part while developing
    if only:
        stages = [(name, stage) for name, stage in stages if name in only.split(",")]
    for name, stage in stages:
        t0 = time.monotonic()
        print(f"[{time.monotonic() - started:6.1f}s] {name} ...", flush=True)
        try:
            raw[name] = stage()
        except Exception as exc:  # noqa: BLE001 - report the failure, run the rest
            raw[name] = {"error": str(exc)}
            print(f"  FAILED: {exc}", file=sys.stderr, flush=True)
        raw[name + "_seconds"] = time.monotonic() - t0
    raw["seconds"] = time.monotonic() - started

    rows = build_rows(raw)
    title = (
        f"{'quick' if args.quick else 'full'} run, W={WORLD_SIZE} gloo ranks, "
        f"{raw['model']}, torch {torch.__version__}"
    )
    print()
    print(f"fsdp2 vs torch fully_shard ({title}); medians unless noted")
    print()
    print(markdown(rows))
    paired = [
        f"{r['name'].split(' (')[0]}: {r['paired_ratio']:.3f}" for r in rows if "paired_ratio" in r
    ]
    print()
    print(NOTES)
    if paired:
        print("- paired step-time ratios: " + "; ".join(paired))
    print(
        f"- machine load average at start: {raw['load_average_at_start'][0]:.1f} "
        f"({os.cpu_count()} CPUs)"
    )
    if args.profile and "profile" in raw.get("hooks_w1", {}):
        print()
        print(profile_text(raw["hooks_w1"]))
    if args.profile and "profile" in raw.get("small_params", {}):
        print()
        print("cProfile of one flat AdamW step, small-parameter model (rank 0):")
        print(raw["small_params"]["profile"])
    write_json(os.path.join(args.out, "results.json"), {"rows": rows, "raw": raw})
    print()
    print(f"wrote {os.path.join(args.out, 'results.json')}")
    print(write_png(os.path.join(args.out, "results.png"), rows, title))
    print(f"total {raw['seconds']:.0f} s")
    failed = [name for name, _ in stages if "error" in raw[name]]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
