"""Activations passed between sharded modules inside dataclasses and namedtuples.

pytree does not look into dataclasses, but FSDP must hook every output tensor
that starts a group's backward (else backward runs on freed parameters) and
cast every floating input. Each case trains the same model three steps with
the implementation under test and with upstream's ``fully_shard`` in one
launch: losses and parameters must be identical, and in fp32 also match the
unsharded model.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
import torch.nn as nn
from _impl import MixedPrecisionPolicy, fully_shard
from checks import check_case, launch_cases
from models import cpu_mesh, global_mean, rank_slice
from torch.distributed.fsdp import MixedPrecisionPolicy as UpstreamMP
from torch.distributed.fsdp import fully_shard as upstream_fully_shard

DIM = 8


@dataclasses.dataclass
class Pair:
    h: torch.Tensor
    aux: torch.Tensor


@dataclasses.dataclass
class Nested:
    pair: Pair
    scale: float


class Named(typing.NamedTuple):
    h: torch.Tensor
    aux: torch.Tensor


def _pack(kind: str, h: torch.Tensor, aux: torch.Tensor):
    if kind == "dataclass":
        return Pair(h, aux)
    if kind == "nested":
        return Nested(Pair(h, aux), 0.5)
    return Named(h, aux)


def _unpack(kind: str, value) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "nested":
        return value.pair.h * value.scale, value.pair.aux
    return value.h, value.aux


class _Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.main = nn.Linear(DIM, DIM)
        self.side = nn.Linear(DIM, DIM)

    def forward(self, value):
        h, aux = _unpack(self.kind, value)
        x = torch.tanh(h + aux)
        return _pack(self.kind, self.main(x), self.side(x))


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([_Block(kind) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        value = _pack(self.kind, h, 2 * h)
        for block in self.blocks:
            value = block(value)
        h, aux = _unpack(self.kind, value)
        return h + aux


PRECISIONS = {
    "fp32": None,
    "bf16": (torch.bfloat16, torch.float32),
    "bf16-reduce": (torch.bfloat16, torch.bfloat16),
}


def _train(kind, precision, shard_fn, policy_cls, rank, world_size):
    torch.manual_seed(0)
    model = Net(kind)
    if shard_fn is not None:
        kwargs = {"mesh": cpu_mesh()}
        if PRECISIONS[precision] is not None:
            param_dtype, reduce_dtype = PRECISIONS[precision]
            kwargs["mp_policy"] = policy_cls(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for block in model.blocks:
            shard_fn(block, **kwargs)
        shard_fn(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):
        batch = torch.randn(2 * world_size, DIM, generator=gen)
        x = batch if shard_fn is None else rank_slice((batch,), rank, world_size)[0]
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() if shard_fn is None else global_mean(loss.detach()).item())
    params = {
        n: (p.full_tensor() if shard_fn is not None else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return losses, params


def _case(kind, precision):
    def body(rank, world_size):
        losses, params = _train(kind, precision, fully_shard, MixedPrecisionPolicy, rank, world_size)
        up_losses, up_params = _train(
            kind, precision, upstream_fully_shard, UpstreamMP, rank, world_size
        )
        assert losses == up_losses, (losses, up_losses)
        for name, value in up_params.items():
            assert torch.equal(params[name], value), name
        if precision == "fp32":
            ref_losses, ref_params = _train(kind, precision, None, None, rank, world_size)
            torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
            for name, value in ref_params.items():
                torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)

    return body


CASES = {
    f"{kind}-{precision}": _case(kind, precision)
    for kind in ("dataclass", "nested", "namedtuple")
    for precision in PRECISIONS
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_structured_activations_match_upstream(case, world_size):
    """Dataclass / nested dataclass / namedtuple activations train as upstream (and the reference)."""
    check_case(launch_cases(("structured", world_size), world_size, CASES), case)
