"""All-gather extensions: an int8-quantized frozen weight (examples/int8_all_gather.py).

The sharded weights' local tensors are ``Int8Weight`` subclasses whose
``fsdp_pre_all_gather`` sends int8 rows + fp32 scales and whose
``fsdp_post_all_gather`` dequantizes. Training must match a reference whose
weights are the dequantized values, and each block's all-gather must carry
the subclass's bytes (int8 + scales + the fp32 bias), not fp32 weights.

A second, lossless subclass (``_HiLoWeight``: bf16 high part + fp32 residual)
must train bit for bit like upstream ``fully_shard``, frozen or trainable,
with and without bf16 mixed precision.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.distributed.fsdp as upstream
import torch.nn as nn
from _impl import MixedPrecisionPolicy, fsdp2_only, fully_shard
from _multiproc import run_ranks
from checks import assert_losses_match, record_collective_bytes
from models import assert_grads_match, cpu_mesh, global_mean, mlp_batch, rank_slice
from torch.utils._pytree import tree_map

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
from int8_all_gather import Int8Weight  # noqa: E402

aten = torch.ops.aten


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        # even rows: per-row scales are not of the padded shard's shape, which
        # upstream (and we) require from ranks holding padding
        self.blocks = nn.ModuleList([nn.Linear(7, 14), nn.Linear(14, 6)])
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _block_bytes(block: nn.Linear, world_size: int) -> int:
    rows = -(-block.weight.shape[0] // world_size)
    return rows * block.weight.shape[1] + 4 * rows + 4 * rows  # int8 + scales + fp32 bias


def _extension_body(rank, world_size):
    torch.manual_seed(3)
    model = _Net()
    ref = copy.deepcopy(model)
    for block, ref_block in zip(model.blocks, ref.blocks):
        q = Int8Weight.from_float(block.weight)
        block.weight = nn.Parameter(q, requires_grad=False)
        ref_block.weight = nn.Parameter(q.dequantize(), requires_grad=False)
    expected = [_block_bytes(b, world_size) for b in ref.blocks]
    mesh = cpu_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert type(model.blocks[0].weight.to_local()) is Int8Weight
    params = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    ref_opt, opt = torch.optim.SGD(params(ref), lr=0.1), torch.optim.SGD(params(model), lr=0.1)
    ref_losses, losses = [], []
    for step in range(3):
        x, y = mlp_batch(step, 2 * world_size)
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        xs, ys = rank_slice((x, y), rank, world_size)
        with record_collective_bytes() as calls:
            loss = nn.functional.mse_loss(model(xs), ys)
            loss.backward()
        gathered = [nbytes for kind, _, nbytes in calls if kind == "all_gather"]
        # forward: root, block 0, block 1; backward: block 1, block 0 again
        assert gathered[1:] == [expected[0], expected[1], expected[1], expected[0]], (
            gathered, expected)
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(grads[f"blocks.{i}.weight"] is None for i in range(2))
        assert_grads_match(ref, model, rtol=1e-5, atol=1e-6)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        ref_losses.append(ref_loss.item())
        losses.append(global_mean(loss).item())
    assert_losses_match(ref_losses, losses)
    # the unsharded weight equals the dequantized reference
    model.blocks[0].unshard()
    torch.testing.assert_close(model.blocks[0].weight, ref.blocks[0].weight, rtol=0, atol=0)
    model.blocks[0].reshard()


def test_int8_all_gather_extension():
    """Int8Weight subclass: parity with dequantized reference, all-gathers carry int8 + scales."""
    run_ranks(_extension_body, 2)


# ---- a second extension: two inputs of different dtypes, lossless -----------

_WRAPPED = {
    aten.detach.default, aten.alias.default, aten.view.default, aten.split.Tensor,
    aten.slice.Tensor, aten.new_zeros.default, aten.new_empty.default, aten.clone.default,
}


class _HiLoWeight(torch.Tensor):
    """An fp32 weight gathered as its bf16 high part plus the fp32 residual (exact)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)

    def __init__(self, data):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x._data if isinstance(x, _HiLoWeight) else x  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable and isinstance(args[0], _HiLoWeight):
            return args[0]  # in place on the data (copy_, the optimizer's add_)
        if func in _WRAPPED:
            return tree_map(lambda x: cls(x) if isinstance(x, torch.Tensor) else x, out)
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        hi = self._data.to(torch.bfloat16)
        return (hi, self._data - hi.float()), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        hi, lo = all_gather_outputs
        if out is not None:  # .data: no version bump, and no in-place on a grad leaf
            out.data.copy_((hi.float() + lo).to(param_dtype))
            return None
        weight = (hi.float() + lo).to(param_dtype)
        return weight, (weight,)


def _plain(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t._data if isinstance(t, _HiLoWeight) else t


def _hilo_models(fully_shard_fns, requires_grad, mesh, **kwargs):
    torch.manual_seed(3)
    base = _Net()
    ref = copy.deepcopy(base)
    for block in base.blocks:
        block.weight = nn.Parameter(_HiLoWeight(block.weight.detach()), requires_grad)
    for block in ref.blocks:
        block.weight.requires_grad_(requires_grad)
    models = []
    for shard in fully_shard_fns:
        model = copy.deepcopy(base)
        for block in model.blocks:
            shard(block, mesh=mesh, **kwargs)
        shard(model, mesh=mesh, **kwargs)
        assert type(model.blocks[0].weight.to_local()) is _HiLoWeight
        models.append(model)
    return ref, models


def _upstream_parity_body(rank, world_size):
    mesh = cpu_mesh()
    for param_dtype in (None, torch.bfloat16):
        for requires_grad in (False, True):
            where = f"param_dtype={param_dtype}, requires_grad={requires_grad}"
            mps = (MixedPrecisionPolicy(param_dtype), upstream.MixedPrecisionPolicy(param_dtype))
            ref, (ours, theirs) = _hilo_models(
                [lambda m, mp=mps[0], **kw: fully_shard(m, mp_policy=mp, **kw),
                 lambda m, mp=mps[1], **kw: upstream.fully_shard(m, mp_policy=mp, **kw)],
                requires_grad, mesh,
            )
            models = (ref, ours, theirs)
            opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
                    for m in models]
            for step in range(2):
                x, y = mlp_batch(step, 2 * world_size)
                batches = ((x, y), *[rank_slice((x, y), rank, world_size)] * 2)
                losses = []
                for model, (xs, ys) in zip(models, batches):
                    loss = nn.functional.mse_loss(model(xs).float(), ys)
                    loss.backward()
                    losses.append(loss if model is ref else global_mean(loss))
                assert torch.equal(losses[1], losses[2]), (where, step, losses)
                grads = [{n: p.grad for n, p in m.named_parameters()} for m in (ours, theirs)]
                for name, grad in grads[0].items():
                    other = grads[1][name]
                    assert (grad is None) == (other is None), (where, name)
                    assert grad is None or torch.equal(_plain(grad), _plain(other)), (where, name)
                if param_dtype is None:  # the weights are exact: the plain model's numerics
                    assert_grads_match(ref, ours, rtol=1e-5, atol=1e-6)
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
            for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
                assert torch.equal(_plain(p), _plain(q)), (where, name)


def test_two_input_extension_matches_upstream():
    """bf16 + fp32 pre-hook inputs: losses, grads and params bitwise equal to upstream's."""
    run_ranks(_upstream_parity_body, 2)


def _one_rank_body(rank, world_size):
    ref, (model,) = _hilo_models([fully_shard], True, cpu_mesh())
    x, y = mlp_batch(0, 4)
    for m in (ref, model):
        nn.functional.mse_loss(m(x), y).backward()
    assert_grads_match(ref, model, rtol=1e-5, atol=1e-6)


# Upstream (torch 2.13) gets this wrong: at shard world size 1,
# FSDPParamGroup.wait_for_unshard skips the collective and copies only
# all_gather_inputs[0] into a single output, so fsdp_post_all_gather receives
# one tensor instead of the pre hook's two (here a ValueError unpacking them;
# `FSDP2_IMPL=torch python examples/int8_all_gather.py` fails the same way).
# We hand the post hook every input, as at any other world size.
@fsdp2_only
def test_multi_input_extension_one_rank():
    """Shard group of one rank: the post hook gets all of the pre hook's tensors."""
    run_ranks(_one_rank_body, 1)


# ---- the parameter-major layout: a subclass's rows, any W ------------------------------


def _ragged_body(rank, world_size):
    """_HiLoWeight on RaggedShard groups (fsdp2's layout): the reference's gradients, and at
    W = 2 the dim-0 layout's bits. At W = 3 the 14-row weight is uneven: the dim-0 layout
    (and upstream) refuse this hook there; each rank sends its own rows, padded by FSDP."""
    from fsdp2 import MixedPrecisionPolicy as Policy
    from fsdp2 import RaggedShard
    from fsdp2 import fully_shard as shard

    ragged = {"shard_placement_fn": lambda p: RaggedShard()}
    for param_dtype in (None, torch.bfloat16):
        for requires_grad in (False, True):
            where = f"W={world_size}, param_dtype={param_dtype}, requires_grad={requires_grad}"
            mp = Policy(param_dtype)
            fns = [lambda m, mp=mp, **kw: shard(m, mp_policy=mp, **ragged, **kw)]
            if world_size == 2:
                fns.append(lambda m, mp=mp, **kw: shard(m, mp_policy=mp, **kw))
            ref, models = _hilo_models(fns, requires_grad, cpu_mesh())
            opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
                    for m in (ref, *models)]
            for step in range(2):
                x, y = mlp_batch(step, 2 * world_size)
                nn.functional.mse_loss(ref(x), y).backward()
                losses = []
                for model in models:
                    xs, ys = rank_slice((x, y), rank, world_size)
                    loss = nn.functional.mse_loss(model(xs).float(), ys)
                    loss.backward()
                    losses.append(global_mean(loss))
                if param_dtype is None:  # exact weights: the plain model's numerics
                    assert_grads_match(ref, models[0], rtol=1e-5, atol=1e-6)
                assert all(torch.equal(loss, losses[0]) for loss in losses), (where, losses)
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
            weight = models[0].blocks[0].weight
            assert type(weight.to_local()) is _HiLoWeight, where
            assert isinstance(weight.placements[0], RaggedShard), where
            if world_size == 2:
                for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
                    assert torch.equal(_plain(p.full_tensor()), _plain(q.full_tensor())), (
                        where, name)


@fsdp2_only
@pytest.mark.parametrize("world_size", [2, 3])
def test_subclass_extension_on_the_parameter_major_layout(world_size):
    """A subclass with all-gather hooks on RaggedShard: the reference's training at W = 2, 3."""
    run_ranks(_ragged_body, world_size)


class _OneRowHook(_HiLoWeight):
    """Sends one row whatever it holds: not rows of its shard."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._data.new_zeros(1, *self._data.shape[1:]),), None


def _bad_rows_body(rank, world_size):
    torch.manual_seed(3)
    layer = nn.Linear(7, 14)
    layer.weight = nn.Parameter(_OneRowHook(layer.weight.detach()), requires_grad=False)
    from fsdp2 import RaggedShard
    from fsdp2 import fully_shard as shard

    shard(layer, mesh=cpu_mesh(), shard_placement_fn=lambda p: RaggedShard("whole"))
    # rank 0 holds all 14 rows (one row sent: refused), rank 1 none (one padding row: fine)
    with pytest.raises(AssertionError, match="inputs whose dim 0 holds the shard's rows|Another"):
        layer(torch.zeros(2, 7))
    return True


@fsdp2_only
def test_subclass_inputs_that_are_not_rows_raise_on_every_rank():
    """A hook whose inputs are not its rows fails on every rank before the collective (no hang)."""
    assert run_ranks(_bad_rows_body, 2, timeout=60) == [True, True]
