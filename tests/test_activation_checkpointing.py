"""Activation checkpointing composed with fully_shard: parity and all-gather counts.

Non-reentrant ``torch.utils.checkpoint`` recomputes a block's forward inside
backward. The recompute must run on the parameters the pre-backward hook
already gathered, so a checkpointed model issues exactly as many all-gathers
as the same model without checkpointing. All cases run in one launch.
"""

from __future__ import annotations

import functools

import torch
from _impl import fully_shard
from checks import assert_losses_match, check_case, count_collectives, train_steps
from models import (
    Transformer,
    assert_params_match,
    build_transformer,
    cpu_mesh,
    make_pair,
    toy_args,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

STEPS = 2
N_LAYERS = 2


class _OuterCheckpointTransformer(Transformer):
    """Calls ``checkpoint(layer, h)`` around each (already fully_shard-ed) block."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1], tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, cos, sin, use_reentrant=False)
        return self.output(self.norm(h))


def _build(outer: bool) -> Transformer:
    torch.manual_seed(7)
    return (_OuterCheckpointTransformer if outer else Transformer)(toy_args())


def _train_counting(rank, world_size, ref, model):
    """Train a few steps with parity checks; return per-step (all-gathers, reduce-scatters)."""
    batches = [transformer_batch(step, 2 * world_size) for step in range(STEPS)]
    ref_losses, losses, counts = train_steps(
        ref, model, batches, transformer_loss, rank, world_size, record=count_collectives
    )
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)
    return [(c["all_gather"], c["reduce_scatter"]) for c in counts]


def _case_wrapper_inside(reshard_after_forward, expected_all_gathers):
    """checkpoint_wrapper on each block, then fully_shard(wrapped block) and the root."""

    def case(rank, world_size):
        ref, model = make_pair(lambda: build_transformer(seed=7))
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
        ref_layers = list(ref.layers)
        for i, layer in enumerate(ref_layers):
            ref.layers[i] = checkpoint_wrapper(layer)
        mesh = cpu_mesh()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh)
        counts = _train_counting(rank, world_size, ref, model)
        assert counts == [(expected_all_gathers, N_LAYERS + 1)] * STEPS, counts

    return case


def _case_checkpoint_outside(early_stop: bool):
    """torch.utils.checkpoint(fsdp_block, h) from the parent's forward, blocks resharded.

    Without early stop the recompute runs the block's whole forward, FSDP's
    post-forward hook included, which must not reshard inside backward.
    """

    def case(rank, world_size):
        ref, model = make_pair(lambda: _build(outer=True))
        mesh = cpu_mesh()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with set_checkpoint_early_stop(early_stop):
            counts = _train_counting(rank, world_size, ref, model)
        # forward: root + each block; backward: each block once more (root stays unsharded)
        assert counts == [(1 + 2 * N_LAYERS, N_LAYERS + 1)] * STEPS, counts

    return case


def _case_checkpoint_inside_fn(rank, world_size):
    """A block whose forward checkpoints its own submodules (checkpoint inside the group)."""
    ref, model = make_pair(lambda: _build(outer=False))
    for m in (ref, model):
        for layer in m.layers:
            layer.feed_forward.forward = functools.partial(
                checkpoint, layer.feed_forward.__class__.forward, layer.feed_forward,
                use_reentrant=False,
            )
    mesh = cpu_mesh()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    counts = _train_counting(rank, world_size, ref, model)
    assert counts == [(1 + 2 * N_LAYERS, N_LAYERS + 1)] * STEPS, counts


CASES = {
    "wrapper_inside_reshard": _case_wrapper_inside(True, 1 + 2 * N_LAYERS),
    "wrapper_inside_no_reshard": _case_wrapper_inside(False, 1 + N_LAYERS),
    "checkpoint_outside": _case_checkpoint_outside(True),
    "checkpoint_outside_no_early_stop": _case_checkpoint_outside(False),
    "checkpoint_inside_fn": _case_checkpoint_inside_fn,
}


def test_checkpoint_wrapper_inside_fully_shard(launch_cases):
    """checkpoint_wrapper(block) then fully_shard: parity, 2 all-gathers per block per step."""
    check_case(launch_cases(2, CASES), "wrapper_inside_reshard")


def test_checkpoint_wrapper_no_reshard_gathers_once(launch_cases):
    """With reshard_after_forward=False the recompute adds no all-gather: 1 per block per step."""
    check_case(launch_cases(2, CASES), "wrapper_inside_no_reshard")


def test_checkpoint_outside_fully_shard(launch_cases):
    """checkpoint(fsdp_block, h) from the parent: parity and no extra all-gather for recompute."""
    check_case(launch_cases(2, CASES), "checkpoint_outside")


def test_checkpoint_outside_full_recompute(launch_cases):
    """Recompute without early stop runs FSDP's post-forward in backward: still no extra all-gather."""
    check_case(launch_cases(2, CASES), "checkpoint_outside_no_early_stop")


def test_checkpoint_of_submodule_inside_group(launch_cases):
    """Checkpointing a submodule inside a sharded block: parity and no extra all-gather."""
    check_case(launch_cases(2, CASES), "checkpoint_inside_fn")
