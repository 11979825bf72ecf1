"""Muon on a sharded model: fsdp2.Muon vs the per-matrix full_tensor() workaround vs AdamW.

The demo model is sharded with fsdp2's ``fully_shard`` (one group per block,
then the root); its hidden matrices (every 2-D parameter but the embedding and
the head) get seeded gradients, the same on every implementation, and one of
three optimizers steps them:

* ``fsdp2.Muon``: owner ranks, two all-to-alls per step (``fsdp2/optim/muon.py``);
* the workaround users write today: each rank updates its rows of the momentum,
  gathers every update whole with ``DTensor.full_tensor()``, runs the same
  Newton-Schulz on it, and keeps its own rows;
* AdamW (``foreach=True`` with ``fsdp2.enable_local_shard_step``) on the same
  matrices, for scale.

Per optimizer, per rank (the slowest / largest rank is reported):

* step time: median of interleaved ``optimizer.step()`` calls (rotating order);
* bytes moved: bytes this rank *receives* from other ranks inside ``step()``
  (all-to-all: its output; ``full_tensor()``'s all-gather: (W-1)/W of the output);
* peak live bytes during ``step()`` (``instruments.LiveBytes``: parameters,
  gradients and state it touches plus everything it allocates);
* Newton-Schulz flops per rank: the owners' load (``fsdp2.Muon.load_balance``)
  vs every matrix on every rank.

Under ``backend="fake"`` (W=8 in one process) collectives move nothing, so the
bytes and the CPU time of one rank's share of the work are what count.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from common import max_over_ranks, median, rotated, wrap
from instruments import LiveBytes
from model import build_model
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2
from fsdp2.optim.muon import newton_schulz

HYPER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}


class FullTensorMuon(torch.optim.Optimizer):
    """The workaround: ``full_tensor()`` every matrix's update on every rank (1-D mesh, Shard(0))."""

    def __init__(self, params, lr: float, weight_decay: float, momentum: float) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf, grad = state["momentum_buffer"].to_local(), p.grad.to_local()
                buf.lerp_(grad, 1 - mom)
                update = grad.lerp(buf, mom)
                whole = DTensor.from_local(
                    update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                ).full_tensor()
                ortho = newton_schulz(whole.bfloat16()[None], (3.4445, -4.7750, 2.0315), 5, 1e-7)
                size = -(-p.shape[0] // p.device_mesh.size())
                start = min(size * p.device_mesh.get_local_rank(), p.shape[0])
                rows = ortho[0].narrow(0, start, p.to_local().shape[0])
                local = p.to_local()
                local.mul_(1 - lr * wd)
                local.add_(rows, alpha=-lr * math.sqrt(max(1, p.shape[0] / p.shape[1])))


class _ReceivedBytes(TorchDispatchMode):
    """Bytes this rank receives from others in all-to-alls and functional all-gathers."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self._orig = None

    def __enter__(self):
        self._orig = dist.all_to_all_single

        def counted(output, input, *args, **kwargs):
            self.bytes += output.numel() * output.element_size()  # fsdp2.Muon sends 0 to itself
            return self._orig(output, input, *args, **kwargs)

        dist.all_to_all_single = counted
        return super().__enter__()

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "all_gather_into_tensor":
            group_size = args[1]
            self.bytes += (group_size - 1) * args[0].numel() * args[0].element_size()
        return out


def _hidden(model: torch.nn.Module) -> list:
    return [
        (n, p) for n, p in model.named_parameters()
        if p.ndim == 2 and "embed" not in n and "output" not in n
    ]


def _optimizers(model: torch.nn.Module) -> dict[str, torch.optim.Optimizer]:
    hidden = _hidden(model)
    params = [p for _, p in hidden]
    adamw = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    fsdp2.enable_local_shard_step(adamw)
    return {
        "fsdp2.Muon": fsdp2.Muon(hidden, **HYPER),
        "full_tensor() workaround": FullTensorMuon(params, **HYPER),
        "AdamW": adamw,
    }


def _seed_grads(model: torch.nn.Module) -> None:
    torch.manual_seed(dist.get_rank())
    for _, p in _hidden(model):
        local = torch.randn(p.to_local().shape)
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )


def muon_body(rank: int, world_size: int, cfg: dict) -> dict:
    models = {}
    optims = {}
    for name in ("fsdp2.Muon", "full_tensor() workaround", "AdamW"):
        models[name] = wrap(build_model(0, cfg["muon_shape"]), "fsdp2")
        _seed_grads(models[name])
        optims[name] = _optimizers(models[name])[name]
        optims[name].step()  # state exists from here on
    received, peak = {}, {}
    for name, opt in optims.items():
        counter = _ReceivedBytes()
        with counter:
            opt.step()
        received[name] = counter.bytes
        live = LiveBytes()
        with live:
            opt.step()
        peak[name] = live.peak
    times: dict[str, list[float]] = {n: [] for n in optims}
    for i in range(cfg["muon_reps"]):
        for name in rotated(list(optims), i):
            dist.barrier()
            t0 = time.perf_counter()
            optims[name].step()
            times[name].append(time.perf_counter() - t0)
    (load,) = optims["fsdp2.Muon"].load_balance()
    return {
        "world_size": world_size,
        "times": {n: max_over_ranks(v) for n, v in times.items()},
        "received": {n: max_over_ranks([float(b)])[0] for n, b in received.items()},
        "peak": {n: max_over_ranks([float(b)])[0] for n, b in peak.items()},
        "ns_flops": {"fsdp2.Muon": max(load.flops), "full_tensor() workaround": load.total},
        "max_over_mean": load.max_over_mean,
        "n_matrices": len(_hidden(models["fsdp2.Muon"])),
    }


def muon_rows(raw: dict) -> list[dict]:
    """Rows for run.py: fsdp2 = fsdp2.Muon, torch = the full_tensor() workaround, ref = AdamW."""
    from report import MB, row

    rows = []
    for key in ("muon", "muon_fake"):
        r = raw.get(key)
        if not r:
            continue
        w = r["world_size"]
        where = f"W={w} {'fake PG' if key == 'muon_fake' else 'gloo'}"
        t = {n: 1e3 * median(v) for n, v in r["times"].items()}
        ours, theirs, adamw = "fsdp2.Muon", "full_tensor() workaround", "AdamW"
        rows.append(row(f"Muon step time, {where} (ms)", t[ours], t[theirs], t[adamw]))
        b = {n: v / MB for n, v in r["received"].items()}
        ok = b[ours] <= 2 / w * b[theirs]
        rows.append(
            row(f"Muon step bytes received, {where} (MB)", b[ours], b[theirs], b[adamw],
                f"<= 2/W = {2 / w:.3g}", ok)
        )
        f = {n: v / 1e9 for n, v in r["ns_flops"].items()}
        ok = f[ours] <= r["max_over_mean"] * f[theirs] / w + 1e-9
        rows.append(
            row(f"Muon Newton-Schulz GFLOP per rank, {where}", f[ours], f[theirs], None,
                f"<= 1/W x max/mean ({r['max_over_mean']:.3f})", ok)
        )
        m = {n: v / MB for n, v in r["peak"].items()}
        rows.append(row(f"Muon step peak live (MB), {where}", m[ours], m[theirs], m[adamw]))
    return rows


NOTES = """- Muon rows (bench_muon.py): fsdp2 = fsdp2.Muon, torch = the per-matrix full_tensor()
  workaround on the same fsdp2-sharded model, DDP/ref = AdamW on the same matrices; bytes are
  those a rank receives inside optimizer.step(); both Muons give the same update."""
