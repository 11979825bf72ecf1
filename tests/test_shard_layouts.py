"""Other shard layouts: Shard(1) via shard_placement_fn, reshard_after_forward=int, two meshes.

All cases run in one 4-rank launch; each test checks its case against a
full-batch unsharded reference.
"""

from __future__ import annotations

import pytest
import torch.nn as nn
from _impl import fully_shard
from checks import assert_losses_match, check_case, record_collectives, train_steps
from models import (
    assert_params_match,
    build_transformer,
    cpu_mesh,
    make_pair,
    rank_slice,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

STEPS = 3


def _train_and_compare(rank, world_size, ref, model):
    batches = [transformer_batch(step, 2 * world_size) for step in range(STEPS)]
    ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)


def _shard_dim1(param: nn.Parameter):
    # Every 2-D weight whose dim 1 (8 features) divides over 4 ranks: Shard(1).
    return Shard(1) if param.dim() == 2 and param.size(1) % 4 == 0 else None


def _shard1(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=11, hidden=12))
    shard_transformer(model, fully_shard, mesh=cpu_mesh(), shard_placement_fn=_shard_dim1)
    for name, p in model.named_parameters():
        expected = Shard(1) if _shard_dim1(p) is not None else Shard(0)
        assert tuple(p.placements) == (expected,), (name, p.placements)
        assert p.to_local().shape == p.full_tensor().chunk(world_size, expected.dim)[rank].shape
    _train_and_compare(rank, world_size, ref, model)


def _reshard_to_two(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=12, n_layers=3))
    shard_transformer(model, fully_shard, mesh=cpu_mesh(), reshard_after_forward=2)
    batch = transformer_batch(0, 2 * world_size)
    loss = transformer_loss(model, rank_slice(batch, rank, world_size))
    with record_collectives() as calls:
        loss.backward()
    gathers = [size for kind, size in calls if kind == "all_gather"]
    # every group, the root too (explicit int), re-gathers over 2 ranks only
    assert gathers == [2] * (len(model.layers) + 1), calls
    model.zero_grad()
    _train_and_compare(rank, world_size, ref, model)


def _two_meshes(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=13))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = cpu_mesh()
    for layer in model.layers:  # "experts": their own (HSDP) mesh, the rest on the 1-D mesh
        fully_shard(layer.feed_forward, mesh=hsdp)
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    for name, p in model.named_parameters():
        expected = (Replicate(), Shard(0)) if "feed_forward" in name else (Shard(0),)
        assert tuple(p.placements) == expected, (name, p.placements)
    _train_and_compare(rank, world_size, ref, model)


CASES = {"shard1": _shard1, "reshard_to_two": _reshard_to_two, "two_meshes": _two_meshes}


def test_shard_placement_fn_shard1(launch_cases):
    """shard_placement_fn -> Shard(1): placements, local shapes and training match the reference."""
    check_case(launch_cases(4, CASES), "shard1")


def test_reshard_after_forward_int(launch_cases):
    """reshard_after_forward=2 on 4 ranks: backward all-gathers over 2 ranks; training matches."""
    check_case(launch_cases(4, CASES), "reshard_to_two")


@pytest.mark.parametrize("case", ["two_meshes"])
def test_two_meshes_in_one_model(case, launch_cases):
    """Feed-forward "experts" on an HSDP mesh, the rest on a 1-D mesh, trained together."""
    check_case(launch_cases(4, CASES), case)
