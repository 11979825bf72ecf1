"""HSDP: a 2-D (replicate, shard) mesh, against a full-batch unsharded reference.

All cases run in one 4-rank launch (2x2 and 4x1 meshes); each test checks its case.
"""

from __future__ import annotations

import pytest
from _impl import fully_shard
from checks import (
    assert_losses_match,
    check_case,
    make_opts,
    record_collectives,
    train_steps,
)
from models import (
    assert_grads_match,
    assert_params_match,
    build_transformer,
    make_pair,
    rank_slice,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

STEPS = 3


def _hsdp_mesh(replicate: int, shard: int):
    return init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))


def _parity(rank, world_size, replicate, shard):
    mesh = _hsdp_mesh(replicate, shard)
    ref, model = make_pair(lambda: build_transformer(seed=7))
    shard_transformer(model, fully_shard, mesh=mesh)
    for name, p in model.named_parameters():
        assert p.device_mesh == mesh, name
        assert tuple(p.placements) == (Replicate(), Shard(0)), (name, p.placements)
    batches = [transformer_batch(step, 2 * world_size) for step in range(STEPS)]
    ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)


def _all_reduce_counts(rank, world_size):
    mesh = _hsdp_mesh(2, 2)
    ref, model = make_pair(lambda: build_transformer(seed=8))
    shard_transformer(model, fully_shard, mesh=mesh)
    num_groups = len(model.layers) + 1
    batch = transformer_batch(0, 2 * world_size)
    with record_collectives() as calls:  # the first step: lazy init adds no collective
        transformer_loss(model, rank_slice(batch, rank, world_size)).backward()
    all_reduces = [size for kind, size in calls if kind == "all_reduce"]
    assert all_reduces == [2] * num_groups, calls
    reduce_scatters = [size for kind, size in calls if kind == "reduce_scatter"]
    assert reduce_scatters == [2] * num_groups, calls
    transformer_loss(ref, batch).backward()
    assert_grads_match(ref, model)


def _accumulation(rank, world_size):
    mesh = _hsdp_mesh(2, 2)
    ref, model = make_pair(lambda: build_transformer(seed=9))
    shard_transformer(model, fully_shard, mesh=mesh)
    ref_opt, opt = make_opts(ref, model)
    micro = [transformer_batch(10 + i, 2 * world_size) for i in range(3)]
    for step in range(2):
        for i, batch in enumerate(micro):
            last = i == len(micro) - 1
            model.set_requires_all_reduce(last)
            with record_collectives() as calls:
                transformer_loss(model, rank_slice(batch, rank, world_size)).backward()
            all_reduces = [c for c in calls if c[0] == "all_reduce"]
            expected = len(model.layers) + 1 if last else 0
            assert len(all_reduces) == expected, (step, i, calls)
            if not last:  # shard-reduced gradients wait for the all-reduce
                assert all(p.grad is None for p in model.parameters()), (step, i)
            transformer_loss(ref, batch).backward()
        assert_grads_match(ref, model)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert_params_match(ref, model)


CASES = {
    "parity_2x2": lambda r, w: _parity(r, w, 2, 2),
    "parity_4x1": lambda r, w: _parity(r, w, 4, 1),
    "all_reduce_counts": _all_reduce_counts,
    "accumulation": _accumulation,
}


@pytest.mark.parametrize("mesh_shape", ["2x2", "4x1"])
def test_hsdp_parity(mesh_shape, launch_cases):
    """HSDP training matches the reference; params are (Replicate(), Shard(0)) DTensors."""
    check_case(launch_cases(4, CASES), f"parity_{mesh_shape}")


def test_hsdp_one_all_reduce_per_group(launch_cases):
    """One reduce-scatter over the shard dim and one all-reduce over the replicate dim per group."""
    check_case(launch_cases(4, CASES), "all_reduce_counts")


def test_hsdp_set_requires_all_reduce_accumulation(launch_cases):
    """set_requires_all_reduce(False) skips the all-reduce; the syncing step gives the right grads."""
    check_case(launch_cases(4, CASES), "accumulation")
