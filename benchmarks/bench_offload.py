"""Optimizer state off the device: step time, peak resident memory and disk traffic per tier.

``python benchmarks/bench_offload.py [--quick]`` (also run.py's ``offload``
stage). The demo model (``BENCH_SHAPE``, fp32) is sharded by fsdp2 over W=2
gloo ranks and trained with AdamW(amsgrad=True), whose state (three moments)
is three times the parameters, in three ways; ``--shape linear`` instead
trains issue 42's parameter-dominated model at W=1: 24 x ``Linear(2048,
2048, bias=False)`` (100M parameters, 1,208 MB of state), each layer one
``fully_shard``, a batch of 16 rows, the loss ``out.square().mean()``:

* ``memory``: ``enable_local_shard_step(optim)``, the state in memory;
* ``host``: ``offload=OptimizerOffloadPolicy("host")``;
* ``nvme``: ``offload=OptimizerOffloadPolicy("nvme", directory=<a temp dir>)``.

Peaks: over the first step (state created), over three steps, and with one
``save_checkpoint`` after them (also printed per tier, with the step times,
as the docs' table). Step time: one launch, the three trainers' steps interleaved, medians of the
slowest rank, for the optimizer step alone and the whole step. Peak resident
memory: one launch per tier (a process's peak cannot be shared), the peak RSS
of each rank (``ru_maxrss``) minus its RSS before the model was built, as a
ratio to ``memory``. Disk: the bytes the ``nvme`` tier's step read and wrote
(``/proc/self/io``, after its write-back finished) against the analytic
minimum (the state read once and written once), and the disk's bandwidth,
measured on the same directory (a file of the state's size written with
``fsync``, then read back after dropping it from the page cache).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from _ranks import launch
from common import wrap
from model import BENCH_SHAPE, batch, build_model, model_loss

TIERS = ("memory", "host", "nvme")
QUICK_SHAPE = {"vocab_size": 1024, "dim": 256, "n_layers": 4, "n_heads": 4, "ffn_hidden_dim": 704}
LINEAR_SHAPE = {"linear_dim": 2048, "n_layers": 24, "rows": 16}  # issue 42's model


class Linears(torch.nn.Module):
    """``n_layers`` x ``Linear(dim, dim, bias=False)`` in a row: parameters, few activations."""

    def __init__(self, dim: int, n_layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _build(shape: dict) -> torch.nn.Module:
    if "linear_dim" in shape:
        torch.manual_seed(0)
        return Linears(shape["linear_dim"], shape["n_layers"])
    return build_model(0, shape)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


class _Run:
    def __init__(self, tier: str, cfg: dict, root: str) -> None:
        import fsdp2

        self.rank = dist.get_rank()
        self.cfg = cfg
        self.model = wrap(_build(cfg["shape"]), "fsdp2")
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3, amsgrad=True, foreach=True)
        policy = None
        if tier != "memory":
            directory = os.path.join(root, tier)
            policy = fsdp2.OptimizerOffloadPolicy(tier, directory, unit_bytes=cfg["unit_bytes"])
        self.handle = fsdp2.enable_local_shard_step(self.optim, offload=policy)
        self.tier = self.handle.engine.tier  # where the state lives (memory: waits for nothing)

    def forward_backward(self, i: int) -> None:
        c = self.cfg
        if "linear_dim" in c["shape"]:
            g = torch.Generator().manual_seed(1000 * i + self.rank)
            x = torch.randn(c["shape"]["rows"], c["shape"]["linear_dim"], generator=g)
            self.model(x).square().mean().backward()
            return
        tokens, targets = batch(i, self.rank, c["batch"], c["seq"], c["shape"]["vocab_size"])
        model_loss(self.model, tokens, targets).backward()

    def optimizer_step(self) -> None:
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        return sum(
            v.to_local().numel() * v.element_size()
            for s in self.optim.state.values() for v in s.values() if v.dim() > 0
        )


def timing_body(rank: int, world_size: int, cfg: dict, root: str) -> dict:
    torch.manual_seed(0)
    runs = {tier: _Run(tier, cfg, root) for tier in TIERS}
    opt_times: dict[str, list[float]] = {t: [] for t in TIERS}
    step_times: dict[str, list[float]] = {t: [] for t in TIERS}
    io = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        for tier in TIERS[i % 3:] + TIERS[: i % 3]:  # rotate who goes first
            run = runs[tier]
            dist.barrier()
            t0 = time.perf_counter()
            run.forward_backward(i)
            t1 = time.perf_counter()
            before = _io()
            run.optimizer_step()
            t2 = time.perf_counter()
            run.tier.wait()  # the write-back behind the step, counted in the bytes
            if tier == "nvme" and i >= cfg["warmup"]:
                after = _io()
                io.append((after[0] - before[0], after[1] - before[1]))
            if i >= cfg["warmup"]:
                opt_times[tier].append(_slowest(t2 - t1))
                step_times[tier].append(_slowest(t2 - t0))
    state = runs["nvme"].state_bytes()
    bandwidth = _disk_bandwidth(os.path.join(root, "nvme"), max(state, 64 << 20)) if rank == 0 else None
    for run in runs.values():
        run.handle.remove()
    return {
        "opt_ms": {t: 1e3 * statistics.median(v) for t, v in opt_times.items()},
        "step_ms": {t: 1e3 * statistics.median(v) for t, v in step_times.items()},
        "read_mb": statistics.median(r for r, _ in io) / 1e6,
        "write_mb": statistics.median(w for _, w in io) / 1e6,
        "state_mb": state / 1e6,
        "disk_mb_s": bandwidth,
    }


def memory_body(rank: int, world_size: int, cfg: dict, root: str, tier: str) -> dict:
    torch.manual_seed(0)
    import fsdp2

    before = _rss_mb()
    run = _Run(tier, cfg, root)
    peaks = []
    for i in range(3):
        run.forward_backward(i)
        run.optimizer_step()
        run.tier.wait()
        peaks.append(_peak_mb() - before)  # [0]: the first step's peak
    fsdp2.save_checkpoint(os.path.join(root, f"ckpt-{tier}"), run.model, run.optim)
    saved = _peak_mb() - before
    params = sum(p.to_local().numel() * p.element_size() for p in run.model.parameters()) / 1e6
    result = {"peak_mb": _max(peaks[-1]), "first_step_peak_mb": _max(peaks[0]),
              "save_peak_mb": _max(saved), "params_mb": params, "state_mb": run.state_bytes() / 1e6}
    run.handle.remove()
    return result


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # kB on Linux


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _max(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _disk_bandwidth(directory: str, nbytes: int) -> dict:
    path = os.path.join(directory, "bandwidth.probe")
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = (nbytes >> 20) / (time.perf_counter() - t0)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    while os.read(fd, 1 << 20):
        pass
    read = (nbytes >> 20) / (time.perf_counter() - t0)
    os.close(fd)
    os.unlink(path)
    return {"write": write * 1.048576, "read": read * 1.048576}  # MB/s (10^6 bytes)


def offload_body_all(cfg: dict, world_size: int = 2) -> dict:
    """Every launch of this benchmark; the raw results run.py's rows are made from."""
    root = tempfile.mkdtemp(prefix="fsdp2-offload-", dir=cfg.get("directory"))
    try:
        raw = {"timing": launch(timing_body, world_size, cfg, root, timeout=cfg["timeout"])[0]}
        for tier in TIERS:
            raw[tier] = launch(memory_body, world_size, cfg, root, tier, timeout=cfg["timeout"])[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return raw


def rows(raw: dict) -> list[dict]:
    from report import ratio_row, row

    t, out = raw["timing"], []
    mem = t["opt_ms"]["memory"]
    out.append(ratio_row("optimizer step, NVMe state / in memory (ms)", t["opt_ms"]["nvme"], mem, limit=1.5))
    whole = t["step_ms"]["memory"]
    out.append(ratio_row("whole step, NVMe state / in memory (ms)", t["step_ms"]["nvme"], whole, limit=1.5))
    peak = raw["memory"]["peak_mb"]
    out.append(ratio_row("peak RSS per rank, NVMe state / in memory (MB)", raw["nvme"]["peak_mb"], peak, limit=0.5))
    out.append(ratio_row("peak RSS per rank, host state / in memory (MB)", raw["host"]["peak_mb"], peak, limit=1.05))
    first = raw["memory"]["first_step_peak_mb"]
    out.append(ratio_row("peak RSS over the first step, NVMe state / in memory (MB)",
                         raw["nvme"]["first_step_peak_mb"], first, limit=0.5))
    saved = raw["memory"]["save_peak_mb"]
    out.append(ratio_row("peak RSS with a save_checkpoint, NVMe state / in memory (MB)",
                         raw["nvme"]["save_peak_mb"], saved, limit=0.6))
    out.append(ratio_row("peak RSS with a save_checkpoint, host state / in memory (MB)",
                         raw["host"]["save_peak_mb"], saved, limit=1.05))
    out.append(ratio_row("optimizer step, host state / in memory, CPU ranks (ms)",
                         t["opt_ms"]["host"], mem, limit=1.05))
    minimum = 2 * t["state_mb"]
    r = row("NVMe bytes read + written per step and rank (MB)", t["read_mb"] + t["write_mb"], minimum,
            None, f"analytic minimum {minimum:.1f} (state read and written once)")
    out.append(r)
    bw = t["disk_mb_s"]
    if bw:
        out.append(row("disk bandwidth on the state directory (MB/s, write / read)",
                       f"{bw['write']:.0f} / {bw['read']:.0f}", None, None,
                       f"state {t['state_mb']:.1f} MB per rank"))
    return out


def tier_table(raw: dict) -> str:
    """Per tier, in MB and ms: the peaks and step times (the docs' table)."""
    t = raw["timing"]
    lines = ["| | in memory | host tier | NVMe tier |", "|---|---:|---:|---:|"]
    for label, values in (
        ("peak RSS over the first step (MB)", [raw[x]["first_step_peak_mb"] for x in TIERS]),
        ("peak RSS over 3 steps (MB)", [raw[x]["peak_mb"] for x in TIERS]),
        ("peak RSS with one save_checkpoint (MB)", [raw[x]["save_peak_mb"] for x in TIERS]),
        ("optimizer step (ms)", [t["opt_ms"][x] for x in TIERS]),
        ("whole step (ms)", [t["step_ms"][x] for x in TIERS]),
    ):
        lines.append(f"| {label} | " + " | ".join(f"{v:,.0f}" for v in values) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shape", choices=("demo", "linear"), default="demo",
                        help="linear: issue 42's 24 x Linear(2048, 2048) at W=1")
    parser.add_argument("--directory", help="where the nvme tier writes (default: the temp dir)")
    args = parser.parse_args()
    linear = args.shape == "linear"
    shape = LINEAR_SHAPE if linear else QUICK_SHAPE if args.quick else BENCH_SHAPE
    cfg = {
        "shape": shape, "batch": 2, "seq": 64,
        "warmup": 1, "steps": 3 if args.quick else 6, "unit_bytes": (64 if linear else 8) << 20,
        "timeout": 900, "directory": args.directory,
    }
    from report import markdown

    raw = offload_body_all(cfg, world_size=1 if linear else 2)
    print(markdown(rows(raw)))
    print(tier_table(raw))
    for tier in TIERS:
        print(f"- {tier}: peak RSS {raw[tier]['peak_mb']:.0f} MB per rank over its start; "
              f"parameters {raw[tier]['params_mb']:.1f} MB, state {raw[tier]['state_mb']:.1f} MB")
    print(f"- timing: {raw['timing']}")


if __name__ == "__main__":
    sys.exit(main())
