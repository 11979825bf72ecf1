"""A small mixture-of-experts transformer, sharded as torchtitan shards one: experts on their own mesh.

Launch (from the repository root; CPU gloo or one GPU per rank):

    torchrun --standalone --nproc-per-node 4 examples/moe.py --steps 10          # ep=2, efsdp=2
    torchrun --standalone --nproc-per-node 4 examples/moe.py --ep 4 --steps 10   # ep=4, efsdp=1
    torchrun --standalone --nproc-per-node 2 examples/moe.py --steps 10          # ep=2, efsdp=1

Every block routes each token to one expert (top-1). Experts are split over
an expert-parallel mesh ``ep`` (a ``DTensor``, ``Shard(0)`` on ``ep``): tokens
travel to their expert's rank and back by all-to-all. FSDP shards the dense
parameters over ``dp`` (all ranks) and each expert stack over ``efsdp``, the
ranks holding the same experts, with one ``fully_shard`` call per block whose
``shard_placement_fn`` returns a ``ShardPlacementResult`` per parameter
(``Shard(1)`` for the experts when ``efsdp * ep`` exceeds the number of
experts). Gradient division is off, the loss is divided by the global token
count, as torchtitan does. See docs/moe.md for the mesh picture.
``FSDP2_IMPL=torch`` runs the same script on upstream ``torch.distributed.fsdp``.
The tests import the model from here (tests/test_moe.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]  # this checkout's fsdp2


@dataclass
class MoEArgs:
    vocab: int = 32
    dim: int = 16
    hidden: int = 24
    num_experts: int = 4
    n_layers: int = 2


class Experts(nn.Module):
    """``num_experts`` SiLU MLPs as two stacked weights; a DTensor ``Shard(0)`` on ``ep`` under EP."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, hidden) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, dim) * hidden**-0.5)

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each row of ``x`` through its local expert ``local_ids[row]``."""
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        out = x.new_zeros(x.shape)
        for e in range(w1.shape[0]):  # an expert without tokens still gets a (zero) gradient
            rows = (local_ids == e).nonzero(as_tuple=True)[0]
            out = out.index_add(0, rows, F.silu(x[rows] @ w1[e]) @ w2[e])
        return out


class MoE(nn.Module):
    """Top-1 token routing to the experts, over ``ep_group`` by all-to-all when given."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.router = nn.Linear(args.dim, args.num_experts, bias=False)
        self.experts = Experts(args.num_experts, args.dim, args.hidden)
        self.ep_group: dist.ProcessGroup | None = None  # set by expert_parallel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):  # a full-DTensor model (dp_mesh_dims): route the local tokens
            out = self._route(x.to_local(), self.router(x).to_local())
            return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
        return self._route(x, self.router(x))

    def _route(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        gate, expert = logits.softmax(-1).max(-1)
        if self.ep_group is None:
            return gate[:, None] * self.experts(x, expert)
        return gate[:, None] * self._all_to_all(x, expert)

    def _all_to_all(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        ep = dist.get_world_size(self.ep_group)
        num_local = self.num_experts // ep
        order = torch.argsort(expert, stable=True)  # tokens grouped by expert, so by ep rank
        counts = torch.bincount(expert, minlength=self.num_experts)
        recv_counts = torch.empty_like(counts)  # per source rank, tokens for each local expert
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        send = counts.view(ep, num_local).sum(1).tolist()
        recv = recv_counts.view(ep, num_local).sum(1).tolist()
        tokens = _AllToAll.apply(x[order], recv, send, self.ep_group)
        local_ids = torch.arange(num_local).repeat(ep).repeat_interleave(recv_counts)
        out = self.experts(tokens, local_ids)
        back = _AllToAll.apply(out, send, recv, self.ep_group)
        return back[torch.argsort(order)]


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of ``group`` (``send[r]`` to rank r, ``recv[r]`` from it); backward: back."""

    @staticmethod
    def forward(ctx, x, recv: list[int], send: list[int], group) -> torch.Tensor:  # type: ignore[override]
        ctx.splits = (recv, send, group)
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        recv, send, group = ctx.splits
        out = grad.new_empty(sum(send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), send, recv, group=group)
        return out, None, None, None


class MoEBlock(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(args.dim)
        self.dense = nn.Linear(args.dim, args.dim)
        self.moe = MoE(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.dense(h) + self.moe(h)


class MoEModel(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(MoEBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)
        self.checkpoint_layers = False  # activation checkpointing of every block

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            if self.checkpoint_layers:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(self.norm(x))


def build_moe(seed: int = 0, **kwargs) -> MoEModel:
    torch.manual_seed(seed)
    return MoEModel(MoEArgs(**kwargs))


def moe_meshes(device_type: str, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """``dp`` over every rank, and ``(efsdp, ep)``: ranks ``i * ep + j`` hold expert block ``j``."""
    world_size = dist.get_world_size()
    dp = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    sparse = init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("efsdp", "ep"))
    return dp, sparse


def expert_parallel(model: MoEModel, ep_mesh: DeviceMesh) -> None:
    """Split every block's experts over ``ep_mesh`` (``Shard(0)``); tokens then go by all-to-all."""
    for layer in model.layers:
        experts = layer.moe.experts
        for name in ("w1", "w2"):
            full = getattr(experts, name).detach()
            setattr(experts, name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)])))
        layer.moe.ep_group = ep_mesh.get_group()


def expert_placement(num_experts: int, sparse: DeviceMesh) -> Shard:
    """``Shard(0)`` over efsdp, or ``Shard(1)`` when efsdp * ep ranks outnumber the experts."""
    return Shard(1) if sparse.size() > num_experts else Shard(0)


def shard_moe(
    model: MoEModel,
    fully_shard,
    result_cls,
    mesh_info_cls,
    dp: DeviceMesh,
    sparse: DeviceMesh,
    **kwargs,
) -> MoEModel:
    """torchtitan's recipe: per block, experts on efsdp and the rest on dp, then the root on dp.

    ``result_cls`` / ``mesh_info_cls``: ``ShardPlacementResult`` and torch's
    ``FSDPMeshInfo``; ``kwargs`` go to every ``fully_shard`` call.
    """
    dp_info = mesh_info_cls(mesh=dp, shard_mesh_dim=0)
    efsdp_info = mesh_info_cls(mesh=sparse["efsdp"], shard_mesh_dim=0)
    placement = expert_placement(model.layers[0].moe.num_experts, sparse)
    expert_only = sparse["ep"].size() == 1  # efsdp is dp: the call's own mesh, as torchtitan
    for layer in model.layers:
        experts = set(layer.moe.experts.parameters())

        def place(p: nn.Parameter, experts: set = experts):
            if expert_only:
                return placement if p in experts else None
            if p in experts:
                return result_cls(placement=placement, mesh_info=efsdp_info)
            return result_cls(placement=Shard(0), mesh_info=dp_info)

        fully_shard(layer, mesh=dp, shard_placement_fn=place, **kwargs)
    fully_shard(model, mesh=dp, **kwargs)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree (default 2)")
    parser.add_argument("--experts", type=int, default=4)
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device_type = "cuda" if use_cuda else "cpu"
    if os.environ.get("FSDP2_IMPL", "fsdp2") == "torch":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    else:
        from fsdp2 import ShardPlacementResult, fully_shard
    # torch's clip_grad_norm_ cannot stack norms of DTensors on different meshes; fsdp2's
    # takes one norm over all of them (upstream's parameters too)
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,  # torch's, as torchtitan
    )

    from fsdp2 import clip_grad_norm_

    rank, world_size = dist.get_rank(), dist.get_world_size()
    dp, sparse = moe_meshes(device_type, args.ep)
    model = build_moe(num_experts=args.experts).to(device_type)
    expert_parallel(model, sparse["ep"])
    shard_moe(model, fully_shard, ShardPlacementResult, FSDPMeshInfo, dp, sparse)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)  # summed; the loss is over global tokens
            if not use_cuda:
                module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    if rank == 0:
        for name, p in model.named_parameters():
            if "layers.0" in name:
                print(f"{name:28} mesh {p.device_mesh.mesh_dim_names} {tuple(p.placements)} "
                      f"local {tuple(p.to_local().shape)}")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    vocab = model.embed.num_embeddings
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, vocab, (64,), generator=g).to(device_type)
        targets = (tokens * 7 + 3) % vocab  # a rule the model can learn
        global_tokens = tokens.numel() * world_size
        loss = F.cross_entropy(model(tokens), targets, reduction="sum") / global_tokens
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            print(f"step {step:3d}  loss {total.item():.4f}  grad norm {norm.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
