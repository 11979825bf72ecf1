"""The shard layouts side by side: upstream, fsdp2 dim-0 chunks, fsdp2 parameter-major (its
contiguous plan and its packed plan).

    python benchmarks/bench_layouts.py [--quick]

One launch of W = 2 gloo ranks trains the demo model (benchmarks/model.py)
under each layout, in fp32 and with bf16 mixed precision (fp32 reduce), and
prints per rank: bytes copied outside the collectives in one step (the
counter of instruments.py; the all-gather side and the reduce-scatter side
apart), bytes communicated (against the analytic figure: every group's
padded parameters gathered twice and reduced once), the peak of live bytes,
and the median step time over interleaved steps (the slowest rank's); then
the peak of live bytes at the first step, around a DCP save and load of
the model and optimizer state dicts and around fsdp2's ``save_checkpoint``
and ``load_checkpoint`` of them (a second table). The
parameter-major layout is ``shard_placement_fn=lambda p: RaggedShard()``
on every call (docs/layouts.md); "fsdp2 packed" is the same with the packed
plan forced on every group (``fully_shard`` takes it by itself only where the
contiguous plan pads much: tiles larger than a rank's share), to show what
its copies cost.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys

import torch
from _ranks import launch
from common import cpu_mesh, max_over_ranks, median, rotated, timed
from instruments import CommCounter, CopyCounter, LiveBytes
from model import REPO, batch, build_model, model_loss

if REPO not in sys.path:
    sys.path.insert(1, REPO)

SHAPES = {
    "full": {"vocab_size": 4096, "dim": 512, "n_layers": 8, "n_heads": 8, "ffn_hidden_dim": 1408},
    "quick": {"vocab_size": 1024, "dim": 256, "n_layers": 4, "n_heads": 4, "ffn_hidden_dim": 704},
}
LAYOUTS = ("torch", "fsdp2 dim-0", "fsdp2 ragged", "fsdp2 packed")
# the dim-0 layout's two reordering copies, by the op that writes them
COPY_OUT = ("split_with_sizes_copy",)  # all-gather output -> each parameter
REORDER = ("_chunk_cat", "chunk_cat")  # gradients -> rank-major reduce-scatter input


def _build(layout: str, shape: dict, mp: bool):
    if layout == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp2 import MixedPrecisionPolicy, RaggedShard, fully_shard
    model = build_model(0, shape)
    kwargs = {"mesh": cpu_mesh()}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if layout in ("fsdp2 ragged", "fsdp2 packed"):
        kwargs["shard_placement_fn"] = lambda p: RaggedShard()
    with _packed_plan() if layout == "fsdp2 packed" else contextlib.nullcontext():
        for layer in model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, optim


@contextlib.contextmanager
def _packed_plan():
    """Every ``RaggedShard`` group planned in the block takes the packed plan."""
    from fsdp2.runtime.storage import ragged_rows
    from fsdp2.runtime.storage.block_packing import pack_blocks

    choose = ragged_rows.choose_plan
    ragged_rows.choose_plan = lambda shapes, granularities, world_size, names=None: pack_blocks(
        [tuple(s) for s in shapes], granularities, world_size, names)
    try:
        yield
    finally:
        ragged_rows.choose_plan = choose


def _step(model, optim, i: int, rank: int, shape: dict, cfg: dict) -> None:
    tokens, targets = batch(i, rank, cfg["batch"], cfg["seq"], shape["vocab_size"])
    model_loss(model, tokens, targets).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _analytic_comm(model, mp: bool) -> int:
    """Bytes a rank's collectives carry per step, counted as the counter counts them (full
    outputs / inputs): every block gathered in forward and backward, the root once (it is
    not resharded after forward), every gradient reduced once in fp32."""
    blocks = sum(p.numel() for layer in model.layers for p in layer.parameters())
    total = sum(p.numel() for p in model.parameters())
    gathered = (2 * blocks + (total - blocks)) * (2 if mp else 4)
    return gathered + total * 4


def body(rank: int, world_size: int, cfg: dict) -> dict:
    shape = SHAPES[cfg["size"]]
    out: dict = {}
    for mp in (False, True):
        runs = {}
        for layout in LAYOUTS:
            model, optim = _build(layout, shape, mp)
            for i in range(cfg["warmup"]):
                _step(model, optim, i, rank, shape, cfg)
            with CopyCounter() as copies:
                _step(model, optim, 100, rank, shape, cfg)
            with CommCounter() as comms:
                _step(model, optim, 101, rank, shape, cfg)
            runs[layout] = (model, optim)
            out[(mp, layout)] = {
                "copy": copies.total,
                "copy_out": sum(v for k, v in copies.bytes.items() if k in COPY_OUT),
                "reorder": sum(v for k, v in copies.bytes.items() if k in REORDER),
                "copy_ops": dict(copies.bytes),
                "comm": comms.total,
                "analytic": _analytic_comm(model, mp),
            }
        times: dict = {layout: [] for layout in LAYOUTS}
        for i in range(cfg["steps"]):
            for layout in rotated(list(LAYOUTS), i):
                model, optim = runs[layout]
                times[layout].append(timed(_step, model, optim, 200 + i, rank, shape, cfg))
        for layout in LAYOUTS:
            out[(mp, layout)]["step_ms"] = 1e3 * median(max_over_ranks(times[layout]))
        del runs
        gc.collect()
        for layout in LAYOUTS:
            with LiveBytes() as live:
                model, optim = _build(layout, shape, mp)
                for i in range(2):
                    _step(model, optim, i, rank, shape, cfg)
                live.reset_peak()
                _step(model, optim, 2, rank, shape, cfg)
                out[(mp, layout)]["peak"] = live.peak
                del model, optim
                gc.collect()
        for layout in LAYOUTS:
            out[(mp, layout)].update(_peaks_around(layout, shape, mp, rank, cfg))
            gc.collect()
    return out


def _peaks_around(layout: str, shape: dict, mp: bool, rank: int, cfg: dict) -> dict:
    """Peak live bytes of the first step (lazy init and the optimizer's state included), of a
    DCP save of the model and optimizer state dicts, and of loading them back."""
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = [tempfile.mkdtemp(prefix="bench_layouts_") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    peaks = {}
    with LiveBytes() as live:
        model, optim = _build(layout, shape, mp)
        live.reset_peak()
        _step(model, optim, 0, rank, shape, cfg)
        peaks["first_step_peak"] = live.peak
        live.reset_peak()
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder[0])
        del msd, osd
        peaks["save_peak"] = live.peak
        live.reset_peak()
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=folder[0])
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        del msd, osd, state
        peaks["load_peak"] = live.peak
        # fsdp2's own save and load (checksums; ragged rows saved in pieces)
        import fsdp2

        live.reset_peak()
        fsdp2.save_checkpoint(folder[0] + "/own", model, optim)
        peaks["own_save_peak"] = live.peak
        live.reset_peak()
        fsdp2.load_checkpoint(folder[0] + "/own", model, optim)
        peaks["own_load_peak"] = live.peak
        del model, optim
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(folder[0], ignore_errors=True)
    return peaks


def table(result: dict) -> str:
    rows = [
        "| precision | layout | copied outside collectives (MB) | of which copy-out / rank-major "
        "reorder (MB) | ratio to upstream | communicated (MB) | analytic (MB) | peak live (MB) "
        "| step (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mp in (False, True):
        base = result[(mp, "torch")]["copy"]
        for layout in LAYOUTS:
            r = result[(mp, layout)]
            rows.append(
                f"| {'bf16 / fp32 reduce' if mp else 'fp32'} | {layout} | {r['copy'] / 1e6:.2f} | "
                f"{r['copy_out'] / 1e6:.2f} / {r['reorder'] / 1e6:.2f} | "
                f"{r['copy'] / base:.3f} | {r['comm'] / 1e6:.2f} | {r['analytic'] / 1e6:.2f} | "
                f"{r['peak'] / 1e6:.1f} | {r['step_ms']:.1f} |"
            )
    return "\n".join(rows)


def memory_table(result: dict) -> str:
    """Peak live bytes per rank at the first step and around a DCP save and load, and
    fsdp2's ``save_checkpoint`` and ``load_checkpoint``."""
    rows = [
        "| precision | layout | first step (MB) | DCP save (MB) | DCP load (MB) "
        "| `save_checkpoint` (MB) | `load_checkpoint` (MB) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for mp in (False, True):
        for layout in LAYOUTS:
            r = result[(mp, layout)]
            rows.append(
                f"| {'bf16 / fp32 reduce' if mp else 'fp32'} | {layout} | "
                f"{r['first_step_peak'] / 1e6:.1f} | {r['save_peak'] / 1e6:.1f} | "
                f"{r['load_peak'] / 1e6:.1f} | {r['own_save_peak'] / 1e6:.1f} | "
                f"{r['own_load_peak'] / 1e6:.1f} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cfg = {"size": "quick" if args.quick else "full", "batch": 2, "seq": 64,
           "warmup": 2, "steps": 4 if args.quick else 10}
    per_rank = launch(body, 2, cfg, timeout=1800)
    print(table(per_rank[0]))
    print()
    print(memory_table(per_rank[0]))
    for mp in (False, True):
        for layout in LAYOUTS:
            ops = per_rank[0][(mp, layout)]["copy_ops"]
            print(f"{'bf16' if mp else 'fp32'} {layout}: " + ", ".join(
                f"{k} {v / 1e6:.2f} MB" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
