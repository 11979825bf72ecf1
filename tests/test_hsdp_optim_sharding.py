"""HSDP with the optimizer state sharded across replicas (``shard_across_replicas=True``).

Each case trains two copies of one model on a (replicate, shard) mesh: plain
HSDP with the flat step, and the option. Parameters must be bit-identical at
R = 2 (2x2 at W=4 on gloo; 2x4 at W=8 on torch's threaded process group,
which runs in a child process), within one rounding at R = 4 (4x1 on gloo,
4x2 on threads) and with clipping (the norm sums in another order); the state
held per rank 1/R of plain HSDP's; the collectives one reduce-scatter over
replicate in place of each all-reduce and one all-gather per group after the
step. Also: mixed precision, param groups with ``add_param_group`` and a
scheduler, accumulation with either setter, ``step()`` leaving the
parameters current (and stale with ``overlap_replica_gather`` until a wait),
state dicts in plain HSDP's layout, ``handle.remove()`` and the refusals.
Checkpoints across layouts: test_hsdp_optim_checkpoints.py; streams:
test_streams.py. See [Note: Replica slices] in fsdp2/runtime/group/replica_slices.py.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _impl import fsdp2_only, fully_shard
from _multiproc import launch_dir
from _threaded import run_threads_spawned
from checks import check_case, record_collectives, train_alone
from models import build_transformer, full, mlp_batch, rank_slice, shard_transformer
from models import transformer_batch as batch_of
from models import transformer_loss as loss_of
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as upstream_fully_shard
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from fsdp2.ragged_placement import RowRuns
from fsdp2.runtime.group import replica_slices

pytestmark = fsdp2_only  # fsdp2's own option (refused for upstream's parameters: test_refusals)

OPTIMS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
}
STEPS = 3


def _mesh(replicate: int = 2, shard: int = 2):
    return init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))


def _pair(base, mesh, make, *, mp_policy=None, placement_fn=None, **opt_kw):
    """(plain model, its optimizer, its handle), the same for the option.

    ``base``: a seed, or a model to copy (thread ranks share the default RNG).
    ``placement_fn``: ``shard_placement_fn`` of both (the parameter-major layout).
    """
    if isinstance(base, int):
        base = build_transformer(seed=base)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    if placement_fn is not None:
        kwargs["shard_placement_fn"] = placement_fn
    out = []
    for sharded in (False, True):
        model = shard_transformer(copy.deepcopy(base), fully_shard, mesh=mesh, **kwargs)
        optim = make(model)
        handle = fsdp2.enable_local_shard_step(
            optim, shard_across_replicas=sharded, **(opt_kw if sharded else {})
        )
        out.append((model, optim, handle))
    return out


def _train(model, optim, rank, world_size, steps, *, micro=1, clip=None, first=0, **options):
    """``checks.train_alone`` on the tests' transformer batches (2 rows per rank and micro-batch)."""
    batches = [batch_of(step, 2 * world_size * micro) for step in range(first, first + steps)]
    if clip is not None:
        options["after_backward"] = lambda: fsdp2.clip_grad_norm_(model.parameters(), clip)
    train_alone(model, batches, loss_of, rank, world_size, optim, mean=False,
                micro_batches=micro, **options)


def _fulls(model, handle):
    handle.wait_for_parameters()
    return {n: full(p.detach()) for n, p in model.named_parameters()}


def _assert_equal(a: dict, b: dict, exact: bool = True):
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max())
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def _state_numel(optim, handle=None) -> int:
    """Elements of parameter-shaped state this rank holds (the option's slices included)."""
    total = 0
    for values in optim.state.values():
        for v in values.values():
            if torch.is_tensor(v) and v.dim():
                total += (v.to_local() if isinstance(v, DTensor) else v).numel()
    if handle is not None and handle.engine.replicas is not None:
        for r in handle.engine.replicas.runs.values():
            total += sum(v.numel() for v in r.state.values() if torch.is_tensor(v) and v.dim())
    return total


def _check_parity(rank, world_size, base, shape, make, *, exact=True, **pair_kw):
    """Train plain HSDP and the option on a ``shape`` mesh; compare; the state is 1/R."""
    (plain, p_opt, p_h), (model, opt, h) = _pair(base, _mesh(*shape), make, **pair_kw)
    _train(plain, p_opt, rank, world_size, STEPS)
    _train(model, opt, rank, world_size, STEPS)
    expected = _fulls(plain, p_h)
    if pair_kw.get("overlap_replica_gather"):  # in flight: other replicas' rows are stale
        assert any(not torch.equal(expected[n], full(p.detach())) for n, p in model.named_parameters())
    else:  # step() waited: the parameters are current without a call
        _assert_equal(expected, {n: full(p.detach()) for n, p in model.named_parameters()}, exact)
    _assert_equal(expected, _fulls(model, h), exact=exact)
    # slices of ceil(N / R) elements: at most a few elements per group above 1/R
    replicas = shape[0]
    mine, theirs = _state_numel(opt, h), _state_numel(p_opt)
    assert mine <= theirs // replicas + 64 * len(list(model.modules())), (mine, theirs)
    assert mine < theirs, (mine, theirs)


def _parity(name):
    def case(rank, world_size):  # SGD: with the all-gathers left in flight after step()
        overlap = {"overlap_replica_gather": True} if name == "sgd" else {}
        _check_parity(rank, world_size, 11, (2, 2), OPTIMS[name], **overlap)
    return case


def _parity_four_replicas(rank, world_size):
    """R = 4 (a 4 x 1 mesh): gloo's reduce-scatter may sum in another order than its all-reduce."""
    _check_parity(rank, world_size, 18, (4, 1), OPTIMS["adamw"], exact=False)


def _mixed_precision(rank, world_size):
    """bf16 parameters for compute, fp32 reductions: the fp32 slices step as plain HSDP's."""
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _check_parity(rank, world_size, 19, (2, 2), OPTIMS["adamw"], mp_policy=mp)


def _groups_and_schedulers(rank, world_size):
    """Two param groups, add_param_group after the first step, a StepLR: bit-identical."""

    def make(model):
        blocks = [p for n, p in model.named_parameters() if n.startswith("layers.")]
        return torch.optim.AdamW([
            {"params": [p for p in blocks if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for p in blocks if p.ndim <= 1], "weight_decay": 0.0},
        ], lr=1e-2)

    fulls = []
    for model, opt, h in _pair(20, _mesh(), make):
        _train(model, opt, rank, world_size, 1)
        rest = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
        opt.add_param_group({"params": rest, "lr": 5e-3, "weight_decay": 0.0})
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        _train(model, opt, rank, world_size, 2, first=1, after_step=sched.step)
        fulls.append(_fulls(model, h))
        if h.engine.replicas is not None:  # the added group's buffer is sliced too
            assert len(h.engine.replicas.slices) == len(model.layers) + 1
    _assert_equal(*fulls)


def _all_reduce_off(rank, world_size):
    """Accumulation with set_requires_all_reduce(False): one reduce-scatter over replicas, exact."""
    fulls = []
    for model, opt, h in _pair(21, _mesh(), OPTIMS["adamw"]):
        _train(model, opt, rank, world_size, 2, micro=3, accumulate_with="set_requires_all_reduce")
        fulls.append(_fulls(model, h))
    _assert_equal(*fulls)


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


def _assert_true_layout(po: dict, mo: dict) -> None:
    """The option's state dict (``mo``) holds plain HSDP's (``po``) values in its true layout:
    each rank its slice (``RowRuns`` on the flattened mesh), every element on one rank only,
    none gathered across replicas; the scalars as plain HSDP's."""
    assert sorted(po["state"]) == sorted(mo["state"])
    ours = theirs = 0
    for fqn, values in po["state"].items():
        assert list(mo["state"][fqn]) == list(values), fqn
        for key, v in values.items():
            w = mo["state"][fqn][key]
            if isinstance(v, DTensor):
                assert isinstance(w, DTensor) and len(w.placements) == 1, (fqn, key, w)
                assert isinstance(w.placements[0], RowRuns), (fqn, key, w.placements)
                assert torch.equal(w.full_tensor(), v.full_tensor()), (fqn, key)
                ours, theirs = ours + w.to_local().numel(), theirs + v.to_local().numel()
            else:
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(w)), (fqn, key)
    counts = torch.tensor([ours, theirs])
    dist.all_reduce(counts)
    whole = counts[1] // 2  # plain HSDP holds every element on its R = 2 replicas
    assert counts[0] == whole, (counts, "each element once across all ranks")
    assert ours <= theirs * 0.6, (ours, theirs)  # about 1 / (R * S) of the whole, not 1 / S


def _state_dict_round_trip(rank, world_size):
    """The option's state dict is in its true layout (each rank its slice); DCP saves and
    loads it both ways."""
    mesh = _mesh()
    (plain, p_opt, p_h), (model, opt, h) = _pair(15, mesh, OPTIMS["adamw"])
    _train(plain, p_opt, rank, world_size, 2)
    _train(model, opt, rank, world_size, 2)
    ps, po = get_state_dict(plain, p_opt)
    ms, mo = get_state_dict(model, opt)
    _assert_true_layout(po, mo)
    # save with the option, load into plain HSDP (and the other way): training goes on alike
    folder = launch_dir("dcp")
    dcp.save({"model": ms, "optim": mo}, checkpoint_id=folder + "/opt")
    dcp.save({"model": ps, "optim": po}, checkpoint_id=folder + "/plain")
    (plain2, p_opt2, p_h2), (model2, opt2, h2) = _pair(16, mesh, OPTIMS["adamw"])
    for m, o, src in ((plain2, p_opt2, "opt"), (model2, opt2, "plain")):
        _train(m, o, rank, world_size, 1)  # state to load into
        s, os_ = get_state_dict(m, o)
        loaded = {"model": s, "optim": os_}
        dcp.load(loaded, checkpoint_id=f"{folder}/{src}")
        set_state_dict(m, o, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for m, o in ((plain, p_opt), (model, opt), (plain2, p_opt2), (model2, opt2)):
        _train(m, o, rank, world_size, 2, first=2)
    expected = _fulls(plain, p_h)
    for m, handle in ((model, h), (plain2, p_h2), (model2, h2)):
        _assert_equal(expected, _fulls(m, handle))
    # a state dict whose runs are another mesh's slices is refused by name
    sd = opt.state_dict()
    entry = next(v for v in sd["state"].values() if isinstance(v.get("exp_avg"), DTensor))
    value = entry["exp_avg"]
    other = RowRuns(tuple(reversed(value.placements[0].runs)))
    entry["exp_avg"] = DTensor.from_local(value.to_local(), value.device_mesh, (other,),
                                          run_check=False, shape=value.shape, stride=value.stride())
    with pytest.raises(ValueError, match="through DCP"):
        opt.load_state_dict(sd)


def _state_dict_keys_and_held_views(rank, world_size):
    """Odd sizes, so that some parameters lie wholly in one replica's slice (found by the
    call sequences): every rank's state dict has every entry, in the parameters' order, as
    plain HSDP's; it goes through ``torch.save`` and ``deepcopy``; a state dict held across
    ``load_state_dict`` of its own values stays live."""
    mesh = _mesh()
    base = build_transformer(seed=5, dim=12, hidden=37, vocab=29)
    (plain, p_opt, _), (model, opt, _) = _pair(base, mesh, OPTIMS["adamw"])
    _train(plain, p_opt, rank, world_size, 2)
    _train(model, opt, rank, world_size, 2)
    keys = list(opt.state_dict()["state"])
    everyone = [None] * world_size
    dist.all_gather_object(everyone, keys)
    assert all(k == list(p_opt.state_dict()["state"]) for k in everyone), everyone
    held = opt.state_dict()
    # torch.save and deepcopy of it (a DTensor over a view inside a larger storage fails both)
    buffer = io.BytesIO()
    torch.save(held, buffer)
    buffer.seek(0)
    saved, copied = torch.load(buffer, weights_only=False), copy.deepcopy(held)
    for index, values in held["state"].items():
        for key, value in values.items():
            for other in (saved, copied):
                got = other["state"][index][key]
                assert type(got) is type(value) and torch.equal(
                    got.to_local() if isinstance(got, DTensor) else got,
                    value.to_local() if isinstance(value, DTensor) else value,
                ), (index, key)
    opt.load_state_dict(opt.state_dict())
    p_opt.load_state_dict(p_opt.state_dict())
    _train(plain, p_opt, rank, world_size, 1, first=2)
    _train(model, opt, rank, world_size, 1, first=2)
    now, plain_now = opt.state_dict(), p_opt.state_dict()
    for index, values in held["state"].items():
        for key, value in values.items():
            if isinstance(value, DTensor):  # the held view shows the step after the load
                assert torch.equal(value.full_tensor(), now["state"][index][key].full_tensor())
                assert torch.equal(value.full_tensor(), plain_now["state"][index][key].full_tensor())


def _other_shard_dim(rank, world_size):
    """Shard(1) matrices: a slice is no run of rows of them, so their groups' state dicts keep
    plain HSDP's layout (gathered over replicas), with plain HSDP's values."""
    dim1 = lambda p: Shard(1) if p.dim() == 2 and p.shape[1] % 2 == 0 else None  # noqa: E731
    (plain, p_opt, _), (model, opt, _) = _pair(15, _mesh(), OPTIMS["adamw"], placement_fn=dim1)
    for m, o in ((plain, p_opt), (model, opt)):
        _train(m, o, rank, world_size, 2)
    po, mo = get_state_dict(plain, p_opt)[1], get_state_dict(model, opt)[1]
    seen = set()
    for fqn, values in po["state"].items():
        for key, v in values.items():
            w = mo["state"][fqn][key]
            if isinstance(v, DTensor):
                assert w.placements == v.placements, (fqn, key, w.placements)
                seen.add(w.placements[-1])
            assert torch.equal(full(w), full(v)), (fqn, key)
    assert Shard(1) in seen, seen


def _param_major(rank, world_size):
    """RaggedShard slices alike: bit-identical to plain HSDP on that layout with 1/R of the
    state; its state dict (each rank's slice, RowRuns) saved with DCP loads
    into dim-0 plain HSDP, which then trains on exactly as the ragged run does."""
    ragged = lambda p: fsdp2.RaggedShard()  # noqa: E731
    _check_parity(rank, world_size, 11, (2, 2), OPTIMS["adamw"], placement_fn=ragged)
    mesh = _mesh()
    (plain, p_opt, p_h), (model, opt, h) = _pair(15, mesh, OPTIMS["adamw"], placement_fn=ragged)
    for m, o in ((plain, p_opt), (model, opt)):
        _train(m, o, rank, world_size, 2)
    ms, mo = get_state_dict(model, opt)
    _, po = get_state_dict(plain, p_opt)
    _assert_true_layout(po, mo)
    folder = launch_dir("dcp")
    dcp.save({"model": ms, "optim": mo}, checkpoint_id=folder + "/ragged")
    (dim0, d_opt, d_h), _ = _pair(16, mesh, OPTIMS["adamw"])
    _train(dim0, d_opt, rank, world_size, 1)  # state to load into
    s, os_ = get_state_dict(dim0, d_opt)
    loaded = {"model": s, "optim": os_}
    dcp.load(loaded, checkpoint_id=folder + "/ragged")
    set_state_dict(dim0, d_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for m, o in ((model, opt), (dim0, d_opt)):
        _train(m, o, rank, world_size, 2, first=2)
    _assert_equal(_fulls(model, h), _fulls(dim0, d_h))


def _param_major_dtypes(rank, world_size):
    """A RaggedShard call of several dtypes (trainable fp32, frozen bf16 / float64 / int8: one
    group per dtype) slices its state like plain HSDP steps it, bit for bit; a dim-0 group
    of several dtypes (one uint8 buffer) is refused."""
    from test_mixed_dtypes import _build
    from test_mixed_dtypes import _loss as mixed_loss

    runs = []
    for sliced in (False, True):
        model = _build()
        for module in (*model.blocks, model):
            fully_shard(module, mesh=_mesh(), shard_placement_fn=lambda p: fsdp2.RaggedShard())
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        if sliced:
            fsdp2.enable_local_shard_step(opt, shard_across_replicas=True)
        for step in range(2):
            mixed_loss(model, rank_slice(mlp_batch(step, 2 * world_size), rank, world_size)
                       ).backward()
            opt.step()
            opt.zero_grad()
        runs.append({n: p.full_tensor() for n, p in model.named_parameters()})
    for name, value in runs[0].items():
        assert torch.equal(value, runs[1][name]), name
    dim0 = _build()
    for module in (*dim0.blocks, dim0):
        fully_shard(module, mesh=_mesh())
    opt = torch.optim.AdamW([p for p in dim0.parameters() if p.requires_grad], lr=1e-2)
    with pytest.raises(NotImplementedError, match="in a group of several dtypes"):
        fsdp2.enable_local_shard_step(opt, shard_across_replicas=True)
        mixed_loss(dim0, rank_slice(mlp_batch(0, 2 * world_size), rank, world_size)).backward()
        opt.step()


def _remove(rank, world_size):
    """handle.remove() gathers the slices' state back: plain HSDP from there, bit-identical."""
    (plain, p_opt, p_h), (model, opt, h) = _pair(23, _mesh(), OPTIMS["adamw"])
    for m, o in ((plain, p_opt), (model, opt)):
        _train(m, o, rank, world_size, 2)
    h.remove()
    assert all(replica_slices.slices_of(p) is None for p in model.parameters())
    expected = {n: {k: full(v) for k, v in s.items()}
                for n, s in get_state_dict(plain, p_opt)[1]["state"].items()}
    got = {n: {k: full(v) for k, v in s.items()}
           for n, s in get_state_dict(model, opt)[1]["state"].items()}
    assert sorted(got) == sorted(expected)
    for name in expected:
        _assert_equal(expected[name], got[name])
    for m, o in ((plain, p_opt), (model, opt)):
        _train(m, o, rank, world_size, 1, first=2)
    _assert_equal(_fulls(plain, p_h), _fulls(model, h))


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
    upstream = shard_transformer(build_transformer(seed=17), upstream_fully_shard, mesh=mesh)
    with pytest.raises(NotImplementedError, match="outside fsdp2's flat shard buffers"):
        fsdp2.enable_local_shard_step(
            torch.optim.AdamW(upstream.parameters()), shard_across_replicas=True
        )
    for kwargs in ({"flat_buffers": False}, {"offload": fsdp2.OptimizerOffloadPolicy("host")}):
        with pytest.raises(NotImplementedError, match="cannot be combined"):
            fsdp2.enable_local_shard_step(
                torch.optim.AdamW(model.parameters()), shard_across_replicas=True, **kwargs
            )
    # a group's parameter left to another optimizer would step on zeros outside the slice
    with pytest.raises(ValueError, match="same fully_shard group") as e:
        fsdp2.enable_local_shard_step(torch.optim.AdamW(hidden), shard_across_replicas=True)
    assert "norm.weight" in str(e.value), e.value  # the 1-D parameters left out of ``hidden``
    # the per-parameter fallback is refused: a run with a gradient missing cannot step its slice
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    h = fsdp2.enable_local_shard_step(opt, shard_across_replicas=True)
    _train(model, opt, rank, world_size, 1)
    before = _fulls(model, h)
    loss_of(model, rank_slice(batch_of(1, 2 * world_size), rank, world_size)).backward()
    model.layers[0].attention.wq.weight.grad = None
    with pytest.raises(RuntimeError, match="cannot step on its own"):
        opt.step()
    assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
    _assert_equal(before, _fulls(model, h))  # nothing stepped
    opt.zero_grad()
    _train(model, opt, rank, world_size, 1, first=2)  # and the optimizer still works


CASES = {
    "parity_adamw": _parity("adamw"),
    "parity_sgd": _parity("sgd"),
    "parity_four_replicas": _parity_four_replicas,
    "mixed_precision": _mixed_precision,
    "groups_and_schedulers": _groups_and_schedulers,
    "all_reduce_off": _all_reduce_off,
    "clip_and_accumulate": _clip_and_accumulate,
    "collectives": _collectives,
    "state_dict": _state_dict_round_trip,
    "state_dict_keys_and_held_views": _state_dict_keys_and_held_views,
    "other_shard_dim": _other_shard_dim,
    "remove": _remove,
    "refusals": _refusals,
    "param_major": _param_major,
    "param_major_dtypes": _param_major_dtypes,
}


def test_parameter_major_layout(launch_cases):
    """RaggedShard groups: bitwise to plain HSDP on them; DCP into dim-0 plain HSDP."""
    check_case(launch_cases(4, CASES), "param_major")


def test_parameter_major_groups_of_several_dtypes(launch_cases):
    """A RaggedShard call of several dtypes (a group per dtype): bitwise to plain HSDP;
    refused on a dim-0 group of several dtypes."""
    check_case(launch_cases(4, CASES), "param_major_dtypes")


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
    """state_dict() in its true layout; DCP checkpoints load across the option both ways."""
    check_case(launch_cases(4, CASES), "state_dict")


def test_state_dict_keys_agree_and_held_views_stay_live(launch_cases):
    """Every rank's state dict has every entry in order (parameters wholly in another
    replica's slice too); a held state dict stays live across load_state_dict."""
    check_case(launch_cases(4, CASES), "state_dict_keys_and_held_views")


def test_state_dict_of_another_shard_dim(launch_cases):
    """Shard(1) parameters: plain HSDP's layout in state dicts."""
    check_case(launch_cases(4, CASES), "other_shard_dim")


def test_remove_gathers_the_state_back(launch_cases):
    """handle.remove(): optimizer.state in plain HSDP's layout, training goes on bit-identical."""
    check_case(launch_cases(4, CASES), "remove")


def test_refusals(launch_cases):
    """Muon, LBFGS and a 1-D mesh are refused with a clear error."""
    check_case(launch_cases(4, CASES), "refusals")


def test_four_replicas(launch_cases):
    """4x1 (R = 4): within one rounding of plain HSDP; state per rank a quarter."""
    check_case(launch_cases(4, CASES), "parity_four_replicas")


def test_mixed_precision(launch_cases):
    """param_dtype bf16, reduce_dtype fp32: bit-identical to plain HSDP."""
    check_case(launch_cases(4, CASES), "mixed_precision")


def test_param_groups_add_param_group_and_scheduler(launch_cases):
    """Two param groups, add_param_group (its buffer sliced at the next step), StepLR: exact."""
    check_case(launch_cases(4, CASES), "groups_and_schedulers")


def test_accumulation_with_all_reduce_off(launch_cases):
    """set_requires_all_reduce(False) micro-batches, then one reduce-scatter: exact."""
    check_case(launch_cases(4, CASES), "all_reduce_off")


# ---------------------------------------------------------------- W = 8 on thread ranks


def _eight_ranks(rank, world_size, base):
    """2x4 (R = 2, bit-identical) and 4x2 (R = 4, within one rounding) on one thread world."""
    _check_parity(rank, world_size, base, (2, 4), OPTIMS["adamw"])
    _check_parity(rank, world_size, base, (4, 2), OPTIMS["adamw"], exact=False)


def test_eight_ranks_on_threads():
    """W=8 as 2x4 and 4x2 on torch's threaded process group (one process, eight thread ranks)."""
    run_threads_spawned(_eight_ranks, 8, build_transformer(seed=22))
