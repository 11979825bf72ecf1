"""``fsdp2.summon_full_params``: FSDP1's full parameters on demand, for ``fully_shard`` models.

Upstream ``fully_shard`` has no such API, so every test is fsdp2-only; each
compares what the block shows (and what it writes back) with an unsharded
reference model trained alongside. One launch per world size runs every case
(W = 1, 2, 3; on 4 ranks HSDP 2x2 and
``reshard_after_forward=2``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _impl import CPUOffloadPolicy, MixedPrecisionPolicy, fsdp2_only, fully_shard
from checks import ATOL, RTOL, check_case, count_collectives, make_opts, train_steps
from models import (
    assert_grads_match,
    assert_params_match,
    build_transformer,
    cpu_mesh,
    make_pair,
    rank_slice,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

pytestmark = fsdp2_only  # summon_full_params is fsdp2's API: upstream fully_shard has none


def _communicates(world_size: int) -> bool:
    """Whether a shard group of ``world_size`` ranks all-gathers (FSDP2_FORCE_COLLECTIVES at 1)."""
    from fsdp2.runtime.comm.force_collectives import collectives_forced

    return world_size > 1 or collectives_forced()

NUM_GROUPS = 3  # shard_transformer: two blocks and the root


def _summon(*args, **kwargs):
    from fsdp2 import summon_full_params

    return summon_full_params(*args, **kwargs)


def _trained_pair(rank, world_size, mesh=None, steps=1, **shard_kwargs):
    """A reference and a sharded Transformer after ``steps`` identical training steps."""
    ref, model = make_pair(lambda: build_transformer(seed=3))
    shard_transformer(model, fully_shard, mesh=mesh or cpu_mesh(), **shard_kwargs)
    opts = make_opts(ref, model)
    batches = [transformer_batch(s, 2 * world_size) for s in range(steps)]
    train_steps(ref, model, batches, transformer_loss, rank, world_size, opts)
    return ref, model, opts


def _assert_full_like(model, ref, where, dtype=torch.float32):
    """Inside the block: every parameter is a plain full tensor equal to the reference's."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and not isinstance(p, DTensor), (where, name, type(p))
        assert p.dtype == dtype, (where, name, p.dtype)
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{where} {n}: {m}")


def _edit(modules):
    """The same in-place edit of every parameter of each module."""
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.mul_(0.5).add_(0.25)


def _step(ref, model, opts, step, rank, world_size):
    train_steps(ref, model, [transformer_batch(step, 2 * world_size)], transformer_loss,
                rank, world_size, opts)


# ---------------------------------------------------------------- cases


def _case_values_and_writeback(rank, world_size):
    ref, model, opts = _trained_pair(rank, world_size)
    with count_collectives() as counts:
        with _summon(model):
            _assert_full_like(model, ref, "summoned")
            _edit([model])
    assert counts["all_gather"] == (NUM_GROUPS if _communicates(world_size) else 0), counts
    _edit([ref])
    assert_params_match(ref, model)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} not sharded again after the block"
    _step(ref, model, opts, 1, rank, world_size)  # training goes on from the edited values
    assert_params_match(ref, model)


def _case_no_writeback(rank, world_size):
    ref, model, _ = _trained_pair(rank, world_size)
    with _summon(model, writeback=False):
        _edit([model])
    assert_params_match(ref, model)


def _case_with_grads(rank, world_size):
    ref, model, _ = _trained_pair(rank, world_size)
    batch = transformer_batch(5, 2 * world_size)
    transformer_loss(ref, batch).backward()
    transformer_loss(model, rank_slice(batch, rank, world_size)).backward()
    with count_collectives() as counts:
        with _summon(model, with_grads=True):
            ref_params = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                assert p.grad is not None and not isinstance(p.grad, DTensor), name
                torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=RTOL, atol=ATOL)
            model.output.weight.grad.mul_(3.0)  # written back with the parameters
    assert counts["all_gather"] == (2 * NUM_GROUPS if _communicates(world_size) else 0), counts
    ref.output.weight.grad.mul_(3.0)
    assert_grads_match(ref, model)


def _case_rank0_only_offload(rank, world_size):
    ref, model, _ = _trained_pair(rank, world_size)
    with count_collectives() as counts:
        with _summon(model, rank0_only=True, writeback=False, offload_to_cpu=True):
            if rank == 0:
                _assert_full_like(model, ref, "rank 0")
                assert all(p.device.type == "cpu" for p in model.parameters())
            else:
                assert all(isinstance(p, DTensor) for p in model.parameters())
    assert counts["all_gather"] == (NUM_GROUPS if _communicates(world_size) else 0), counts  # every rank
    with pytest.raises(NotImplementedError, match="writeback=True and rank0_only=True"):
        with _summon(model, rank0_only=True):
            pass
    assert_params_match(ref, model)


def _case_recurse(rank, world_size):
    ref, model, _ = _trained_pair(rank, world_size)
    with _summon(model, recurse=False):
        own = {"tok_embeddings.weight", "norm.weight", "output.weight"}
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) != (name in own), name
        _edit([model.output])
    with _summon(model.layers[1], recurse=False):
        assert not isinstance(model.layers[1].feed_forward.w1.weight, DTensor)
        assert isinstance(model.layers[0].feed_forward.w1.weight, DTensor)
        _edit([model.layers[1]])
    with _summon(model.layers[1].attention, recurse=False):  # not an FSDP module: nothing
        assert isinstance(model.layers[1].attention.wq.weight, DTensor)
    _edit([ref.output, ref.layers[1]])
    assert_params_match(ref, model)


def _case_tied(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=4, tie_weights=True))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    with _summon(model):
        assert model.output.weight is model.tok_embeddings.weight
        _assert_full_like(model, ref, "tied")
        _edit([model.output])
    _edit([ref.output])
    assert_params_match(ref, model)
    opts = make_opts(ref, model)
    _step(ref, model, opts, 0, rank, world_size)


def _case_mixed_precision_and_offload(rank, world_size):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for kwargs in ({"mp_policy": mp}, {"offload_policy": CPUOffloadPolicy()}):
        ref, model = make_pair(lambda: build_transformer(seed=5))
        shard_transformer(model, fully_shard, mesh=cpu_mesh(), **kwargs)
        opts = make_opts(ref, model)
        batch = transformer_batch(0, 2 * world_size)
        for m, b in ((ref, batch), (model, rank_slice(batch, rank, world_size))):
            transformer_loss(m, b).backward()
        for opt in opts:
            opt.step()
        expected = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        with _summon(model):
            for name, p in model.named_parameters():
                assert p.dtype == torch.float32, (kwargs, name, p.dtype)  # not param_dtype
                torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=0)
            _edit([model])
        if "mp_policy" not in kwargs:  # fp32 training equals the reference
            _edit([ref])
            assert_params_match(ref, model)
        for name, p in model.named_parameters():
            exp = expected[name] * 0.5 + 0.25
            torch.testing.assert_close(p.full_tensor(), exp, rtol=RTOL, atol=ATOL)


def _case_other_shard_dim(rank, world_size):
    torch.manual_seed(6)
    ref = nn.Sequential(nn.Linear(6, 12), nn.Linear(12, 6))
    model = nn.Sequential(nn.Linear(6, 12), nn.Linear(12, 6))
    model.load_state_dict(ref.state_dict())
    fn = lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % world_size == 0 else None  # noqa: E731
    for layer in model:
        fully_shard(layer, mesh=cpu_mesh(), shard_placement_fn=fn)
    fully_shard(model, mesh=cpu_mesh())
    with _summon(model):
        _assert_full_like(model, ref, "Shard(1)")
        _edit([model[1]])
    _edit([ref[1]])
    assert_params_match(ref, model)


def _case_errors(rank, world_size):
    ref, model, opts = _trained_pair(rank, world_size)
    seen = []

    def summon_in_forward(module, args, output):
        try:
            with _summon(model):
                pass
        except AssertionError as e:
            seen.append(str(e))

    handle = model.layers[0].attention.register_forward_hook(summon_in_forward)
    batch = transformer_batch(1, 2 * world_size)
    loss = transformer_loss(model, rank_slice(batch, rank, world_size))
    handle.remove()
    assert seen and "during forward/backward" in seen[0], seen
    with pytest.raises(RuntimeError, match="holds gathered parameters"):
        with _summon(model):  # between forward and backward: the root is still gathered
            pass
    loss.backward()
    transformer_loss(ref, batch).backward()
    assert_grads_match(ref, model)  # the refused calls left the step intact
    for opt in opts:
        opt.step()
        opt.zero_grad()
    with _summon(model):
        with pytest.raises(RuntimeError, match="inside summon_full_params"):
            model(transformer_batch(2, 2)[0])
        with pytest.raises(AssertionError, match="already unsharding"):
            with _summon(model.layers[0]):
                pass
        _assert_full_like(model, ref, "after refusals")
    assert_params_match(ref, model)


def _case_int_reshard_after_forward(rank, world_size):
    # W = 4, groups of 2: an int that neither equals 1 nor the world size
    mesh = init_device_mesh("cpu", (world_size,))
    ref, model, opts = _trained_pair(rank, world_size, mesh=mesh, reshard_after_forward=2)
    with _summon(model):
        _assert_full_like(model, ref, "int")
    loss = transformer_loss(model, rank_slice(transformer_batch(1, 2 * world_size), rank,
                                              world_size))
    with pytest.raises(RuntimeError, match="holds gathered parameters"):
        with _summon(model.layers[0]):  # sharded over its post-forward group until backward
            pass
    loss.backward()
    opts[1].zero_grad()
    _step(ref, model, opts, 2, rank, world_size)


CASES = {
    "values_and_writeback": _case_values_and_writeback,
    "no_writeback": _case_no_writeback,
    "with_grads": _case_with_grads,
    "rank0_only_offload": _case_rank0_only_offload,
    "recurse": _case_recurse,
    "tied": _case_tied,
    "mixed_precision_and_offload": _case_mixed_precision_and_offload,
    "other_shard_dim": _case_other_shard_dim,
    "errors": _case_errors,
}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_summon_full_params(case, world_size, launch_cases):
    """summon_full_params case ``case`` matches the unsharded reference at this world size."""
    check_case(launch_cases(world_size, CASES), case)


def _hsdp_body(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref, model, opts = _trained_pair(rank, world_size, mesh=mesh)
    with count_collectives() as counts:
        with _summon(model, with_grads=False):
            _assert_full_like(model, ref, "hsdp")
            _edit([model])
    assert counts["all_gather"] == NUM_GROUPS, counts  # over the shard dim only
    _edit([ref])
    assert_params_match(ref, model)
    _step(ref, model, opts, 1, rank, world_size)


FOUR_RANK_CASES = {"hsdp": _hsdp_body, "int_reshard_after_forward": _case_int_reshard_after_forward}


def test_summon_full_params_hsdp(launch_cases):
    """HSDP on a 2x2 mesh: one all-gather per group over the shard dim, write-back, training."""
    check_case(launch_cases(4, FOUR_RANK_CASES), "hsdp")


def test_summon_full_params_int_reshard_after_forward(launch_cases):
    """reshard_after_forward=2 on 4 ranks: summoned after a step; refused between forward and backward."""
    check_case(launch_cases(4, FOUR_RANK_CASES), "int_reshard_after_forward")
