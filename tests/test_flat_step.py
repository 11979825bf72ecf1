"""enable_local_shard_step's flat steps: elementwise optimizers on fsdp2's flat shard buffers.

Every update must be bit-identical to the same optimizer stepping on the
unsharded model given the same (gathered) gradients, and to the plain DTensor
step; optimizer state stays per-parameter DTensors with the same values. See
[Note: Flat optimizer steps] in fsdp2/optim/flat_run.py.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _impl import fully_shard
from _multiproc import DEFAULT_TIMEOUT_S, run_ranks
from checks import assert_same_params, check_case
from models import build_transformer, cpu_mesh, full_all, rank_slice, shard_transformer
from models import transformer_batch as batch_of
from models import transformer_loss as loss_of
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.api import CPUOffloadPolicy, MixedPrecisionPolicy
from fsdp2.optim import flat_run, step_plan

pytestmark = pytest.mark.skipif(
    os.environ.get("FSDP2_TEST_IMPL") == "torch", reason="fsdp2's own feature (flat buffers)"
)

ADAM_KW = dict(lr=1e-2, weight_decay=0.1)
OPTIMS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, **ADAM_KW),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, **ADAM_KW, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, **ADAM_KW, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
}


def _groups(model):
    """Two param groups: no weight decay on norms and biases (1-D parameters)."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _set_ref_grads(ref, model):
    for r, g in zip(ref.parameters(), full_all(p.grad for p in model.parameters())):
        r.grad = None if g is None else g.clone()


def _assert_same(ref, model, where, exact=True):
    names, params = zip(*model.named_parameters())
    fulls = full_all(p.detach() for p in params)
    for name, p, got, r in zip(names, params, fulls, ref.parameters()):
        assert isinstance(p, DTensor), (where, name)
        if exact:
            assert torch.equal(got, r.detach()), f"{where}: {name} differs"
        else:  # one rounding apart at most (see _train)
            torch.testing.assert_close(got, r.detach(), rtol=2e-7, atol=1e-8)


def _assert_same_state(got_opt, want_opt, where, exact=True):
    got, want = got_opt.state_dict(), want_opt.state_dict()
    assert got["param_groups"] == want["param_groups"], where
    assert got["state"].keys() == want["state"].keys(), where
    for idx, state in want["state"].items():
        assert list(got["state"][idx]) == list(state), (where, idx)
        for key, value in state.items():
            g = got["state"][idx][key]
            assert type(g) is type(value), (where, idx, key, type(g))
            if isinstance(value, DTensor):
                assert g.placements == value.placements, (where, idx, key)
                if exact:
                    assert torch.equal(g.to_local(), value.to_local()), (where, idx, key)
                else:
                    torch.testing.assert_close(g.to_local(), value.to_local(), rtol=2e-7, atol=1e-8)
            else:
                assert torch.equal(torch.as_tensor(g), torch.as_tensor(value)), (where, idx, key)


def _step_three_ways(rank, world_size, make, *, steps=3, shard_kw=None, mesh=None, accumulate=1,
           clip=False, zero_to_none=True, scheduler=False, add_group=False, drop_grad=False,
           default=False):
    """Flat-step model vs DTensor-step model vs unsharded reference on the same gradients.

    Not ``checks.train_steps``: three optimizers step in lockstep, the reference
    on the DTensor model's gradients (set, not computed), compared after each step.
    ``default``: the flat model's optimizer steps flat by default, without
    ``enable_local_shard_step``; the DTensor model's has the default switched off.
    Returns (flat model, its optimizer, its engine).
    """
    ref = build_transformer(seed=5)
    flat, slow = copy.deepcopy(ref), copy.deepcopy(ref)
    for m in (flat, slow):
        shard_transformer(m, fully_shard, mesh=mesh or cpu_mesh(), **(shard_kw or {}))

    def groups(m):
        g = _groups(m)
        return g[:1] if add_group else g

    opts = [make(groups(m)) for m in (ref, flat, slow)]
    fsdp2.disable_flat_step(opts[2])
    handle = None if default else fsdp2.enable_local_shard_step(opts[1])
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in opts] if scheduler else []
    for step in range(steps):
        if add_group and step == 1:
            for o, m in zip(opts, (ref, flat, slow)):
                o.add_param_group(_groups(m)[1])
        for micro in range(accumulate):
            batch = rank_slice(batch_of(step * accumulate + micro, 2 * world_size), rank, world_size)
            for m in (flat, slow):
                if accumulate > 1:
                    m.set_requires_gradient_sync(micro == accumulate - 1)
                loss_of(m, batch).backward()
        if drop_grad and step == 1:  # a run with a hole: per-parameter, then never one run again
            for m in (flat, slow):  # (its step counts differ from there on)
                m.layers[0].attention.wq.weight.grad = None
        if clip:
            for m in (flat, slow):
                fsdp2.clip_grad_norm_(m.parameters(), 0.05)
        _set_ref_grads(ref, slow)
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
        for o in opts:
            o.zero_grad(set_to_none=zero_to_none)
        # torch's fused CPU kernels round an element in a vector lane and in the scalar
        # tail differently, so a fused step depends on where a tensor starts and ends:
        # already the DTensor step of a shard differs from the unsharded step there.
        exact = not getattr(opts[0], "defaults", {}).get("fused")
        _assert_same(ref, slow, f"step {step}: DTensor step vs unsharded", exact)
        _assert_same(ref, flat, f"step {step}: flat step vs unsharded", exact)
    _assert_same_state(opts[1], opts[2], "state", exact)
    engine = fsdp2.optim.flat_step_engine(opts[1]) if default else handle.engine
    assert engine is not None and engine.runs()
    return flat, opts[1], engine


def _case(name, **kw):
    return lambda rank, world_size: _step_three_ways(rank, world_size, OPTIMS[name], **kw)


def _uses_flat_runs(rank, world_size):
    flat, opt, engine = _step_three_ways(rank, world_size, OPTIMS["adamw"], steps=2)
    runs = engine.runs()
    # one run per (block or root) group and param group; no parameter left out
    assert runs and sum(len(r.params) for r in runs) == len(list(flat.parameters()))
    # (the default engine's first step is torch's own: see [Note: The flat step by default])
    first = 1 if fsdp2.optim.flat_step_engine(opt) is not None else 0
    assert all(r.flat_steps == 2 - first for r in runs), [r.flat_steps for r in runs]
    if world_size > 1:  # the reduce-scatter output is the flat gradient: no copy
        assert all(r.grad_was_view for r in runs)


def _missing_grad(rank, world_size):
    """One parameter without a gradient: its run steps per parameter, every other run flat."""
    flat, _, engine = _step_three_ways(rank, world_size, OPTIMS["adamw"], drop_grad=True, steps=4)
    holed = flat.layers[0].attention.wq.weight
    for run in engine.runs():
        assert run.flat_steps == (1 if any(p is holed for p in run.params) else 4), run.flat_steps


def _in_pieces(name, **kw):
    """Runs handed to the optimizer in pieces of 64 elements (CPU's cache-sized pieces, scaled down)."""

    def case(rank, world_size):
        saved, flat_run.PIECE_NUMEL = flat_run.PIECE_NUMEL, 64
        try:
            _, _, engine = _step_three_ways(rank, world_size, OPTIMS[name], **kw)
        finally:
            flat_run.PIECE_NUMEL = saved
        runs = engine.runs()
        assert any(len(r.pieces) > 1 for r in runs), "the model must have runs of several pieces"
        assert all(r.flat_steps > 0 for r in runs)

    return case


def _large_pieces_foreach(rank, world_size):
    """foreach=True on pieces counted as large: the per-tensor loop (in cache), the same bits."""
    import torch.optim.adam as adam_module

    per_tensor = []
    real = adam_module._single_tensor_adam
    adam_module._single_tensor_adam = lambda *a, **k: (per_tensor.append(1), real(*a, **k))[1]
    saved, step_plan.CPP_LOOP_MEAN_NUMEL = step_plan.CPP_LOOP_MEAN_NUMEL, 1
    try:  # the reference and the DTensor step take the C++ loop the user asked for
        _, opt, _ = _step_three_ways(rank, world_size, OPTIMS["adamw-foreach"], steps=2)
    finally:
        step_plan.CPP_LOOP_MEAN_NUMEL = saved
        adam_module._single_tensor_adam = real
    assert len(per_tensor) == 2 * len(opt.param_groups), len(per_tensor)
    assert all(g["foreach"] is True for g in opt.param_groups)  # the user's, back


def _dcp_round_trip(rank, world_size, path):
    """Saved at W=4 after flat steps; loaded at this world size, stepping on bit-identically."""
    model, slow = build_transformer(seed=5), build_transformer(seed=5)
    for m in (model, slow):
        shard_transformer(m, fully_shard, mesh=cpu_mesh())
    opt = OPTIMS["adamw"](_groups(model))
    fsdp2.enable_local_shard_step(opt)
    slow_opt = OPTIMS["adamw"](_groups(slow))
    fsdp2.disable_flat_step(slow_opt)
    for m, o in ((model, opt), (slow, slow_opt)):
        msd, osd = get_state_dict(m, o)  # initializes the state (a step with lr 0)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _assert_same_state(opt, slow_opt, "loaded")
    assert opt.state and all(int(s["step"]) == 2 for s in opt.state.values())
    for step in range(2):
        batch = rank_slice(batch_of(10 + step, 2 * world_size), rank, world_size)
        for m, o in ((model, opt), (slow, slow_opt)):
            loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
        assert_same_params(model, slow, f"step {step}")
    _assert_same_state(opt, slow_opt, "after load and steps")


def _dcp_save(rank, world_size, path):
    flat, opt, _ = _step_three_ways(rank, world_size, OPTIMS["adamw"], steps=2)
    msd, osd = get_state_dict(flat, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


CASES = {f"{name}": _case(name) for name in OPTIMS}
CASES.update(
    {
        "accumulate": _case("adamw", accumulate=2),
        "clip": _case("adamw", clip=True),
        "zero-grad-keep": _case("adamw-foreach", zero_to_none=False),
        "scheduler": _case("sgd", scheduler=True),
        "missing-grad": _missing_grad,
        "add-param-group": _case("adamw", add_group=True),
        "mixed-precision": _case(
            "adamw", shard_kw={"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
        ),
        "offload": _case("adamw", shard_kw={"offload_policy": CPUOffloadPolicy(pin_memory=False)}),
        "offload-fused": _case("adamw-fused", shard_kw={"offload_policy": CPUOffloadPolicy(pin_memory=False)}),
        "uses-flat-runs": _uses_flat_runs,
        "pieces-adamw": _in_pieces("adamw"),
        "pieces-adam-amsgrad": _in_pieces("adam"),
        "pieces-sgd-foreach": _in_pieces("sgd-foreach", zero_to_none=False),
        "pieces-missing-grad": _in_pieces("adamw", drop_grad=True, steps=4),
        "large-pieces-foreach": _large_pieces_foreach,
        # the same, stepped flat by default (no enable_local_shard_step)
        "default-sgd": _case("sgd", default=True, scheduler=True),
        "default-adamw-foreach": _case("adamw-foreach", default=True, zero_to_none=False, clip=True),
        "default-add-param-group": _case("adam", default=True, add_group=True),
        "default-missing-grad": _case("adamw", default=True, drop_grad=True, steps=4),
        "default-accumulate": _case("rmsprop", default=True, accumulate=2),
    }
)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_flat_step_bit_identical(world_size, case, launch_cases):
    """The flat step equals the unsharded and the DTensor step bitwise; state unchanged."""
    # every case in one launch per world size; W = 3 shards unevenly, W = 4 has empty shards
    check_case(launch_cases(world_size, CASES, timeout=max(DEFAULT_TIMEOUT_S, 600)), case)


def _hsdp(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _step_three_ways(rank, world_size, OPTIMS["adamw"], mesh=mesh)


def test_flat_step_hsdp():
    """HSDP 2x2: bit-identical as well."""
    run_ranks(_hsdp, 4)


def test_flat_step_dcp_save_w4_load_w2_w3():
    """Optimizer state saved at W=4 after flat steps loads at W=2 and W=3 and steps on identically."""
    with tempfile.TemporaryDirectory() as path:
        run_ranks(_dcp_save, 4, path)
        for world_size in (2, 3):
            run_ranks(_dcp_round_trip, world_size, path)


def _upstream(rank, world_size):
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    ref = build_transformer(seed=5)
    model = copy.deepcopy(ref)
    shard_transformer(model, upstream_fully_shard, mesh=cpu_mesh())
    assert step_plan.plan_runs(list(model.parameters()))[0] == []  # no flat buffer to step on
    ref_opt, opt = OPTIMS["adamw"](_groups(ref)), OPTIMS["adamw"](_groups(model))
    fsdp2.enable_local_shard_step(opt)
    for step in range(2):
        loss_of(model, rank_slice(batch_of(step, 2 * world_size), rank, world_size)).backward()
        _set_ref_grads(ref, model)
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _assert_same(ref, model, "upstream")


def test_upstream_fully_shard_keeps_per_parameter_step():
    """Upstream's fully_shard has no flat buffer: the per-parameter local step, still exact."""
    run_ranks(_upstream, 2)


def test_non_elementwise_optimizer_logs_once(caplog):
    """An optimizer not known to be elementwise steps per parameter; a debug line says why."""

    class Custom(torch.optim.SGD):
        pass

    param = torch.nn.Parameter(torch.ones(2))
    with caplog.at_level(logging.DEBUG, logger="fsdp2.optim.local_shard_step"):
        fsdp2.enable_local_shard_step(Custom([param], lr=0.1))
    assert any("Custom is not one of the elementwise" in r.message for r in caplog.records)
    assert not step_plan.is_elementwise(Custom([param], lr=0.1))
    assert step_plan.is_elementwise(torch.optim.AdamW([param]))
