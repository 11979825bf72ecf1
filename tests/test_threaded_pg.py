"""fully_shard on torch's threaded process group: ranks as threads of one process.

Upstream's own tests run FSDP this way (``MultiThreadedTestCase``), and so do
many users' unit tests. Each thread has its own process-group world, but
module globals, the default RNG and the autograd engine are shared, so fsdp2
must keep no per-rank state where another rank's thread can see it (e.g. the
post-forward process groups of ``reshard_after_forward=k``). An MLP sharded
root-only, or per submodule and root, with ``reshard_after_forward`` True,
False and 2, trains on W = 4 and 8 thread ranks; each run trains the
implementation under test and upstream's ``fully_shard`` in the same threads,
and the losses and parameters must equal upstream's to the bit and the
single-process reference's to 1e-5. Models and data come from explicit
generators (the default RNG is shared by all ranks). A hang fails the test
after ``FSDP2_TEST_TIMEOUT`` seconds instead of stalling the suite. The
divergence check of lazy init (a model that differs on one thread rank)
raises the same error on every thread rank.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _impl import fsdp2_only, fully_shard
from _multiproc import RankError, run_ranks
from _threaded import run_threads
from checks import assert_nested_close, full_params, train_alone
from models import MLP, cpu_mesh, mlp_batch, mlp_loss, shard_mlp
from torch.distributed.fsdp import fully_shard as upstream_fully_shard

STEPS, BATCH = 3, 16  # 16: every rank of 8 gets a non-empty slice


def _mlp() -> MLP:
    """An MLP whose values come from an explicit generator (never the shared default RNG)."""
    with torch.device("meta"):
        model = MLP()
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model


def _trained(model, rank: int | None, world_size: int) -> tuple[list[float], dict]:
    """Losses (mean over ranks) and final full parameters after ``STEPS`` AdamW steps."""
    batches = [mlp_batch(step, BATCH) for step in range(STEPS)]
    return train_alone(model, batches, mlp_loss, rank, world_size), full_params(model)


def _train_both(rank, world_size, layout, reshard):
    kwargs = {"per_layer": layout == "per", "mesh": cpu_mesh(), "reshard_after_forward": reshard}
    ours = _trained(shard_mlp(_mlp(), fully_shard, **kwargs), rank, world_size)
    upstream = _trained(shard_mlp(_mlp(), upstream_fully_shard, **kwargs), rank, world_size)
    return ours, upstream


@pytest.mark.parametrize("reshard", [True, False, 2])
@pytest.mark.parametrize("layout", ["root", "per"])
@pytest.mark.parametrize("world_size", [4, 8])
def test_mlp_trains_on_threaded_group(world_size, layout, reshard):
    """Training on thread ranks matches upstream bitwise and the single-process reference."""
    ref_losses, ref_params = _trained(_mlp(), None, world_size)
    results = run_threads(_train_both, world_size, layout, reshard)
    for rank, (ours, upstream) in enumerate(results):
        assert_nested_close(ours, upstream, f"rank {rank} vs upstream", rtol=0, atol=0)
        torch.testing.assert_close(
            torch.tensor(ours[0]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
        )
        assert_nested_close(ours[1], ref_params, f"rank {rank} params vs reference")


def _diverged(rank, world_size):
    """Rank 1's hidden layer is narrower: the first forward raises; the group still works."""
    model = shard_mlp(MLP(hidden=12 if rank == 1 else 13), fully_shard, mesh=cpu_mesh(),
                      reshard_after_forward=True)
    try:
        model(torch.zeros(2, 7))
        message = None
    except ValueError as e:
        message = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    return message, t.item()


@fsdp2_only  # upstream: mismatched collectives (a hang or an abort)
def test_divergence_check_on_threaded_group():
    """Ranks as threads: a model that differs on one rank raises the same ValueError on all."""
    results = run_threads(_diverged, 4)
    messages = {message for message, _ in results}
    assert len(messages) == 1 and None not in messages, messages
    message = messages.pop()
    assert "in group 'in_proj', parameter 'in_proj.weight'" in message, message
    assert "rank 1 differs from rank 0" in message and "shape (12, 7)" in message, message
    assert [total for _, total in results] == [4.0] * 4


def _hang(rank, world_size):
    if rank != 0:  # rank 0 waits in a collective the others never join
        return None
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_run_threads_fails_on_hang_instead_of_stalling():
    """A rank stuck in a collective makes run_threads fail at its timeout, naming the rank."""
    with pytest.raises(RankError, match=r"timed out after 2 s; ranks \[0\] were stuck"):
        run_threads(_hang, 4, timeout=2)


def _reinit(rank, world_size, store_dir):
    """Train, destroy the default group, start a new one, train again (one process per rank)."""
    first = _trained(
        shard_mlp(_mlp(), fully_shard, mesh=cpu_mesh(), reshard_after_forward=2), rank, world_size
    )
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(store_dir, "second"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    second = _trained(
        shard_mlp(_mlp(), fully_shard, mesh=cpu_mesh(), reshard_after_forward=2), rank, world_size
    )
    return first, second


def test_new_process_group_gets_new_post_forward_groups():
    """After destroy_process_group and a new init, reshard_after_forward=2 uses new groups."""
    with tempfile.TemporaryDirectory() as store_dir:
        results = run_ranks(_reinit, 4, store_dir, backend="gloo")  # (both worlds: one backend)
    for rank, (first, second) in enumerate(results):
        assert_nested_close(second, first, f"rank {rank}: second world vs first", rtol=0, atol=0)
