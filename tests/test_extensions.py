"""All-gather extensions: an int8-quantized frozen weight (examples/int8_all_gather.py).

The sharded weights' local tensors are ``Int8Weight`` subclasses whose
``fsdp_pre_all_gather`` sends int8 rows + fp32 scales and whose
``fsdp_post_all_gather`` dequantizes. Training must match a reference whose
weights are the dequantized values, and each block's all-gather must carry
the subclass's bytes (int8 + scales + the fp32 bias), not fp32 weights.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn as nn
from _impl import fully_shard
from _multiproc import run_ranks
from checks import assert_losses_match, record_collective_bytes
from models import assert_grads_match, cpu_mesh, global_mean, mlp_batch, rank_slice

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
from int8_all_gather import Int8Weight  # noqa: E402


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        # even rows: per-row scales are not of the padded shard's shape, which
        # upstream (and we) require from ranks holding padding
        self.blocks = nn.ModuleList([nn.Linear(7, 14), nn.Linear(14, 6)])
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _block_bytes(block: nn.Linear, world_size: int) -> int:
    rows = -(-block.weight.shape[0] // world_size)
    return rows * block.weight.shape[1] + 4 * rows + 4 * rows  # int8 + scales + fp32 bias


def _extension_body(rank, world_size):
    torch.manual_seed(3)
    model = _Net()
    ref = copy.deepcopy(model)
    for block, ref_block in zip(model.blocks, ref.blocks):
        q = Int8Weight.from_float(block.weight)
        block.weight = nn.Parameter(q, requires_grad=False)
        ref_block.weight = nn.Parameter(q.dequantize(), requires_grad=False)
    expected = [_block_bytes(b, world_size) for b in ref.blocks]
    mesh = cpu_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert type(model.blocks[0].weight.to_local()) is Int8Weight
    params = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    ref_opt, opt = torch.optim.SGD(params(ref), lr=0.1), torch.optim.SGD(params(model), lr=0.1)
    ref_losses, losses = [], []
    for step in range(3):
        x, y = mlp_batch(step, 2 * world_size)
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        xs, ys = rank_slice((x, y), rank, world_size)
        with record_collective_bytes() as calls:
            loss = nn.functional.mse_loss(model(xs), ys)
            loss.backward()
        gathered = [nbytes for kind, _, nbytes in calls if kind == "all_gather"]
        # forward: root, block 0, block 1; backward: block 1, block 0 again
        assert gathered[1:] == [expected[0], expected[1], expected[1], expected[0]], (
            gathered, expected)
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(grads[f"blocks.{i}.weight"] is None for i in range(2))
        assert_grads_match(ref, model, rtol=1e-5, atol=1e-6)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        ref_losses.append(ref_loss.item())
        losses.append(global_mean(loss).item())
    assert_losses_match(ref_losses, losses)
    # the unsharded weight equals the dequantized reference
    model.blocks[0].unshard()
    torch.testing.assert_close(model.blocks[0].weight, ref.blocks[0].weight, rtol=0, atol=0)
    model.blocks[0].reshard()


def test_int8_all_gather_extension():
    """Int8Weight subclass: parity with dequantized reference, all-gathers carry int8 + scales."""
    run_ranks(_extension_body, 2)
