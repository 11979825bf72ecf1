"""FSDP2_FORCE_COLLECTIVES=1: a shard group of one rank runs the full collective path.

Without the switch a one-rank group aliases its shards and reduces nothing
(see [Note: Forcing collectives on one rank] in fsdp2/runtime/comm/force_collectives.py);
with it, the same all-gathers, reduce-scatters and custom comms run as on
several ranks. The first tests count them; the last runs the device cases of
tests/device_cases.py (the CUDA tests' bodies) on one gloo rank in forced
mode: parity with the unsharded reference and with upstream for fp32 and
bf16, resharding or not, CPU offload, explicit prefetch,
``set_post_optim_event``, activation checkpointing and a compiled block.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _impl import FSDPModule, MixedPrecisionPolicy, fsdp2_only, fully_shard
from checks import check_case, count_collectives
from device_cases import cases, forced_collectives
from models import (
    build_transformer,
    cpu_mesh,
    make_pair,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from test_custom_comms import CountingAllGather, CountingReduceScatter

N_LAYERS = 2
GROUPS = N_LAYERS + 1


def _model(forced: bool, **kwargs):
    with forced_collectives() if forced else contextlib.nullcontext():
        ref, model = make_pair(lambda: build_transformer(seed=1, n_layers=N_LAYERS))
        shard_transformer(model, fully_shard, mesh=cpu_mesh(), reshard_after_forward=True, **kwargs)
    return ref, model


def _one_step(ref, model) -> dict:
    batch = transformer_batch(0, 2)
    with count_collectives() as counts:
        loss = transformer_loss(model, batch)
        loss.backward()
    ref_loss = transformer_loss(ref, batch)
    ref_loss.backward()
    torch.testing.assert_close(loss.float(), ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    return dict(counts)


def _counts_case(rank: int, world_size: int) -> None:
    # forward: every group; backward: every group again (all reshard), one reduce-scatter each
    full_path = {"all_gather": 2 * GROUPS, "reduce_scatter": GROUPS}
    assert _one_step(*_model(forced=True)) == full_path
    assert _one_step(*_model(forced=False)) == {"all_gather": 0, "reduce_scatter": 0}
    # A cast (mixed precision) writes the all-gather buffer, so a one-rank group gathers
    # in either mode; only the reduce-scatter is skipped without the switch.
    fp64 = MixedPrecisionPolicy(param_dtype=torch.float64)
    assert _one_step(*_model(forced=True, mp_policy=fp64)) == full_path
    cast_only = {"all_gather": 2 * GROUPS, "reduce_scatter": 0}
    assert _one_step(*_model(forced=False, mp_policy=fp64)) == cast_only


def _unsharded_storage_case(rank: int, world_size: int) -> None:
    # forced: the unsharded parameter is a gathered copy; else it aliases the shard
    for forced in (True, False):
        _, model = _model(forced)
        linear = model.layers[0].attention.wq
        shard = linear.weight
        seen: list[bool] = []

        def record(m, args, seen=seen, shard=shard):
            seen.append(m.weight.data_ptr() == shard.to_local().data_ptr())

        linear.register_forward_pre_hook(record)  # inside the group's forward: unsharded
        transformer_loss(model, transformer_batch(0, 2)).backward()
        assert seen == [not forced], (forced, seen)


def _custom_comms_case(rank: int, world_size: int) -> None:
    # a one-rank group calls the custom comms only when forced
    for forced, expected in ((True, (2 * GROUPS, GROUPS)), (False, (0, 0))):
        ref, model = _model(forced)
        ag, rs = CountingAllGather(), CountingReduceScatter()
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(ag)
                m.set_custom_reduce_scatter(rs)
        _one_step(ref, model)
        assert (len(ag.calls), len(rs.calls)) == expected, (forced, len(ag.calls), len(rs.calls))


SWITCH_CASES = {
    "counts": _counts_case,
    "unsharded_storage": _unsharded_storage_case,
    "custom_comms": _custom_comms_case,
}


# Upstream (torch 2.13) skips the collectives of a one-rank group itself and
# has no such switch, so these three hold for fsdp2 only.
@fsdp2_only
def test_forced_one_rank_group_issues_every_collective(launch_cases):
    """Forced: 2 all-gathers and 1 reduce-scatter per group per step at W=1 (none without)."""
    check_case(launch_cases(1, SWITCH_CASES), "counts")


@fsdp2_only
def test_forced_one_rank_group_gathers_a_copy(launch_cases):
    """Forced: the unsharded parameter is the all-gather's copy, not an alias of the shard."""
    check_case(launch_cases(1, SWITCH_CASES), "unsharded_storage")


@fsdp2_only
def test_forced_one_rank_group_calls_custom_comms(launch_cases):
    """Forced: custom all-gather / reduce-scatter comms run at W=1 (skipped without the switch)."""
    check_case(launch_cases(1, SWITCH_CASES), "custom_comms")


@fsdp2_only
@pytest.mark.parametrize("value,forced", [("1", True), ("true", True), ("ON", True),
                                          ("0", False), ("", False), ("no", False)])
def test_switch_values(monkeypatch, value, forced):
    """FSDP2_FORCE_COLLECTIVES: 1/true/yes/on (any case) turn it on, anything else leaves it off."""
    from fsdp2.runtime.comm.force_collectives import ENV_VAR, collectives_forced, skips_collectives

    monkeypatch.setenv(ENV_VAR, value)
    assert collectives_forced() is forced
    assert skips_collectives(1) is not forced
    assert skips_collectives(2) is False


DEVICE_CASES = cases("cpu")


@pytest.mark.parametrize("name", list(DEVICE_CASES))
def test_device_case_on_cpu(name, launch_cases):
    """The CUDA tests' cases on one gloo rank, forced: parity with the reference and upstream."""
    check_case(launch_cases(1, DEVICE_CASES), name)
