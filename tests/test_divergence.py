"""A model that differs across ranks: the same clear error on every rank, at the first forward.

Each case builds a model that differs on one rank (a parameter's shape, an
extra parameter, a dtype, requires_grad, the mesh, the mixed-precision
policy, reshard_after_forward) and runs the first forward. Every rank must
raise the same ``ValueError`` naming the group, the parameter or setting and
each side's value, before any FSDP collective (no gloo abort, no hang: the
launch's timeout catches one), and a later ``all_reduce`` must still work. A
lazy-init error on one rank only (a parameter left on ``meta``) must reach
the other ranks as a ``RuntimeError`` quoting it. W = 2, 3 and 4. The
ranks compare through the default process group's store: a divergence fixed
on the failing rank passes when the first forward is re-run and leaves no
key behind, and a rank that never reaches the first forward is named in a
``RuntimeError`` at the store's timeout on the ranks that did (and on itself,
when it arrives late). Under torch's fake process group (one process playing
W = 1024 ranks) the check is skipped: nothing waits for ranks that do not exist.

Upstream runs into the mismatched collectives instead (gloo aborts), so these
run on fsdp2 only; the matching model runs on both.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _impl import IMPL, MixedPrecisionPolicy, fsdp2_only, fully_shard
from _multiproc import run_ranks
from checks import check_case
from torch.distributed.device_mesh import init_device_mesh

# A generous bound on "within seconds": a hang is what it catches, not speed.
_MAX_SECONDS = 60.0


def _model(rank, world_size, differ_on, change=None, shard_kwargs=None):
    """Linear(8, 8) -> ReLU -> Linear(8, 8), each a group, and the root; ``change`` on one rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    mesh = init_device_mesh("cpu", (world_size,))
    # built on every rank (a mesh is made collectively), used on one
    alternative = shard_kwargs(world_size) if shard_kwargs is not None else None
    kwargs = [{}, {}, {}]
    if rank == differ_on:
        if change is not None:
            change(model)
        if alternative is not None:
            kwargs = alternative
    fully_shard(model[0], **{"mesh": mesh, **kwargs[0]})
    fully_shard(model[2], **{"mesh": mesh, **kwargs[1]})
    fully_shard(model, **{"mesh": mesh, **kwargs[2]})
    return model


def _expect_same_error(kind, *needles, differ_on=1, change=None, shard_kwargs=None):
    def case(rank, world_size):
        model = _model(rank, world_size, differ_on, change, shard_kwargs)
        start = time.monotonic()
        try:
            model(torch.randn(2, 8))
            message = None
        except kind as e:
            message = f"{type(e).__name__}: {e}"
        elapsed = time.monotonic() - start
        t = torch.ones(1)
        dist.all_reduce(t)  # the process group is still usable
        assert t.item() == world_size
        messages = [None] * world_size
        dist.all_gather_object(messages, message)
        assert message is not None, "no error on this rank"
        assert elapsed < _MAX_SECONDS, elapsed
        if kind is ValueError:
            assert all(m == message for m in messages), messages
        for needle in needles:
            assert needle in message, (needle, message)

    return case


def _extra_param(model):
    model[2].register_parameter("extra", nn.Parameter(torch.zeros(3)))


def _hsdp_mesh_for_second(world_size):
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    return [{}, {"mesh": mesh}, {}]


def _left_on_meta(model):
    model[2].bias = nn.Parameter(torch.empty(8, device="meta"))


def _no_grad_bias(model):
    model[0].bias.requires_grad_(False)


def _keys_left(world_size):
    """The divergence checks' keys still in the store, over every check on these ranks so far."""
    from fsdp2._torch_compat import default_store
    from fsdp2.runtime.hooks import divergence

    store, ranks = default_store(), tuple(range(world_size))
    checks = divergence._CHECKS[dist.group.WORLD][ranks]
    prefix = divergence._next_prefix(ranks).rsplit("/", 1)[0]
    divergence._CHECKS[dist.group.WORLD][ranks] = checks  # undo _next_prefix's count
    return [f"{prefix}/{k}/{key}" for k in range(checks) for key in divergence._KEYS
            if store.check([f"{prefix}/{k}/{key}"])]


def _rerun_after_fix(rank, world_size):
    """Rank 1 differs, every rank raises; rank 1 fixes it, the re-run passes; no key left."""
    model = _model(rank, world_size, differ_on=1, change=_no_grad_bias)
    try:
        model(torch.randn(2, 8))
        raised = None
    except ValueError as e:
        raised = str(e)
    assert raised is not None and "requires_grad=False" in raised, raised
    if rank == 1:
        model[0].bias.requires_grad_(True)
    model(torch.randn(2, 8)).sum().backward()  # lazy init again, with fresh keys
    assert model[0].bias.grad is not None
    dist.barrier()  # the last rank out of each check has deleted its keys
    assert _keys_left(world_size) == []


def _first_forward_error(model):
    try:
        model(torch.randn(2, 8))
    except RuntimeError as e:
        return str(e)
    return None


def _missing_rank(rank, world_size):
    """Rank 1 comes after rank 0 gave up: both raise a RuntimeError naming rank 1, no hang."""
    from fsdp2._torch_compat import default_store

    store = default_store()
    timeout = store.timeout
    store.set_timeout(timedelta(seconds=2))
    try:
        model = _model(rank, world_size, differ_on=-1)
        message = _first_forward_error(model) if rank == 0 else None
        dist.barrier()  # rank 1 reaches its first forward only after rank 0 gave up
        if rank == 1:
            message = _first_forward_error(model)
    finally:
        store.set_timeout(timeout)
    assert message is not None, "no error on this rank"
    assert "rank [1] never reached the first forward" in message, message
    assert "waited for store key 'done'" in message, message
    if rank == 1:
        assert "abandoned by another rank" in message, message


CASES = {
    "shape": _expect_same_error(
        ValueError, "in group '2', parameter '2.weight'", "shape (8, 8)", "shape (4, 8)",
        "rank 1 differs from rank 0",
        change=lambda m: m.__setitem__(2, nn.Linear(8, 4)),
    ),
    "extra_param": _expect_same_error(
        ValueError, "parameter counts differ: 2 vs 3", "parameter '2.extra'", "no such parameter",
        change=_extra_param,
    ),
    "dtype": _expect_same_error(
        ValueError, "parameter '2.weight'", "dtype torch.float32", "dtype torch.float64",
        change=lambda m: m[2].double(),
    ),
    "requires_grad": _expect_same_error(
        ValueError, "parameter '0.bias'", "requires_grad=True", "requires_grad=False",
        change=lambda m: m[0].bias.requires_grad_(False),
    ),
    "mp_policy": _expect_same_error(
        ValueError, "in group '2', mp_policy", "param_dtype=None", "param_dtype=torch.bfloat16",
        shard_kwargs=lambda w: [{}, {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}, {}],
    ),
    "reshard_after_forward": _expect_same_error(
        ValueError, "in group '0', reshard_after_forward", "True", "False",
        shard_kwargs=lambda w: [{"reshard_after_forward": False}, {}, {}],
    ),
    "local_error": _expect_same_error(
        RuntimeError, "still on meta device", "2.bias", change=_left_on_meta,
    ),
}
# Through the store: a re-run after a fix, a rank that never comes (W=2, same launch).
STORE_CASES = {"rerun_after_fix": _rerun_after_fix, "missing_rank": _missing_rank}


def _same_model(rank, world_size):
    """The same model on every rank trains (both implementations)."""
    model = _model(rank, world_size, differ_on=-1)
    model(torch.randn(2, 8)).sum().backward()
    assert model[0].weight.grad is not None


def _cases(world_size):
    if IMPL == "torch":
        return {"same_model": _same_model}
    cases = {"same_model": _same_model}
    if world_size == 2:
        cases.update(CASES)
        cases.update(STORE_CASES)
    elif world_size == 3:
        cases["shape_last_rank"] = _expect_same_error(
            ValueError, "rank 2 differs from rank 0", "shape (4, 8)", differ_on=2,
            change=lambda m: m.__setitem__(2, nn.Linear(8, 4)),
        )
        cases["extra_param"] = _expect_same_error(
            ValueError, "parameter '2.extra'", change=_extra_param
        )
    else:
        cases["mesh"] = _expect_same_error(
            ValueError, "in group '2', mesh", "shape (4,)", "shape (2, 2) dims ('replicate', 'shard')",
            shard_kwargs=_hsdp_mesh_for_second,
        )
        cases["requires_grad"] = CASES["requires_grad"]
        cases["local_error"] = CASES["local_error"]
    return cases


@fsdp2_only  # upstream: a gloo abort on one rank, "Connection reset by peer" on the other
@pytest.mark.parametrize("case", sorted(CASES))
def test_divergence_raises_on_every_rank(case, launch_cases):
    """Each divergence variant: the same ValueError on both ranks; all_reduce works after (W=2)."""
    check_case(launch_cases(2, _cases(2)), case)


@fsdp2_only
@pytest.mark.parametrize("case", ["shape_last_rank", "extra_param"])
def test_divergence_three_ranks(case, launch_cases):
    """W=3: the rank that differs is named; every rank raises the same error."""
    check_case(launch_cases(3, _cases(3)), case)


@fsdp2_only
@pytest.mark.parametrize("case", ["mesh", "requires_grad", "local_error"])
def test_divergence_four_ranks(case, launch_cases):
    """W=4: a 1-D mesh on some ranks and a 2-D one on another; requires_grad; a local error."""
    check_case(launch_cases(4, _cases(4)), case)


@fsdp2_only
def test_rerun_after_a_fix_uses_fresh_keys(launch_cases):
    """A divergence fixed on the failing rank: the re-run passes on every rank, no key left."""
    check_case(launch_cases(2, _cases(2)), "rerun_after_fix")


@fsdp2_only
def test_missing_rank_is_named_at_the_store_timeout(launch_cases):
    """A rank that never reaches the first forward: RuntimeError naming it, on both ranks."""
    check_case(launch_cases(2, _cases(2)), "missing_rank")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_same_model_passes_the_check(world_size, launch_cases):
    """The same model on every rank runs forward and backward (both implementations)."""
    check_case(launch_cases(world_size, _cases(world_size)), "same_model")


def _fake_world(rank, world_size):
    """W=1024 under torch's fake process group: the first forward returns, nothing exchanged."""
    from fsdp2._torch_compat import init_fake_process_group
    from fsdp2.runtime.hooks import divergence

    dist.destroy_process_group()
    init_fake_process_group(1024)
    exchanged = []
    original = divergence.exchange
    divergence.exchange = lambda *a, **k: exchanged.append(a) or original(*a, **k)
    try:
        mesh = init_device_mesh("cpu", (1024,))
        model = nn.Sequential(nn.Linear(8, 2048), nn.Linear(2048, 8))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(torch.randn(2, 8))
    finally:
        divergence.exchange = original
    return len(exchanged)


@fsdp2_only  # upstream has no check to skip
def test_fake_process_group_skips_the_check():
    """Fake PG, W=1024 in one process: the check is skipped, so it cannot wait for absent ranks."""
    assert run_ranks(_fake_world, 1) == [0]
