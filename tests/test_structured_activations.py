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
from checks import check_case, full_params, train_alone
from models import cpu_mesh, shard_groups
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


def _build_and_train(kind, precision, shard_fn, policy_cls, rank, world_size):
    """Blocks then root sharded by ``shard_fn`` (None: plain, whole batches); SGD steps.

    Returns the losses and the final full parameters.
    """
    torch.manual_seed(0)
    model = Net(kind)
    if shard_fn is not None:
        kwargs = {"mesh": cpu_mesh()}
        if PRECISIONS[precision] is not None:
            param_dtype, reduce_dtype = PRECISIONS[precision]
            kwargs["mp_policy"] = policy_cls(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        shard_groups(model, shard_fn, model.blocks, **kwargs)
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(2 * world_size, DIM, generator=gen),) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train_alone(model, batches, _loss, None if shard_fn is None else rank, world_size, opt)
    return losses, full_params(model)


def _loss(model, batch):
    (x,) = batch
    return model(x).float().pow(2).mean()


def _case(kind, precision):
    def body(rank, world_size):
        losses, params = _build_and_train(
            kind, precision, fully_shard, MixedPrecisionPolicy, rank, world_size
        )
        up_losses, up_params = _build_and_train(
            kind, precision, upstream_fully_shard, UpstreamMP, rank, world_size
        )
        assert losses == up_losses, (losses, up_losses)
        for name, value in up_params.items():
            assert torch.equal(params[name], value), name
        if precision == "fp32":
            ref_losses, ref_params = _build_and_train(kind, precision, None, None, rank, world_size)
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
def test_structured_activations_match_upstream(case, world_size, launch_cases):
    """Dataclass / nested dataclass / namedtuple activations train as upstream (and the reference)."""
    check_case(launch_cases(world_size, CASES), case)
