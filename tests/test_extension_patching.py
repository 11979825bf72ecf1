"""All-gather extensions attached to the plain local shard, decided per parameter at lazy init.

As in upstream's own test, ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
are bound onto the plain local tensor object of chosen sharded weights (no
subclass): after ``fully_shard`` on a real model, and after ``to_empty()``
on a ``meta`` model (through ``FSDPModule.to_empty`` and through
``nn.Module.to_empty``, whose new tensors the group adopts at lazy init). The
hooks gather a weight as its bf16 high part plus its fp32 residual, so
training is exact: it must match a single-process reference, match upstream
to the bit, call the hooks exactly as upstream does (same count, same
arguments), and hand them only the 1-D shard mesh on a 2x2 HSDP mesh. A
subclass extension (``_HiLoWeight``) gets the same 1-D mesh on HSDP.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.fsdp as upstream
import torch.nn as nn
from _impl import IMPL, fsdp2_only, fully_shard
from checks import (
    assert_losses_match,
    check_case,
    full_params,
    record_collective_bytes,
    train_steps,
)
from models import assert_params_match, shard_groups
from test_extensions import _HiLoWeight, _plain
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

IMPLS = {"ours": fully_shard, "upstream": upstream.fully_shard}
CALLS: list = []


def _pre(self, mesh, outer_size, outer_stride, module, mp_policy):
    CALLS.append((mesh.ndim, mesh.size(), mesh.mesh_dim_names, tuple(outer_size),
                  type(module).__name__))
    hi = self.to(torch.bfloat16)
    return (hi, self - hi.float()), None


@torch.no_grad()
def _post(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    hi, lo = all_gather_outputs
    weight = (hi.float() + lo).to(param_dtype)
    if out is not None:
        out.data.copy_(weight)  # .data: no version bump of a tensor autograd saved
        return None
    return weight, (weight,)


def _patch(model) -> int:
    """Bind the hooks onto every 2-D weight's local tensor object; returns how many."""
    count = 0
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            local = p._local_tensor  # the object upstream's test patches too
            local.fsdp_pre_all_gather = _pre.__get__(local)
            local.fsdp_post_all_gather = _post.__get__(local)
            count += 1
    return count


def _build():
    torch.manual_seed(0)
    # dims 0 divide by 2 and 4: a pre hook's inputs must be padded otherwise
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 4))


def _shard_linears(model, shard, mesh):
    """``model[0]`` and ``model[2]`` each in a group, then the root (holds ``model[4]``)."""
    return shard_groups(model, shard, [model[0], model[2]], mesh=mesh)


def _materialize(model, ref, mesh, how):
    if how == "fsdp_to_empty":
        model.to_empty(device="cpu")
    else:  # module by module through nn.Module._apply: new tensors, adopted at lazy init
        nn.Module.to_empty(model, device="cpu")
    full = ref.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(full[name], mesh, p.placements))


def _batches(world_size):
    """Three (inputs, targets) batches; rank r's slice is its data-parallel index's (HSDP too)."""
    batches = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        batches.append((torch.randn(2 * world_size, 8, generator=g),
                        torch.randn(2 * world_size, 4, generator=g)))
    return batches


def _mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _train_recording_gathers(model, ref, rank, world_size):
    """SGD next to the reference; (losses, full params, per-step all-gather bytes)."""
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model))
    ref_losses, losses, calls = train_steps(ref, model, _batches(world_size), _mse, rank,
                                            world_size, opts, record=record_collective_bytes)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)
    sent = [[c for c in step if c[0] == "all_gather"] for step in calls]
    return losses, full_params(model), sent


def _mesh(world_size, hsdp):
    if hsdp:
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world_size,))


def _patched_case(how, hsdp):
    def case(rank, world_size):
        mesh = _mesh(world_size, hsdp)
        runs = {}
        for name, shard in IMPLS.items():
            ref = _build()
            if how == "after_fully_shard":
                model = _shard_linears(copy.deepcopy(ref), shard, mesh)
            else:
                with torch.device("meta"):
                    model = _shard_linears(_build(), shard, mesh)
                _materialize(model, ref, mesh, how)
            assert _patch(model) == 3
            CALLS.clear()
            runs[name] = (*_train_recording_gathers(model, ref, rank, world_size), list(CALLS))
        (losses, params, sent, calls), (up_losses, up_params, up_sent, up_calls) = runs.values()
        assert losses == up_losses, (losses, up_losses)
        assert all(torch.equal(params[n], up_params[n]) for n in params)
        assert calls and calls == up_calls, (calls, up_calls)
        shard_size = mesh.size(mesh.ndim - 1)
        names = ("shard",) if hsdp else None
        assert {c[:3] for c in calls} == {(1, shard_size, names)}, calls  # the 1-D shard mesh
        # what went on the wire: the hooks' bf16 + fp32 parts, as upstream sends them
        assert [sum(b for _, _, b in step) for step in sent] == [
            sum(b for _, _, b in step) for step in up_sent], (sent, up_sent)

    return case


def _subclass_hsdp(rank, world_size):
    """A subclass extension on HSDP: the hooks get the 1-D shard mesh; parity with upstream."""
    mesh = _mesh(world_size, hsdp=True)
    seen = []
    original = _HiLoWeight.fsdp_pre_all_gather

    def spy(self, mesh, outer_size, outer_stride, module, mp_policy):
        seen.append((mesh.ndim, mesh.mesh_dim_names))
        return original(self, mesh, outer_size, outer_stride, module, mp_policy)

    _HiLoWeight.fsdp_pre_all_gather = spy
    try:
        results = []
        for shard in IMPLS.values():
            torch.manual_seed(3)
            model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
            for layer in (model[0], model[2]):
                layer.weight = nn.Parameter(_HiLoWeight(layer.weight.detach()))
                shard(layer, mesh=mesh)
            shard(model, mesh=mesh)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
            model(x).pow(2).mean().backward()
            results.append([_plain(p.grad.full_tensor()) for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*results))
        assert seen and set(seen) == {(1, ("shard",))}, seen
    finally:
        _HiLoWeight.fsdp_pre_all_gather = original


def _replaced_after_lazy_init(rank, world_size):
    """fsdp2 only: hooks bound after the first forward wait; replaced locals drop their hooks."""
    mesh = _mesh(world_size, hsdp=False)
    ref = _build()
    model = _shard_linears(copy.deepcopy(ref), fully_shard, mesh)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    _patch(model)  # after lazy init: not picked up (upstream fails at the next all-gather)
    CALLS.clear()
    model(x).sum().backward()
    assert CALLS == []
    # hooks decided at lazy init, then every local tensor replaced by one without them
    model = _shard_linears(copy.deepcopy(ref), fully_shard, mesh)
    _patch(model)
    model(x).sum().backward()
    assert CALLS
    loaded = {k: v.detach() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(loaded, assign=True)
    CALLS.clear()
    model(x).sum().backward()
    assert CALLS == []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), q.detach() + 1), name
    model[0].unshard()
    assert torch.equal(model[0].weight, ref[0].weight.detach() + 1)
    model[0].reshard()
    # a subclass weight (its own shard, outside the flat buffer) replaced by a
    # plain one: the group lays its buffer out again, with the weight inside
    from fsdp2.runtime.hooks.state import state_of

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model[0].weight = nn.Parameter(_HiLoWeight(model[0].weight.detach()))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(x).sum().backward()
    group = state_of(model[0]).param_group
    assert [p.in_flat for p in group.fsdp_params] == [False, True]
    plain = {k: distribute_tensor(_plain(v.full_tensor()) * 2, mesh, v.placements)
             for k, v in model[0].state_dict().items()}
    model[0].load_state_dict(plain, assign=True)
    model(x).sum().backward()
    assert [p.in_flat for p in group.fsdp_params] == [True, True]
    assert group.fsdp_params[0].extension is None
    assert torch.equal(model[0].weight.full_tensor(), _plain(plain["weight"].full_tensor()))


HOWS = ("after_fully_shard", "fsdp_to_empty", "module_to_empty")
CASES_2 = {how: _patched_case(how, hsdp=False) for how in HOWS}
if IMPL == "fsdp2":  # upstream fails in this flow (see docs/differences.md)
    CASES_2["replaced_after_lazy_init"] = _replaced_after_lazy_init
CASES_4 = {
    **{how: _patched_case(how, hsdp=False) for how in HOWS},
    **{f"hsdp_{how}": _patched_case(how, hsdp=True) for how in HOWS},
    "subclass_hsdp": _subclass_hsdp,
}


CASES = {2: CASES_2, 4: CASES_4}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("how", HOWS)
def test_hooks_patched_on_local_shard(world_size, how, launch_cases):
    """Hooks bound onto plain local shards (after fully_shard / to_empty): upstream's calls and numerics."""
    check_case(launch_cases(world_size, CASES[world_size]), how)


@pytest.mark.parametrize("how", HOWS)
def test_patched_hooks_on_hsdp_get_the_shard_mesh(how, launch_cases):
    """2x2 HSDP: the patched hooks get the 1-D shard mesh; upstream's numerics and calls."""
    check_case(launch_cases(4, CASES_4), f"hsdp_{how}")


def test_subclass_extension_on_hsdp_gets_the_shard_mesh(launch_cases):
    """2x2 HSDP with a subclass extension: the 1-D shard mesh, gradients equal upstream's."""
    check_case(launch_cases(4, CASES_4), "subclass_hsdp")


@fsdp2_only
def test_hooks_bound_late_or_replaced(launch_cases):
    """Hooks bound after the first forward wait; parameters replaced without hooks gather plainly."""
    check_case(launch_cases(2, CASES_2), "replaced_after_lazy_init")
