"""HSDP with the optimizer state sharded across replicas (``shard_across_replicas=True``).

Each case trains two copies of one model on a 2x2 (replicate, shard) mesh:
plain HSDP with the flat step, and the option. Parameters must be
bit-identical at R = 2 (clipping: within one rounding, the norm sums in
another order), the state held per rank 1/R of plain HSDP's, the collectives
one reduce-scatter over replicate in place of each all-reduce and one
all-gather per group after the step. See [Note: Replica slices] in
fsdp2/runtime/replica_slices.py.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _impl import fully_shard
from checks import check_case, record_collectives
from models import build_transformer, full, rank_slice, shard_transformer
from models import transformer_batch as batch_of
from models import transformer_loss as loss_of
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2

OPTIMS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}
STEPS = 3


def _mesh(replicate: int = 2, shard: int = 2):
    return init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))


def _pair(seed: int, mesh, make, **opt_kw):
    """(plain model, its optimizer, its handle), the same for the option."""
    base = build_transformer(seed=seed)
    out = []
    for sharded in (False, True):
        model = shard_transformer(copy.deepcopy(base), fully_shard, mesh=mesh)
        optim = make(model.parameters())
        handle = fsdp2.enable_local_shard_step(optim, shard_across_replicas=sharded, **opt_kw)
        out.append((model, optim, handle))
    return out


def _train(model, optim, rank, world_size, steps, *, micro=1, clip=None, first=0):
    for step in range(first, first + steps):
        batch = batch_of(step, 2 * world_size * micro)
        for m in range(micro):
            part = tuple(t.chunk(micro)[m] for t in batch)
            model.set_requires_gradient_sync(m == micro - 1)
            loss_of(model, rank_slice(part, rank, world_size)).backward()
        if clip is not None:
            fsdp2.clip_grad_norm_(model.parameters(), clip)
        optim.step()
        optim.zero_grad()


def _fulls(model, handle):
    handle.wait_for_parameters()
    return {n: full(p.detach()) for n, p in model.named_parameters()}


def _assert_equal(a: dict, b: dict, exact: bool = True):
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max())
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def _state_numel(optim) -> int:
    """Elements of parameter-shaped state this rank holds (slices included)."""
    total = 0
    for values in optim.state.values():
        for v in values.values():
            if torch.is_tensor(v) and v.dim():
                total += (v.to_local() if isinstance(v, DTensor) else v).numel()
    handle_runs = getattr(optim, "_test_replicas", None)
    if handle_runs is not None:
        for r in handle_runs.runs.values():
            total += sum(v.numel() for v in r.state.values() if torch.is_tensor(v) and v.dim())
    return total


def _parity(name):
    def case(rank, world_size):
        mesh = _mesh()
        (plain, p_opt, p_h), (model, opt, h) = _pair(11, mesh, OPTIMS[name])
        _train(plain, p_opt, rank, world_size, STEPS)
        _train(model, opt, rank, world_size, STEPS)
        _assert_equal(_fulls(plain, p_h), _fulls(model, h))
        # the state per rank: about 1/R of plain HSDP's (slices of ceil(N / R))
        opt._test_replicas = h.engine.replicas
        mine, theirs = _state_numel(opt), _state_numel(p_opt)
        assert mine <= theirs // 2 + 64 * len(list(model.modules())), (mine, theirs)
        assert mine < theirs, (mine, theirs)
    return case


def _clip_and_accumulate(rank, world_size):
    mesh = _mesh()
    (plain, p_opt, p_h), (model, opt, h) = _pair(12, mesh, OPTIMS["adamw"])
    _train(plain, p_opt, rank, world_size, STEPS, micro=2, clip=0.05)
    _train(model, opt, rank, world_size, STEPS, micro=2, clip=0.05)
    _assert_equal(_fulls(plain, p_h), _fulls(model, h), exact=False)
    # without clipping, accumulation is exact
    (plain, p_opt, p_h), (model, opt, h) = _pair(13, mesh, OPTIMS["adamw"])
    _train(plain, p_opt, rank, world_size, STEPS, micro=2)
    _train(model, opt, rank, world_size, STEPS, micro=2)
    _assert_equal(_fulls(plain, p_h), _fulls(model, h))


def _collectives(rank, world_size):
    mesh = _mesh()
    (_, _, _), (model, opt, h) = _pair(14, mesh, OPTIMS["adamw"])
    num_groups = len(model.layers) + 1
    batch = batch_of(0, 2 * world_size)
    with record_collectives() as calls:
        loss_of(model, rank_slice(batch, rank, world_size)).backward()
    reductions = [c for c in calls if c[0] != "all_gather"]
    # per group: the reduce-scatter over shard, then one over replicate (no all-reduce)
    assert reductions == [("reduce_scatter", 2)] * (2 * num_groups), calls
    with record_collectives() as calls:
        opt.step()
    assert calls == [("all_gather", 2)] * num_groups, calls  # the slices, over replicate
    opt.zero_grad()


def _state_dict_round_trip(rank, world_size):
    """The option's state dict has plain HSDP's layout; DCP saves and loads it both ways."""
    mesh = _mesh()
    (plain, p_opt, p_h), (model, opt, h) = _pair(15, mesh, OPTIMS["adamw"])
    _train(plain, p_opt, rank, world_size, 2)
    _train(model, opt, rank, world_size, 2)
    ps, po = get_state_dict(plain, p_opt)
    ms, mo = get_state_dict(model, opt)
    assert sorted(po["state"]) == sorted(mo["state"])
    for fqn, values in po["state"].items():
        for key, v in values.items():
            w = mo["state"][fqn][key]
            if isinstance(v, DTensor):
                assert isinstance(w, DTensor) and w.placements == v.placements, (fqn, key)
                assert torch.equal(v.to_local(), w.to_local()), (fqn, key)
            else:
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(w)), (fqn, key)
    # save with the option, load into plain HSDP (and the other way): training goes on alike
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    dcp.save({"model": ms, "optim": mo}, checkpoint_id=folder[0] + "/opt")
    dcp.save({"model": ps, "optim": po}, checkpoint_id=folder[0] + "/plain")
    (plain2, p_opt2, p_h2), (model2, opt2, h2) = _pair(16, mesh, OPTIMS["adamw"])
    for m, o, src in ((plain2, p_opt2, "opt"), (model2, opt2, "plain")):
        _train(m, o, rank, world_size, 1)  # state to load into
        s, os_ = get_state_dict(m, o)
        loaded = {"model": s, "optim": os_}
        dcp.load(loaded, checkpoint_id=f"{folder[0]}/{src}")
        set_state_dict(m, o, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for m, o in ((plain, p_opt), (model, opt), (plain2, p_opt2), (model2, opt2)):
        _train(m, o, rank, world_size, 2, first=2)
    expected = _fulls(plain, p_h)
    for m, handle in ((model, h), (plain2, p_h2), (model2, h2)):
        _assert_equal(expected, _fulls(m, handle))


def _refusals(rank, world_size):
    mesh = _mesh()
    model = shard_transformer(build_transformer(seed=17), fully_shard, mesh=mesh)
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "layers" in n]
    for make in (lambda: fsdp2.Muon(hidden, lr=0.02), lambda: torch.optim.LBFGS(hidden)):
        try:
            fsdp2.enable_local_shard_step(make(), shard_across_replicas=True)
        except ValueError as e:
            assert "elementwise" in str(e), e
        else:
            raise AssertionError("a non-elementwise optimizer was accepted")
    flat = shard_transformer(
        build_transformer(seed=17), fully_shard, mesh=init_device_mesh("cpu", (world_size,))
    )
    try:
        fsdp2.enable_local_shard_step(torch.optim.AdamW(flat.parameters()), shard_across_replicas=True)
    except ValueError as e:
        assert "2-D" in str(e), e
    else:
        raise AssertionError("a 1-D mesh was accepted")


CASES = {
    "parity_adamw": _parity("adamw"),
    "parity_sgd": _parity("sgd"),
    "clip_and_accumulate": _clip_and_accumulate,
    "collectives": _collectives,
    "state_dict": _state_dict_round_trip,
    "refusals": _refusals,
}


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_parity_with_plain_hsdp(optim, launch_cases):
    """2x2: bit-identical parameters to plain HSDP's flat step; state per rank halved."""
    check_case(launch_cases(4, CASES), f"parity_{optim}")


def test_clip_and_accumulation(launch_cases):
    """clip_grad_norm_ (norm over every rank once) within rounding; accumulation exact."""
    check_case(launch_cases(4, CASES), "clip_and_accumulate")


def test_collectives(launch_cases):
    """A reduce-scatter over replicate in place of each all-reduce; one all-gather per group."""
    check_case(launch_cases(4, CASES), "collectives")


def test_state_dict_and_dcp(launch_cases):
    """state_dict() in plain HSDP's layout; DCP checkpoints load across the option both ways."""
    check_case(launch_cases(4, CASES), "state_dict")


def test_refusals(launch_cases):
    """Muon, LBFGS and a 1-D mesh are refused with a clear error."""
    check_case(launch_cases(4, CASES), "refusals")
