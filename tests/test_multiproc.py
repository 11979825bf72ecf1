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
