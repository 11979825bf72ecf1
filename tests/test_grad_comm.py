"""GradientCommPolicy: gradients exchanged in bf16, fp8 or int8 blocks, summed in fp32.

Against the plain fp32 reduce-scatter of the same model and batch: the error
each payload makes stays within its bound; the same bits run to run;
representable gradients cross exactly; the bf16 exchange is at least as
accurate as upstream's bf16 reduce (``reduce_dtype=torch.bfloat16``); error
feedback keeps the error from growing over steps; it composes with gradient
accumulation, HSDP, the parameter-major layout and parameters unused on every
rank. See [Note: Quantized gradient exchange] in
fsdp2/runtime/comm/quantized_reduce.py.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
from _multiproc import run_ranks
from checks import packed_everywhere
from models import build_transformer, cpu_mesh, full, rank_slice, shard_transformer
from models import transformer_batch as batch_of
from models import transformer_loss as loss_of

import fsdp2
from fsdp2 import GradientCommPolicy, MixedPrecisionPolicy
from fsdp2.runtime.comm.quantized_reduce import QuantizedReduceScatter, decode, encode, wire_bytes

pytestmark = pytest.mark.skipif(
    os.environ.get("FSDP2_TEST_IMPL") == "torch", reason="fsdp2's own feature"
)

PAYLOADS = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
# relative error (Frobenius) of one reduced gradient against the fp32 reduce, per payload
BOUND = {torch.bfloat16: 5e-3, torch.int8: 2e-2, torch.float8_e4m3fn: 8e-2, torch.float8_e5m2: 0.16}


def test_encode_decode_exact_zeros_and_bytes():
    """Representable values cross bit for bit; an all -0.0 block stays -0.0; wire bytes."""
    torch.manual_seed(0)
    segments = [300, 5, 211]  # blocks restart at every edge (a short last block each)
    n = sum(segments)
    starts = [s + b for s, seg in zip([0, 300, 305], segments) for b in range(0, seg, 128)]
    for payload in PAYLOADS:
        if payload == torch.bfloat16:
            exact = torch.randn(n).to(torch.bfloat16).float()
        elif payload == torch.int8:  # integers times a power of two, 127 somewhere in each block
            exact = torch.randint(-127, 128, (n,)).float() * 2.0**-5
            exact[starts] = 127 * 2.0**-5
        else:  # payload values at scale 1: each block's largest is the payload's largest
            exact = torch.randn(n).to(payload).float()
            exact[starts] = torch.finfo(payload).max
        codes, scales = encode(exact, payload, 128, segments)
        assert torch.equal(decode(codes, scales, torch.float32, 128, segments), exact), payload
        negative = torch.full((n,), -0.0)
        negative[310:] = 1.0  # the first two segments all -0.0, the third not
        back = decode(*encode(negative, payload, 128, segments), torch.float32, 128, segments)
        assert torch.signbit(back[:305]).all() and torch.equal(back[305:], negative[305:]), payload
        tiny = torch.full((n,), 1e-44)  # denormal: a scale would underflow to 0 (0 / 0 codes)
        assert torch.equal(decode(*encode(tiny, payload, 128, segments), torch.float32, 128, segments),
                           tiny.bfloat16().float() if payload == torch.bfloat16 else torch.zeros(n)), payload
        small = torch.randn(n) * 1e-40  # denormal scales: coarse, yet every code finite
        back = decode(*encode(small, payload, 128, segments), torch.float32, 128, segments)
        assert torch.isfinite(back).all(), payload
        noisy = torch.randn(n)
        error = (decode(*encode(noisy, payload, 128, segments), torch.float32, 128, segments) - noisy)
        assert error.norm() / noisy.norm() < BOUND[payload] / 2, payload
    fp32 = 4 * 4096
    assert wire_bytes(4096, torch.int8, 128) / fp32 <= 0.27
    assert wire_bytes(4096, torch.float8_e4m3fn, 256) / fp32 <= 0.27
    assert wire_bytes(4096, torch.bfloat16, 128) / fp32 == 0.5


def _policy_model(policy, mesh=None, **shard_kw):
    model = build_transformer(seed=5)
    shard_transformer(model, fsdp2.fully_shard, mesh=mesh or cpu_mesh(), **shard_kw)
    for m in model.modules():
        if isinstance(m, fsdp2.FSDPModule):
            m.set_gradient_comm_policy(policy)
    return model


def _grads(model, batch, micro=1):
    for m in range(micro):
        if micro > 1:
            model.set_requires_gradient_sync(m == micro - 1)
        loss_of(model, tuple(t[m::micro] for t in batch)).backward()
    grads = {n: None if p.grad is None else full(p.grad).clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _error(got, want):
    num = sum(float((got[n] - want[n]).double().norm() ** 2) for n in want if want[n] is not None)
    den = sum(float(want[n].double().norm() ** 2) for n in want if want[n] is not None)
    return (num / den) ** 0.5


def _payloads_body(rank, world_size):
    batch = rank_slice(batch_of(0, 4 * world_size), rank, world_size)
    want = _grads(_policy_model(None), batch)
    errors = {}
    for payload in PAYLOADS:
        got = _grads(_policy_model(GradientCommPolicy(payload)), batch)
        again = _grads(_policy_model(GradientCommPolicy(payload)), batch)
        assert all(torch.equal(got[n], again[n]) for n in got), f"{payload}: not the same bits"
        errors[str(payload)] = _error(got, want)
        if world_size > 1:
            assert 0 < errors[str(payload)] < BOUND[payload], (payload, errors)
        else:  # one rank sends nothing: nothing is encoded
            assert all(torch.equal(got[n], want[n]) for n in got), payload
    # upstream's lever: the reduce-scatter itself in bf16
    bf16_sum = _grads(_policy_model(None, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)), batch)
    errors["bf16 reduce"] = _error({n: g.float() for n, g in bf16_sum.items()}, want)
    if world_size > 1:
        assert errors["torch.bfloat16"] <= errors["bf16 reduce"], errors
    return errors


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_payload_against_the_fp32_reduce(world_size):
    run_ranks(_payloads_body, world_size)


def _exact_body(rank, world_size):
    """Each rank's slices representable: the owner's sum is the fp32 reduce-scatter's, exactly."""
    n, segments = 300, [[120, 180]] * world_size
    g = torch.Generator().manual_seed(rank)
    starts = [r * n + b for r in range(world_size) for b in (0, 120, 248)]  # every block's first
    for payload in PAYLOADS:
        values = torch.randint(-127, 128, (world_size * n,), generator=g).float() * 2.0**-4
        values[starts] = 127 * 2.0**-4  # each block's largest
        if payload in (torch.float8_e4m3fn, torch.float8_e5m2):
            values = torch.randn(world_size * n, generator=g).to(payload).float()
            values[starts] = torch.finfo(payload).max
        out = torch.empty(n)
        QuantizedReduceScatter(payload, 128, False)(out, values.clone(), dist.group.WORLD,
                                                    dist.ReduceOp.SUM, segments)
        want = torch.empty(n)
        dist.reduce_scatter_tensor(want, values)
        assert torch.equal(out, want), payload


def test_representable_gradients_cross_exactly():
    run_ranks(_exact_body, 2)


def _feedback_body(rank, world_size):
    """The same gradient reduced K times: with error feedback the sum's error stays one step's."""
    batch = rank_slice(batch_of(1, 4 * world_size), rank, world_size)
    want = _grads(_policy_model(None), batch)
    steps, out = 8, {}
    for feedback in (False, True):
        model = _policy_model(GradientCommPolicy(torch.int8, 32, error_feedback=feedback))
        total = None
        for _ in range(steps):
            got = _grads(model, batch)
            total = got if total is None else {n: total[n] + got[n] for n in got}
        out[feedback] = _error(total, {n: steps * w for n, w in want.items()})
    assert out[True] < out[False] / 3, out
    return out


def test_error_feedback_keeps_the_error_from_growing():
    run_ranks(_feedback_body, 2)


def _compose_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    batch = rank_slice(batch_of(2, 4 * world_size), rank, world_size)
    policy = GradientCommPolicy(torch.int8)
    cases = {
        "accumulate": ({}, 2),
        "ragged": ({"shard_placement_fn": lambda p: fsdp2.RaggedShard()}, 1),
        "packed": ({"shard_placement_fn": lambda p: fsdp2.RaggedShard()}, 1),  # forced below
        "offload": ({"offload_policy": fsdp2.CPUOffloadPolicy(pin_memory=False)}, 1),
    }
    if world_size == 4:
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        cases["hsdp"] = ({"mesh": hsdp}, 1)
    for name, (kw, micro) in cases.items():
        with packed_everywhere() if name == "packed" else contextlib.nullcontext():
            want = _grads(_policy_model(None, **kw), batch, micro)
            got = _grads(_policy_model(policy, **kw), batch, micro)
        assert _error(got, want) < BOUND[torch.int8], (name, _error(got, want))
    # the flat optimizer step (the default) steps on the encoded exchange's output
    model, plain = _policy_model(policy), _policy_model(None)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, plain)]
    for _ in range(3):
        for m, opt in zip((model, plain), opts):
            loss_of(m, batch).backward()
            opt.step()
            opt.zero_grad()
    engine = fsdp2.optim.flat_step_engine(opts[0])
    assert engine is not None and all(r.flat_steps == 2 for r in engine.runs())
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(full(p.detach()), full(q.detach()), atol=3e-2, rtol=0, msg=n)
    # parameters no rank uses keep grad None (the -0.0 fill crosses as -0.0)
    models = []
    feedback = GradientCommPolicy(torch.int8, error_feedback=True)
    for p in (policy, GradientCommPolicy(torch.float8_e4m3fn), feedback, None):
        model = build_transformer(seed=5)
        model.layers[0].spare = torch.nn.Linear(5, 3)  # in block 0's group, never called
        shard_transformer(model, fsdp2.fully_shard, mesh=cpu_mesh())
        model.layers[0].set_gradient_comm_policy(p)
        for _ in range(2):  # the second with a residual kept from the first
            model.zero_grad()
            loss_of(model, batch).backward()
        models.append(model)
    *encoded, plain = models
    assert [n for n, p in plain.named_parameters() if p.grad is None] == [
        "layers.0.spare.weight", "layers.0.spare.bias"]
    for model in encoded:
        assert [n for n, p in model.named_parameters() if p.grad is None] == [
            "layers.0.spare.weight", "layers.0.spare.bias"]
    return sorted(cases)


@pytest.mark.parametrize("world_size", [2, 4])
def test_composes_with_accumulation_hsdp_ragged_offload_flat_step(world_size):
    run_ranks(_compose_body, world_size)


def _bad_body(rank, world_size):
    class Comm:
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)

    model = build_transformer(seed=5)
    shard_transformer(model, fsdp2.fully_shard, mesh=cpu_mesh())
    block = model.layers[0]
    block.set_gradient_comm_policy(GradientCommPolicy())
    with pytest.raises(ValueError, match="GradientCommPolicy and a custom reduce-scatter"):
        block.set_custom_reduce_scatter(Comm())
    other = model.layers[1]
    other.set_custom_reduce_scatter(Comm())
    with pytest.raises(ValueError, match="GradientCommPolicy and a custom reduce-scatter"):
        other.set_gradient_comm_policy(GradientCommPolicy(torch.int8))
    with pytest.raises(TypeError, match="expects a GradientCommPolicy"):
        block.set_gradient_comm_policy(torch.int8)


def test_bad_input():
    for kw in ({"payload": torch.float16}, {"block_size": 0}, {"block_size": True}):
        with pytest.raises(ValueError, match="GradientCommPolicy"):
            GradientCommPolicy(**kw)
    run_ranks(_bad_body, 2)


def test_policy_is_a_plain_value():
    policy = GradientCommPolicy(torch.float8_e4m3fn, 256, error_feedback=True)
    assert copy.deepcopy(policy) == policy and hash(policy) == hash(copy.copy(policy))
