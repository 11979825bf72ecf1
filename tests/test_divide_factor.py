"""``set_gradient_divide_factor`` means upstream's: the gradient is the sum over ranks / factor.

Over every data-parallel rank: with HSDP the shard group times the replicate
group (upstream divides once, over both, never per group). One test per
sub-case of upstream's ``test_set_reduce_scatter_divide_factor`` and beyond:
a plain factor, factor 1 (the plain sum), mixed precision, HSDP (with and
without a factor, with ``set_force_sum_reduction_for_comms``), and HSDP with
gradient accumulation between all-reduces. Each compares with a
single-process reference on the full batch: its mean gradient times
``ranks / factor``. Under ``FSDP2_TEST_IMPL=torch`` the cases upstream can
run on gloo (no ``PREMUL_SUM``: the default, a factor equal to the shard
size, force-sum) pass against the same reference; the others are fsdp2's.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _impl import MixedPrecisionPolicy, fsdp2_only, fully_shard
from _multiproc import run_ranks
from checks import ATOL, RTOL
from models import assert_grads_match, build_chain, chain_batch, make_pair, mlp_loss, rank_slice
from models import shard_chain as shard_groups_of
from torch.distributed.device_mesh import init_device_mesh


def _body(rank, world_size, factor, *, hsdp=False, force_sum=False, mp=False, micro=1):
    ref, model = make_pair(build_chain)
    shape = (2, world_size // 2) if hsdp else (world_size,)
    names = ("replicate", "shard") if hsdp else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    kwargs = {"mesh": mesh}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    shard_groups_of(model, fully_shard, **kwargs)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):  # neither setting is recursive
            if factor is not None:
                m.set_gradient_divide_factor(factor)
            if force_sum:
                m.set_force_sum_reduction_for_comms(True)
    for i in range(micro):  # HSDP: the replicate all-reduce only on the last one
        batch = chain_batch(i, 2 * world_size)
        if micro > 1:
            model.set_requires_all_reduce(i == micro - 1)
        mlp_loss(model, rank_slice(batch, rank, world_size)).backward()
        mlp_loss(ref, batch).backward()
    # every rank's loss is a mean over its slice: the sum over ranks of the
    # gradients is world_size x the full batch's mean gradient
    scale = world_size / (factor if factor is not None else world_size)
    for p in ref.parameters():
        p.grad.mul_(scale)
    rtol, atol = (2e-2, 1e-3) if mp else (RTOL, ATOL)
    assert_grads_match(ref, model, rtol, atol)


@fsdp2_only  # upstream asks gloo for PREMUL_SUM and stops
@pytest.mark.parametrize("world_size", [2, 4])
def test_factor(world_size):
    """A factor of 3 on a 1-D mesh (gloo: divided before a SUM): sum / 3."""
    run_ranks(_body, world_size, 3.0)


@fsdp2_only  # upstream asks gloo for PREMUL_SUM and stops
@pytest.mark.parametrize("world_size", [2, 4])
def test_factor_one_is_the_sum(world_size):
    """A factor of 1: the plain sum over ranks (no division at all)."""
    run_ranks(_body, world_size, 1.0)


@fsdp2_only  # upstream asks gloo for PREMUL_SUM and stops
def test_mixed_precision():
    """bf16 parameters, float32 reduction, factor 3 at W=4: sum / 3 (within bf16 compute)."""
    run_ranks(functools.partial(_body, mp=True), 4, 3.0)


def test_hsdp_default_is_the_mean():
    """HSDP 2 x 2, no factor: the mean over all 4 ranks."""
    run_ranks(functools.partial(_body, hsdp=True), 4, None)


@fsdp2_only  # upstream asks gloo for PREMUL_SUM and stops
def test_hsdp_factor_divides_once_over_both_groups():
    """HSDP 2 x 2, factor 3: sum over all 4 ranks / 3 (not / (3 x 2) as a per-group division)."""
    run_ranks(functools.partial(_body, hsdp=True), 4, 3.0)


def test_hsdp_factor_equal_to_the_shard_size():
    """HSDP 2 x 2, factor 2 (the shard size, where upstream uses AVG for the reduce-scatter): sum / 2."""
    run_ranks(functools.partial(_body, hsdp=True), 4, 2.0)


@fsdp2_only  # upstream asks gloo for PREMUL_SUM and stops
def test_hsdp_mixed_precision_factor():
    """HSDP 2 x 2 with bf16 parameters, factor 3: sum / 3."""
    run_ranks(functools.partial(_body, hsdp=True, mp=True), 4, 3.0)


@pytest.mark.parametrize("factor", [None, 3.0], ids=["mean", "factor3"])
def test_force_sum(factor):
    """set_force_sum_reduction_for_comms, W=4: SUM on the wire, then the same sum / factor."""
    run_ranks(functools.partial(_body, force_sum=True), 4, factor)


@pytest.mark.parametrize("factor", [None, 3.0], ids=["mean", "factor3"])
def test_hsdp_force_sum(factor):
    """HSDP 2 x 2 with force-sum: SUM over both groups, divided once after the all-reduce."""
    run_ranks(functools.partial(_body, hsdp=True, force_sum=True), 4, factor)


@fsdp2_only  # upstream asks gloo for PREMUL_SUM and stops
def test_hsdp_factor_with_accumulation():
    """HSDP 2 x 2, factor 3, two micro-batches with the all-reduce on the last: sum / 3."""
    run_ranks(functools.partial(_body, hsdp=True, micro=2), 4, 3.0)
