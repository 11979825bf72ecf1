"""Gradient reduction controls: accumulation without sync, divide factor, SUM, all-reduce hook.

Gradients are compared with an unsharded reference that sees the full
batches; reduce-scatters are counted (and their op read) at the public
``torch.distributed`` calls.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _impl import fsdp2_only, fully_shard
from _multiproc import run_ranks
from checks import ATOL, RTOL, assert_sharded, count_collectives, make_opts
from models import (
    assert_grads_match,
    assert_params_match,
    build_chain,
    chain_batch,
    chain_group_names,
    cpu_mesh,
    make_pair,
    mlp_loss,
    rank_slice,
    shard_chain,
)

WORLD_SIZES = [2, 4]
NUM_GROUPS = 5  # Chain: L0..L3 and the root (head)


def _chain_pair(dtype=torch.float32):
    ref, model = make_pair(lambda: build_chain().to(dtype))
    shard_chain(model, fully_shard, mesh=cpu_mesh())
    return ref, model


# ---------------------------------------------------------------- accumulation without sync


def _no_sync_body(rank, world_size):
    counts = {}
    for recurse in (True, False):
        ref, model = _chain_pair()
        opts = make_opts(ref, model)
        for cycle in range(2 if recurse else 1):  # accumulate 3 micro-batches, step
            micro = [chain_batch(3 * cycle + i, 2 * world_size) for i in range(3)]
            model.set_requires_gradient_sync(False, recurse=recurse)
            per_step = []
            for i, batch in enumerate(micro):
                if i == len(micro) - 1:
                    model.set_requires_gradient_sync(True, recurse=recurse)
                loss = mlp_loss(model, rank_slice(batch, rank, world_size))
                with count_collectives() as bwd:
                    loss.backward()
                per_step.append((bwd["all_gather"], bwd["reduce_scatter"]))
                mlp_loss(ref, batch).backward()
                if recurse and i < len(micro) - 1:
                    for name, p in model.named_parameters():
                        assert p.grad is None, f"{name} got a reduced grad while not syncing"
                    assert_sharded(model, rank, world_size, "after a no-sync backward")
            assert_grads_match(ref, model, RTOL, ATOL)
            for o in opts:
                o.step()
                o.zero_grad()
            counts[recurse] = per_step
        assert_params_match(ref, model, RTOL, ATOL)
    return counts


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_requires_gradient_sync(world_size):
    """No reduce-scatter while sync is off; one per group on the syncing step; grads as accumulated."""
    counts = run_ranks(_no_sync_body, world_size)[0]
    # (backward all-gathers, backward reduce-scatters) per micro-batch: layers reshard after forward
    assert counts[True] == [(4, 0), (4, 0), (4, NUM_GROUPS)], counts
    # recurse=False: only the root's group stops syncing
    assert counts[False] == [(4, 4), (4, 4), (4, NUM_GROUPS)], counts


# ---------------------------------------------------------------- divide factor / SUM / hook


def _fsdp_modules(model):
    return [m for m in model.modules() if hasattr(m, "set_gradient_divide_factor")]


def _scaled_grads_body(rank, world_size, configs):
    """Per (dtype, factor, force_sum): reduce-scatter ops by group; grads must be sum / factor."""
    ops_per_config = []
    for dtype, factor, force_sum in configs:
        ref, model = _chain_pair(dtype)
        for m in _fsdp_modules(model):  # neither setting is recursive
            if factor is not None:
                m.set_gradient_divide_factor(factor)
            if force_sum:
                m.set_force_sum_reduction_for_comms(True)
        names = chain_group_names(model, world_size)
        batch = tuple(t.to(dtype) for t in chain_batch(0, 2 * world_size))
        log = []
        loss = mlp_loss(model, rank_slice(batch, rank, world_size))
        with count_collectives(log):
            loss.backward()
        mlp_loss(ref, batch).backward()
        scale = world_size / (factor or world_size)  # reference grads are means over ranks
        for p in ref.parameters():
            p.grad.mul_(scale)
        rtol, atol = (RTOL, ATOL) if dtype == torch.float32 else (1e-12, 1e-14)
        assert_grads_match(ref, model, rtol, atol)
        ops = {names[entry[1]]: _op_name(entry[2]) for entry in log if entry[0] == "reduce_scatter"}
        assert sorted(ops) == sorted(names.values()), ops
        ops_per_config.append(set(ops.values()))
    return ops_per_config


def _op_name(op) -> str:
    for name in ("SUM", "AVG"):
        if op == getattr(dist.ReduceOp, name):
            return name
    return "other"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_force_sum_reduction_and_divide_factor(world_size):
    """Default: AVG. force-sum: SUM, then / W. float64 or force-sum with a factor: SUM, sum / factor."""
    configs = [
        (torch.float32, None, False),
        (torch.float32, None, True),
        (torch.float32, 2.5, True),
        (torch.float64, 3.0, False),  # divided before and after the sum
    ]
    ops = run_ranks(_scaled_grads_body, world_size, configs)[0]
    assert ops == [{"AVG"}, {"SUM"}, {"SUM"}, {"SUM"}], ops


@fsdp2_only
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradient_divide_factor_float32_on_gloo(world_size):
    """float32 grads with a divide factor of 3 on gloo: sum / 3 (upstream asks gloo for PREMUL_SUM and fails)."""
    run_ranks(_scaled_grads_body, world_size, [(torch.float32, 3.0, False)])


def _hook_body(rank, world_size, force_sum):
    ref, model = _chain_pair()
    layer = model.layers[3]  # Linear(8, 9): ceil(9 / W) padded rows per rank
    seen = []

    def hook(output):
        seen.append(output.clone())
        output.mul_(2)  # in place: the gradients are scaled by 2

    if force_sum:
        layer.set_force_sum_reduction_for_comms(True)
    layer.set_all_reduce_hook(hook)
    batch = chain_batch(0, 2 * world_size)
    model.set_requires_gradient_sync(False)
    mlp_loss(model, rank_slice(batch, rank, world_size)).backward()
    assert seen == [], "the hook ran without a reduction"
    model.set_requires_gradient_sync(True)
    mlp_loss(model, rank_slice(batch, rank, world_size)).backward()
    for _ in range(2):
        mlp_loss(ref, batch).backward()
    for p in ref.layers[3].parameters():
        p.grad.mul_(2)
    assert_grads_match(ref, model, RTOL, ATOL)
    # the hook saw the reduce-scatter output before the division by W of a SUM
    (output,) = seen
    rows = -(-9 // world_size)
    assert output.numel() == rows * 8 + rows, output.shape
    weight, bias = layer.weight.grad.to_local(), layer.bias.grad.to_local()
    local = weight.shape[0]
    divided = output * 2 / (world_size if force_sum else 1)
    torch.testing.assert_close(divided[: local * 8].view(local, 8), weight, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(divided[rows * 8 : rows * 8 + local], bias, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("force_sum", [False, True], ids=["avg", "sum"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_hook(world_size, force_sum):
    """set_all_reduce_hook runs once per reduction on the group's flat output, before post-division."""
    run_ranks(_hook_body, world_size, force_sum)


# ---------------------------------------------------------------- no-sync in a reduce dtype


def _no_sync_reduce_dtype_body(rank, world_size):
    from _impl import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    micro = [chain_batch(i, 2 * world_size) for i in range(2)]

    def sharded_grads(sync_each: bool):
        _, model = make_pair(build_chain)
        shard_chain(model, fully_shard, mesh=cpu_mesh(), mp_policy=policy)
        grads = {}
        for i, batch in enumerate(micro):
            model.set_requires_gradient_sync(sync_each or i == len(micro) - 1)
            mlp_loss(model, rank_slice(batch, rank, world_size)).backward()
            if sync_each:  # one synced backward per micro-batch: sum the reduced grads
                for n, p in model.named_parameters():
                    g = p.grad.to_local().clone()
                    grads[n] = g if n not in grads else grads[n] + g
                model.zero_grad()
        if not sync_each:
            grads = {n: p.grad.to_local() for n, p in model.named_parameters()}
        return grads

    accumulated, synced = sharded_grads(False), sharded_grads(True)
    for n, g in accumulated.items():
        assert g.dtype == torch.float32, n
        # bf16 accumulation of the two micro-batches would be ~1e-3 off
        torch.testing.assert_close(g, synced[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_requires_gradient_sync_accumulates_in_reduce_dtype(world_size):
    """With bf16 params and fp32 reduce dtype, no-sync micro-batches accumulate in fp32."""
    run_ranks(_no_sync_reduce_dtype_body, world_size)
