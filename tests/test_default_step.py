"""The flat optimizer step by default: a stock training loop, no fsdp2 call but fully_shard.

An elementwise ``torch.optim`` optimizer over fsdp2-sharded parameters steps
on the flat buffers from its first ``step()``, with upstream's bits; anything
the flat path cannot take steps as torch does. See [Note: The flat step by
default] in fsdp2/optim/default_step.py.
"""

from __future__ import annotations

import copy
import io
import os
import weakref

import pytest
import torch
from _impl import IMPL
from _multiproc import run_ranks
from checks import assert_same_optimizer_state, assert_same_params, check_case
from models import build_transformer, cpu_mesh, full, rank_slice, shard_transformer
from models import transformer_batch as batch_of
from models import transformer_loss as loss_of
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.optim import default_step, flat_step_engine

pytestmark = pytest.mark.skipif(IMPL == "torch", reason="fsdp2's own default (not in upstream)")


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _sharded_pair(shard):
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    ref = build_transformer(seed=5)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    shard(ours, fsdp2.fully_shard)
    shard(theirs, upstream_fully_shard)
    return ours, theirs


def _loop(models, opts, rank, world_size, steps, *, first=0, closure_at=(), to_none=True, scheds=()):
    """The stock loop: forward, backward, step, (schedule), zero_grad; params equal after each step."""
    for step in range(first, first + steps):
        batch = rank_slice(batch_of(step, 2 * world_size), rank, world_size)
        for m, o in zip(models, opts):
            if step in closure_at:
                o.step(lambda m=m, batch=batch: loss_of(m, batch).backward())
            else:
                loss_of(m, batch).backward()
                o.step()
            o.zero_grad(set_to_none=to_none)
        for s in scheds:
            s.step()
        assert_same_params(models[0], models[1], f"step {step}")


def _stock_loop_matches_upstream(rank, world_size):
    import torch.optim.adam as adam_module

    ours, theirs = _sharded_pair(lambda m, fs: shard_transformer(m, fs, mesh=cpu_mesh()))
    opts = [torch.optim.AdamW(_groups(m), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7) for o in opts]
    # small CPU pieces take the C++ loop (foreach) with the per-tensor loop's bits:
    # see [Note: The C++ loop on CPU]; upstream's DTensor step keeps the per-tensor loop
    cpp_loops = []
    real = adam_module._multi_tensor_adam
    adam_module._multi_tensor_adam = lambda *a, **k: (cpp_loops.append(1), real(*a, **k))[1]
    try:
        _loop((ours, theirs), opts, rank, world_size, 3, scheds=scheds)
    finally:
        adam_module._multi_tensor_adam = real
    # the first step is torch's own (See [Note: The flat step by default]): two flat ones
    assert len(cpp_loops) == 2 * len(opts[0].param_groups), len(cpp_loops)
    assert all(g["foreach"] is None for o in opts for g in o.param_groups)  # the user's, back
    engine = flat_step_engine(opts[0])
    assert engine is not None, "the default engine must attach at the first step"
    runs = engine.runs()
    assert runs and sum(len(r.params) for r in runs) == len(list(ours.parameters()))
    assert all(r.flat_steps == 2 for r in runs), [r.flat_steps for r in runs]
    assert flat_step_engine(opts[1]) is None  # upstream's parameters: torch's own step
    assert_same_optimizer_state(opts[0], opts[1])


def _state_and_edits(rank, world_size):
    """Hooks, closures, hyperparameter edits, add_param_group, switches, load_state_dict, torch.save."""
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    ref = build_transformer(seed=5)
    flat, slow = copy.deepcopy(ref), copy.deepcopy(ref)
    for m in (flat, slow):
        shard_transformer(m, fsdp2.fully_shard, mesh=cpu_mesh())
    groups = [_groups(m) for m in (flat, slow)]
    opts = [torch.optim.Adam(g[:1], lr=1e-2, foreach=True) for g in groups]
    fsdp2.disable_flat_step(opts[1])
    seen = []

    def check_params(opt, *args):
        seen.append(all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"]))

    opts[0].register_step_pre_hook(check_params)
    opts[0].register_step_post_hook(check_params)
    _loop((flat, slow), opts, rank, world_size, 1)
    assert flat_step_engine(opts[0]) is not None and flat_step_engine(opts[1]) is None
    opts[0].register_step_pre_hook(check_params)  # registered after the engine's
    opts[0].register_step_post_hook(check_params)
    for o, g in zip(opts, groups):
        o.add_param_group(g[1])
        o.param_groups[0]["lr"] = 3e-3
    _loop((flat, slow), opts, rank, world_size, 3, first=1, closure_at=(2,), to_none=False)
    assert_same_optimizer_state(opts[0], opts[1])
    # load_state_dict of a torch.save round trip, then more steps
    buffer = io.BytesIO()
    torch.save(opts[1].state_dict(), buffer)
    buffer.seek(0)
    opts[0].load_state_dict(torch.load(buffer, weights_only=False))
    fsdp2.set_flat_step_default(False)
    try:
        before = [r.flat_steps for r in flat_step_engine(opts[0]).runs()]
        _loop((flat, slow), opts, rank, world_size, 1, first=4)
        assert [r.flat_steps for r in flat_step_engine(opts[0]).runs()] == before
    finally:
        fsdp2.set_flat_step_default(True)
    _loop((flat, slow), opts, rank, world_size, 2, first=5)
    assert all(r.flat_steps > 0 for r in flat_step_engine(opts[0]).runs())
    assert_same_optimizer_state(opts[0], opts[1])
    assert seen and all(seen), seen
    # torch.save of the optimizer object itself: the hooks and the engine stay behind
    assert "_fsdp2_flat_step" not in opts[0].__getstate__()
    # neither upstream's parameters nor a subclass take the default
    theirs = copy.deepcopy(ref)
    shard_transformer(theirs, upstream_fully_shard, mesh=cpu_mesh())

    class MyAdamW(torch.optim.AdamW):
        pass

    others = [torch.optim.AdamW(theirs.parameters()), MyAdamW(slow.parameters())]
    for o, m in zip(others, (theirs, slow)):
        loss_of(m, rank_slice(batch_of(0, 2 * world_size), rank, world_size)).backward()
        o.step()
        o.zero_grad()
        assert flat_step_engine(o) is None


def _zero_grad_flat(rank, world_size):
    """zero_grad clears each run's flat gradient at once: one fill, or every view dropped."""
    model = shard_transformer(build_transformer(seed=5), fsdp2.fully_shard, mesh=cpu_mesh())
    opt = torch.optim.AdamW(_groups(model), foreach=True)
    for set_to_none in (False, True):
        loss_of(model, rank_slice(batch_of(0, 2 * world_size), rank, world_size)).backward()
        opt.step()
        engine = flat_step_engine(opt)
        views = list(engine.memory.grad_views)
        grads = [p.grad for p in model.parameters()]
        if world_size > 1:  # the reduce-scatter output is each run's flat gradient
            assert len(views) == len(engine.runs()), (len(views), len(engine.runs()))
        flats = [weakref.ref(flat) for *_, flat in views]
        del views
        opt.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            assert all(p.grad is None for p in model.parameters())
            assert all(ref() is None for ref in flats), "a flat gradient outlived zero_grad"
        else:
            assert all(p.grad is g for p, g in zip(model.parameters(), grads))
            assert all(not full(g).any() and not g.requires_grad for g in grads)
        del grads


def _held_state_stays_live(rank, world_size):
    """What a caller holds after a load (state dict, DCP dict, a tensor, a slice) moves with every step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    for ragged in (False, True):
        kw = {"shard_placement_fn": lambda p: fsdp2.RaggedShard()} if ragged else {}
        ours, theirs = _sharded_pair(lambda m, fs, kw=kw: shard_transformer(
            m, fs, mesh=cpu_mesh(), **(kw if fs is fsdp2.fully_shard else {})))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
        _loop((ours, theirs), opts, rank, world_size, 1)
        for o in opts:
            o.load_state_dict(o.state_dict())
        held = [o.state_dict() for o in opts]
        dcp_held = [get_optimizer_state_dict(m, o) for m, o in zip((ours, theirs), opts)]
        tensors = [o.state[next(iter(m.parameters()))]["exp_avg"] for m, o in zip((ours, theirs), opts)]
        # a state the user put there: one tensor a slice of a larger one (stepped in place)
        big = [torch.zeros(2 * full(t).numel()) for t in tensors]
        for o, m, b in zip(opts, (ours, theirs), big):
            p = list(m.parameters())[1]
            local = o.state[p]["exp_avg_sq"].to_local()
            b[: local.numel()].copy_(local.reshape(-1))
            o.state[p]["exp_avg_sq"] = DTensor.from_local(
                b[: local.numel()].view(local.shape), p.device_mesh, p.placements,
                shape=p.shape, stride=p.stride())
        _loop((ours, theirs), opts, rank, world_size, 3, first=1)
        assert flat_step_engine(opts[0]) is not None
        for i, (a, b) in enumerate(zip(*(h["state"] for h in held))):
            for key in held[1]["state"][b]:
                assert torch.equal(full(held[0]["state"][a][key]), full(held[1]["state"][b][key])), (
                    ragged, i, key)
        assert_same_optimizer_state(opts[0], opts[1], layouts_differ=ragged)
        for key in dcp_held[1]["state"]:
            for k, v in dcp_held[1]["state"][key].items():
                assert torch.equal(full(dcp_held[0]["state"][key][k]), full(v)), (ragged, key, k)
        assert torch.equal(full(tensors[0]), full(tensors[1]))
        assert not torch.equal(big[1], torch.zeros_like(big[1]))  # upstream stepped the slice
        assert torch.equal(big[0], big[1]) or ragged  # (ragged: another local layout)


def _nesterov_leaves_grads(rank, world_size):
    """SGD with nesterov momentum: p.grad after step() is what backward wrote, as upstream's."""
    ours, theirs = _sharded_pair(lambda m, fs: shard_transformer(m, fs, mesh=cpu_mesh()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)
            for m in (ours, theirs)]
    for step in range(3):
        batch = rank_slice(batch_of(step, 2 * world_size), rank, world_size)
        for m, o in zip((ours, theirs), opts):
            loss_of(m, batch).backward()  # accumulated: no zero_grad
            o.step()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"step {step}: grads differ"
            assert torch.equal(p.to_local(), q.to_local()), f"step {step}: parameters differ"
    assert flat_step_engine(opts[0]) is not None


CASES = {  # no switch: the default as installed
    "stock-loop-matches-upstream": _stock_loop_matches_upstream,
    "state-and-edits": _state_and_edits,
    "zero-grad-flat": _zero_grad_flat,
    "held-state-stays-live": _held_state_stays_live,
    "nesterov-leaves-grads": _nesterov_leaves_grads,
}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_default_flat_step(world_size, case, launch_cases):
    """A stock loop steps flat from its first step, with upstream's bits and the same state."""
    check_case(launch_cases(world_size, CASES), case)


def _env_switch(rank, world_size, value):
    # the variable is read when an optimizer first steps, so setting it here is what a
    # launcher's environment is by then
    os.environ.pop(default_step.ENV_VAR, None)
    if value is not None:
        os.environ[default_step.ENV_VAR] = value
    model = shard_transformer(build_transformer(seed=5), fsdp2.fully_shard, mesh=cpu_mesh())
    optim = torch.optim.AdamW(model.parameters())
    loss_of(model, batch_of(0, 2)).backward()
    optim.step()
    return flat_step_engine(optim) is not None


@pytest.mark.parametrize("value", ["0", "off", "1", None])
def test_env_var_switches_it(value):
    """Unset or FSDP2_FLAT_STEP=1: the engine attaches at the first step; =0 / off: none."""
    assert run_ranks(_env_switch, 1, value) == [value in ("1", None)]


def test_cpp_loop_only_where_the_bits_are_the_same():
    """foreach for small plain CPU tensors, the per-tensor loop for large ones; listed optimizers only."""
    from fsdp2.optim.step_plan import CPP_LOOP_MEAN_NUMEL, cpu_loop_choice

    small = [torch.zeros(10, requires_grad=True) for _ in range(3)]
    big = [torch.zeros(CPP_LOOP_MEAN_NUMEL, requires_grad=True)]

    def choice(opt, tensors=small):
        return cpu_loop_choice(opt, opt.param_groups[0], tensors)

    assert choice(torch.optim.AdamW(small)) is True and choice(torch.optim.SGD(small, lr=0.1)) is True
    assert choice(torch.optim.AdamW(big), big) is None  # left to torch: its per-tensor loop on CPU
    assert choice(torch.optim.AdamW(big, foreach=True), big) is False  # kept in cache, same bits
    assert choice(torch.optim.AdamW(small, foreach=True)) is None  # already the C++ loop
    assert choice(torch.optim.AdamW(small, foreach=False)) is None  # the user's (memory) choice
    assert choice(torch.optim.AdamW(small, lr=torch.tensor(1e-3))) is None  # another code path
    assert choice(torch.optim.NAdam(small)) is None and choice(torch.optim.RAdam(small)) is None
    assert choice(torch.optim.AdamW(small), [t.to("meta") for t in small]) is None  # not on CPU
