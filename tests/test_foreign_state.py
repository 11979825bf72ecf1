"""State the flat step did not write: loads, in-place edits, transports, closures. Upstream's bits.

The flat step steps its own buffers, so before every step it proves that
``optimizer.state`` still holds what it published (see [Note: State the run
did not write] in fsdp2/optim/flat_run.py). Each case does to fsdp2's
optimizer what users and stacks do between steps, does the same to an
optimizer over upstream's ``fully_shard``, and compares every parameter after
every step and the state dicts at the end, bit for bit.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from _impl import IMPL
from checks import assert_same_optimizer_state, assert_same_params, check_case
from models import build_transformer, cpu_mesh, rank_slice, shard_transformer
from models import transformer_batch as batch_of
from models import transformer_loss as loss_of
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.optim import flat_step_engine

pytestmark = pytest.mark.skipif(IMPL == "torch", reason="fsdp2's own default (not in upstream)")


def _models(seed: int = 5):
    """fsdp2's and upstream's sharding of one transformer (same values)."""
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    ref = build_transformer(seed=seed)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    shard_transformer(ours, fsdp2.fully_shard, mesh=cpu_mesh())
    shard_transformer(theirs, upstream_fully_shard, mesh=cpu_mesh())
    return ours, theirs


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(pairs, steps, rank, world_size) -> None:
    """Each (model, optimizer) of ``pairs`` trains ``steps``; fsdp2's equal upstream's after each."""
    for step in steps:
        batch = rank_slice(batch_of(step, 2 * world_size), rank, world_size)
        for model, opt in pairs:
            loss_of(model, batch).backward()
            opt.step()
            opt.zero_grad()
        assert_same_params(pairs[0][0], pairs[1][0], f"step {step}")


def _saved(obj):
    """``obj`` through ``torch.save`` / ``torch.load`` (what a transport hands the healed side)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _assert_rebuilt(opt) -> None:
    engine = flat_step_engine(opt)
    assert engine is not None and engine.runs(), "the flat step must stay on"


def _heal_before_and_between_first_steps(rank, world_size):
    """torchft's flow: a fresh optimizer gets a live one's state before and between its first steps."""
    live = [(m, _adamw(m)) for m in _models()]
    _train(live, range(3), rank, world_size)
    healed = [(m, _adamw(m)) for m in _models(seed=6)]  # restarted: other values, no state
    for (model, opt), (live_model, live_opt) in zip(healed, live):
        model.load_state_dict(_saved(live_model.state_dict()))
        opt.load_state_dict(_saved(live_opt.state_dict()))  # before its first step
    _train(healed, range(3, 5), rank, world_size)
    _train(live, range(3, 5), rank, world_size)
    for (model, opt), (live_model, live_opt) in zip(healed, live):  # healed again, between steps
        model.load_state_dict(_saved(live_model.state_dict()))
        opt.load_state_dict(_saved(live_opt.state_dict()))
    _train(live, range(5, 7), rank, world_size)
    _train(healed, range(5, 7), rank, world_size)
    assert_same_params(healed[0][0], live[0][0], "healed against live")
    assert_same_optimizer_state(healed[0][1], healed[1][1])
    assert_same_optimizer_state(healed[0][1], live[0][1])
    _assert_rebuilt(healed[0][1])


def _loaded_after_backward(rank, world_size):
    """torchft's order: backward, then the live state loaded (model and optimizer), then step."""
    live = [(m, _adamw(m)) for m in _models()]
    _train(live, range(3), rank, world_size)
    healed = [(m, _adamw(m)) for m in _models(seed=6)]  # restarted: other values, no state
    batch = rank_slice(batch_of(3, 2 * world_size), rank, world_size)
    saved = [(_saved(m.state_dict()), _saved(o.state_dict())) for m, o in live]
    for (model, opt), (live_model, _), (model_sd, optim_sd) in zip(healed, live, saved):
        loss_of(live_model, batch).backward()
        loss_of(model, batch).backward()
        with torch.no_grad():  # torchft sums the live group's gradients into the healing one's
            for p, q in zip(model.parameters(), live_model.parameters()):
                p.grad.to_local().copy_(q.grad.to_local())
        model.load_state_dict(model_sd)
        opt.load_state_dict(optim_sd)
    for (_, opt), (_, live_opt) in zip(healed, live):
        opt.step()
        opt.zero_grad()
        live_opt.step()
        live_opt.zero_grad()
    assert_same_params(healed[0][0], live[0][0], "step 3, healed against live")
    assert_same_params(healed[0][0], healed[1][0], "step 3")
    _train(healed, range(4, 6), rank, world_size)
    _train(live, range(4, 6), rank, world_size)
    assert_same_params(healed[0][0], live[0][0], "healed against live")
    assert_same_optimizer_state(healed[0][1], healed[1][1])
    _assert_rebuilt(healed[0][1])  # the flat step attaches once the parameters are adopted


def _received_in_place(rank, world_size):
    """A transport writes the live state into the healed optimizer's own tensors, then loads them."""
    live = [(m, _adamw(m)) for m in _models()]
    _train(live, range(3), rank, world_size)
    for with_load in (False, True):
        healed = [(m, _adamw(m)) for m in _models(seed=6)]
        _train(healed, range(1), rank, world_size)  # it has state: the flat step published views
        for (model, opt), (live_model, live_opt) in zip(healed, live):
            mine, theirs = opt.state_dict(), live_opt.state_dict()
            with torch.no_grad():  # as torchft's PGTransport receives: into each local tensor
                for p, q in zip(model.parameters(), live_model.parameters()):
                    p.to_local().copy_(q.to_local())
                for idx, state in mine["state"].items():
                    for key, value in state.items():
                        src = theirs["state"][idx][key]
                        local = value.to_local() if isinstance(value, DTensor) else value
                        local.copy_(src.to_local() if isinstance(src, DTensor) else src)
            if with_load:  # torchft's load_state_dict of what it received
                opt.load_state_dict(mine)
        steps = range(3 + 2 * with_load, 5 + 2 * with_load)
        _train(live, steps, rank, world_size)
        _train(healed, steps, rank, world_size)
        assert_same_params(healed[0][0], live[0][0], f"healed against live (load: {with_load})")
        assert_same_optimizer_state(healed[0][1], live[0][1])
    _assert_rebuilt(healed[0][1])


def _dcp_state_dict_fns_in_place(rank, world_size):
    """torchtitan's torchft state fns: DCP's get/set_optimizer_state_dict, received in place."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    live = [(m, _adamw(m)) for m in _models()]
    _train(live, range(3), rank, world_size)
    healed = [(m, _adamw(m)) for m in _models(seed=6)]  # fresh: no state, no gradients
    for (model, opt), (live_model, live_opt) in zip(healed, live):
        # the receiving side's own state dict: DCP initializes the state with a zero step
        target = get_optimizer_state_dict(model, opt)
        source = get_optimizer_state_dict(live_model, live_opt)
        with torch.no_grad():
            for p, q in zip(model.parameters(), live_model.parameters()):
                p.to_local().copy_(q.to_local())
            for key, state in target["state"].items():
                for name, value in state.items():
                    src = source["state"][key][name]
                    local = value.to_local() if isinstance(value, DTensor) else value
                    local.copy_(src.to_local() if isinstance(src, DTensor) else src)
        set_optimizer_state_dict(model, opt, target)
    _train(live, range(3, 5), rank, world_size)
    _train(healed, range(3, 5), rank, world_size)
    assert_same_params(healed[0][0], live[0][0], "healed against live")
    assert_same_optimizer_state(healed[0][1], live[0][1])
    _assert_rebuilt(healed[0][1])


def _edits_in_place_and_replaced(rank, world_size):
    """A user writes state in place (moments, step) and replaces values and whole entries."""
    pairs = [(m, _adamw(m)) for m in _models()]
    _train(pairs, range(2), rank, world_size)

    def edit(opt, how):
        params = [p for g in opt.param_groups for p in g["params"]]
        state = opt.state
        with torch.no_grad():
            if how == "in place":
                state[params[0]]["exp_avg"].mul_(0.5)  # through the DTensor
                state[params[1]]["exp_avg_sq"].to_local().add_(1.0)  # through its local tensor
                for p in params[2:5]:
                    state[p]["step"].add_(3)  # one run's step counts now differ: per parameter
            elif how == "replaced":
                state[params[0]]["exp_avg"] = torch.zeros_like(state[params[0]]["exp_avg"])
                state[params[3]] = {k: v.clone() for k, v in state[params[3]].items()}
            else:  # the whole dict, as torch's load_state_dict does
                opt.state = type(state)(dict, {k: dict(v) for k, v in state.items()})

    for how in ("in place", "replaced", "new dict"):
        for _, opt in pairs:
            edit(opt, how)
        _train(pairs, range(2, 4), rank, world_size)
        assert_same_optimizer_state(pairs[0][1], pairs[1][1])
    _assert_rebuilt(pairs[0][1])


def _closure_between_flat_steps(rank, world_size):
    """A step the optimizer takes itself (a closure) between flat ones: the runs rebuild after."""
    pairs = [(m, _adamw(m)) for m in _models()]
    _train(pairs, range(2), rank, world_size)
    batch = rank_slice(batch_of(2, 2 * world_size), rank, world_size)
    for model, opt in pairs:
        opt.step(lambda model=model: loss_of(model, batch).backward())
        opt.zero_grad()
    assert_same_params(pairs[0][0], pairs[1][0], "the closure's step")
    runs = flat_step_engine(pairs[0][1]).runs()
    before = [r.flat_steps for r in runs]
    _train(pairs, range(3, 5), rank, world_size)
    assert [r.flat_steps for r in runs] == [b + 2 for b in before]
    assert_same_optimizer_state(pairs[0][1], pairs[1][1])


def _refused_step_gives_the_parameters_back(rank, world_size):
    """A step that raises (capturable on CPU) leaves DTensor parameters, as upstream's does."""
    pairs = [(m, torch.optim.Adam(m.parameters(), lr=1e-2)) for m in _models()]
    _train(pairs, range(1), rank, world_size)
    errors = []
    for model, opt in pairs:
        loss_of(model, rank_slice(batch_of(1, 2 * world_size), rank, world_size)).backward()
        for g in opt.param_groups:
            g["capturable"] = True  # refused on CPU by torch's own step
        try:
            opt.step()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        for g in opt.param_groups:
            g["capturable"] = False
        assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
        opt.zero_grad()
    assert len(errors) == 2 and errors[0] == errors[1], errors
    _train(pairs, range(2, 4), rank, world_size)
    assert_same_optimizer_state(pairs[0][1], pairs[1][1])


CASES = {
    "heal-before-and-between-first-steps": _heal_before_and_between_first_steps,
    "loaded-after-backward": _loaded_after_backward,
    "received-in-place": _received_in_place,
    "dcp-state-dict-fns-in-place": _dcp_state_dict_fns_in_place,
    "edits-in-place-and-replaced": _edits_in_place_and_replaced,
    "closure-between-flat-steps": _closure_between_flat_steps,
    "refused-step": _refused_step_gives_the_parameters_back,
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_state_it_did_not_write(world_size, case, launch_cases):
    """Loads, in-place edits, transports and the optimizer's own steps between flat steps: upstream's bits."""
    check_case(launch_cases(world_size, CASES, timeout=600), case)
