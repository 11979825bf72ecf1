"""One fully_shard group holding parameters of several dtypes (frozen ones may differ).

Each block's group mixes trainable fp32 parameters with frozen bf16, float64
and int8 ones, as a LoRA model over a frozen low-precision or quantized base
does. Upstream gathers such a group in one all-gather on bytes and returns
every parameter in its own dtype; only the trainable (uniform-dtype)
parameters' gradients are reduced. On the parameter-major layout
(``RaggedShard``) the call makes one group per dtype ([Note: Parameter-major
groups of several dtypes] in fsdp2/runtime/meshes/param_meshes.py): the same
training, bit for bit the dim-0 layout's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _impl import MixedPrecisionPolicy, fsdp2_only, fully_shard
from _multiproc import run_ranks
from checks import (
    ATOL,
    RTOL,
    assert_losses_match,
    check_case,
    log_collectives,
    run_cases,
    train_steps,
)
from models import (
    assert_grads_match,
    assert_params_match,
    cpu_mesh,
    global_mean,
    make_pair,
    mlp_batch,
    rank_slice,
    shard_groups,
    sharded_state_dict_from,
)
from torch.distributed.tensor import DTensor

from fsdp2 import RaggedShard


class MixedBlock(nn.Module):
    """Trainable fp32 ``proj``; frozen bf16 ``base``, float64 ``scale`` and int8 ``codes``."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim)
        self.base = nn.Linear(in_dim, out_dim).to(torch.bfloat16).requires_grad_(False)
        self.scale = nn.Parameter(
            torch.rand(out_dim, dtype=torch.float64) + 0.5, requires_grad=False
        )
        codes = torch.randint(-8, 8, (out_dim, 3), dtype=torch.int8)
        self.codes = nn.Parameter(codes, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the frozen weights are upcast to the compute dtype (as QLoRA dequantizes)
        base = F.linear(x, self.base.weight.to(x.dtype), self.base.bias.to(x.dtype))
        offset = self.codes.to(x.dtype).mean(dim=1) / 8
        return torch.tanh(self.proj(x) + base * self.scale.to(x.dtype) + offset)


class MixedModel(nn.Module):
    """Two mixed-dtype blocks and an fp32 head (the root's own group)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MixedBlock(7, 13), MixedBlock(13, 5)])
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.to(self.head.weight.dtype))


def _build() -> MixedModel:
    torch.manual_seed(5)
    return MixedModel()


def _make_sharded(reshard_after_forward=None, **kwargs):
    """(reference, sharded copy): blocks, then the root, on a 1-D CPU mesh."""
    ref, model = make_pair(_build)
    shard_groups(model, fully_shard, model.blocks, mesh=cpu_mesh(),
                 reshard_after_forward=reshard_after_forward, **kwargs)
    return ref, model


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _gather_numel(params: list[nn.Parameter], world_size: int) -> int:
    """All-gather output numel of a group of ``params``: bytes if they mix dtypes."""
    as_bytes = len({p.dtype for p in params}) > 1
    total = 0
    for p in params:
        rows = -(-p.shape[0] // world_size)
        numel = rows * (p.numel() // p.shape[0])
        total += numel * (p.element_size() if as_bytes else 1)
    return world_size * total


def _train_checking_gathers(ref, model, rank, world_size, steps, expected_gathers=None):
    """Train both; per step the grads match and (optionally) the all-gathers are as expected."""
    batches = [mlp_batch(step, 2 * world_size) for step in range(steps)]
    ref_losses, losses, logs = train_steps(ref, model, batches, _loss, rank, world_size,
                                           record=log_collectives)
    if expected_gathers is not None:
        for log in logs:
            gathers = sorted(n for kind, n, *_ in log if kind == "all_gather")
            assert gathers == expected_gathers, (gathers, expected_gathers)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model, RTOL, ATOL)


def _parity_body(rank, world_size, reshard_after_forward):
    ref, model = _make_sharded(reshard_after_forward)
    frozen = {n: p.full_tensor() for n, p in model.named_parameters() if not p.requires_grad}
    for name, p in model.named_parameters():
        assert p.dtype == dict(ref.named_parameters())[name].dtype, name
    # One all-gather per group use: each block in forward and again in backward; the
    # root (head only) once, twice if it reshards after forward too.
    blocks = [_gather_numel(list(b.parameters()), world_size) for b in ref.blocks]
    root = [_gather_numel(list(ref.head.parameters()), world_size)]
    expected = None
    if world_size > 1:
        expected = sorted(blocks * 2 + root * (1 if reshard_after_forward is None else 2))
    _train_checking_gathers(ref, model, rank, world_size, 3, expected)
    for name, p in model.named_parameters():
        if name in frozen:
            assert p.grad is None, f"frozen {name} got a gradient"
            torch.testing.assert_close(p.full_tensor(), frozen[name], rtol=0, atol=0)


@pytest.mark.parametrize(
    "world_size, reshard_after_forward",
    [(1, None), (2, None), (3, None), (4, 2)],
    ids=["W1", "W2", "W3_uneven", "W4_reshard_to_2"],
)
def test_mixed_dtype_group_parity(world_size, reshard_after_forward):
    """fp32 trainable + frozen bf16/float64/int8 in one group: parity, frozen intact, one all-gather per use."""
    run_ranks(_parity_body, world_size, reshard_after_forward)


def _mixed_precision_case(rank, world_size):
    ref, model = _make_sharded(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    seen = {}

    def record(module, args):
        seen.update({n: p.dtype for n, p in module.named_parameters()})

    model.blocks[0].register_forward_pre_hook(record)
    batch = mlp_batch(0, 2 * world_size)
    loss = _loss(model, rank_slice(batch, rank, world_size))
    loss.backward()
    # floating parameters compute in bf16, the int8 codes stay int8 (as upstream)
    bf16 = torch.bfloat16
    expected = {
        "proj.weight": bf16, "proj.bias": bf16, "base.weight": bf16, "base.bias": bf16,
        "scale": bf16, "codes": torch.int8,
    }
    assert seen == expected, seen
    torch.testing.assert_close(global_mean(loss), _loss(ref, batch), rtol=0.05, atol=0.02)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32, name
        else:
            assert p.grad is None, name


def _meta_load_case(rank, world_size):
    ref = _build()
    with torch.device("meta"):
        model = MixedModel()
    mesh = cpu_mesh()
    shard_groups(model, fully_shard, model.blocks, mesh=mesh)
    model.to_empty(device="cpu")
    model.load_state_dict(sharded_state_dict_from(ref, mesh))
    assert_params_match(ref, model, 0, 0)
    _train_checking_gathers(ref, model, rank, world_size, 2)
    model.load_state_dict(sharded_state_dict_from(ref, mesh), assign=True)
    _train_checking_gathers(ref, model, rank, world_size, 2)
    sd = model.state_dict()
    for key, value in ref.state_dict().items():
        assert isinstance(sd[key], DTensor) and sd[key].dtype == value.dtype, key
        torch.testing.assert_close(sd[key].full_tensor(), value, rtol=RTOL, atol=ATOL)


def _to_dtype_case(rank, world_size):
    ref, model = _make_sharded()
    ref.to(torch.float64)
    model.to(torch.float64)  # floating parameters become float64; int8 stays: still mixed
    for name, p in model.named_parameters():
        assert p.dtype == (torch.int8 if name.endswith("codes") else torch.float64), name
    batch = tuple(t.double() for t in mlp_batch(0, 2 * world_size))
    ref_loss = _loss(ref, batch)
    ref_loss.backward()
    loss = _loss(model, rank_slice(batch, rank, world_size))
    loss.backward()
    torch.testing.assert_close(global_mean(loss), ref_loss.detach())
    assert_grads_match(ref, model)


def test_mixed_dtype_group_lifecycle():
    """Mixed-dtype groups under mixed precision, meta init + load (copy, assign), state_dict, .to(float64)."""
    cases = {
        "mixed_precision": _mixed_precision_case,
        "meta_load": _meta_load_case,
        "to_dtype": _to_dtype_case,
    }
    results = run_ranks(run_cases, 2, cases)
    for name in cases:
        check_case((True, results), name)


def _unfrozen_body(rank, world_size):
    model = _build()
    shard_groups(model, fully_shard, model.blocks, mesh=cpu_mesh())
    model.blocks[0].base.requires_grad_(True)  # bf16 next to trainable fp32, after fully_shard
    with pytest.raises((ValueError, AssertionError), match="bfloat16") as info:
        _loss(model, mlp_batch(0, 2)).backward()
    assert "float32" in str(info.value)


def test_mixed_trainable_dtypes_rejected_by_first_forward():
    """Unfreezing a bf16 param next to fp32 trainable ones after fully_shard fails at the first forward."""
    run_ranks(_unfrozen_body, 1)


def _unfrozen_messages_body(rank, world_size):
    model = _build()
    shard_groups(model, fully_shard, model.blocks, mesh=cpu_mesh())
    model.blocks[0].base.requires_grad_(True)
    with pytest.raises(ValueError, match="blocks.0.base.weight") as info:
        model(mlp_batch(0, 2)[0])
    assert "requires_grad_(False)" in str(info.value) and "blocks.0.proj.weight" in str(info.value)
    model.blocks[0].base.requires_grad_(False)
    _loss(model, mlp_batch(0, 2)).backward()  # lazy init done: gradients reduce in float32
    model.blocks[1].base.requires_grad_(True)
    with pytest.raises(ValueError, match=r"'blocks.1.base.weight' \(bfloat16\)") as info:
        _loss(model, mlp_batch(1, 2)).backward()
    assert "float32" in str(info.value)


@fsdp2_only
def test_mixed_trainable_dtypes_messages():
    """fsdp2's ValueErrors name the params, dtypes and fix, at lazy init and after it (upstream: AssertionError)."""
    run_ranks(_unfrozen_messages_body, 1)


def _ragged_body(rank, world_size):
    """RaggedShard on every parameter: one group per dtype, the reference's training, dim-0's
    bits; frozen groups gather but never reduce; a hook names the call's mesh."""
    ref, dim0 = _make_sharded()
    _, model = _make_sharded(shard_placement_fn=lambda p: RaggedShard())
    state = model.blocks[0]._get_fsdp_state()
    dtypes = [g.fsdp_params[0].sharded_param.dtype for g in state._fsdp_param_groups]
    # in the order of each dtype's first parameter (the block's own first: scale, codes)
    assert dtypes == [torch.float64, torch.int8, torch.float32, torch.bfloat16], dtypes
    hooked = []
    model.blocks[0].set_all_reduce_hook(hooked.append)  # one mesh: not ambiguous
    batches = [mlp_batch(step, 2 * world_size) for step in range(3)]
    ref_losses, losses, logs = train_steps(ref, model, batches, _loss, rank, world_size,
                                           record=log_collectives)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model, RTOL, ATOL)
    assert len(hooked) == 3, len(hooked)  # the fp32 group's reduction, once a step
    _, dim0_losses, dim0_logs = train_steps(None, dim0, batches, _loss, rank, world_size,
                                            record=log_collectives)
    reductions = [[n for kind, n, *_ in log if kind == "reduce_scatter"] for log in logs]
    assert len(reductions[0]) == len([n for kind, n, *_ in dim0_logs[0]
                                      if kind == "reduce_scatter"]), reductions  # fp32 only
    for (name, p), q in zip(model.named_parameters(), dim0.parameters()):
        assert p.dtype == q.dtype, name
        # the same sums in the same rank order, elementwise AdamW: dim-0's bits
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        if not p.requires_grad:
            assert p.grad is None, name
    assert losses == dim0_losses


@fsdp2_only
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ragged_layout_splits_a_call_by_dtype(world_size):
    """RaggedShard over fp32 + frozen bf16/float64/int8 parameters trains like the dim-0 group."""
    run_ranks(_ragged_body, world_size)
