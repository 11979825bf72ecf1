"""Block-scaled fp8 all-gather (fsdp2.quant.gather_fp8_tiles): quantize-after-gather's bits.

Each rank quantizes the 128 x 128 tiles of its own rows and the group gathers
codes and scales; the weight a module computes with must equal, bit for bit,
``dequantize_tiles(*quantize_tiles(full weight))`` at every world size, the
all-gather must carry the codes and scales only (about half of bf16's bytes),
and training must match a single-process model that quantizes its weights
the same way in forward (gradients straight through). See [Note: Block-scaled
fp8 all-gather] in fsdp2/quant/fp8_tiles.py.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _impl import fsdp2_only
from checks import assert_losses_match, check_case, log_collectives, train_steps
from models import cpu_mesh, full
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2 import MixedPrecisionPolicy, fully_shard
from fsdp2.quant import dequantize_tiles, gather_fp8_tiles, quantize_tiles

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))

pytestmark = fsdp2_only  # fsdp2's own recipe

TILE = 128


class _FakeQuant(torch.autograd.Function):
    """The reference's weight: quantized and dequantized in forward, gradient straight through."""

    @staticmethod
    def forward(ctx, w, dtype):
        return dequantize_tiles(*quantize_tiles(w.detach(), TILE), TILE, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Net(nn.Module):
    """Two tiled weights (512 rows: whole tiles per rank at W = 1, 2, 4; 192 columns: a
    partial column tile) and a small head gathered as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(192, 512, bias=False)
        self.b = nn.Linear(512, 512, bias=False)
        self.head = nn.Linear(512, 8)
        self.quantize_in_forward = False  # the single-process reference's switch

    def _linear(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_in_forward:
            return F.linear(x, _FakeQuant.apply(linear.weight, linear.weight.dtype))
        return linear(x)  # sharded: the module's hooks gather its weight

    def forward(self, x):
        x = torch.tanh(self._linear(self.a, x))
        x = torch.tanh(self._linear(self.b, x))
        return self.head(x)


def _batch(step: int, world_size: int):
    g = torch.Generator().manual_seed(40 + step)
    return torch.randn(2 * world_size, 192, generator=g), torch.randn(2 * world_size, 8, generator=g)


def _loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _tiled(name: str, p) -> bool:
    return name in ("a.weight", "b.weight")


def _tile_major(p):
    """The parameter-major layout keeping tiles whole: 128-row bands of the 2-D weights."""
    return fsdp2.RaggedShard((TILE, TILE)) if p.dim() == 2 else fsdp2.RaggedShard()


def _sharded(mp_policy=None, mesh=None, placement_fn=None, **extra):
    torch.manual_seed(5)
    ref = _Net()
    model = copy.deepcopy(ref)
    kwargs = {"mesh": mesh or cpu_mesh(), "mp_policy": mp_policy or MixedPrecisionPolicy(), **extra}
    if placement_fn is not None:
        kwargs["shard_placement_fn"] = placement_fn
    for layer in (model.a, model.b):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    assert gather_fp8_tiles(model, filter_fn=_tiled) == ["a.weight", "b.weight"]
    return ref, model


def _gathered_weights(model) -> dict[str, torch.Tensor]:
    """The weights the linears compute with in the next forward (the unsharded parameters)."""
    seen = {}
    handles = [
        layer.register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, m.weight.detach().clone())
        )
        for name, layer in (("a", model.a), ("b", model.b))
    ]
    _loss(model, _batch(0, 1))
    for h in handles:
        h.remove()
    return seen


def _quantize_after_gather(rank, world_size):
    configs = [(None, None, None), (MixedPrecisionPolicy(param_dtype=torch.bfloat16), None, None)]
    if world_size == 4:  # HSDP: the tiles of the shard dim's rows, replicas alike (both layouts)
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        configs += [(None, hsdp, None), (None, hsdp, _tile_major)]
    for mp, mesh, placement_fn in configs:
        ref, model = _sharded(mp, mesh, placement_fn)
        dtype = torch.float32 if mp is None else torch.bfloat16
        with log_collectives() as log:
            seen = _gathered_weights(model)
        for name in ("a", "b"):
            want = dequantize_tiles(*quantize_tiles(getattr(ref, name).weight.detach()), TILE, dtype)
            assert seen[name].dtype == dtype
            assert torch.equal(seen[name], want), (name, mp)
        if world_size > 1:  # bytes on the wire: codes (1 byte) + one fp32 scale per tile
            for rows, cols in ((512, 192), (512, 512)):
                tiles = (rows // TILE) * -(-cols // TILE)
                assert ("all_gather", rows * cols + 4 * tiles) in log, (rows, cols, log)


def _quantize_after_gather_param_major(rank, world_size):
    """RaggedShard((128, 128)): every rank's rows start at a tile boundary at any W (dim-0
    chunks of 512 rows cut tiles at W = 3), each rank sends its own rows' tiles, padded
    with zero rows to the largest rank's, and the weight is quantize-after-gather's."""
    offload = {"offload_policy": fsdp2.CPUOffloadPolicy()}
    for mp, extra in ((None, {}), (MixedPrecisionPolicy(param_dtype=torch.bfloat16), {}),
                      (None, offload)):
        ref, model = _sharded(mp, placement_fn=_tile_major, **extra)
        dtype = torch.float32 if mp is None else torch.bfloat16
        with log_collectives() as log:
            seen = _gathered_weights(model)
        for name in ("a", "b"):
            want = dequantize_tiles(*quantize_tiles(getattr(ref, name).weight.detach()), TILE, dtype)
            assert seen[name].dtype == dtype
            assert torch.equal(seen[name], want), (name, mp)
        if world_size > 1:  # W blocks of the largest rank's codes and scales, nothing else
            for name, cols in (("a", 192), ("b", 512)):
                bounds = getattr(model, name).weight.placements[0].row_bounds
                most = max(y - x for x, y in zip(bounds, bounds[1:]))
                assert most % TILE == 0 and all(b % TILE == 0 for b in bounds[:-1]), bounds
                block = most * cols + 4 * (most // TILE) * -(-cols // TILE)
                assert ("all_gather", world_size * block) in log, (name, block, log)


def _training_param_major(rank, world_size):
    """Two SGD steps against the reference on the parameter-major layout: the head (not
    tiled) gathers its rows beside the hooks' codes and scales in the root's collective."""
    ref, model = _sharded(placement_fn=_tile_major)
    ref.quantize_in_forward = True
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model))
    ref_losses, losses = train_steps(ref, model, [_batch(0, world_size)], _loss, rank, world_size,
                                     opts)
    assert_losses_match(ref_losses, losses)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.detach()), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _training(rank, world_size):
    """One step against the reference: the same quantized weights, so the gradients (reduced
    over the ranks' batch slices) and the step agree within the tests' tolerances. Later
    steps start from weights that differ in their last bits (the reduction's order), and
    an fp8 rounding that flips on such a bit moves an element by a whole fp8 step."""
    ref, model = _sharded()
    ref.quantize_in_forward = True
    # SGD: AdamW's first step is lr * sign(grad), which turns a gradient's last bit into lr
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model))
    ref_losses, losses = train_steps(ref, model, [_batch(0, world_size)], _loss, rank, world_size,
                                     opts)
    assert_losses_match(ref_losses, losses)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.detach()), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _bad_input(rank, world_size):
    torch.manual_seed(5)
    with pytest.raises(ValueError, match="call it after fully_shard"):
        gather_fp8_tiles(_Net())
    with pytest.raises(ValueError, match=r"tile=0"):
        gather_fp8_tiles(_Net(), tile=0)
    if world_size == 4:  # 320 rows: 80 per rank, a tile straddles ranks 0 and 1
        odd = nn.Sequential(nn.Linear(64, 320, bias=False))
        fully_shard(odd, mesh=cpu_mesh())
        with pytest.raises(ValueError, match=r"'0.weight' has 320 rows, 80 per rank at W=4"):
            gather_fp8_tiles(odd)
    # a tensor subclass with hooks on RaggedShard: its own rows, gathered whole (see
    # [Note: Subclasses on the parameter-major layout] in fsdp2/runtime/storage/extensions.py)
    from int8_all_gather import Int8Weight  # examples/, on the path (see the imports)

    sub = nn.Linear(64, 130, bias=False)  # 130 rows: uneven at W = 3 and 4
    quantized = Int8Weight.from_float(sub.weight)
    want = quantized.dequantize()
    sub.weight = nn.Parameter(quantized, requires_grad=False)
    fully_shard(sub, mesh=cpu_mesh(), shard_placement_fn=lambda p: fsdp2.RaggedShard())
    sub.unshard()
    assert torch.equal(sub.weight, want)
    sub.reshard()
    if world_size > 1:  # whole rows of 320: a rank boundary inside a tile at W = 2, 3, 4
        rows = nn.Sequential(nn.Linear(64, 320, bias=False))
        fully_shard(rows, mesh=cpu_mesh(), shard_placement_fn=lambda p: fsdp2.RaggedShard())
        with pytest.raises(ValueError, match=r"'0.weight' is held by the ranks in rows .*"
                                             r"RaggedShard\(\(128, 128\)\)"):
            gather_fp8_tiles(rows)


CASES = {
    "quantize_after_gather": _quantize_after_gather,
    "training": _training,
    "bad_input": _bad_input,
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_tiles(case, world_size, launch_cases):
    check_case(launch_cases(world_size, CASES), case)


PARAM_MAJOR = {
    "quantize_after_gather": _quantize_after_gather_param_major,
    "training": _training_param_major,
}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("case", list(PARAM_MAJOR))
def test_fp8_tiles_on_the_parameter_major_layout(case, world_size, launch_cases):
    check_case(launch_cases(world_size, PARAM_MAJOR), case)


def test_tiles_are_local():
    """A tile's codes and scale depend on its own elements: quantizing two row blocks cut at a
    tile boundary gives the whole weight's codes and scales (what makes the gather exact)."""
    torch.manual_seed(0)
    x = torch.randn(300, 200) * torch.logspace(-3, 3, 200)
    codes, scales = quantize_tiles(x)
    top, bottom = quantize_tiles(x[:256]), quantize_tiles(x[256:])
    assert torch.equal(torch.cat([top[0], bottom[0]]), codes)
    assert torch.equal(torch.cat([top[1], bottom[1]]), scales)
    err = (dequantize_tiles(codes, scales) - x).abs()
    tile_max = x.abs().max()
    assert err.max() <= tile_max / 8  # e4m3: 3 mantissa bits, so within 1/16 of each tile's amax
