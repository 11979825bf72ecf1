"""Pipeline parallelism x FSDP with fsdp2: torch's pipeline schedules over sharded stages.

Launch (from the repository root; 4 CPU ranks on gloo, or one GPU per rank):

    torchrun --nproc-per-node 4 examples/pipeline.py                          # 1F1B
    torchrun --nproc-per-node 4 examples/pipeline.py --schedule Interleaved1F1B

The 4 ranks form a (pp=2, dp=2) mesh. A stack of residual MLP blocks is cut
into pipeline stages (one per rank for GPipe / 1F1B, two per rank for the
multi-stage schedules); every block and every stage root is sharded with
``fully_shard`` over ``dp``, and each stage goes into
``fsdp2.pipelining.PipelineStage``. Gradients accumulate unsharded across the
micro-batches and are reduce-scattered once per step, as torch does for its
own ``fully_shard``. Prints the mean loss and, per step, this rank's
all-gathers and reduce-scatters. ``FSDP2_IMPL=torch`` runs the same script on
upstream ``torch.distributed.fsdp`` with torch's own ``PipelineStage``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]  # this checkout's fsdp2
if os.environ.get("FSDP2_IMPL", "fsdp2") == "torch":
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
else:
    from fsdp2 import fully_shard
    from fsdp2.pipelining import PipelineStage  # was: from torch.distributed.pipelining import ...

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stage(nn.Module):
    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Counter:
    """Count this rank's all-gathers and reduce-scatters by wrapping torch.distributed."""

    NAMES = ("all_gather_single", "all_gather_into_tensor",
             "reduce_scatter_single", "reduce_scatter_tensor")

    def __enter__(self) -> Counter:
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self.saved = {name: getattr(dist, name) for name in self.NAMES if hasattr(dist, name)}
        for name, orig in self.saved.items():
            kind = "all_gather" if name.startswith("all_gather") else "reduce_scatter"

            def wrapper(*args, _orig=orig, _kind=kind, **kwargs):
                self.counts[_kind] += 1
                return _orig(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self.saved.items():
            setattr(dist, name, orig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1F1B", choices=SCHEDULES)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")
    if dist.get_world_size() != 4:
        raise SystemExit("run on 4 ranks: torchrun --nproc-per-node 4 examples/pipeline.py")
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()

    single = args.schedule in ("GPipe", "1F1B")
    num_stages = 2 if single else 4
    if single:
        mine = [pp_rank]
    elif args.schedule in ("ZBVZeroBubble", "DualPipeV"):  # V-shaped: 0 and 3 on one rank
        mine = [pp_rank, num_stages - 1 - pp_rank]
    else:  # looped: 0 and 2 on one rank
        mine = [pp_rank, pp_rank + 2]

    torch.manual_seed(0)  # every rank builds the same full model, then keeps its stages
    blocks = [Block(args.dim, 2 * args.dim) for _ in range(4)]
    per_stage = len(blocks) // num_stages
    stages, modules = [], []
    for index in mine:
        module = Stage(blocks[index * per_stage:(index + 1) * per_stage]).to(device)
        for block in module.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        modules.append(module)
        stages.append(PipelineStage(module, index, num_stages, device, group=mesh["pp"].get_group()))

    schedule_cls = getattr(pipelining, "Schedule" + args.schedule)
    schedule = schedule_cls(stages[0] if single else stages, n_microbatches=args.microbatches,
                            loss_fn=nn.functional.mse_loss)
    optim = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-2)
    first, last = 0 in mine, num_stages - 1 in mine
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)  # the same global batch on every rank
        x = torch.randn(8 * args.microbatches, args.dim, generator=g)
        y = torch.sin(x)  # learn sin, elementwise
        x, y = (t.chunk(2)[dp_rank].to(device) for t in (x, y))  # this dp rank's half
        losses: list[torch.Tensor] = []
        with Counter() as counter:
            schedule.step(*([x] if first else []), **({"target": y, "losses": losses} if last else {}))
        optim.step()
        optim.zero_grad()
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
        dist.all_reduce(loss)  # only the last stage's ranks contribute
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item() / 2:.4f}  rank 0: "
                  f"{counter.counts['all_gather']} all-gathers, "
                  f"{counter.counts['reduce_scatter']} reduce-scatters", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
