"""FSDP's streams proven race-free on CPU with the stream-order checker (tests/stream_checker.py).

Each planted missing wait must be caught; the training matrix must run with no
race and match the unsharded reference. See [Note: Streams] in
fsdp2/runtime/streams.py.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from checks import assert_grads_match, check_case
from models import build_chain, chain_batch, make_pair, mlp_loss, rank_slice, shard_chain
from stream_checker import StreamChecker, skipped
from torch.distributed.device_mesh import init_device_mesh

from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from fsdp2.runtime import streams

STEPS = 3


def _train(rank, world_size, edge=None, *, check_ref=True, accumulate=False, prefetch=False,
           post_optim_event=False, mesh=None, hook_stream=False, **kwargs):
    """Train a Chain under the checker; returns its errors (and checks parity with no edge skipped)."""
    ref, model = make_pair(build_chain)
    shard_chain(model, fully_shard, mesh=mesh, **kwargs)
    if prefetch:
        layers = list(model.layers)
        for a, b in zip(layers, layers[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checker = StreamChecker()
    seen = []
    with checker, skipped(edge) if edge else contextlib.nullcontext():
        if hook_stream:
            model.set_all_reduce_hook(lambda t: seen.append(t.sum()), stream=checker.new_stream("hook"))
        for step in range(STEPS):
            batch = chain_batch(step, 8)
            micro = 2 if accumulate else 1
            for m in range(micro):
                if accumulate:
                    model.set_requires_gradient_sync(m == micro - 1)
                half = [t.chunk(micro)[m] for t in batch]
                ref_loss = mlp_loss(ref, half) * (1 / micro)
                ref_loss.backward()
                loss = mlp_loss(model, rank_slice(half, rank, world_size)) * (1 / micro)
                loss.backward()
            if check_ref and not edge:
                assert_grads_match(ref, model, 1e-5, 1e-6)
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
            if post_optim_event:
                event = checker.new_event()
                event.record()
                model.set_post_optim_event(event)
    if hook_stream and not edge:
        assert len(seen) > 0
    return checker.errors


def _planted(rank, world_size):
    out = {}
    for edge in CAUGHT:
        kwargs = {"offload_policy": CPUOffloadPolicy()} if edge == "offload->optimizer" else {}
        errors = _train(rank, world_size, edge, post_optim_event=edge == "post_optim->all_gather",
                        **kwargs)
        out[edge] = errors[:2]
    out["none"] = _train(rank, world_size)
    return out


def test_each_planted_missing_wait_is_caught(launch_cases):
    ok, per_rank = launch_cases.run(_planted, 2)
    assert ok, per_rank
    for rank, result in enumerate(per_rank):
        assert result["none"] == [], f"rank {rank}: a race with every wait in place: {result['none']}"
        for edge in CAUGHT:
            errors = result[edge]
            assert errors, f"rank {rank}: skipping the wait '{edge}' went unnoticed"
            assert SIGNATURE[edge] in errors[0], (edge, errors[0])


# The race each skipped wait leaves, as the checker names it (first error).
SIGNATURE = {
    "all_gather->copy_out": "on stream 0 (compute) reads memory that 'all_gather_single' wrote",
    "copy_out->compute": "is reused by stream 1 (copy_in) while 'all_gather_single'",
    "compute->reduce_scatter": "'_chunk_cat' on stream 3 (reduce_scatter) reads memory",
    "reduce_scatter->optimizer": "on stream 0 (compute) reads memory that 'reduce_scatter_single'",
    "offload->optimizer": "on stream 0 (compute) reads memory that 'reduce_scatter_single'",
    "post_optim->all_gather": "'all_gather_single' on stream 5 (process group 0) reads memory",
}


# At W=2; the post-forward shard's edge needs a smaller post-forward group (W=4 below).
CAUGHT = [e for e in streams.EDGES if e != "post_forward_shard->all_gather"]


def _case(**kwargs):
    def case(rank, world_size):
        errors = _train(rank, world_size, **kwargs)
        assert errors == [], "\n".join(errors[:5])
    return case


def _hsdp(rank, world_size):
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    errors = _train(rank, world_size, mesh=mesh, hook_stream=False)
    assert errors == [], "\n".join(errors[:5])


MATRIX = {
    "default": _case(),
    "no_reshard": _case(reshard_after_forward=False),
    "explicit_prefetch": _case(prefetch=True, post_optim_event=True),
    "mixed_precision": _case(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64)),
    "offload": _case(offload_policy=CPUOffloadPolicy()),
    "accumulate": _case(accumulate=True),
    "hook_on_stream": _case(hook_stream=True),
}


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_matrix_w2(launch_cases, name):
    check_case(launch_cases(2, MATRIX), name)


def _reshard_int(rank, world_size):
    errors = _train(rank, world_size, reshard_after_forward=2)
    assert errors == [], "\n".join(errors[:5])
    planted = _train(rank, world_size, "post_forward_shard->all_gather", reshard_after_forward=2)
    assert planted and "'cat' wrote on stream 0 (compute)" in planted[0], planted[:2]


MATRIX_W4 = {"default": _case(), "reshard_int": _reshard_int, "hsdp": _hsdp}


@pytest.mark.parametrize("name", sorted(MATRIX_W4))
def test_matrix_w4(launch_cases, name):
    check_case(launch_cases(4, MATRIX_W4), name)


def _forced(rank, world_size):
    os.environ["FSDP2_FORCE_COLLECTIVES"] = "1"
    return {"default": _train(rank, world_size)}


def test_one_rank_forced_collectives(launch_cases):
    ok, per_rank = launch_cases.run(_forced, 1)
    assert ok, per_rank
    assert per_rank[0]["default"] == []


def _profile(rank, world_size):
    ref, model = make_pair(build_chain)
    shard_chain(model, fully_shard)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        mlp_loss(model, rank_slice(chain_batch(0, 8), rank, world_size)).backward()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("FSDP::")})


def test_profiler_ranges_have_upstreams_names(launch_cases):
    ok, per_rank = launch_cases.run(_profile, 2)
    assert ok, per_rank
    expected = {
        "FSDP::all_gather", "FSDP::all_gather_copy_out", "FSDP::pre_forward",
        "FSDP::post_forward", "FSDP::pre_backward", "FSDP::post_backward",
        "FSDP::post_backward_reduce",
    }
    assert expected <= set(per_rank[0]), per_rank[0]


def test_cpu_has_no_streams():
    comm = streams.CommStreams()
    comm.init(torch.device("cpu"))
    assert not comm.active and comm.copy_in is None
