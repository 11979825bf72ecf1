"""A parameter shared by several modules (tied weights) never ends up in two FSDP groups.

Shared by modules given to separate ``fully_shard`` calls, it would be sharded
twice and train as two parameters; upstream raises ``ValueError`` ("...
is shared with a parameter already managed by another FSDP group ...") at
lazy init, on every rank, and so must fsdp2: separate calls, a holder sharded
before its parent, nested calls, cross-block sharing, and torchtune's
``shard_model`` (bottom-up over ``reversed(named_modules())``, then the
root). The ways that keep one parameter (one call for all holders:
``fully_shard([a, b])``, a common parent, or ``ignored_params`` in every
call) train with parity to the unsharded model. fsdp2 also rejects two ways
upstream lets a shared parameter split silently (fsdp2-only tests, see
[Note: A parameter belongs to one group] in fsdp2/runtime/hooks/shared_params.py).
All cases run in one launch per world size (2 and 4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _impl import IMPL, fsdp2_only, fully_shard
from checks import assert_losses_match, check_case, train_steps
from models import (
    Block,
    assert_params_match,
    build_transformer,
    cpu_mesh,
    make_pair,
    transformer_batch,
    transformer_loss,
)

UPSTREAM = (
    "Parameter '{}' is shared with a parameter already managed by another FSDP group. For "
    "shared/tied parameters, use fully_shard([module_a, module_b]) to place them in the same "
    "FSDP group."
)


def _tied():
    return build_transformer(seed=2, tie_weights=True)


def _shard_model(model, conditions, **kwargs):
    """torchtune's shard_model: matching modules bottom-up, then the root."""
    for name, module in reversed(list(model.named_modules())):
        if any(condition(name, module) for condition in conditions):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)


def _raises_at_lazy_init(model, fqn):
    """fully_shard accepted the model; its first forward raises upstream's error naming ``fqn``."""
    try:
        transformer_loss(model, transformer_batch(0, 2))
    except Exception as e:  # noqa: BLE001 - the class is checked below
        error = e
    else:
        raise AssertionError(f"the first forward ran: '{fqn}' is in two FSDP groups")
    assert isinstance(error, ValueError), f"{type(error).__name__}: {error}"
    assert UPSTREAM.format(fqn) in str(error), str(error)


# ---- shared parameters in two groups: upstream's ValueError --------------------------------


def _separate_calls(rank, world_size):
    model = _tied()
    fully_shard(model.tok_embeddings, mesh=cpu_mesh())
    fully_shard(model.output, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    _raises_at_lazy_init(model, "output.weight")


def _output_then_root(rank, world_size):
    model = _tied()
    fully_shard(model.output, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())  # shards the embedding's (original) weight again
    _raises_at_lazy_init(model, "output.weight")


def _embedding_then_root(rank, world_size):
    model = _tied()
    fully_shard(model.tok_embeddings, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())  # shards the output's (original) weight again
    _raises_at_lazy_init(model, "tok_embeddings.weight")


def _nested_calls(rank, world_size):
    model = build_transformer(seed=2)
    attention = model.layers[0].attention
    attention.wq.weight = attention.wo.weight  # both (dim, dim)
    fully_shard(attention.wq, mesh=cpu_mesh())
    fully_shard(model.layers[0], mesh=cpu_mesh())  # holds wo: the same weight again
    fully_shard(model, mesh=cpu_mesh())
    _raises_at_lazy_init(model, "layers.0.attention.wq.weight")


def _shared_across_blocks(rank, world_size):
    model = build_transformer(seed=2)
    model.layers[1].feed_forward.w1.weight = model.layers[0].feed_forward.w1.weight
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    _raises_at_lazy_init(model, "layers.1.feed_forward.w1.weight")


def _shard_model_linears(rank, world_size):
    model = _tied()
    linear_or_embedding = lambda name, m: isinstance(m, (nn.Linear, nn.Embedding))  # noqa: E731
    _shard_model(model, [linear_or_embedding], mesh=cpu_mesh())
    _raises_at_lazy_init(model, "output.weight")


def _raises_before_meta_check(rank, world_size):
    with torch.device("meta"):
        model = _tied()
    fully_shard(model.tok_embeddings, mesh=cpu_mesh())
    fully_shard(model.output, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    _raises_at_lazy_init(model, "output.weight")  # not the RuntimeError about meta parameters


# ---- one group for all holders: parity ----------------------------------------------------


def _train_with_parity(ref, model, rank, world_size, full_batch=False):
    assert model.output.weight is model.tok_embeddings.weight, "the tie must survive fully_shard"
    batches = [transformer_batch(s, 2 * world_size) for s in range(3)]
    # Ignored parameters' gradients are not reduced: every rank then trains on the whole batch.
    r, w = (0, 1) if full_batch else (rank, world_size)
    ref_losses, losses = train_steps(ref, model, batches, transformer_loss, r, w)
    assert model.output.weight is model.tok_embeddings.weight
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)


def _list_group(rank, world_size):
    ref, model = make_pair(_tied)
    fully_shard([model.tok_embeddings, model.output], mesh=cpu_mesh())
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    _train_with_parity(ref, model, rank, world_size)


def _shard_model_blocks(rank, world_size):
    ref, model = make_pair(_tied)
    _shard_model(model, [lambda name, m: isinstance(m, Block)], mesh=cpu_mesh())
    _train_with_parity(ref, model, rank, world_size)


def _ignored_everywhere(rank, world_size):
    ref, model = make_pair(_tied)
    shared = {model.tok_embeddings.weight}
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh(), ignored_params=shared)
    fully_shard(model, mesh=cpu_mesh(), ignored_params=shared)
    assert type(model.output.weight) is nn.Parameter, "ignored: left as it was"
    _train_with_parity(ref, model, rank, world_size, full_batch=True)


# ---- fsdp2's stricter checks (upstream lets these split silently) --------------------------


def _ignored_in_one_call(rank, world_size):
    model = _tied()
    fully_shard(model.output, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh(), ignored_params={model.tok_embeddings.weight})
    _raises_at_lazy_init(model, "tok_embeddings.weight")


def _tied_after_fully_shard(rank, world_size):
    model = build_transformer(seed=2)
    fully_shard(model.tok_embeddings, mesh=cpu_mesh())
    model.output.weight = model.tok_embeddings.weight  # the sharded DTensor parameter
    fully_shard(model, mesh=cpu_mesh())
    _raises_at_lazy_init(model, "output.weight")


CASES = {
    "separate_calls": _separate_calls,
    "output_then_root": _output_then_root,
    "embedding_then_root": _embedding_then_root,
    "nested_calls": _nested_calls,
    "shared_across_blocks": _shared_across_blocks,
    "shard_model_linears": _shard_model_linears,
    "raises_before_meta_check": _raises_before_meta_check,
    "list_group": _list_group,
    "shard_model_blocks": _shard_model_blocks,
    "ignored_everywhere": _ignored_everywhere,
}
FSDP2_CASES = {
    "ignored_in_one_call": _ignored_in_one_call,
    "tied_after_fully_shard": _tied_after_fully_shard,
}


ALL_CASES = dict(CASES, **(FSDP2_CASES if IMPL == "fsdp2" else {}))


WORLD_SIZES = pytest.mark.parametrize("world_size", [2, 4])


@WORLD_SIZES
def test_separate_calls(world_size, launch_cases):
    """Tied tok/out given to separate fully_shard calls: ValueError at the first forward."""
    check_case(launch_cases(world_size, ALL_CASES), "separate_calls")


@WORLD_SIZES
def test_output_then_root(world_size, launch_cases):
    """The head sharded before the root holding the tied embedding: ValueError on the head."""
    check_case(launch_cases(world_size, ALL_CASES), "output_then_root")


@WORLD_SIZES
def test_embedding_then_root(world_size, launch_cases):
    """The embedding sharded before the root holding the tied head: ValueError on the embedding."""
    check_case(launch_cases(world_size, ALL_CASES), "embedding_then_root")


@WORLD_SIZES
def test_nested_calls(world_size, launch_cases):
    """A weight tied inside a block, one holder sharded alone first (nested calls): ValueError."""
    check_case(launch_cases(world_size, ALL_CASES), "nested_calls")


@WORLD_SIZES
def test_shared_across_blocks(world_size, launch_cases):
    """A weight shared by two blocks sharded one call each: ValueError naming the second block's."""
    check_case(launch_cases(world_size, ALL_CASES), "shared_across_blocks")


@WORLD_SIZES
def test_shard_model_matching_linears(world_size, launch_cases):
    """torchtune's shard_model with conditions matching the tied embedding and head: ValueError."""
    check_case(launch_cases(world_size, ALL_CASES), "shard_model_linears")


@WORLD_SIZES
def test_shared_check_before_meta_check(world_size, launch_cases):
    """On a meta model the shared-parameter ValueError comes before the meta RuntimeError."""
    check_case(launch_cases(world_size, ALL_CASES), "raises_before_meta_check")


@WORLD_SIZES
def test_list_group_keeps_tie(world_size, launch_cases):
    """fully_shard([tok, out]) (upstream's advice) keeps one parameter and trains with parity."""
    check_case(launch_cases(world_size, ALL_CASES), "list_group")


@WORLD_SIZES
def test_shard_model_blocks_keeps_tie(world_size, launch_cases):
    """torchtune's shard_model over blocks only: the root holds the tie; parity."""
    check_case(launch_cases(world_size, ALL_CASES), "shard_model_blocks")


@WORLD_SIZES
def test_ignored_in_every_call_keeps_tie(world_size, launch_cases):
    """A tied weight ignored by every call stays one plain parameter; parity on full batches."""
    check_case(launch_cases(world_size, ALL_CASES), "ignored_everywhere")


@fsdp2_only
@WORLD_SIZES
def test_ignored_in_one_call_only(world_size, launch_cases):
    """Sharded by one call, ignored by another: ValueError (upstream unties it silently)."""
    check_case(launch_cases(world_size, ALL_CASES), "ignored_in_one_call")


@fsdp2_only
@WORLD_SIZES
def test_tied_after_fully_shard(world_size, launch_cases):
    """A head tied to a sharded parameter after fully_shard: ValueError (upstream: TypeError)."""
    check_case(launch_cases(world_size, ALL_CASES), "tied_after_fully_shard")
