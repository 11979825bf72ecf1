"""LoRA-style fine-tuning: frozen base weights and trainable adapters in one group.

Each block's group mixes frozen base parameters and trainable low-rank
adapters. Training must match the unsharded reference, the frozen weights
must never change or get a gradient, and the reduce-scatter must carry only
the adapters' gradients (no bytes for frozen parameters).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from _impl import fully_shard
from _multiproc import run_ranks
from checks import assert_losses_match, make_opts, record_collective_bytes
from models import (
    assert_grads_match,
    assert_params_match,
    cpu_mesh,
    global_mean,
    make_pair,
    mlp_batch,
    rank_slice,
)

RANK = 3


class LoRALinear(nn.Module):
    """``base(x) + up(down(x))`` with a frozen ``base`` and trainable adapters."""

    def __init__(self, in_dim: int, out_dim: int, rank: int = RANK):
        super().__init__()
        self.base = nn.Linear(in_dim, out_dim)
        self.lora_down = nn.Linear(in_dim, rank, bias=False)
        self.lora_up = nn.Linear(rank, out_dim, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_up(self.lora_down(x))


class LoRAModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([LoRALinear(7, 13), LoRALinear(13, 5)])
        self.head = nn.Linear(5, 1)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _build() -> LoRAModel:
    torch.manual_seed(11)
    return LoRAModel()


def _padded_grad_bytes(module: nn.Module, world_size: int) -> int:
    """Reduce-scatter input bytes for the trainable parameters of ``module``'s own group."""
    total = 0
    for p in module.parameters():
        if p.requires_grad:
            rows = -(-p.shape[0] // world_size)
            total += world_size * rows * (p.numel() // p.shape[0]) * p.element_size()
    return total


def _lora_body(rank, world_size):
    ref, model = make_pair(_build)
    expected_rs = [_padded_grad_bytes(b, world_size) for b in reversed(ref.blocks)]
    mesh = cpu_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    frozen_before = {n: p.full_tensor() for n, p in model.named_parameters() if not p.requires_grad}
    ref_opt, opt = make_opts(ref, model)
    ref_losses, losses = [], []
    for step in range(3):
        x, y = mlp_batch(step, 2 * world_size)
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        xs, ys = rank_slice((x, y), rank, world_size)
        with record_collective_bytes() as calls:
            loss = nn.functional.mse_loss(model(xs), ys)
            loss.backward()
        rs = [nbytes for kind, _, nbytes in calls if kind == "reduce_scatter"]
        # one reduce-scatter per block with adapters only; the all-frozen root none
        assert rs == expected_rs, (rs, expected_rs)
        assert_grads_match(ref, model)
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, f"frozen {name} got a gradient"
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        ref_losses.append(ref_loss.item())
        losses.append(global_mean(loss).item())
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)
    for name, p in model.named_parameters():
        if name in frozen_before:
            torch.testing.assert_close(p.full_tensor(), frozen_before[name], rtol=0, atol=0)


def test_lora_frozen_base_and_adapters_in_one_group():
    """Frozen base + trainable adapters per group: parity, frozen unchanged, adapters-only reduce bytes."""
    run_ranks(_lora_body, 2)
