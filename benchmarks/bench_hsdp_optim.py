"""HSDP with the optimizer state sharded across replicas vs plain HSDP (issue 43).

Both columns are fsdp2 on the same (replicate, shard) mesh with AdamW
(``foreach=True``) stepped by ``fsdp2.enable_local_shard_step``; the fsdp2
column adds ``shard_across_replicas=True`` (see [Note: Replica slices] in
fsdp2/runtime/group/replica_slices.py), the torch column is plain HSDP.

* W=4 gloo as 2 x 2: step time (forward, backward, ``step()``,
  ``zero_grad()``; medians of interleaved steps, the slowest rank each),
  bytes a rank puts on the wire per step (a ring collective over n ranks
  sends ``(n-1)/n`` of the full tensor for a reduce-scatter or an all-gather
  and twice that for an all-reduce; counted per call from its group's size),
  optimizer-state bytes a rank holds, peak live bytes of one step;
* W = 8 x 128 under torch's fake process group (one process, collectives move
  nothing): optimizer-state bytes per rank and peak live bytes of one step.

``python benchmarks/bench_hsdp_optim.py [--quick]`` runs it alone and prints
the rows; ``FSDP2_BENCH_ONLY=hsdp_optim,hsdp_optim_fake`` in run.py.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from common import max_over_ranks, median, rotated
from instruments import LiveBytes
from model import batch, build_model, model_loss
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.plan.collective_calls import CollectiveCalls, call_group, call_tensors

NAMES = ("sharded across replicas", "plain HSDP")


class WireBytes:
    """Bytes this rank sends in ring collectives while entered (see the module docstring)."""

    def __init__(self) -> None:
        self.bytes = 0.0
        self._calls = CollectiveCalls(self._count)

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        n = dist.get_world_size(call_group(args, kwargs))
        logical = call_tensors(name, args, kwargs)[1]
        factor = 2.0 if "all_reduce" in name else 1.0
        self.bytes += factor * logical * (n - 1) / n

    def __enter__(self) -> WireBytes:
        self._calls.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._calls.__exit__(*exc)


def _trainer(cfg: dict, mesh, sharded: bool):
    model = build_model(0, cfg["hsdp_shape"])
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    handle = fsdp2.enable_local_shard_step(optim, shard_across_replicas=sharded)
    return model, optim, handle


def _step(cfg: dict, model, optim, i: int) -> None:
    tokens, targets = batch(i, dist.get_rank(), cfg["batch"], cfg["seq"],
                            cfg["hsdp_shape"]["vocab_size"])
    model_loss(model, tokens, targets).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _state_tensors(optim, handle) -> list[torch.Tensor]:
    tensors = [t for s in optim.state.values() for t in s.values() if torch.is_tensor(t)]
    return tensors + handle.state_tensors()


def _state_bytes(optim, handle) -> int:
    total = 0
    for t in _state_tensors(optim, handle):
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _sd_bytes(sd: dict) -> int:
    """Bytes of the local tensors of an optimizer state dict's state on this rank."""
    total = 0
    for entry in sd["state"].values():
        for t in entry.values():
            if torch.is_tensor(t):
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size()
    return total


def hsdp_optim_body(rank: int, world_size: int, cfg: dict, mesh_shape: tuple[int, int]) -> dict:
    """Both configurations on one mesh: state bytes, peak live bytes (and on gloo: time, wire)."""
    fake = dist.get_backend() == "fake"
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    out: dict = {"mesh": list(mesh_shape), "state": {}, "peak": {}, "wire": {}, "times": {}}
    runs = {}
    for name in NAMES:
        live = LiveBytes()
        with live:  # on from before the model is built: every storage it holds is seen
            model, optim, handle = _trainer(cfg, mesh, name == NAMES[0])
            for i in range(cfg["warmup"] + 1):  # the state exists from the first step
                _step(cfg, model, optim, i)
            live.reset_peak()
            wire = WireBytes()
            with wire:
                _step(cfg, model, optim, cfg["warmup"] + 1)
        out["peak"][name] = max_over_ranks([float(live.peak)])[0] if not fake else live.peak
        out["state"][name] = _state_bytes(optim, handle)
        if not fake:  # (the scalars are agreed on over replicas: a real collective)
            live = LiveBytes()
            with live:
                params = [p for g in optim.param_groups for p in g["params"]]
                for t in _state_tensors(optim, handle) + params:  # held before: not added
                    live.see(t)
                base = live.current
                live.reset_peak()
                sd = optim.state_dict()
            out.setdefault("state_dict", {})[name] = max_over_ranks([float(_sd_bytes(sd))])[0]
            out.setdefault("state_dict_peak", {})[name] = max_over_ranks(
                [float(live.peak - base)])[0]
            del sd
        out["wire"][name] = wire.bytes
        runs[name] = (model, optim)
    if fake:
        return out
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    for i in range(cfg["hsdp_reps"]):
        for name in rotated(list(NAMES), i):
            model, optim = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            _step(cfg, model, optim, 10 + i)
            times[name].append(time.perf_counter() - t0)
    out["times"] = {n: max_over_ranks(v) for n, v in times.items()}
    out["wire"] = {n: max_over_ranks([b])[0] for n, b in out["wire"].items()}
    out["state"] = {n: max_over_ranks([float(b)])[0] for n, b in out["state"].items()}
    return out


def hsdp_optim_rows(raw: dict) -> list[dict]:
    """Rows for run.py: fsdp2 = the option, torch = plain HSDP (both fsdp2)."""
    from report import MB, row

    rows = []
    ours, theirs = NAMES
    for key in ("hsdp_optim", "hsdp_optim_fake"):
        r = raw.get(key)
        if not r:
            continue
        replicas, shard = r["mesh"]
        where = f"{replicas}x{shard} {'fake PG' if key.endswith('fake') else 'gloo'}"
        if r["times"]:
            t = {n: 1e3 * median(v) for n, v in r["times"].items()}
            rows.append(row(f"HSDP state across replicas: step time, {where} (ms)",
                            t[ours], t[theirs], None, "<= 1.05", t[ours] <= 1.05 * t[theirs]))
            w = {n: v / MB for n, v in r["wire"].items()}
            rows.append(row(f"HSDP state across replicas: bytes sent per step, {where} (MB)",
                            w[ours], w[theirs], None, "= plain",
                            abs(w[ours] - w[theirs]) <= 1e-3 * w[theirs]))
        s = {n: v / MB for n, v in r["state"].items()}
        rows.append(row(f"HSDP state across replicas: optimizer state per rank, {where} (MB)",
                        s[ours], s[theirs], None, f"<= 1/R = {1 / replicas:.3g} (+ padding)",
                        s[ours] <= s[theirs] / replicas * 1.01))
        if r.get("state_dict"):
            d = {n: v / MB for n, v in r["state_dict"].items()}
            rows.append(row(f"HSDP state across replicas: optimizer.state_dict() per rank, {where} "
                            "(MB)", d[ours], d[theirs], None, f"<= 1/R = {1 / replicas:.3g} (+ rows)",
                            d[ours] <= d[theirs] / replicas * 1.02))
            d = {n: v / MB for n, v in r["state_dict_peak"].items()}
            rows.append(row(f"HSDP state across replicas: live bytes added by state_dict(), {where} "
                            "(MB)", d[ours], d[theirs], None))
        m = {n: v / MB for n, v in r["peak"].items()}
        rows.append(row(f"HSDP state across replicas: peak live per rank, {where} (MB)",
                        m[ours], m[theirs], None))
    return rows


NOTES = """- HSDP state-across-replicas rows (bench_hsdp_optim.py): fsdp2 = shard_across_replicas=True,
  torch = plain HSDP, both fsdp2's fully_shard with AdamW on enable_local_shard_step; bytes sent
  are ring bytes per rank ((n-1)/n of a reduce-scatter's or all-gather's full tensor, twice that
  for an all-reduce)."""


def main() -> None:
    from _ranks import launch
    from run import FULL, HSDP_FAKE_MESH, QUICK

    cfg = QUICK if "--quick" in sys.argv else FULL
    replicas, shard = HSDP_FAKE_MESH
    raw = {
        "hsdp_optim": launch(hsdp_optim_body, 4, cfg, (2, 2), timeout=cfg["timeout"])[0],
        "hsdp_optim_fake": launch(hsdp_optim_body, replicas * shard, cfg, HSDP_FAKE_MESH,
                                  backend="fake", timeout=cfg["timeout"])[0],
    }
    from report import markdown

    print(markdown(hsdp_optim_rows(raw)))
    print(NOTES)
    print(f"- machine load average: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
