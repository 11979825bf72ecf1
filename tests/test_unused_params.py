"""Parameters that get a gradient on some ranks only: DDP's gradients, by default.

A mixture-of-experts block (router and four experts in one ``fully_shard``
group) routes each rank to a rank- and step-dependent pair of experts; expert
3 is used on no rank. Every rank's sharded model must match a single-process
reference of the per-rank losses (the mean over ranks, zeros where an expert
was unused, ``grad is None`` for expert 3, as DDP with
``find_unused_parameters=True``) for 3 AdamW steps: fp32 on W = 2, 3 and 4,
with a bf16 reduce, on an HSDP 2x2 mesh, with gradient accumulation without
sync (and, on HSDP, without the all-reduce), with CPU offload and with the
block grouped with the head (``fully_shard([block, head])``). A step costs one reduce-scatter
per group and nothing else, of exactly the trainable parameters' padded size
(frozen parameters add nothing).

Upstream aborts on gloo in these cases unless ``set_reduce_scatter_unused_params``
is on, so they run on fsdp2 only; with the flag on (zeros for unused
parameters, also on every rank) both implementations must give the
reference's gradients for the used experts and zeros for expert 3.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _impl import IMPL, CPUOffloadPolicy, MixedPrecisionPolicy, fsdp2_only, fully_shard
from checks import check_case, on_collectives
from models import assert_grads_match, full, global_mean, shard_groups
from torch.distributed.device_mesh import init_device_mesh

DIM, EXPERTS, STEPS = 6, 4, 3


class Block(nn.Module):
    """A router and experts; the experts a call uses are given (rank-dependent routing)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor, experts: tuple[int, ...]) -> torch.Tensor:
        gate = torch.softmax(self.router(h), dim=-1)
        for e in experts:
            h = h + gate[:, e : e + 1] * torch.tanh(self.experts[e](h))
        return h


class MoE(nn.Module):
    """Input projection, a routed block (one FSDP group, run on every rank), a head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, DIM)
        self.block = Block()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, experts: tuple[int, ...]) -> torch.Tensor:
        return self.head(self.block(torch.tanh(self.inp(x)), experts))


def _route(rank: int, step: int) -> tuple[int, ...]:
    """Expert 0 everywhere, expert 1 or 2 by rank and step, expert 3 never."""
    return (0, 1 + (rank + step) % 2)


def _batch(step: int, world_size: int, micro: int = 0):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(2 * world_size, 5, generator=g), torch.randn(2 * world_size, 1, generator=g)


def _loss(model, x, y, rank, step, world_size, micro=0):
    """Rank ``rank``'s loss on its slice of the batch (the reference passes every rank)."""
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    route = _route(rank + micro, step)
    return nn.functional.mse_loss(model(xs, route), ys)


def _train_case(hsdp=False, micro_batches=1, rtol=1e-5, atol=1e-6, grouped=False, **kwargs):
    """3 AdamW steps against the single-process reference of the per-rank losses.

    With micro-batches, the earlier ones skip the gradient sync (FSDP) or only
    the all-reduce over the replicate dim (HSDP: the shard-reduced gradients
    and presence flags are kept for the next all-reduce).
    """

    def case(rank, world_size):
        torch.manual_seed(0)
        ref = MoE()
        model = copy.deepcopy(ref)
        mesh = (
            init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
            if hsdp else init_device_mesh("cpu", (world_size,))
        )
        # the block in a group of its own, or with the head (fully_shard([block, head]))
        group = [model.block, model.head] if grouped else model.block
        shard_groups(model, fully_shard, [group], mesh=mesh, **kwargs)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(STEPS):
            ref_loss = 0.0
            loss = torch.zeros(())
            for micro in range(micro_batches):
                x, y = _batch(step, world_size, micro)
                ref_loss = ref_loss + sum(
                    _loss(ref, x, y, r, step, world_size, micro) for r in range(world_size)
                ) / world_size
                if micro_batches > 1:
                    last = micro == micro_batches - 1
                    if hsdp:
                        model.set_requires_all_reduce(last)
                    else:
                        model.set_requires_gradient_sync(last)
                mine = _loss(model, x, y, rank, step, world_size, micro)
                mine.backward()
                loss = loss + mine.detach()
            ref_loss.backward()
            assert ref.block.experts[3].weight.grad is None
            assert_grads_match(ref, model, rtol, atol)
            torch.testing.assert_close(global_mean(loss), ref_loss.detach(), rtol=rtol, atol=atol)
            ref_opt.step()
            opt.step()
            ref_opt.zero_grad()
            opt.zero_grad()
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                full(p.detach()), dict(ref.named_parameters())[name].detach(), rtol=rtol,
                atol=atol, msg=lambda m, n=name: f"{n}: {m}",
            )

    return case


def _one_reduce_scatter_per_group(rank, world_size):
    """One reduce-scatter per group, of the trainable parameters' padded size; no all-reduce."""
    torch.manual_seed(0)
    model = MoE()
    model.block.experts[1].bias.requires_grad_(False)  # frozen: neither reduced nor flagged
    shard_groups(model, fully_shard, [model.block], mesh=init_device_mesh("cpu", (world_size,)))
    calls = []

    def record(kind, args, kwargs):
        inp = args[1] if kind == "reduce_scatter" and len(args) > 1 else kwargs.get("input")
        calls.append((kind, None if inp is None else inp.numel()))

    x, y = _batch(0, world_size)
    loss = _loss(model, x, y, rank, 0, world_size)
    with on_collectives(record):
        loss.backward()
    trainable = [p for p in model.block.parameters() if p.requires_grad]
    padded = sum(-(-p.shape[0] // world_size) * p[0].numel() for p in trainable)
    root = [p for n, p in model.named_parameters() if not n.startswith("block.")]
    root_padded = sum(-(-p.shape[0] // world_size) * p[0].numel() for p in root)
    reductions = [call for call in calls if call[0] != "all_gather"]  # the block's re-gather
    assert reductions == [
        ("reduce_scatter", world_size * padded),
        ("reduce_scatter", world_size * root_padded),
    ], calls
    assert model.block.experts[3].weight.grad is None
    assert model.block.experts[1].bias.grad is None
    assert model.block.experts[1].weight.grad is not None  # used on some rank


def _flag_on(rank, world_size):
    """set_reduce_scatter_unused_params(True): the reference's grads, zeros for expert 3."""
    torch.manual_seed(0)
    ref = MoE()
    model = copy.deepcopy(ref)
    shard_groups(model, fully_shard, [model.block], mesh=init_device_mesh("cpu", (world_size,)))
    model.set_reduce_scatter_unused_params(True)
    x, y = _batch(0, world_size)
    (sum(_loss(ref, x, y, r, 0, world_size) for r in range(world_size)) / world_size).backward()
    _loss(model, x, y, rank, 0, world_size).backward()
    for name, p in model.named_parameters():
        grad = full(p.grad)
        ref_grad = dict(ref.named_parameters())[name].grad
        if ref_grad is None:
            assert name.startswith("block.experts.3.") and not grad.any(), name
        else:
            torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def _cases(world_size: int) -> dict:
    if IMPL == "torch":
        return {"flag_on": _flag_on}
    cases = {"fp32": _train_case(), "flag_on": _flag_on}
    if world_size == 2:
        bf16 = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
        cases.update(
            bf16_reduce=_train_case(mp_policy=bf16, rtol=2e-2, atol=2e-3),
            no_sync=_train_case(micro_batches=2),
            offload=_train_case(offload_policy=CPUOffloadPolicy(pin_memory=False)),
            one_reduce_scatter=_one_reduce_scatter_per_group,
            grouped=_train_case(grouped=True),
            grouped_no_sync=_train_case(grouped=True, micro_batches=2),
        )
    if world_size == 4:
        cases.update(
            hsdp=_train_case(hsdp=True),
            hsdp_no_sync=_train_case(hsdp=True, micro_batches=2),
            hsdp_bf16_reduce=_train_case(
                hsdp=True, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
                rtol=2e-2, atol=2e-3,
            ),
        )
    return cases


@fsdp2_only  # upstream: gloo aborts (pytorch/pytorch#158719) unless the flag is on
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_moe_matches_reference(world_size, launch_cases):
    """MoE, experts used on some ranks and one on none: reference losses, grads, params (fp32)."""
    check_case(launch_cases(world_size, _cases(world_size)), "fp32")


@fsdp2_only
@pytest.mark.parametrize("case", ["bf16_reduce", "no_sync", "offload"])
def test_moe_variants(case, launch_cases):
    """The MoE reference with a bf16 reduce, no-sync accumulation, CPU offload (W = 2)."""
    check_case(launch_cases(2, _cases(2)), case)


@fsdp2_only
@pytest.mark.parametrize("case", ["grouped", "grouped_no_sync"])
def test_moe_in_group_of_several_modules(case, launch_cases):
    """fully_shard([block, head]): the block's unused experts are still filled (W = 2)."""
    check_case(launch_cases(2, _cases(2)), case)


@fsdp2_only
@pytest.mark.parametrize("case", ["hsdp", "hsdp_no_sync", "hsdp_bf16_reduce"])
def test_moe_hsdp(case, launch_cases):
    """The MoE reference on an HSDP 2x2 mesh (also accumulating, also a bf16 reduce)."""
    check_case(launch_cases(4, _cases(4)), case)


@fsdp2_only
def test_one_reduce_scatter_per_group(launch_cases):
    """No extra collective, no extra byte: the reduce-scatter input is the padded gradients."""
    check_case(launch_cases(2, _cases(2)), "one_reduce_scatter")


@pytest.mark.parametrize("world_size", [2, 4])
def test_flag_on_gives_zeros(world_size, launch_cases):
    """set_reduce_scatter_unused_params(True) (both implementations): zeros for expert 3."""
    check_case(launch_cases(world_size, _cases(world_size)), "flag_on")
