"""CPU offload: sharded parameters, gradients and optimizer state live in host memory.

On these CPU meshes the host-device copies are no-ops, so the checks are that
offloading changes no numbers (parity with the fp32 reference, and bit-equality
with the same run without offload, also under bf16 mixed precision), that every
sharded tensor the optimizer touches is a CPU tensor, that meta-device init
works, and that parameters off the CPU are reported.

The checks of one world size run in one process launch (kept for the module's
tests by the ``launch_cases`` fixture).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from _impl import IMPL, CPUOffloadPolicy, MixedPrecisionPolicy, fsdp2_only, fully_shard
from _multiproc import run_ranks
from checks import (
    ATOL,
    RTOL,
    assert_losses_match,
    check_case,
    make_opts,
    train_alone,
    train_steps,
)
from models import (
    assert_params_match,
    build_transformer,
    cpu_mesh,
    rank_slice,
    shard_transformer,
    sharded_state_dict_from,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.tensor import DTensor

STEPS = 3
PER_RANK_BATCH = 2
# Upstream pins unconditionally and fails without an accelerator; fsdp2 pins
# only when there is a device to copy to. The shared checks do not pin.
NO_PIN = {"offload_policy": CPUOffloadPolicy(pin_memory=False)}


def _batches(world_size: int) -> list:
    return [transformer_batch(s, PER_RANK_BATCH * world_size) for s in range(STEPS)]


def _assert_on_cpu(model: nn.Module, opt: torch.optim.Optimizer, where: str) -> None:
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{where}: {name} is not sharded"
        assert p.to_local().device.type == "cpu", f"{where}: {name} on {p.to_local().device}"
        if p.grad is not None:
            assert p.grad.to_local().device.type == "cpu", f"{where}: {name}.grad off the CPU"
        for key, state in opt.state[p].items():
            if torch.is_tensor(state):
                assert state.device.type == "cpu", f"{where}: {name} optimizer {key} off the CPU"


def _check_fp32_parity(rank, world_size, policy_kwargs):
    ref = build_transformer(seed=5)
    model = shard_transformer(copy.deepcopy(ref), fully_shard, mesh=cpu_mesh(), **policy_kwargs)
    opts = make_opts(ref, model)
    ref_losses, losses = train_steps(
        ref, model, _batches(world_size), transformer_loss, rank, world_size, opts
    )
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model, RTOL, ATOL)
    _assert_on_cpu(model, opts[1], "after training")


def _check_bf16_same_as_without_offload(rank, world_size, policy_kwargs):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = build_transformer(seed=7)
    plain = shard_transformer(copy.deepcopy(base), fully_shard, mesh=cpu_mesh(), mp_policy=mp)
    offloaded = shard_transformer(
        copy.deepcopy(base), fully_shard, mesh=cpu_mesh(), mp_policy=mp, **policy_kwargs
    )
    plain_losses = train_alone(plain, _batches(world_size), transformer_loss, rank, world_size,
                               mean=False)
    opt = torch.optim.AdamW(offloaded.parameters(), lr=1e-2)
    losses = train_alone(offloaded, _batches(world_size), transformer_loss, rank, world_size, opt,
                         mean=False)
    assert losses == plain_losses, f"offload changed the losses: {losses} vs {plain_losses}"
    for (name, p), q in zip(offloaded.named_parameters(), plain.parameters()):
        assert p.dtype == torch.float32, (name, p.dtype)
        assert torch.equal(p.to_local(), q.to_local()), f"offload changed {name}"
    _assert_on_cpu(offloaded, opt, "bf16 after training")


def _check_meta_init(rank, world_size, policy_kwargs):
    ref = build_transformer(seed=9)
    with torch.device("meta"):
        model = build_transformer(seed=9)
    mesh = cpu_mesh()
    shard_transformer(model, fully_shard, mesh=mesh, **policy_kwargs)
    model.to_empty(device="cpu")
    model.load_state_dict(sharded_state_dict_from(ref, mesh))
    opts = make_opts(ref, model)
    ref_losses, losses = train_steps(
        ref, model, _batches(world_size), transformer_loss, rank, world_size, opts
    )
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model, RTOL, ATOL)
    _assert_on_cpu(model, opts[1], "meta init")


CHECKS = {
    "fp32_parity": _check_fp32_parity,
    "bf16_same": _check_bf16_same_as_without_offload,
    "meta_init": _check_meta_init,
}


VARIANTS = {"no_pin": NO_PIN}
if IMPL == "fsdp2":  # the default policy, pin_memory=True, on a CPU mesh
    VARIANTS["default"] = {"offload_policy": CPUOffloadPolicy()}
CASES = {
    f"{variant}/{name}": functools.partial(check, policy_kwargs=policy_kwargs)
    for variant, policy_kwargs in VARIANTS.items()
    for name, check in CHECKS.items()
}


WORLD_SIZES = pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")


@WORLD_SIZES
def test_offload_trains_like_reference_with_cpu_state(world_size, launch_cases):
    """Offloaded fp32 training matches the reference; params, grads and optimizer state are CPU tensors."""
    check_case(launch_cases(world_size, CASES), "no_pin/fp32_parity")


@WORLD_SIZES
def test_offload_with_bf16_changes_no_bits(world_size, launch_cases):
    """Offload under bf16 mixed precision gives bit-identical losses and params to no offload."""
    check_case(launch_cases(world_size, CASES), "no_pin/bf16_same")


@WORLD_SIZES
def test_offload_meta_init_to_empty_cpu(world_size, launch_cases):
    """Meta-device model, fully_shard with offload, to_empty(device='cpu') and a load trains with parity."""
    check_case(launch_cases(world_size, CASES), "no_pin/meta_init")


@fsdp2_only
@pytest.mark.parametrize("check", list(CHECKS))
@WORLD_SIZES
def test_default_pinned_offload_works_on_cpu_mesh(world_size, check, launch_cases):
    """CPUOffloadPolicy() (pin_memory=True) works on a CPU mesh (upstream fails to pin without an accelerator)."""
    check_case(launch_cases(world_size, CASES), f"default/{check}")


def _not_on_cpu_body(rank, world_size):
    from fsdp2.runtime.hooks.state import state_of

    model = build_transformer(seed=1)
    shard_transformer(model, fully_shard, mesh=cpu_mesh(), **NO_PIN)
    # No device but the CPU here: meta stands in for "not on the CPU".
    model.to_empty(device="meta")
    with pytest.raises(RuntimeError, match=r"(?s)materialized on CPU.*'output\.weight'.*meta") as info:
        state_of(model).param_group.check_offloaded()
    assert 'to_empty(device="cpu")' in str(info.value)


@fsdp2_only
def test_offload_rejects_params_not_on_cpu():
    """The offload check run at lazy init names every parameter not on the CPU and says how to fix it."""
    run_ranks(_not_on_cpu_body, 2)


def _cuda_params_body(rank, world_size):
    torch.cuda.set_device(0)
    with torch.device("meta"):
        model = build_transformer(seed=1)
    mesh = cpu_mesh()
    shard_transformer(model, fully_shard, mesh=mesh, **NO_PIN)
    model.to_empty(device="cuda")
    batch = rank_slice(transformer_batch(0, 2 * world_size), rank, world_size)
    with pytest.raises(RuntimeError, match="(?i)cpu"):
        transformer_loss(model, tuple(t.cuda() for t in batch))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_params_moved_to_cuda_raise_at_first_forward():
    """Offloaded params materialized on CUDA make the first forward raise a RuntimeError about the CPU."""
    run_ranks(_cuda_params_body, 1)
