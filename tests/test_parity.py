"""Training parity: fully_shard on W ranks vs one unsharded model on the full batch.

Each rank trains the sharded model on its slice of the global batch; every rank
also trains an unsharded reference on the whole batch.  Losses are means, so
the mean of the rank losses equals the reference loss and the mean of the rank
gradients equals the full-batch gradient.

To keep the suite fast, all configurations of one world size run in a single
process launch (cached per module); each pytest case then checks its own
configuration's outcome.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from _impl import fully_shard
from _multiproc import RankError, run_ranks
from models import (
    assert_grads_match,
    assert_params_match,
    build_mlp,
    build_transformer,
    cpu_mesh,
    global_mean,
    make_pair,
    mlp_batch,
    mlp_loss,
    rank_slice,
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

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses, losses = [], []
    for step in range(STEPS):
        batch = make_batch(step, PER_RANK_BATCH * world_size)

        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()

        loss = loss_fn(model, rank_slice(batch, rank, world_size))
        loss.backward()
        # AdamW is nearly invariant to a gradient scale, so check the reduced
        # gradients themselves (mean over ranks), not only the trained values.
        # Gathers every grad before comparing: the outcome is the same on all ranks.
        assert_grads_match(ref, model, rtol=RTOL, atol=ATOL)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()

        ref_losses.append(ref_loss.item())
        losses.append(global_mean(loss).item())

    # Every comparison sees identical values on all ranks (full tensors, global
    # losses), so a failure is raised everywhere and collectives stay in step.
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(ref_losses),
        rtol=RTOL,
        atol=ATOL,
        msg=lambda m: f"losses: {m}",
    )
    assert_params_match(ref, model, rtol=RTOL, atol=ATOL)


def _parity_body(rank: int, world_size: int, configs) -> dict:
    outcome = {}
    for cfg in configs:
        try:
            _run_one(rank, world_size, *cfg)
            outcome[cfg] = None
        except AssertionError:
            # Assertions are evaluated identically on all ranks after the
            # collectives, so the next configuration can still run.
            outcome[cfg] = traceback.format_exc()
    return outcome


_LAUNCHES: dict[int, tuple[bool, object]] = {}


def _outcome(world_size: int):
    if world_size not in _LAUNCHES:
        try:
            _LAUNCHES[world_size] = (True, run_ranks(_parity_body, world_size, CONFIGS))
        except RankError as e:
            _LAUNCHES[world_size] = (False, str(e))
    return _LAUNCHES[world_size]


@pytest.mark.parametrize("reshard_after_forward", RESHARD, ids=lambda r: f"raf={r}")
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"ws{w}")
def test_training_parity(world_size, model_name, reshard_after_forward):
    """Losses every step and final params match the full-batch unsharded reference."""
    ok, result = _outcome(world_size)
    if not ok:
        pytest.fail(f"launch for world_size={world_size} failed:\n{result}", pytrace=False)
    cfg = (model_name, reshard_after_forward)
    errors = [f"--- rank {r}:\n{res[cfg]}" for r, res in enumerate(result) if res[cfg] is not None]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
