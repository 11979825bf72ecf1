"""state_dict / load_state_dict of sharded models: keys, DTensor values, no padding, reloads."""

from __future__ import annotations

import torch
from _impl import fully_shard
from _multiproc import run_ranks
from checks import (
    ATOL,
    RTOL,
    assert_losses_match,
    assert_sharded,
    expected_local_shape,
    train_steps,
)
from models import (
    assert_params_match,
    build_mlp,
    build_transformer,
    cpu_mesh,
    full,
    global_mean,
    make_pair,
    mlp_batch,
    mlp_loss,
    rank_slice,
    shard_mlp,
    shard_transformer,
    sharded_state_dict_from,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.tensor import DTensor, Shard


def _state_dict_body(rank, world_size):
    for build, shard in (
        (build_mlp, shard_mlp),
        (lambda: build_transformer(seed=1), shard_transformer),
    ):
        ref, model = make_pair(build)
        shard(model, fully_shard, mesh=cpu_mesh())
        ref_sd = ref.state_dict()
        sd = model.state_dict()
        assert list(sd) == list(ref_sd), (list(sd), list(ref_sd))
        for k, v in sd.items():
            assert isinstance(v, DTensor), f"{k} is {type(v).__name__}"
            assert tuple(v.placements) == (Shard(0),), k
            assert v.shape == ref_sd[k].shape, (k, v.shape)
            assert v.to_local().shape == expected_local_shape(v.shape, rank, world_size), (
                k,
                v.to_local().shape,
            )
        fulls = {k: v.full_tensor() for k, v in sd.items()}
        for k, v in fulls.items():
            torch.testing.assert_close(v, ref_sd[k], rtol=0, atol=0)
        # after training too (values come from the live sharded params, not a stale copy)
        batches = (
            [transformer_batch(0, 2 * world_size)]
            if shard is shard_transformer
            else [mlp_batch(0, 2 * world_size)]
        )
        loss_fn = transformer_loss if shard is shard_transformer else mlp_loss
        train_steps(ref, model, batches, loss_fn, rank, world_size)
        fulls = {k: v.full_tensor() for k, v in model.state_dict().items()}
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(fulls[k], v, rtol=RTOL, atol=ATOL)


def test_state_dict_is_sharded_dtensors_without_padding():
    """state_dict has the unsharded keys, Shard(0) DTensor values, unpadded shapes, reference values."""
    run_ranks(_state_dict_body, 3)


def _load_state_dict_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=2))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # scramble the live parameters
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
    fulls = {n: full(p.detach()) for n, p in model.named_parameters()}
    assert not torch.equal(fulls["output.weight"], ref.output.weight.detach())
    result = model.load_state_dict(saved)
    assert not result.missing_keys and not result.unexpected_keys, result
    assert_sharded(model, rank, world_size, "after load_state_dict")
    assert_params_match(ref, model, 0, 0)
    # the restored values are what forward actually uses
    batches = [transformer_batch(s, 2 * world_size) for s in range(2)]
    ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model, RTOL, ATOL)


def test_load_state_dict_restores_values():
    """Loading a saved sharded state dict after changing params restores values used in training."""
    run_ranks(_load_state_dict_body, 3)


def _state_dict_mid_step_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=4))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    batch = transformer_batch(0, 2 * world_size)
    loss = transformer_loss(model, rank_slice(batch, rank, world_size))
    # The root keeps its parameters unsharded after forward; state_dict must not see that.
    sd = model.state_dict()
    for k, v in sd.items():
        assert isinstance(v, DTensor), f"{k} is {type(v).__name__} between forward and backward"
        torch.testing.assert_close(v.full_tensor(), ref.state_dict()[k], rtol=0, atol=0)
    loss.backward()
    ref_loss = transformer_loss(ref, batch)
    ref_loss.backward()
    assert_losses_match([ref_loss.item()], [global_mean(loss).item()])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.grad), q.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_state_dict_between_forward_and_backward():
    """state_dict() after forward (root still unsharded) gives sharded DTensors; backward is unaffected."""
    run_ranks(_state_dict_mid_step_body, 2)


def _assign_after_training_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=6))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    batches = [transformer_batch(s, 2 * world_size) for s in range(4)]
    ref_losses, losses = train_steps(ref, model, batches[:2], transformer_loss, rank, world_size)
    # A fresh model's values, loaded by assignment after lazy init and training.
    fresh = build_transformer(seed=8)
    ref.load_state_dict(fresh.state_dict())
    model.load_state_dict(sharded_state_dict_from(fresh, cpu_mesh()), assign=True)
    assert_sharded(model, rank, world_size, "after load_state_dict(assign=True)")
    # The next all-gathers must read the assigned values, not the old buffer.
    r2, l2 = train_steps(ref, model, batches[2:], transformer_loss, rank, world_size)
    assert_losses_match(ref_losses + r2, losses + l2)


def test_load_state_dict_assign_after_training():
    """load_state_dict(assign=True) after training steps: the next forward uses the loaded values."""
    run_ranks(_assign_after_training_body, 2)
