"""torch.nn.utils.clip_grad_norm_ over sharded gradients matches the unsharded model."""

from __future__ import annotations

import torch
from _impl import fully_shard
from _multiproc import run_ranks
from checks import ATOL, RTOL
from models import (
    assert_grads_match,
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


def _clip_body(rank, world_size):
    inf = float("inf")
    cases = (
        (lambda: build_transformer(seed=31), shard_transformer, transformer_batch, transformer_loss,
         ((2.0, 0.05), (inf, 0.01), (1.0, 0.02))),
        # Empty shards on rank 3. No inf norm here: torch's norm kernels refuse an empty
        # tensor for it (upstream fully_shard fails the same way).
        (lambda: build_mlp(seed=31), shard_mlp, mlp_batch, mlp_loss, ((2.0, 0.05), (1.0, 0.02))),
    )
    for build, shard, make_batch, loss_fn, norms in cases:
        ref, model = make_pair(build)
        shard(model, fully_shard, mesh=cpu_mesh())
        batch = make_batch(0, 2 * world_size)
        loss_fn(ref, batch).backward()
        loss_fn(model, rank_slice(batch, rank, world_size)).backward()
        for norm_type, max_norm in norms:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
            assert ref_norm > max_norm, (norm_type, ref_norm)  # clipping really happened
            torch.testing.assert_close(full(norm), ref_norm, rtol=RTOL, atol=ATOL)
            assert_grads_match(ref, model, RTOL, ATOL)


def test_clip_grad_norm_over_sharded_grads_matches_unsharded():
    """Total norm (2, inf, 1) and clipped gradients equal the unsharded model's; 2 and 1 with empty shards too."""
    run_ranks(_clip_body, 4)
