"""fsdp2.enable_local_shard_step and fsdp2.clip_grad_norm_ on sharded parameters.

The fast paths must give the same numbers as the plain DTensor path (bit for
bit for the optimizer) and as the unsharded reference (within fp32 rounding),
and leave DTensor-valued optimizer state behind.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from _impl import fully_shard
from _multiproc import run_ranks
from checks import ATOL, RTOL
from models import (
    assert_params_match,
    build_mlp,
    build_transformer,
    cpu_mesh,
    full,
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

import fsdp2

OPTIMS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9, foreach=True),
}


def _local_step_body(rank, world_size):
    for name, make in OPTIMS.items():
        ref = build_transformer(seed=11)
        slow, fast = copy.deepcopy(ref), copy.deepcopy(ref)
        for m in (slow, fast):
            shard_transformer(m, fully_shard, mesh=cpu_mesh())
        ref_opt, slow_opt, fast_opt = make(ref.parameters()), make(slow.parameters()), make(
            fast.parameters()
        )
        fsdp2.disable_flat_step(slow_opt)  # the DTensor step, not the default flat one
        fsdp2.enable_local_shard_step(fast_opt)
        for step in range(3):
            batch = transformer_batch(step, 2 * world_size)
            transformer_loss(ref, batch).backward()
            for m in (slow, fast):
                transformer_loss(m, rank_slice(batch, rank, world_size)).backward()
            for opt in (ref_opt, slow_opt, fast_opt):
                opt.step()
                opt.zero_grad()
        for (n, p), q, r in zip(fast.named_parameters(), slow.parameters(), ref.parameters()):
            assert isinstance(p, DTensor), f"{name}: {n} is no longer a DTensor"
            assert torch.equal(p.to_local(), q.to_local()), f"{name}: {n} differs from DTensor step"
            torch.testing.assert_close(full(p.detach()), r.detach(), rtol=RTOL, atol=ATOL)
        fast_sd, slow_sd = fast_opt.state_dict(), slow_opt.state_dict()
        assert fast_sd["param_groups"] == slow_sd["param_groups"], name
        assert fast_sd["state"].keys() == slow_sd["state"].keys(), name
        for idx, state in slow_sd["state"].items():
            for key, value in state.items():
                got = fast_sd["state"][idx][key]
                assert type(got) is type(value), (name, idx, key, type(got), type(value))
                if isinstance(value, DTensor):
                    assert got.placements == value.placements, (name, idx, key)
                    assert torch.equal(got.to_local(), value.to_local()), (name, idx, key)
                else:
                    assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), (idx, key)
        # parameters are left as the optimizer's own again
        assert all(p is q for p, q in zip(fast_opt.param_groups[0]["params"], fast.parameters()))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_local_shard_step_matches_dtensor_step(world_size):
    """AdamW/SGD via enable_local_shard_step equal the DTensor step bitwise; state stays DTensor."""
    run_ranks(_local_step_body, world_size)


def _mixed_group_body(rank, world_size):
    # An ignored (plain) parameter in the same param group: the group is stepped as usual.
    ref = build_mlp(seed=3)
    model = copy.deepcopy(ref)
    ignored = model.in_proj.bias
    fully_shard(model, mesh=cpu_mesh(), ignored_params={ignored})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp2.enable_local_shard_step(opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batch = mlp_batch(0, 2 * world_size)
    mlp_loss(model, batch).backward()  # same data on every rank: the ignored grad is global
    mlp_loss(ref, batch).backward()
    opt.step()
    ref_opt.step()
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.detach()), r.detach(), rtol=RTOL, atol=ATOL, msg=n)


def test_local_shard_step_falls_back_for_plain_params():
    """A param group holding a non-DTensor (ignored) parameter is stepped correctly."""
    run_ranks(_mixed_group_body, 2)


def _clip_body(rank, world_size):
    # The MLP has parameters with fewer dim-0 rows than ranks: some shards are empty.
    cases = [
        (lambda: build_transformer(seed=12), shard_transformer, transformer_batch, transformer_loss),
        (lambda: build_mlp(seed=12), shard_mlp, mlp_batch, mlp_loss),
    ]
    for (build, shard, make_batch, loss_fn), norm_type in itertools.product(
        cases, (2.0, 1.0, float("inf"))
    ):
        ref = build()
        model = copy.deepcopy(ref)
        shard(model, fully_shard, mesh=cpu_mesh())
        batch = make_batch(0, 2 * world_size)
        loss_fn(ref, batch).backward()
        loss_fn(model, rank_slice(batch, rank, world_size)).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        norm = fsdp2.clip_grad_norm_(model.parameters(), 0.05, norm_type)
        assert not isinstance(norm, DTensor)
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL, msg=str(norm_type))
        assert ref_norm > 0.05, "the test must actually clip"
        for (n, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(full(p.grad), r.grad, rtol=RTOL, atol=ATOL, msg=n)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_clip_grad_norm_matches_unsharded(world_size):
    """fsdp2.clip_grad_norm_ (2, 1, inf norms; empty shards too) returns the reference norm, clips like it."""
    run_ranks(_clip_body, world_size)


def _clip_nonfinite_body(rank, world_size):
    model = build_mlp(seed=1)
    fully_shard(model, mesh=cpu_mesh())
    mlp_loss(model, mlp_batch(0, 4)).backward()
    if rank == 0:
        model.in_proj.weight.grad.to_local()[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        fsdp2.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def test_clip_grad_norm_nonfinite_raises_on_every_rank():
    """A NaN on one rank's shard makes every rank raise with error_if_nonfinite=True."""
    run_ranks(_clip_nonfinite_body, 2)


def test_local_shard_step_rejects_non_optimizer():
    """enable_local_shard_step on something that is not an optimizer raises ValueError."""
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        fsdp2.enable_local_shard_step([torch.nn.Parameter(torch.ones(1))])


# ---------------------------------------------------------------- post-accumulate-grad hooks


def _post_acc_hook_body(rank, world_size):
    # Optimizer in backward: one SGD step per parameter as soon as its sharded grad is ready.
    ref, model = make_pair(lambda: build_transformer(seed=13))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    calls = []

    def make_hook(optim):
        def hook(param):
            calls.append(param)
            optim.step()
            optim.zero_grad()

        return hook

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(make_hook(torch.optim.SGD([p], lr=0.1)))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        batch = transformer_batch(step, 2 * world_size)
        calls.clear()
        transformer_loss(model, rank_slice(batch, rank, world_size)).backward()
        transformer_loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert sorted(map(id, calls)) == sorted(map(id, model.parameters())), "one call per param"
        assert all(isinstance(p, DTensor) for p in calls), "hooks must see the sharded params"
        assert all(p.grad is None for p in model.parameters())
    assert_params_match(ref, model, RTOL, ATOL)


def test_post_accumulate_grad_hooks_run_on_sharded_params():
    """Hooks from register_post_accumulate_grad_hook run once per step with the reduced grad."""
    run_ranks(_post_acc_hook_body, 2)
