"""HSDP training on a (replicate=2, shard=2) mesh: the body of tests/test_multinode.py.

Launched by torchrun, one agent per (simulated) node, every agent with the
same arguments (from the repository root; OUT_DIR receives one file per rank):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT --rdzv-id JOB tests/_multinode_train.py OUT_DIR

The test also runs :func:`train` in one 4-rank launch (``run_ranks``) and
compares the two. Every rank trains a tiny transformer on its own slice of a
fixed batch; the launch records what torchrun told the rank (its environment)
and which ranks took part in each collective of one step.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from _impl import fully_shard
from checks import TENSOR_COLLECTIVES, on_collectives
from models import (
    build_transformer,
    full,
    global_mean,
    rank_slice,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.device_mesh import init_device_mesh

MESH_SHAPE = (2, 2)  # (nodes, ranks per node): replicate across nodes, shard within one
STEPS = 3
SEED = 11
LR = 1e-2
# What torchrun sets for each worker; the test checks these.
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: two samples per rank."""
    return transformer_batch(step, 2 * MESH_SHAPE[0] * MESH_SHAPE[1])


def train(rank: int, world_size: int) -> dict:
    """Train ``STEPS`` AdamW steps with HSDP; return losses, full parameters and collective groups.

    ``losses`` are the global means per step; ``groups`` lists ``(kind, ranks
    of its process group)`` for every collective of the first step's forward
    and backward (lazy init included: it adds none); ``params`` (rank 0 only,
    else ``None``) are the final full parameters by name.
    """
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("replicate", "shard"))
    model = shard_transformer(build_transformer(seed=SEED), fully_shard, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    groups: list[tuple[str, tuple[int, ...]]] = []

    def record(kind, args, kwargs):
        group = kwargs.get("group")
        ranks = range(world_size) if group is None else dist.get_process_group_ranks(group)
        groups.append((kind, tuple(ranks)))

    losses = []
    for step in range(STEPS):
        with on_collectives(record, TENSOR_COLLECTIVES) if step == 0 else nullcontext():
            loss = transformer_loss(model, rank_slice(batch(step), rank, world_size))
            loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss).item())
    params = {name: full(p.detach()) for name, p in model.named_parameters()}
    return {"losses": losses, "groups": groups, "params": params if rank == 0 else None}


def main() -> None:
    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    # The test kills leftover workers by these ids if a launch fails or hangs.
    with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    torch.set_num_threads(1)
    # A lost peer fails the run within a minute instead of hanging it.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = train(dist.get_rank(), dist.get_world_size())
    result["env"] = {name: os.environ.get(name) for name in LAUNCH_ENV}
    result["dist_rank"] = dist.get_rank()
    result["agent_pid"] = os.getppid()  # torchrun's agent starts its workers itself
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
