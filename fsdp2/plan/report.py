"""A plan as a table, as JSON numbers, and as a plot of live memory across the step."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from fsdp2.plan.tracker import CATEGORIES

if TYPE_CHECKING:
    from fsdp2.plan.planner import Plan

GiB = 1024**3
LABELS = {
    "parameters": "sharded parameters",
    "gradients": "sharded gradients",
    "optimizer": "optimizer state",
    "unsharded": "unsharded groups in flight",
    "comm": "collective buffers",
    "activations": "activations + temporaries",
}
COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer": "#55a868",
    "unsharded": "#c44e52",
    "comm": "#8172b3",
    "activations": "#937860",
}


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def config_dict(cfg) -> dict[str, Any]:
    """The plan's configuration, JSON-ready (callables by name)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if callable(value):
            value = getattr(value, "__qualname__", repr(value))
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    out["mesh"] = list(cfg.mesh_shape())
    return out


def plan_dict(p: Plan) -> dict[str, Any]:
    """Every number of a plan, JSON-ready."""
    sim = p.simulation
    return {
        "config": config_dict(p.config),
        "device": p.device.as_dict(),
        "num_params": p.num_params,
        "peak_bytes_per_rank": p.peak_bytes_per_rank,
        "peak_breakdown_bytes": p.peak_breakdown,
        "peak_phase": p.peak_phase,
        "host_bytes_per_rank": p.host_bytes_per_rank,
        "state_bytes_per_rank": sim.state_bytes,
        "fits": p.fits,
        "comm_bytes_per_step": p.comm_bytes_per_step,
        "comm_calls_per_step": p.comm_calls_per_step,
        "flops_per_step": p.flops_per_step,
        "flops_by_phase": sim.flops,
        "step_time": p.time,
        "simulation_seconds": sim.seconds,
        "simulation_cpu_seconds": sim.cpu_seconds,
    }


def _mesh_text(shape: tuple[int, ...]) -> str:
    if len(shape) == 1:
        return f"FSDP over {shape[0]}"
    if len(shape) == 2:
        return f"HSDP {shape[0]} x {shape[1]} (replicate x shard)"
    return f"HSDP {shape[0]} x {shape[1]} x TP {shape[2]}"


def plan_table(p: Plan) -> str:
    """The human-readable report: settings, memory breakdown, traffic, time."""
    cfg, dev, t = p.config, p.device, p.time
    model = cfg.hf_config if cfg.hf_config is not None else cfg.model
    if isinstance(model, dict):
        model = model.get("model_type", "hf config")
    elif callable(model):
        model = getattr(model, "__qualname__", repr(model))
    mp = f"param {cfg.param_dtype or cfg.dtype}, reduce {cfg.reduce_dtype or cfg.param_dtype or cfg.dtype}"
    lines = [
        f"fsdp2 plan: {model} ({p.num_params / 1e9:.2f}B params), {_mesh_text(cfg.mesh_shape())}, "
        f"W={cfg.world_size}",
        f"  dtype {cfg.dtype} ({mp}), reshard_after_forward={cfg.reshard_after_forward}, "
        f"activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}, "
        f"CPU offload {'on' if cfg.cpu_offload else 'off'}, {cfg.optimizer}"
        f"{' (state sharded across replicas)' if cfg.shard_optim_across_replicas else ''}, "
        f"batch {cfg.batch_size} x seq {cfg.seq_len} per rank",
        "",
        f"Peak memory per rank: {_gib(p.peak_bytes_per_rank)} (in {p.peak_phase}) of "
        f"{dev.memory_gib:g} GiB on {dev.name}: {'fits' if p.fits else 'DOES NOT FIT'}",
    ]
    for c in CATEGORIES:
        lines.append(f"  {LABELS[c]:<28} {_gib(p.peak_breakdown.get(c, 0)):>14}")
    if cfg.cpu_offload:
        lines.append(f"  host memory (offloaded state) {_gib(p.host_bytes_per_rank):>12}")
    lines.append(f"  {'optimizer state held':<28} {_gib(p.simulation.state_bytes['optimizer']):>14}")
    lines += ["", "Communication per step per rank (logical bytes, calls):"]
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
        if kind in p.comm_bytes_per_step:
            lines.append(
                f"  {kind:<28} {_gb(p.comm_bytes_per_step[kind]):>14}  "
                f"{p.comm_calls_per_step[kind]:>5}"
            )
    lines.append(f"  {'total':<28} {_gb(p.comm_bytes_per_step['total']):>14}")
    lines += [
        "",
        f"Estimated step time: {t['step_s_overlap'] * 1e3:,.1f} ms with overlap, "
        f"{t['step_s_no_overlap'] * 1e3:,.1f} ms without",
        f"  compute {t['compute_s'] * 1e3:,.1f} ms ({p.flops_per_step / 1e12:,.1f} TFLOP at "
        f"{dev.mfu:.0%} of {dev.peak_tflops:g} TFLOP/s), communication {t['comm_s'] * 1e3:,.1f} ms "
        f"(intra-node {dev.intra_node_gbps:g} GB/s, inter-node {dev.inter_node_gbps:g} GB/s, "
        f"{dev.gpus_per_node} GPUs per node)",
        f"  (simulated in {p.simulation.seconds:.1f} s, {p.simulation.cpu_seconds:.1f} s CPU; see docs/plan.md for the model and its limits)",
    ]
    return "\n".join(lines)


def _downsample(n: int, limit: int = 4000) -> list[int]:
    step = max(1, n // limit)
    return list(range(0, n, step))


def plot_timeline(p: Plan, path: str) -> str:
    """Stacked live memory by category across the step, phases shaded, peak marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib, which fsdp2 does not depend on: pip install matplotlib"
        ) from exc
    tl = p.simulation.timeline
    idx = _downsample(len(tl.totals))
    if tl.peak_index not in idx:
        idx = sorted({*idx, tl.peak_index})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ys = [[tl.by_category[c][i] / GiB for i in idx] for c in CATEGORIES]
    ax.stackplot(idx, ys, labels=[LABELS[c] for c in CATEGORIES], colors=[COLORS[c] for c in CATEGORIES])
    n = len(tl.totals)
    bounds = [(s, name) for s, name in tl.phases if name in ("forward", "backward", "optimizer")]
    for k, (start, name) in enumerate(bounds):
        end = bounds[k + 1][0] if k + 1 < len(bounds) else n
        ax.axvspan(start, end, color="0.9" if k % 2 else "0.97", zorder=-1)
        ax.text((start + end) / 2, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom")
    peak = tl.totals[tl.peak_index] / GiB if tl.totals else 0
    ax.plot([tl.peak_index], [peak], "k^")
    ax.annotate(
        f"peak {peak:,.2f} GiB", (tl.peak_index, peak), textcoords="offset points", xytext=(6, 4)
    )
    cfg = p.config
    model = cfg.hf_config if isinstance(cfg.hf_config, str) else "model"
    ax.set_title(
        f"{model}, W={cfg.world_size}, mesh {'x'.join(map(str, cfg.mesh_shape()))}: "
        "live memory per rank (rank 0)",
        pad=18,
    )
    ax.set_xlabel("allocation events through one training step")
    ax.set_ylabel("GiB")
    ax.set_xlim(0, max(1, n - 1))
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def search_table(plans: list[Plan], memory_limit: int) -> str:
    """Ranked configurations: those that fit first, fastest first."""
    head = (
        f"{'#':>2}  {'mesh':<12} {'reshard':<8} {'AC':<4} {'offload':<8} "
        f"{'peak GiB':>9} {'fits':<5} {'step ms':>9} {'comm GB':>9}"
    )
    lines = [f"Configurations under a {memory_limit / GiB:,.1f} GiB limit, fastest first:", head]
    for i, p in enumerate(plans, 1):
        c = p.config
        fits = p.peak_bytes_per_rank <= memory_limit
        lines.append(
            f"{i:>2}  {'x'.join(map(str, c.mesh_shape())):<12} {str(c.reshard_after_forward):<8} "
            f"{'on' if c.activation_checkpointing else 'off':<4} {'on' if c.cpu_offload else 'off':<8} "
            f"{p.peak_bytes_per_rank / GiB:>9.2f} {'yes' if fits else 'no':<5} "
            f"{p.step_seconds * 1e3:>9.1f} {p.comm_bytes_per_step['total'] / 1e9:>9.2f}"
        )
    return "\n".join(lines)
