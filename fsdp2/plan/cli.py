"""``python -m fsdp2.plan``: plan a training run from the command line.

    python -m fsdp2.plan --hf-config llama-3-70b --world-size 1024 --param-dtype bf16 \\
        --seq-len 4096 --plot plan.png --json plan.json
    python -m fsdp2.plan --model examples/model.py:demo_model --world-size 2 --seq-len 64
    python -m fsdp2.plan --hf-config llama-3-8b --world-size 64 --search --memory-limit 60
    python -m fsdp2.plan --hf-config deepseek-v3 --layouts --world-size 8,64,256,1024

``--hf-config`` takes a ``config.json`` path or a shipped name
(``llama-3-8b``, ``llama-3-70b``, ``gpt2``; see ``--list-configs``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

from fsdp2.plan.cost import DEVICES, get_device
from fsdp2.plan.layouts import config_groups, layout_rows, layout_table, module_groups
from fsdp2.plan.planner import plan
from fsdp2.plan.report import search_table
from fsdp2.plan.search import search
from fsdp2.plan.simulate import DTYPES, OPTIMIZERS, PlanConfig
from fsdp2.plan.workload import build_model, load_hf_config, select_groups, shipped_configs

GiB = 1024**3


def _bool_or_int(text: str) -> bool | int:
    low = text.lower()
    if low in ("true", "1.0", "yes"):
        return True
    if low in ("false", "no"):
        return False
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--reshard-after-forward {text!r}: expected true, false or an int (ranks per group)"
        ) from None


def _world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--world-size {text!r}: expected sizes >= 1 (8 or 8,64)")
    return sizes


def _layouts(args: argparse.Namespace) -> str:
    """The ``--layouts`` report: shapes from the config (analytically) or from the model on meta."""
    if args.hf_config is not None:
        groups = config_groups(load_hf_config(args.hf_config))
    else:
        with torch.device("meta"):
            model = build_model(None, args.model, torch.float32)
        patterns = args.groups.split(",") if args.groups else None
        groups = module_groups(model, select_groups(model, patterns))
    return layout_table(layout_rows(groups, args.world_size))


def _mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--mesh {text!r}: expected sizes separated by commas: shard, "
            "replicate,shard or replicate,shard,tp (e.g. 8,128)"
        ) from None
    return shape


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fsdp2.plan",
        description="Simulate one fsdp2 training step at the target world size (fake tensors, "
        "fake process group) and report per-rank peak memory, bytes per step and step time.",
    )
    src = p.add_argument_group("model (one of)")
    src.add_argument("--hf-config", help="Hugging Face config.json path or shipped name")
    src.add_argument("--model", help="module:function or file.py:function returning an nn.Module")
    src.add_argument("--list-configs", action="store_true", help="list the shipped configs")
    run = p.add_argument_group("parallelism and training")
    run.add_argument("--world-size", type=_world_sizes, default=(8,),
                     help="ranks (with --layouts: several, comma-separated)")
    run.add_argument("--mesh", type=_mesh, help="replicate,shard[,tp] sizes (default: W)")
    run.add_argument(
        "--groups",
        help="comma-separated fnmatch patterns of modules that get fully_shard "
        "(default: the transformer blocks; the root always does)",
    )
    run.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameter dtype")
    run.add_argument("--param-dtype", choices=sorted(DTYPES), help="mixed precision: compute dtype")
    run.add_argument("--reduce-dtype", choices=sorted(DTYPES), help="mixed precision: reduce dtype")
    run.add_argument("--reshard-after-forward", type=_bool_or_int, default=True, metavar="true|false|N")
    run.add_argument("--activation-checkpointing", action="store_true")
    run.add_argument("--cpu-offload", action="store_true")
    run.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    run.add_argument("--shard-optim-across-replicas", action="store_true",
                     help="HSDP: optimizer state sharded over the replicate dim too (fsdp2 only)")
    run.add_argument("--batch-size", type=int, default=1, help="per data-parallel rank")
    run.add_argument("--seq-len", type=int, default=2048)
    run.add_argument("--implementation", default="fsdp2", choices=("fsdp2", "torch"),
                     help="simulate fsdp2 (default) or torch's fully_shard")
    dev = p.add_argument_group("device and cost model")
    dev.add_argument("--gpu", default="h100", help=f"one of {sorted(DEVICES)}")
    dev.add_argument("--gpu-memory-gib", type=float, dest="memory_gib")
    dev.add_argument("--tflops", type=float, dest="peak_tflops", help="peak dense TFLOP/s")
    dev.add_argument("--mfu", type=float, help="fraction of peak FLOP/s reached (default 0.4)")
    dev.add_argument("--hbm-gbps", type=float)
    dev.add_argument("--intra-node-gbps", type=float)
    dev.add_argument("--inter-node-gbps", type=float)
    dev.add_argument("--gpus-per-node", type=int)
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="OUT", help="write the numbers as JSON")
    out.add_argument("--plot", metavar="OUT.png", help="plot live memory across the step")
    out.add_argument("--search", action="store_true", help="rank configurations by step time")
    out.add_argument("--layouts", action="store_true",
                     help="the padding of each shard layout (dim-0 chunks, parameter-major rows, "
                     "tiles, blocks) at each --world-size (a comma list here); builds nothing")
    out.add_argument("--memory-limit", type=float, metavar="GIB",
                     help="search: memory limit per rank (default: the device's memory)")
    return p


def _one_world_size(sizes: tuple[int, ...]) -> int:
    if len(sizes) != 1:
        raise ValueError(f"--world-size {','.join(map(str, sizes))}: give one size (several only with --layouts)")
    return sizes[0]


def config_from_args(args: argparse.Namespace) -> PlanConfig:
    """The ``PlanConfig`` the command line asks for."""
    return PlanConfig(
        hf_config=args.hf_config,
        model=args.model,
        world_size=_one_world_size(args.world_size),
        mesh=args.mesh,
        groups=args.groups.split(",") if args.groups else None,
        dtype=args.dtype,
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        reshard_after_forward=args.reshard_after_forward,
        activation_checkpointing=args.activation_checkpointing,
        cpu_offload=args.cpu_offload,
        optimizer=args.optimizer,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        implementation=args.implementation,
        shard_optim_across_replicas=args.shard_optim_across_replicas,
    )


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.list_configs:
        print("\n".join(shipped_configs()))
        return
    if (args.hf_config is None) == (args.model is None):
        parser().error("give exactly one of --hf-config and --model")
    if args.plot:  # fail before a long simulation, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser().error("--plot needs matplotlib, which fsdp2 does not depend on: pip install matplotlib")
    if args.layouts:
        try:
            print(_layouts(args))
        except (ValueError, ImportError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        return
    warnings.filterwarnings("ignore")  # fake tensors and DTensor on CPU warn; nothing to act on
    overrides = {
        k: getattr(args, k)
        for k in ("memory_gib", "peak_tflops", "mfu", "hbm_gbps", "intra_node_gbps",
                  "inter_node_gbps", "gpus_per_node")
    }
    try:
        device = get_device(args.gpu, **overrides)
        cfg = config_from_args(args)
        if args.search:
            limit = int(args.memory_limit * GiB) if args.memory_limit else None
            plans = search(cfg, device, limit, progress=lambda m: print(m, file=sys.stderr))
            print(search_table(plans, limit or int(device.memory_gib * GiB)))
            print()
            best = plans[0]
        else:
            best = plan(cfg, device)
    except (ValueError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(best.table())
    if args.json:
        data = best.to_dict()
        if args.search:
            data["search"] = [p.to_dict() for p in plans]
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1, default=str)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {best.plot(args.plot)}")


if __name__ == "__main__":
    main()
