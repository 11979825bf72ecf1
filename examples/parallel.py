"""HSDP and FSDP + tensor parallel (2-D) with fsdp2, on a small residual MLP.

Launch (from the repository root; 4 ranks, CPU gloo or one GPU per rank):

    torchrun --nproc-per-node 4 examples/parallel.py --mode hsdp   # 2 replicas x 2 shards
    torchrun --nproc-per-node 4 examples/parallel.py --mode tp     # 2 data-parallel x 2 TP
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id hsdp examples/parallel.py --mode hsdp --shard-size 8   # on every node

``--shard-size`` is the size of the HSDP ``shard`` dim (default 2); with one
node's device count, parameters are sharded within each node and only the
gradient all-reduce crosses nodes (docs/multi-node.md).
``FSDP2_IMPL=torch`` runs the same script on upstream ``torch.distributed.fsdp``.
Every data-parallel rank draws its own batch; TP ranks of one data-parallel
index share theirs. The printed loss is the mean over data-parallel ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]  # this checkout's fsdp2
if os.environ.get("FSDP2_IMPL", "fsdp2") == "torch":
    from torch.distributed.fsdp import fully_shard
else:
    from fsdp2 import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


def build(dim: int = 32, hidden: int = 64, n_layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(dim, hidden) for _ in range(n_layers)), nn.Linear(dim, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["hsdp", "tp"], default="hsdp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--shard-size", type=int, default=2,
        help="hsdp: ranks per shard group, e.g. the devices of one node (default 2)",
    )
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device_type = "cuda" if use_cuda else "cpu"
    world_size = dist.get_world_size()
    model = build().to(device_type)

    if args.mode == "hsdp":
        # Parameters: (Replicate(), Shard(0)) DTensors. Gradients are
        # reduce-scattered over "shard" and all-reduced over "replicate".
        if world_size % args.shard_size != 0:
            raise SystemExit(f"--shard-size {args.shard_size} must divide the world size {world_size}")
        # Consecutive ranks form a shard group: with one node's devices each,
        # all-gathers and reduce-scatters stay inside a node.
        mesh = init_device_mesh(
            device_type,
            (world_size // args.shard_size, args.shard_size),
            mesh_dim_names=("replicate", "shard"),
        )
        dp_mesh = mesh
        dp_rank = dist.get_rank()
    else:
        # TP first on the "tp" dim, then FSDP over the "dp" dim.
        mesh = init_device_mesh(device_type, (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in model[:-1]:
            parallelize_module(
                block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
            )
        dp_mesh = mesh["dp"]
        dp_rank = dp_mesh.get_local_rank()
    for block in model[:-1]:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    generator = torch.Generator().manual_seed(1000 + dp_rank)
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        x = torch.randn(16, 32, generator=generator).to(device_type)
        loss = F.mse_loss(model(x), (x @ target.to(device_type)).tanh())
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # TP ranks repeat their data-parallel rank's loss
        if dist.get_rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"{args.mode} step {step:3d}  loss {mean.item() / world_size:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
