"""fully_shard on submodules under torch's composable ``replicate()`` on the root.

The sharded submodules are marked in torch's composable-API registry, so
``replicate(model.to(device))`` leaves their parameters to FSDP and
all-reduces only the rest (DDP), as with upstream. The parent's forward
starts each child's all-gather with ``unshard(async_op=True)`` before using
it. Losses and parameters must equal upstream's flow and the unsharded model
trained on the whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _impl import fully_shard
from checks import check_case, full_params, train_alone
from models import cpu_mesh
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import fully_shard as upstream_fully_shard


class Net(nn.Module):
    def __init__(self, prefetch: bool) -> None:
        super().__init__()
        self.prefetch = prefetch
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)  # not sharded: replicate's DDP reduces it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prefetch:
            for child in (self.a, self.b):
                child.unshard(async_op=True)
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def _build_and_train(shard_fn, prefetch, rank, world_size):
    """Children sharded by ``shard_fn`` under ``replicate`` (None: plain, whole batches); train.

    Returns the losses and the final full parameters.
    """
    torch.manual_seed(0)
    model = Net(prefetch and shard_fn is not None)
    if shard_fn is not None:
        mesh = cpu_mesh()
        shard_fn(model.a, mesh=mesh)
        shard_fn(model.b, mesh=mesh)
        replicate(model.to("cpu"), device_ids=None)
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2 * world_size, 8, generator=gen),) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train_alone(model, batches, _loss, None if shard_fn is None else rank, world_size, opt)
    return losses, full_params(model)


def _loss(model, batch):
    (x,) = batch
    return model(x).pow(2).mean()


def _case(prefetch):
    def body(rank, world_size):
        losses, params = _build_and_train(fully_shard, prefetch, rank, world_size)
        up_losses, up_params = _build_and_train(upstream_fully_shard, prefetch, rank, world_size)
        ref_losses, ref_params = _build_and_train(None, prefetch, rank, world_size)
        assert losses == up_losses, (losses, up_losses)
        assert sorted(params) == sorted(up_params) == sorted(ref_params)
        for name in ref_params:
            assert torch.equal(params[name], up_params[name]), name
            torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)

    return body


CASES = {"async-unshard": _case(True), "plain": _case(False)}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_fully_shard_under_replicate_matches_upstream(case, world_size, launch_cases):
    """Sharded children under replicate(model.to(device)) train as upstream and the reference."""
    check_case(launch_cases(world_size, CASES), case)
