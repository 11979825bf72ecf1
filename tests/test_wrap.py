"""``fsdp2.shard_model``: FSDP1's auto-wrap policies applied with ``fully_shard``.

For every kind of policy torch ships, the modules ``shard_model`` shards are
exactly the units torch's FSDP1 makes from the same policy (built on the same
ranks, CPU gloo), and training matches the unsharded model. ``shard_model`` is
fsdp2's API (upstream has no auto-wrap for ``fully_shard``), so the file is
fsdp2-only; its reference is torch's own FSDP1.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from _impl import MixedPrecisionPolicy, fsdp2_only
from checks import check_case, train_steps
from models import (
    Attention,
    Block,
    FeedForward,
    RMSNorm,
    assert_params_match,
    build_transformer,
    cpu_mesh,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import fsdp2
from fsdp2.runtime.hooks.state import state_of

pytestmark = fsdp2_only  # shard_model is fsdp2's API; its reference is torch's FSDP1


def _ffn_custom(fsdp1: bool):
    """CustomPolicy: blocks with the root's arguments, feed-forwards with their own."""
    override = {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP} if fsdp1 else {
        "reshard_after_forward": False
    }
    return CustomPolicy(
        lambda m: dict(override) if isinstance(m, FeedForward) else isinstance(m, Block)
    )


# name -> (policy for fsdp2, policy for FSDP1)
POLICIES = {
    "module_wrap": lambda fsdp1: ModuleWrapPolicy({Block}),
    "custom": _ffn_custom,
    "size_based": lambda fsdp1: functools.partial(size_based_auto_wrap_policy,
                                                  min_num_params=150),
    "transformer": lambda fsdp1: functools.partial(transformer_auto_wrap_policy,
                                                   transformer_layer_cls={Block, RMSNorm}),
    "lambda": lambda fsdp1: functools.partial(
        lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, (Attention, nn.Embedding))
    ),
    "always": lambda fsdp1: always_wrap_policy,
    "class_set": lambda fsdp1: {FeedForward, RMSNorm} if not fsdp1 else ModuleWrapPolicy(
        {FeedForward, RMSNorm}
    ),
}


def _fsdp1_units(model: nn.Module, policy) -> list[str]:
    """FSDP1's units for ``policy``, less containers without forward (fully_shard refuses them)."""
    wrapped = FSDP1(copy.deepcopy(model), auto_wrap_policy=policy, device_id=torch.device("cpu"))
    return sorted(
        name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
        for name, m in wrapped.named_modules()
        if isinstance(m, FSDP1) and not isinstance(m.module, nn.ModuleList)
    )


def _groups(model: nn.Module) -> list[str]:
    return sorted(name for name, m in model.named_modules() if isinstance(m, fsdp2.FSDPModule))


def _policy_case(name):
    def case(rank, world_size):
        ref = build_transformer(seed=7)
        expected = _fsdp1_units(ref, POLICIES[name](True))
        model = copy.deepcopy(ref)
        assert fsdp2.shard_model(model, auto_wrap_policy=POLICIES[name](False),
                                 mesh=cpu_mesh()) is model
        assert _groups(model) == expected, (name, _groups(model), expected)
        assert len(expected) > 1, expected  # the policy selected something below the root
        if name == "custom":
            for m in model.modules():
                state = state_of(m)
                if state is not None and state.param_group is not None and m is not model:
                    want = not isinstance(m, FeedForward)
                    assert state.param_group.settings.reshard_after_forward is want, (m, want)
        batches = [transformer_batch(0, 2 * world_size)]
        # SGD: AdamW's first step is lr * g / (|g| + eps), which turns a last-bit
        # difference of a gradient near eps into 1e-5 of the parameter (torch 2.15)
        opts = (torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1))
        train_steps(ref, model, batches, transformer_loss, rank, world_size, opts)
        assert_params_match(ref, model)

    return case


def _case_kwargs_reach_every_call(rank, world_size):
    model = build_transformer(seed=8)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fsdp2.shard_model(model, auto_wrap_policy={Block}, mesh=cpu_mesh(), mp_policy=mp,
                      reshard_after_forward=False)
    groups = [state_of(m).param_group for m in (model, *model.layers)]
    assert all(g.mp_policy.param_dtype == torch.bfloat16 for g in groups)
    assert all(g.settings.reshard_after_forward is False for g in groups)


def _case_tied(rank, world_size):
    ref = build_transformer(seed=9, tie_weights=True)
    model = copy.deepcopy(ref)
    with pytest.raises(ValueError, match=r"'tok_embeddings.weight' is also held by 'output'"):
        fsdp2.shard_model(model, auto_wrap_policy={nn.Embedding}, mesh=cpu_mesh())
    assert not _groups(model)  # refused before anything was sharded
    fsdp2.shard_model(model, auto_wrap_policy={Block}, mesh=cpu_mesh())  # root owns the tie
    batches = [transformer_batch(0, 2 * world_size)]
    train_steps(ref, model, batches, transformer_loss, rank, world_size)


def _case_bad_input(rank, world_size):
    with pytest.raises(ValueError, match="sharding_strategy.*reshard_after_forward"):
        fsdp2.shard_model(build_transformer(), auto_wrap_policy={Block},
                          sharding_strategy=ShardingStrategy.FULL_SHARD)
    with pytest.raises(ValueError, match="'layers.0.feed_forward'.*sharding_strategy"):
        fsdp2.shard_model(build_transformer(), auto_wrap_policy=_ffn_custom(fsdp1=True))
    with pytest.raises(ValueError, match="auto_wrap_policy must be"):
        fsdp2.shard_model(build_transformer(), auto_wrap_policy=3)


CASES = {f"policy_{name}": _policy_case(name) for name in POLICIES}
CASES.update(
    kwargs_reach_every_call=_case_kwargs_reach_every_call,
    tied=_case_tied,
    bad_input=_case_bad_input,
)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_shard_model(case, world_size, launch_cases):
    """shard_model case ``case``: FSDP1's units, fully_shard groups, training parity."""
    check_case(launch_cases(world_size, CASES), case)
