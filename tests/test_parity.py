"""Training parity: fully_shard on W ranks vs one unsharded model on the full batch.

Each rank trains the sharded model on its slice of the global batch; every rank
also trains an unsharded reference on the whole batch.  Losses are means, so
the mean of the rank losses equals the reference loss and the mean of the rank
gradients equals the full-batch gradient.

To keep the suite fast, all configurations of one world size run in a single
process launch (kept for the module's tests by the ``launch_cases`` fixture);
each pytest case then checks its own configuration's outcome.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _impl import fully_shard
from checks import assert_losses_match, check_case, train_steps
from models import (
    assert_params_match,
    build_mlp,
    build_transformer,
    cpu_mesh,
    make_pair,
    mlp_batch,
    mlp_loss,
    shard_mlp,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.tensor import DTensor

WORLD_SIZES = [1, 2, 3, 4]
MODELS = ["mlp", "transformer"]
RESHARD = [True, False, None]
CONFIGS = [(m, r) for m in MODELS for r in RESHARD]
STEPS = 4
PER_RANK_BATCH = 2
RTOL, ATOL = 1e-5, 1e-6


def _run_one(rank: int, world_size: int, model_name: str, reshard_after_forward) -> None:
    mesh = cpu_mesh(world_size)
    if model_name == "mlp":
        ref, model = make_pair(lambda: build_mlp(seed=3))
        shard_mlp(model, fully_shard, mesh=mesh, reshard_after_forward=reshard_after_forward)
        make_batch, loss_fn = mlp_batch, mlp_loss
    else:
        ref, model = make_pair(lambda: build_transformer(seed=5))
        shard_transformer(
            model, fully_shard, mesh=mesh, reshard_after_forward=reshard_after_forward
        )
        make_batch, loss_fn = transformer_batch, transformer_loss

    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} is not a DTensor after fully_shard"

    opts = tuple(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ref, model))
    batches = [make_batch(step, PER_RANK_BATCH * world_size) for step in range(STEPS)]
    # train_steps checks the reduced gradients themselves every step (AdamW is nearly
    # invariant to a gradient scale); every comparison sees identical values on all
    # ranks (full tensors, global losses), so a failure is raised everywhere and
    # collectives stay in step.
    ref_losses, losses = train_steps(ref, model, batches, loss_fn, rank, world_size, opts)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model, rtol=RTOL, atol=ATOL)


CASES = {cfg: functools.partial(_run_one, model_name=cfg[0], reshard_after_forward=cfg[1])
         for cfg in CONFIGS}


@pytest.mark.parametrize("reshard_after_forward", RESHARD, ids=lambda r: f"raf={r}")
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"ws{w}")
def test_training_parity(world_size, model_name, reshard_after_forward, launch_cases):
    """Losses every step and final params match the full-batch unsharded reference."""
    check_case(launch_cases(world_size, CASES), (model_name, reshard_after_forward))
