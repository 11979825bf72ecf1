"""What ``MixedPrecisionPolicy`` means on the installed torch: the reduce-dtype default, overrides.

- ``reduce_dtype=None`` under ``param_dtype=bf16``: torch 2.15 reduces in the
  parameters' fp32, earlier releases in bf16. Three SGD steps with gradient
  accumulation equal, to the bit, a run with that dtype named explicitly, and
  (on 2.15 at W > 1) differ from the other dtype; the implementation under test
  equals upstream's ``fully_shard`` run in the same launch to the bit. W = 1, 2, 4.
- ``param_dtype_override_fn`` keeping the norms in fp32 inside bf16 blocks:
  the norms compute with fp32 weights, the linears with bf16 ones; training
  equals upstream to the bit where torch has the field, and stays within bf16
  rounding of the same model whose norms are sharded on their own without
  mixed precision.
  A return value that is neither ``None``, ``param_dtype`` nor the parameter's
  dtype is a ``ValueError`` at ``fully_shard``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as upstream
import torch.nn as nn
from _impl import IMPL, MixedPrecisionPolicy, fully_shard, needs_upstream
from checks import check_case
from models import shard_groups
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp2.versions import REDUCE_IN_PARAM_DTYPE_BY_DEFAULT, upstream_has

BF16, FP32 = torch.bfloat16, torch.float32
D = 12
STEPS = 3


class Norm(nn.Module):
    """RMS norm computed in fp32 whatever the weight's dtype; output in the input's dtype."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))
        self.seen_dtype: torch.dtype | None = None

    def forward(self, x):
        self.seen_dtype = self.weight.dtype
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * self.weight.float()).to(x.dtype)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Norm()
        self.proj = nn.Linear(D, D, bias=False)  # 1-D parameters of size D: the norms only

    def forward(self, x):
        return x + torch.tanh(self.proj(self.norm(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train_accumulating(rank, world_size, shard):
    """Build, shard with ``shard(model, mesh)``, train; the losses and final full parameters.

    Each step's first micro-batch runs without gradient sync and each rank draws its own
    data: not ``checks.train_steps``'s one synced backward on a slice of a shared batch.
    """
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = Net()
    shard(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        for micro in range(2):  # the first micro-batch without gradient sync
            model.set_requires_gradient_sync(micro == 1)
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            loss = model(torch.randn(4, D, generator=g)).float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return torch.stack(losses), params, model


def _assert_same(a, b, what):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0, msg=f"{what}: losses")
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=0, msg=f"{what}: {name}")


def _blocks_then_root(fully_shard_fn, policy_cls, **mp):
    def shard(model, mesh):
        policy = policy_cls(param_dtype=BF16, **mp)
        shard_groups(model, fully_shard_fn, model.blocks, mesh=mesh, mp_policy=policy)

    return shard


def _reduce_default(rank, world_size):
    """reduce_dtype=None reduces as the installed torch's upstream does, bit for bit."""
    unset = _train_accumulating(rank, world_size,
                                _blocks_then_root(fully_shard, MixedPrecisionPolicy))
    default = FP32 if REDUCE_IN_PARAM_DTYPE_BY_DEFAULT else BF16
    other = BF16 if default == FP32 else FP32
    named = _train_accumulating(rank, world_size, _blocks_then_root(
        fully_shard, MixedPrecisionPolicy, reduce_dtype=default))
    _assert_same(unset, named, f"reduce_dtype=None vs {default}")
    if world_size > 1:
        wrong = _train_accumulating(rank, world_size, _blocks_then_root(
            fully_shard, MixedPrecisionPolicy, reduce_dtype=other))
        assert any(not torch.equal(unset[1][n], wrong[1][n]) for n in unset[1]), (
            f"reduce_dtype=None trained exactly as reduce_dtype={other}: the test cannot tell"
        )
    base = _train_accumulating(rank, world_size, _blocks_then_root(
        upstream.fully_shard, upstream.MixedPrecisionPolicy))
    _assert_same(unset, base, "against upstream")


def _keep_norms_fp32(param):
    return FP32 if param.ndim == 1 and param.numel() == D else None


def _override(rank, world_size):
    """Norms kept fp32 in bf16 blocks: same as norms sharded on their own without mp."""
    policy = MixedPrecisionPolicy(param_dtype=BF16, param_dtype_override_fn=_keep_norms_fp32)

    def with_override(model, mesh):
        shard_groups(model, fully_shard, model.blocks, mesh=mesh, mp_policy=policy)

    def norms_apart(model, mesh):
        # The override also decides the reduce dtype: promoted over the group's gradients
        # (fp32) where reduce_dtype is unset, as on 2.15 for every group of fp32 parameters.
        bf16 = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
        for block in model.blocks:
            fully_shard(block.norm, mesh=mesh)  # no mixed precision: fp32 weights
            fully_shard(block, mesh=mesh, mp_policy=bf16)
        fully_shard(model, mesh=mesh, mp_policy=bf16)

    ours = _train_accumulating(rank, world_size, with_override)
    model = ours[2]
    assert [b.norm.seen_dtype for b in model.blocks] == [FP32, FP32]
    model.blocks[0].unshard()
    assert model.blocks[0].proj.weight.dtype == BF16 and model.blocks[0].norm.weight.dtype == FP32
    model.blocks[0].reshard()
    assert all(isinstance(p, DTensor) and p.dtype == FP32 for p in model.parameters())
    # Not to the bit: the norm's own FSDP hooks reorder autograd's bf16 sums.
    apart = _train_accumulating(rank, world_size, norms_apart)
    torch.testing.assert_close(ours[0], apart[0], rtol=2e-2, atol=1e-3)
    for name in ours[1]:
        torch.testing.assert_close(ours[1][name], apart[1][name], rtol=2e-2, atol=1e-3, msg=name)
    if upstream_has("MixedPrecisionPolicy.param_dtype_override_fn"):
        theirs = upstream.MixedPrecisionPolicy(
            param_dtype=BF16, param_dtype_override_fn=_keep_norms_fp32
        )
        base = _train_accumulating(rank, world_size, lambda m, mesh: shard_groups(
            m, upstream.fully_shard, m.blocks, mesh=mesh, mp_policy=theirs))
        _assert_same(ours, base, "against upstream")
    # Bad answers: ValueError at fully_shard, naming what was returned.
    for bad, match in ((torch.float16, "must return None, param_dtype"), ("fp32", "torch.dtype or None")):
        policy = MixedPrecisionPolicy(param_dtype=BF16, param_dtype_override_fn=lambda p, b=bad: b)
        with pytest.raises(ValueError, match=match):
            fully_shard(Block(), mesh=init_device_mesh("cpu", (world_size,)), mp_policy=policy)


def _cases(world_size):
    cases = {"reduce_default": _reduce_default}
    if world_size == 2 and not (IMPL == "torch" and not upstream_has(
        "MixedPrecisionPolicy.param_dtype_override_fn"
    )):
        cases["override"] = _override
    return cases


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_reduce_dtype_default_follows_installed_torch(world_size, launch_cases):
    """reduce_dtype=None: bit-equal to the dtype the installed torch defaults to, and to upstream."""
    check_case(launch_cases(world_size, _cases(world_size)), "reduce_default")


@needs_upstream("MixedPrecisionPolicy.param_dtype_override_fn")
def test_param_dtype_override_fn(launch_cases):
    """param_dtype_override_fn keeps chosen parameters' dtype; bad answers raise ValueError."""
    check_case(launch_cases(2, _cases(2)), "override")
