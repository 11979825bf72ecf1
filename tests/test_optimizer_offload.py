"""OptimizerOffloadPolicy: optimizer state in host buffers or NVMe files, the same bits.

Every tier (``host``, ``nvme``, and ``host`` with the accelerator path's host
copies forced on CPU) must step exactly like the in-memory local-shard step
(bit for bit, parameters and ``optimizer.state_dict()``) at W = 1, 2, 4, with
two parameter groups, gradient accumulation, ``clip_grad_norm_``,
``zero_grad`` both ways and an LR scheduler; a DCP checkpoint saved at W=4
loads at W=2 into an NVMe-tier optimizer and continues bit-identically; and
every bad directory (unwritable, full, claimed by a live job, holding another
model's files) raises the same ``StoreError`` on every rank, before any step.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from _impl import fully_shard
from _multiproc import run_ranks
from checks import train_alone
from models import (
    build_transformer,
    cpu_mesh,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2 import OptimizerOffloadPolicy
from fsdp2.optim import unit_step
from fsdp2.optim.state_store import StoreError

pytestmark = pytest.mark.skipif(
    os.environ.get("FSDP2_TEST_IMPL") == "torch", reason="fsdp2's own feature"
)


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2, foreach=True)
    if kind == "adam-fused":
        return torch.optim.Adam(groups, lr=1e-2, fused=True, amsgrad=True)
    return torch.optim.SGD(groups, lr=1e-1, momentum=0.9)


def _train_accumulating(model, opt, rank, world_size, steps, first=0):
    """Accumulation without sync, clipping, a scheduler, ``zero_grad`` both ways."""
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    batches = [transformer_batch(step, 4 * world_size) for step in range(first, first + steps)]
    train_alone(model, batches, transformer_loss, rank, world_size, opt, mean=False,
                micro_batches=2, after_backward=lambda: fsdp2.clip_grad_norm_(model.parameters(), 0.5),
                after_step=sched.step, set_to_none=lambda i: (first + i) % 2 == 0)


def _assert_same(model, opt, ref_model, ref_opt, where):
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), f"{where}: parameter {n} differs"
    got, want = opt.state_dict(), ref_opt.state_dict()
    assert got["param_groups"] == want["param_groups"], where
    assert got["state"].keys() == want["state"].keys(), where
    for idx, state in want["state"].items():
        assert got["state"][idx].keys() == state.keys(), (where, idx)
        for key, value in state.items():
            mine = got["state"][idx][key]
            assert type(mine) is type(value), (where, idx, key)
            if isinstance(value, DTensor):
                assert mine.placements == value.placements, (where, idx, key)
                mine, value = mine.to_local(), value.to_local()
            assert torch.equal(mine, value), f"{where}: state {idx}/{key} differs"


@contextlib.contextmanager
def _params_seen_on_accelerator(seen: bool):
    """The offloaded step decides on host copies as if the parameters were (not) on a GPU."""
    decide = unit_step.params_on_accelerator
    unit_step.params_on_accelerator = lambda optimizer: seen
    try:
        yield
    finally:
        unit_step.params_on_accelerator = decide


def _tiers_body(rank, world_size, tmp):
    tiers = [("host", False), ("nvme", False), ("host", True)]
    for kind in ("adamw", "adam-fused", "sgd"):
        ref = build_transformer(seed=5)
        shard_transformer(ref, fully_shard, mesh=cpu_mesh())
        ref_opt = _optimizer(ref, kind)
        fsdp2.enable_local_shard_step(ref_opt)
        _train_accumulating(ref, ref_opt, rank, world_size, 4)
        for tier, copies in tiers:
            model = build_transformer(seed=5)
            shard_transformer(model, fully_shard, mesh=cpu_mesh())
            opt = _optimizer(model, kind)
            policy = OptimizerOffloadPolicy(
                tier=tier, directory=os.path.join(tmp, f"{kind}-{tier}"), unit_bytes=512
            )
            with _params_seen_on_accelerator(copies):  # the host copies, forced on CPU
                handle = fsdp2.enable_local_shard_step(opt, offload=policy)
            stepper = handle.engine
            if tier == "host" and not copies:  # CPU ranks: host memory already, state in place
                assert not stepper.tier.in_units and stepper.units == []
            else:
                assert len(stepper.units) > 2, "the model must span several units"
            _train_accumulating(model, opt, rank, world_size, 4)
            _assert_same(model, opt, ref, ref_opt, f"{kind}/{tier}/copies={copies}")
            if tier == "nvme":
                _assert_files_hold_state(stepper, opt)
            handle.remove()
            # after remove(): ordinary memory, still the same values, steps as before
            _assert_same(model, opt, ref, ref_opt, f"{kind}/{tier} after remove")


def _assert_files_hold_state(stepper, opt):
    """The state the optimizer reports is what the unit files hold (the disk is the state)."""
    store = stepper.tier
    for i, unit in enumerate(stepper.units):
        on_disk = {
            dt: torch.from_file(str(path), shared=False, size=unit.layout.numel[dt], dtype=dt)
            for dt, path in store._paths[i].items()
        }
        for slot in unit.layout.slots:
            p = unit.params[slot.param]
            value = opt.state[p][slot.key].to_local()
            stored = on_disk[slot.dtype].narrow(0, slot.offset, slot.numel).view(slot.shape)
            assert torch.equal(value, stored), (i, slot)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tiers_step_like_memory(world_size, tmp_path):
    run_ranks(_tiers_body, world_size, str(tmp_path))


def _local_values(state_dict) -> dict:
    """Each state tensor's local value, cloned, by (parameter index, key)."""
    return {
        (idx, k): (v.to_local() if isinstance(v, DTensor) else v).clone()
        for idx, state in state_dict["state"].items()
        for k, v in state.items() if isinstance(v, torch.Tensor)
    }


def _held_across_load_body(rank, world_size, tmp):
    """A state dict taken before a load of other values keeps what it showed (the load goes into
    fresh storage, as upstream's does); one loaded into itself (DCP's way) stays the live state."""
    ref = build_transformer(seed=5)
    shard_transformer(ref, fully_shard, mesh=cpu_mesh())
    ref_opt = _optimizer(ref, "adamw")
    fsdp2.enable_local_shard_step(ref_opt)
    for tier, copies in (("nvme", False), ("host", True)):
        model = build_transformer(seed=5)
        shard_transformer(model, fully_shard, mesh=cpu_mesh())
        opt = _optimizer(model, "adamw")
        policy = OptimizerOffloadPolicy(tier=tier, directory=os.path.join(tmp, tier), unit_bytes=512)
        with _params_seen_on_accelerator(copies):
            handle = fsdp2.enable_local_shard_step(opt, offload=policy)
        assert handle.engine.tier.in_units, tier
        first = tier == "nvme"  # the reference trains alongside the first tier only
        for m, o in ((model, opt), (ref, ref_opt)) if first else ((model, opt),):
            _train_accumulating(m, o, rank, world_size, 2)
        held = opt.state_dict()
        shown = _local_values(held)
        if first:
            ref_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # other tensors, the same values
        for m, o in ((model, opt), (ref, ref_opt)) if first else ((model, opt),):
            _train_accumulating(m, o, rank, world_size, 2, first=2)
        if first:
            _assert_same(model, opt, ref, ref_opt, f"{tier}: after a load")
        now = _local_values(opt.state_dict())
        assert any(not torch.equal(now[k], v) for k, v in shown.items()), "the state did not move"
        assert all(torch.equal(_local_values(held)[k], v) for k, v in shown.items()), (
            f"{tier}: a state dict taken before the load followed the steps after it"
        )
        live = opt.state_dict()
        opt.load_state_dict(live)  # its own tensors: nothing renewed, they stay live
        _train_accumulating(model, opt, rank, world_size, 1, first=4)
        after = _local_values(opt.state_dict())
        assert all(torch.equal(_local_values(live)[k], v) for k, v in after.items()), tier
        if tier == "nvme":
            _assert_files_hold_state(handle.engine, opt)
            files = sorted(p.name for p in handle.engine.tier.folder.glob("unit*.bin"))
            assert len(files) == sum(len(u.layout.numel) for u in handle.engine.units), files
        handle.remove()


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_held_across_a_load(world_size, tmp_path):
    run_ranks(_held_across_load_body, world_size, str(tmp_path))


def _replaced_and_flags_body(rank, world_size, tmp):
    """As torch: a state tensor a caller replaces (``state[p][k] = t``) is stepped from then on
    and the replaced one, still held, keeps its values; amsgrad turned on mid-training raises
    torch's ``KeyError`` and leaves the state steppable once it is off again; a group planned
    with amsgrad on and turned off before its first step steps without it. Against the
    in-memory step, which is torch's."""
    def pair(tier, copies, amsgrad=False):
        sides = []
        for offload in (None, tier):
            model = build_transformer(seed=5)
            shard_transformer(model, fully_shard, mesh=cpu_mesh())
            opt = _optimizer(model, "adamw")
            for g in opt.param_groups:
                g["amsgrad"] = amsgrad
            policy = offload and OptimizerOffloadPolicy(
                tier=offload, directory=os.path.join(tmp, f"{offload}{copies}{amsgrad}"),
                unit_bytes=512)
            with _params_seen_on_accelerator(copies):
                handle = fsdp2.enable_local_shard_step(opt, offload=policy)
            assert handle.engine.tier.in_units == (offload is not None)
            sides.append((model, opt, handle))
        return sides

    for tier, copies in (("nvme", False), ("host", True)):
        (ref, ref_opt, _), (model, opt, handle) = pair(tier, copies)
        for m, o in ((model, opt), (ref, ref_opt)):
            _train_accumulating(m, o, rank, world_size, 2)
        held = [o.state_dict()["state"] for o in (opt, ref_opt)]  # a state dict a caller holds
        for o in (opt, ref_opt):
            o.load_state_dict(o.state_dict())  # its own tensors: they stay the state (torchft's)
        replaced_at = len(opt.param_groups[0]["params"])  # the index of the replaced one's param
        replaced, shown = [], None
        for o in (opt, ref_opt):
            entry = o.state[o.param_groups[1]["params"][0]]
            old = entry["exp_avg"]
            entry["exp_avg"] = old.clone()
            replaced.append((entry, old))
            shown = old.to_local().clone()
        for m, o in ((model, opt), (ref, ref_opt)):
            _train_accumulating(m, o, rank, world_size, 1, first=2)
        _assert_same(model, opt, ref, ref_opt, f"{tier}: after a replaced state tensor")
        for (entry, old), o in zip(replaced, (opt, ref_opt)):
            assert torch.equal(old.to_local(), shown), f"{tier}: the replaced tensor followed the step"
            assert not torch.equal(entry["exp_avg"].to_local(), shown), "the replacing one did not"
            assert o.state[o.param_groups[1]["params"][0]]["exp_avg"] is entry["exp_avg"]
        for before, o in zip(held, (opt, ref_opt)):  # the others held are the state, stepped
            now = o.state_dict()["state"]
            kept = [(i, k) for i, s in before.items() for k, v in s.items()
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and (i, k) != (replaced_at, "exp_avg")]
            assert kept and all(before[i][k] is now[i][k] for i, k in kept), (
                f"{tier}: a state tensor held since the load is no longer the state")
        # amsgrad on mid-training: torch's KeyError on both, and both step on once it is off
        for m, o in ((model, opt), (ref, ref_opt)):
            o.param_groups[1]["amsgrad"] = True
            with pytest.raises(KeyError, match="max_exp_avg_sq"):
                _train_accumulating(m, o, rank, world_size, 1, first=3)
            o.param_groups[1]["amsgrad"] = False
            _train_accumulating(m, o, rank, world_size, 1, first=4)
        _assert_same(model, opt, ref, ref_opt, f"{tier}: after amsgrad on and off")
        handle.remove()
        # planned with amsgrad, turned off before the first step
        (ref, ref_opt, _), (model, opt, handle) = pair(tier, copies, amsgrad=True)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.param_groups[0]["amsgrad"] = False
            _train_accumulating(m, o, rank, world_size, 2)
        _assert_same(model, opt, ref, ref_opt, f"{tier}: amsgrad off before the first step")
        handle.remove()
        # planned without amsgrad, turned on before the first step: its state outside the plan
        (ref, ref_opt, _), (model, opt, handle) = pair(tier, copies)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.param_groups[0]["amsgrad"] = True
            _train_accumulating(m, o, rank, world_size, 2)
        _assert_same(model, opt, ref, ref_opt, f"{tier}: amsgrad on before the first step")
        handle.remove()


@pytest.mark.parametrize("world_size", [1, 2])
def test_replaced_state_and_changed_flags_as_torch(world_size, tmp_path):
    run_ranks(_replaced_and_flags_body, world_size, str(tmp_path))


def _dropped_state_body(rank, world_size, tmp):
    """As torch: a state tensor a caller holds keeps its values once its parameter's state is
    dropped (a load without it, ``del optimizer.state[p]``), and the parameter's next step
    starts fresh state elsewhere. Every tier and the default flat step against plain torch."""
    def side(tier):
        model = build_transformer(seed=5)
        shard_transformer(model, fully_shard, mesh=cpu_mesh())
        opt = _optimizer(model, "adamw")
        if tier == "torch":
            fsdp2.disable_flat_step(opt)
        elif tier != "flat":
            policy = OptimizerOffloadPolicy(tier=tier, directory=os.path.join(tmp, tier),
                                            unit_bytes=512)
            fsdp2.enable_local_shard_step(opt, offload=policy)
        return model, opt

    sides = {tier: side(tier) for tier in ("torch", "flat", "nvme", "host")}
    for drop in ("load", "del"):
        held = {}
        for step, (model, opt) in itertools.product((0, 1), sides.values()):
            _train_accumulating(model, opt, rank, world_size, 1, first=step)
        for tier, (_, opt) in sides.items():
            p = opt.param_groups[0]["params"][1]
            held[tier] = (opt.state[p]["exp_avg"], opt.state[p]["exp_avg"].to_local().clone())
            if drop == "load":
                sd = opt.state_dict()
                del sd["state"][1]
                opt.load_state_dict(sd)
            else:
                del opt.state[p]
            assert p not in opt.state, (tier, drop)
        for step, (model, opt) in itertools.product((2, 3), sides.values()):
            _train_accumulating(model, opt, rank, world_size, 1, first=step)
        ref_model, ref_opt = sides["torch"]
        for tier, (model, opt) in sides.items():
            tensor, shown = held[tier]
            assert torch.equal(tensor.to_local(), shown), (
                f"{tier}, state dropped by {drop}: a tensor held from the dropped state followed "
                "the parameter's new state")
            p = opt.param_groups[0]["params"][1]
            assert opt.state[p]["exp_avg"] is not tensor, (tier, drop)
            _assert_same(model, opt, ref_model, ref_opt, f"{tier}, state dropped by {drop}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_dropped_by_a_caller_as_torch(world_size, tmp_path):
    """A tensor held from a parameter's dropped state keeps its values on every tier."""
    run_ranks(_dropped_state_body, world_size, str(tmp_path))


def _snapshot(model, opt) -> list:
    """Every parameter's and state tensor's local bytes (and every other state value)."""
    def raw(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return (t.dtype, tuple(t.shape), t.detach().contiguous().view(-1).view(torch.uint8).tolist())

    values = [raw(p) for p in model.parameters()]
    for idx, state in opt.state_dict()["state"].items():
        values += [(idx, k, raw(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()]
    return values


def _closure_refused_body(rank, world_size, tmp):
    for tier in ("host", "nvme"):
        model = build_transformer(seed=5)
        shard_transformer(model, fully_shard, mesh=cpu_mesh())
        opt = _optimizer(model, "adamw")
        handle = fsdp2.enable_local_shard_step(
            opt, offload=OptimizerOffloadPolicy(tier, os.path.join(tmp, tier))
        )
        _train_accumulating(model, opt, rank, world_size, 1)
        kept = _snapshot(model, opt)  # what the refusals must keep
        ran = []

        def closure(model=model, opt=opt, ran=ran):
            ran.append(1)
            opt.zero_grad()
            loss = transformer_loss(model, transformer_batch(7, 4 * world_size))
            loss.backward()
            return loss

        for grads in (False, True):  # refused whatever the gradients are before the closure
            if grads:
                transformer_loss(model, transformer_batch(6, 4 * world_size)).backward()
            with pytest.raises(ValueError, match=r"step\(closure\) is not supported"):
                opt.step(closure)
            assert not ran, f"{tier}: the closure ran"
            assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
            assert _snapshot(model, opt) == kept, f"{tier}: a refused step(closure) changed state"
        if handle.engine.tier.in_units:  # a compiled step() too, at the call (not while tracing)
            torch._dynamo.reset()
            with pytest.raises(NotImplementedError, match=r"torch.compile of AdamW.step\(\)"):
                torch.compile(opt.step, backend="eager")()
            assert _snapshot(model, opt) == kept, f"{tier}: a refused compiled step changed state"
        opt.step()  # the same optimizer still steps, without the closure
        handle.remove()


@pytest.mark.parametrize("world_size", [1, 2])
def test_offloaded_step_closure_refused(world_size, tmp_path):
    """step(closure) (and a compiled step() on files) of an offloaded optimizer: refused, state untouched."""
    run_ranks(_closure_refused_body, world_size, str(tmp_path))


def _one_cut_body(rank, world_size, tmp):
    """Memory, host and disk tiers: the same runs, units cut from them, the same bits."""
    trained = []
    for tier in (None, "host", "nvme"):
        model = build_transformer(seed=5)
        shard_transformer(model, fully_shard, mesh=cpu_mesh())
        opt = _optimizer(model, "adamw")
        policy = tier and OptimizerOffloadPolicy(
            tier=tier, directory=os.path.join(tmp, f"cut-{tier}"), unit_bytes=512
        )
        handle = fsdp2.enable_local_shard_step(opt, offload=policy)
        _train_accumulating(model, opt, rank, world_size, 2)
        names = {p: n for n, p in model.named_parameters()}
        runs = [[names[p] for p in r.params] for r in handle.engine.runs()]
        units = [[names[p] for p in u.params] for u in handle.engine.units]
        trained.append((model, opt, handle, runs, units))
    (ref, ref_opt, ref_handle, runs, no_units), *stores = trained
    assert no_units == [] and not ref_handle.engine.tier.in_units  # one call over all runs
    assert runs and sum(map(len, runs)) == len(names), "every parameter in a flat run"
    run_of = {name: i for i, run in enumerate(runs) for name in run}
    host, *stores = stores  # on CPU ranks the host tier keeps the state in place: in memory
    assert host[4] == [] and not host[2].engine.tier.in_units and host[3] == runs
    _assert_same(host[0], host[1], ref, ref_opt, "host tier on CPU")
    host[2].remove()
    with _params_seen_on_accelerator(True):  # the host tier's units, as on a GPU rank
        model = build_transformer(seed=5)
        shard_transformer(model, fully_shard, mesh=cpu_mesh())
        opt = _optimizer(model, "adamw")
        policy = OptimizerOffloadPolicy(tier="host", unit_bytes=512)
        handle = fsdp2.enable_local_shard_step(opt, offload=policy)
    _train_accumulating(model, opt, rank, world_size, 2)
    named = {p: n for n, p in model.named_parameters()}
    host_units = [[named[p] for p in u.params] for u in handle.engine.units]
    stores.insert(0, (model, opt, handle, [[named[p] for p in r.params] for r in handle.engine.runs()],
                      host_units))
    for model, opt, handle, store_runs, units in stores:
        where = type(handle.engine.tier).__name__
        assert store_runs == runs, f"{where}: another cut than in memory"
        assert len(units) > len(runs), f"{where}: unit_bytes=512 must split runs"
        assert [n for u in units for n in u] == [n for r in runs for n in r], where
        assert all(len({run_of[n] for n in u}) == 1 for u in units), f"{where}: a unit spans runs"
        _assert_same(model, opt, ref, ref_opt, where)
        handle.remove()
    host_cut = [n for u in stores[0][4] for n in u]
    assert host_cut == [n for u in stores[1][4] for n in u], "host and disk tiers order units apart"


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_cut_for_every_tier(world_size, tmp_path):
    """In memory, host and disk tiers plan the same runs (units split from them) and step alike."""
    run_ranks(_one_cut_body, world_size, str(tmp_path))


def _save_body(rank, world_size, tmp):
    model = build_transformer(seed=7)
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    opt = _optimizer(model, "adamw")
    policy = OptimizerOffloadPolicy(tier="nvme", directory=os.path.join(tmp, "w4"), unit_bytes=512)
    handle = fsdp2.enable_local_shard_step(opt, offload=policy)
    _train_accumulating(model, opt, rank, world_size, 2)
    fsdp2.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
    handle.remove()


def _resume_body(rank, world_size, tmp):
    runs = []
    for tier in (None, "nvme"):
        model = build_transformer(seed=99)  # different init: everything comes from the checkpoint
        shard_transformer(model, fully_shard, mesh=cpu_mesh())
        opt = _optimizer(model, "adamw")
        if tier is None:
            fsdp2.enable_local_shard_step(opt)
        else:
            directory = os.path.join(tmp, "w2")
            policy = OptimizerOffloadPolicy(tier="nvme", directory=directory, unit_bytes=512)
            handle = fsdp2.enable_local_shard_step(opt, offload=policy)
        torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)  # the saved groups carry initial_lr
        fsdp2.load_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
        if tier is not None:  # the loaded state went to the disk, not to memory
            _assert_files_hold_state(handle.engine, opt)
        _train_accumulating(model, opt, rank, world_size, 2, first=2)
        runs.append((model, opt))
    (ref, ref_opt), (model, opt) = runs
    _assert_same(model, opt, ref, ref_opt, "resumed at W=2")
    handle.remove()


def test_checkpoint_saved_at_4_resumes_at_2(tmp_path):
    run_ranks(_save_body, 4, str(tmp_path))
    run_ranks(_resume_body, 2, str(tmp_path))


# ---- bad input: the same StoreError on every rank, before any step ----------------


def _bad_directory_body(rank, world_size, tmp, case):
    model = build_transformer(seed=1)
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    opt = _optimizer(model, "adamw")
    directory = os.path.join(tmp, "state")
    if case == "unwritable" and rank == 1:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "rank00001"), "w") as f:
            f.write("a file where the rank's folder should be")
    dist.barrier()
    if case == "full" and rank == 1:
        def no_space(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate = no_space
    before = [p.to_local().clone() for p in model.parameters()]
    with pytest.raises(StoreError) as info:
        fsdp2.enable_local_shard_step(opt, offload=OptimizerOffloadPolicy("nvme", directory))
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.to_local(), q)
    return str(info.value)


@pytest.mark.parametrize("case", ["unwritable", "full"])
def test_bad_directory_raises_on_every_rank(case, tmp_path):
    messages = run_ranks(_bad_directory_body, 2, str(tmp_path), case)
    assert messages[0] == messages[1] and "rank 1: " in messages[0], messages  # one error, all ranks
    expect = "not writable" if case == "unwritable" else "Cannot reserve"
    assert expect in messages[1] and "rank00001" in messages[1], messages[1]


def _params():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


def test_one_job_per_directory(tmp_path):
    model = _params()
    opt = torch.optim.AdamW(model.parameters())
    policy = OptimizerOffloadPolicy("nvme", tmp_path)
    handle = fsdp2.enable_local_shard_step(opt, offload=policy)
    other = torch.optim.AdamW(model.parameters())
    with pytest.raises(StoreError, match="in use by a live process"):
        fsdp2.enable_local_shard_step(other, offload=policy)
    handle.remove()  # releases the claim
    fsdp2.enable_local_shard_step(other, offload=policy).remove()


def test_claim_of_a_live_other_process(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = tmp_path / "rank00000"
        folder.mkdir()
        record = {"host": os.uname().nodename, "pid": sleeper.pid, "fingerprint": None}
        (folder / "OWNER").write_text(json.dumps(record))
        opt = torch.optim.AdamW(_params().parameters())
        with pytest.raises(StoreError, match=f"pid {sleeper.pid}"):
            fsdp2.enable_local_shard_step(opt, offload=OptimizerOffloadPolicy("nvme", tmp_path))
    finally:
        sleeper.kill()
        sleeper.wait()
    # the owner is gone (as after a SIGKILL): its claim is stale and taken over
    fsdp2.enable_local_shard_step(opt, offload=OptimizerOffloadPolicy("nvme", tmp_path)).remove()


def test_state_files_of_another_model(tmp_path):
    policy = OptimizerOffloadPolicy("nvme", tmp_path)
    first = torch.optim.AdamW(_params().parameters())
    handle = fsdp2.enable_local_shard_step(first, offload=policy)
    stepper = handle.engine
    stepper.tier._claim_file.held = False  # leave the claim behind, as a killed job would
    handle.remove()
    owner = tmp_path / "rank00000" / "OWNER"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owner.write_text(json.dumps({**json.loads(owner.read_text()), "pid": dead.pid}))
    other = torch.optim.AdamW(torch.nn.Linear(5, 3).parameters())
    with pytest.raises(StoreError, match="another model"):
        fsdp2.enable_local_shard_step(other, offload=policy)
    # the same model again (a restarted job): the stale claim is taken over
    same = torch.optim.AdamW(_params().parameters())
    fsdp2.enable_local_shard_step(same, offload=policy).remove()


def test_bad_policies_and_optimizers(tmp_path):
    with pytest.raises(ValueError, match="needs a directory"):
        OptimizerOffloadPolicy("nvme")
    with pytest.raises(ValueError, match="'host' or 'nvme'"):
        OptimizerOffloadPolicy("disk", tmp_path)
    with pytest.raises(ValueError, match="at least 1"):
        OptimizerOffloadPolicy("nvme", tmp_path, units_in_memory=0)
    lbfgs = torch.optim.LBFGS(_params().parameters())
    with pytest.raises(ValueError, match="elementwise optimizer"):
        fsdp2.enable_local_shard_step(lbfgs, offload=OptimizerOffloadPolicy())
    opt = torch.optim.AdamW(_params().parameters())
    fsdp2.enable_local_shard_step(opt, offload=OptimizerOffloadPolicy("nvme", tmp_path))
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: torch.tensor(0.0))


def test_plain_tensors_every_elementwise_optimizer(tmp_path):
    """Without fully_shard too: every accepted optimizer, both tiers, several units."""
    cases = [
        (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}), (torch.optim.Adagrad, {}),
        (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}), (torch.optim.Adamax, {}),
        (torch.optim.NAdam, {}), (torch.optim.RAdam, {}), (torch.optim.Adam, {"foreach": True}),
    ]
    for cls, kwargs in cases:
        results = []
        for tier in (None, "host", "nvme"):
            model = copy.deepcopy(_params())
            opt = cls(model.parameters(), lr=1e-2, **kwargs)
            if tier:
                directory = tmp_path / f"{cls.__name__}-{tier}"
                policy = OptimizerOffloadPolicy(tier, directory, unit_bytes=64)
                handle = fsdp2.enable_local_shard_step(opt, offload=policy)
            for step in range(3):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
                model(x).square().sum().backward()
                opt.step()
                opt.zero_grad()
            results.append([p.detach().clone() for p in model.parameters()])
            if tier:
                handle.remove()
        for got in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0], got)), cls.__name__
