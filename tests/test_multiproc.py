"""The multi-process test helper itself: results, errors, crashes and hangs surface."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from _multiproc import RankError, run_ranks


def _sum_ranks(rank, world_size, offset):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return (rank, world_size, t.item() + offset)


def test_results_come_back_in_rank_order():
    """Every rank runs in an initialized gloo group and its return value comes back in rank order."""
    assert run_ranks(_sum_ranks, 3, 10) == [(r, 3, 13.0) for r in range(3)]


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise KeyError("boom-from-rank-1")
    dist.barrier()  # rank 0 would wait forever for rank 1


def test_exception_propagates_with_traceback():
    """An exception on one rank fails the run quickly with that rank's traceback, even if others block."""
    start = time.monotonic()
    with pytest.raises(RankError, match="boom-from-rank-1") as info:
        run_ranks(_raise_on_rank1, 2)
    assert "rank 1 raised" in str(info.value) and "_raise_on_rank1" in str(info.value)
    assert time.monotonic() - start < 30


def _exit_hard(rank, world_size):
    if rank == 0:
        os._exit(3)


def test_hard_exit_fails():
    """A rank that exits with a non-zero code without raising fails the run."""
    with pytest.raises(RankError, match="exited with code 3"):
        run_ranks(_exit_hard, 2)


def _hang(rank, world_size):
    time.sleep(60)


def test_timeout_kills_ranks():
    """A run exceeding its timeout is killed and reported as timed out instead of hanging."""
    start = time.monotonic()
    with pytest.raises(RankError, match="timed out"):
        run_ranks(_hang, 2, timeout=2)
    assert time.monotonic() - start < 20


def _full_equals_full_tensor(rank, world_size):
    from models import _gather_shards, full, full_all
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import fsdp2

    meshes = [init_device_mesh("cpu", (world_size,))]
    if world_size == 4:
        meshes.append(init_device_mesh("cpu", (2, 2)))
    torch.manual_seed(0)
    fast, tensors, wants = 0, [None, torch.arange(3)], [None, torch.arange(3)]
    for mesh in meshes:
        one = [(Shard(0),), (Shard(1),), (Replicate(),)]
        two = [(Replicate(), Shard(0)), (Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), Shard(0))]
        for placements in one if mesh.ndim == 1 else two:
            for shape in [(7, 5), (1, 3), (3, 2), (13,)] if mesh.ndim == 1 else [(7, 5), (5, 3)]:
                if any(getattr(p, "dim", 0) >= len(shape) for p in placements):
                    continue
                for dtype in (torch.float32, torch.bfloat16, torch.int64):
                    value = (torch.randn(shape) * 100).to(dtype)
                    d = distribute_tensor(value, mesh, placements)
                    got, want = full(d), d.full_tensor()
                    assert got.dtype == want.dtype and torch.equal(got, want), (placements, shape)
                    assert torch.equal(want, value)
                    fast += _gather_shards(d) is not None
                    tensors.append(d)
                    wants.append(value)
    partial = DTensor.from_local(torch.ones(3) * rank, meshes[0], [Partial()])  # takes full_tensor()
    assert _gather_shards(partial) is None and torch.equal(full(partial), partial.full_tensor())
    bounds = (0, 4, 4, 7, 9) if world_size == 4 else (0, 1, 7, 9)
    for shape in [(bounds[-1], 3), (bounds[-1],)]:
        value = torch.randn(shape)
        rows = value[bounds[rank] : bounds[rank + 1]].clone()
        d = DTensor.from_local(rows, meshes[0], [fsdp2.RaggedShard(row_bounds=bounds)],
                               shape=value.shape, stride=value.stride())
        assert torch.equal(full(d), value) and torch.equal(d.full_tensor(), value)
        fast += _gather_shards(d) is not None
        tensors.append(d)
        wants.append(value)
    tensors.append(partial)
    wants.append(partial.full_tensor())
    # all at once: one all-gather per process group and dtype (the rest one by one)
    for got, want in zip(full_all(tensors), wants, strict=True):
        assert got is want is None or (got.dtype == want.dtype and torch.equal(got, want))
    return fast


@pytest.mark.parametrize("world_size", [3, 4])
def test_full_gathers_what_full_tensor_gathers(world_size):
    """The tests' ``full`` (plain shards gathered by process-group collectives) is ``full_tensor()``,
    uneven and empty shards, 2-D meshes and several dtypes included; it takes the fast path.
    ``full_all`` (many tensors, batched) gives the same."""
    assert all(n > 0 for n in run_ranks(_full_equals_full_tensor, world_size))
