"""Full state dicts: gathered to rank 0 as plain CPU tensors, loaded from rank 0 into shards.

``get_full_state_dict`` / ``set_full_state_dict`` are fsdp2's API; the models
are sharded by the implementation under test, so with ``FSDP2_TEST_IMPL=torch``
these tests check that the API also works on upstream ``fully_shard`` models.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from _impl import fully_shard
from _multiproc import run_ranks
from checks import (
    ATOL,
    RTOL,
    assert_losses_match,
    assert_nested_close,
    assert_sharded,
    make_opts,
    train_steps,
)
from models import (
    assert_params_match,
    build_mlp,
    build_transformer,
    cpu_mesh,
    make_pair,
    rank_slice,
    shard_mlp,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp2 import get_full_state_dict, set_full_state_dict
from fsdp2._torch_compat import dispatch_mode_base, local_tensor, strided_shard

# ---------------------------------------------------------------- round trips


def _round_trip_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=11))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    ref_opt, opt = make_opts(ref, model)
    batches = [transformer_batch(s, 2 * world_size) for s in range(3)]
    train_steps(ref, model, batches[:2], transformer_loss, rank, world_size, (ref_opt, opt))

    msd, osd = get_full_state_dict(model, opt)
    # torch's own full-state-dict API sees the same thing on our models
    torch_msd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    tokens = transformer_batch(7, 4)[0]
    with torch.no_grad():
        out = model(tokens)  # collective: every rank runs it
    if rank != 0:
        assert msd == {} and osd == {} and torch_msd == {}, "only rank 0 gets the dicts"
    else:
        assert_nested_close(msd, ref.state_dict(), "model")
        assert_nested_close(msd, torch_msd, "torch model", rtol=0, atol=0)
        assert_nested_close(osd, get_optimizer_state_dict(ref, ref_opt), "optim")
        # into a plain module: identical outputs
        plain = build_transformer(seed=99)
        plain.load_state_dict(msd)
        with torch.no_grad():
            torch.testing.assert_close(plain(tokens), out, rtol=0, atol=0)
        # and the optimizer state into a plain optimizer (local: a plain model needs no peers)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        set_full_state_dict(plain, plain_opt, model_state_dict=msd, optim_state_dict=osd)
        assert_nested_close(get_full_state_dict(plain, plain_opt)[1], osd, "plain optim", 0, 0)
        transformer_loss(plain, batches[2]).backward()
        plain_opt.step()
    # one more step on both: the plain copy continues exactly like the sharded model
    transformer_loss(model, rank_slice(batches[2], rank, world_size)).backward()
    opt.step()
    after, _ = get_full_state_dict(model)
    if rank == 0:
        assert_nested_close(after, plain.state_dict(), "after one more step")


def test_full_state_dict_round_trip_through_plain_module():
    """Full model/optimizer dicts are CPU tensors on rank 0 only; a plain module and optimizer continue identically."""
    run_ranks(_round_trip_body, 3)


def _from_plain_body(rank, world_size):
    ref = build_transformer(seed=12)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = [transformer_batch(s, 2 * world_size) for s in range(4)]
    for batch in batches[:2]:
        transformer_loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    msd, osd = get_full_state_dict(ref, ref_opt)  # a plain model: local, every rank has one
    if rank != 0:
        msd, osd = {}, None  # only rank 0 holds the checkpoint
    with torch.device("meta"):
        model = build_transformer(seed=99)
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    result = set_full_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    assert not result.missing_keys and not result.unexpected_keys
    assert_sharded(model, rank, world_size, "after set_full_state_dict")
    assert_params_match(ref, model, 0, 0)
    ref_losses, losses = train_steps(
        ref, model, batches[2:], transformer_loss, rank, world_size, (ref_opt, opt)
    )
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model, RTOL, ATOL)
    # ranks past the end of a dim 0 (empty shards, at 4 ranks) receive nothing, send nothing
    plain_mlp, mlp = build_mlp(seed=3), build_mlp(seed=4)
    shard_mlp(mlp, fully_shard, mesh=cpu_mesh())
    set_full_state_dict(mlp, model_state_dict=plain_mlp.state_dict() if rank == 0 else None)
    assert_params_match(plain_mlp, mlp, 0, 0)
    back, _ = get_full_state_dict(mlp)
    if rank == 0:
        assert_nested_close(back, plain_mlp.state_dict(), "mlp", 0, 0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_set_full_state_dict_from_plain_model_into_meta_model(world_size):
    """A plain model's dicts, held by rank 0 only, load into a meta-built sharded model; training continues alike."""
    run_ranks(_from_plain_body, world_size)


# ---------------------------------------------------------------- 2-D meshes

_LAYOUTS = {
    "hsdp": ((7, 5), (Replicate(), Shard(0))),
    "fsdp_tp": ((7, 5), (Shard(0), Shard(1))),
    "shard0_twice": ((5, 3), (Shard(0), Shard(0))),
    "tp_only": ((3,), (Replicate(), Shard(0))),
    "col": ((4, 3), (Shard(1), Replicate())),
    # FSDP over a dim TP already splits: several row (or column) ranges per rank
    "strided": ((12, 5), (strided_shard(0, 2), Shard(0))),
    "strided_uneven": ((7, 5), (strided_shard(0, 2), Shard(0))),
    "strided_col": ((3, 10), (strided_shard(1, 2), Shard(1))),
    "strided_and_col": ((6, 4), (strided_shard(0, 2), Shard(1))),
}


def _two_d_body(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2))
    gen = torch.Generator().manual_seed(5)
    fulls = {name: torch.randn(shape, generator=gen) for name, (shape, _) in _LAYOUTS.items()}

    def holder(values):
        module = nn.Module()
        for name, (_, placements) in _LAYOUTS.items():
            # every rank has the same values: split locally (torch's scatter of an uneven
            # strided shard fails on 2.13)
            dt = distribute_tensor(values[name].clone(), mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(dt))
        return module

    msd, _ = get_full_state_dict(holder(fulls))
    if rank == 0:
        assert_nested_close(msd, fulls, "gathered", 0, 0)
    target = holder({k: torch.zeros_like(v) for k, v in fulls.items()})
    set_full_state_dict(target, model_state_dict=fulls if rank == 0 else None)
    for name, (_, placements) in _LAYOUTS.items():
        expected = distribute_tensor(fulls[name], mesh, placements, src_data_rank=None).to_local()
        torch.testing.assert_close(getattr(target, name).to_local(), expected, rtol=0, atol=0)
    for name in ("strided", "strided_and_col"):  # even splits: DTensor's own full_tensor() agrees
        torch.testing.assert_close(getattr(target, name).full_tensor(), fulls[name], rtol=0, atol=0)


def test_full_state_dict_on_2d_mesh_layouts():
    """HSDP-, TP- and strided (FSDP+TP on one dim) placements on a 2x2 mesh gather and scatter to the right chunks."""
    run_ranks(_two_d_body, 4)


# ---------------------------------------------------------------- memory


def _local(t):
    return local_tensor(t) if isinstance(t, DTensor) else t


class _LiveBytes(dispatch_mode_base()):
    """Bytes of tensor storages created while active, as a timeline of (storage, delta).

    Storages alive before (``baseline``: parameters, buffers) never count.
    """

    def __init__(self, baseline):
        super().__init__()
        self._baseline = [_local(t).untyped_storage() for t in baseline]  # alive: ids stay unique
        self._known = {id(s) for s in self._baseline}
        self._sizes = {}
        self.events = []

    def _see(self, t):
        t = _local(t)
        if t.is_meta:
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._known:
            return
        old = self._sizes.get(key)
        if old is None:
            weakref.finalize(storage, self._drop, key)
            old = 0
        if storage.nbytes() != old:
            self._sizes[key] = storage.nbytes()
            self.events.append((key, storage.nbytes() - old))

    def _drop(self, key):
        size = self._sizes.pop(key, 0)
        if size:
            self.events.append((key, -size))

    def peak(self, exclude=frozenset()):
        live = top = 0
        for key, delta in self.events:
            if key not in exclude:
                live += delta
                top = max(top, live)
        return top

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor unwraps; the plain ops on shards come back here
        out = func(*args, **(kwargs or {}))
        for t in _tensor_leaves((args, kwargs, out)):
            self._see(t)
        return out


_DIM, _LAYERS = 128, 6
_PARAM_BYTES = _DIM * _DIM * 4
_SLACK = 8 * 1024  # the one small object collective that checks ranks agree


def _stack():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(_DIM, _DIM, bias=False) for _ in range(_LAYERS)))
    for layer in model:
        fully_shard(layer, mesh=cpu_mesh())
    return fully_shard(model, mesh=cpu_mesh())


def _memory_body(rank, world_size):
    model = _stack()
    with _LiveBytes(model.parameters()) as tracker:
        msd, _ = get_full_state_dict(model)
    kept = {id(v.untyped_storage()) for v in msd.values()}
    kept_bytes = sum(v.untyped_storage().nbytes() for v in msd.values())
    gather = {"peak": tracker.peak(), "transient": tracker.peak(exclude=kept), "kept": kept_bytes}
    target = _stack()
    with _LiveBytes([*target.parameters(), *msd.values()]) as tracker:
        set_full_state_dict(target, model_state_dict=msd if rank == 0 else None)
    load = {"peak": tracker.peak()}
    assert gather["transient"] <= _PARAM_BYTES + _SLACK, (rank, gather)
    assert load["peak"] <= _PARAM_BYTES + _SLACK, (rank, load)
    if rank == 0:
        assert kept_bytes == _LAYERS * _PARAM_BYTES, gather
        assert gather["peak"] <= kept_bytes + _PARAM_BYTES + _SLACK, gather
    return {"gather": gather, "load": load}


def test_full_state_dict_memory_stays_near_one_parameter():
    """Gathering/loading a full state dict holds at most ~one full parameter beyond the shards (and rank 0's output)."""
    results = run_ranks(_memory_body, 2)
    assert results[1]["gather"]["kept"] == 0, results
    print(f"\nfull state dict of {_LAYERS} x {_PARAM_BYTES} B parameters on 2 ranks: {results}")


# ---------------------------------------------------------------- bad input


def _bad_input_body(rank, world_size):
    model = build_transformer(seed=13)
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    transformer_loss(model, rank_slice(transformer_batch(0, 4), rank, world_size)).backward()
    opt.step()
    good_msd, good_osd = get_full_state_dict(model, opt)

    def case(edit_model=None, edit_optim=None):
        if rank != 0:
            return {}, None
        msd = dict(good_msd)
        osd = {"state": {k: dict(v) for k, v in good_osd["state"].items()},
               "param_groups": [dict(g) for g in good_osd["param_groups"]]}
        if edit_model:
            msd = edit_model(msd)
        if edit_optim:
            edit_optim(osd)
        return msd, osd

    def expect_error(pattern, edit_model=None, edit_optim=None):
        msd, osd = case(edit_model, edit_optim)
        with pytest.raises(ValueError, match=pattern):
            set_full_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    # scramble the live values: a failed load must leave these untouched
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    before_msd, before_osd = get_full_state_dict(model, opt)

    expect_error(r"missing keys .*: norm\.weight", lambda sd: {k: v for k, v in sd.items()
                                                               if k != "norm.weight"})
    expect_error(r"unexpected keys .*: extra\.weight", lambda sd: {**sd, "extra.weight": torch.ones(2)})
    expect_error(r"output\.weight: shape \(18, 8\) in the state dict, \(17, 8\) in the model",
                 lambda sd: {**sd, "output.weight": torch.zeros(18, 8)})
    expect_error(r"(?s)missing keys.*tok_embeddings\.weight.*unexpected keys.*in_proj\.weight",
                 lambda sd: build_mlp().state_dict())
    expect_error(r"layers\.0\.attention\.wq\.weight: a DTensor",
                 lambda sd: {**sd, "layers.0.attention.wq.weight":
                             model.state_dict()["layers.0.attention.wq.weight"]})
    expect_error(r"nope\.weight: not a parameter of the optimizer",
                 edit_optim=lambda osd: osd["state"].update(
                     {"nope.weight": osd["state"].pop("norm.weight")}))
    expect_error(r"output\.weight\.exp_avg: shape \(3,\)",
                 edit_optim=lambda osd: osd["state"]["output.weight"].update(exp_avg=torch.ones(3)))
    expect_error(r"group 0: parameters missing: output\.weight",
                 edit_optim=lambda osd: osd["param_groups"][0].update(
                     params=[n for n in osd["param_groups"][0]["params"] if n != "output.weight"]))

    after_msd, after_osd = get_full_state_dict(model, opt)
    if rank == 0:
        assert_nested_close(after_msd, before_msd, "model after failed loads", 0, 0)
        assert_nested_close(after_osd, before_osd, "optim after failed loads", 0, 0)

    # strict=False loads what matches and reports the rest
    msd, _ = case(lambda sd: {**{k: v for k, v in sd.items() if k != "norm.weight"},
                              "extra.weight": torch.ones(2)})
    result = set_full_state_dict(model, model_state_dict=msd, strict=False)
    assert result.missing_keys == ["norm.weight"] and result.unexpected_keys == ["extra.weight"]
    loaded, _ = get_full_state_dict(model)
    if rank == 0:
        torch.testing.assert_close(loaded["output.weight"], good_msd["output.weight"], rtol=0, atol=0)
        torch.testing.assert_close(loaded["norm.weight"], before_msd["norm.weight"], rtol=0, atol=0)

    # a good load into an optimizer that has state writes into that state in place
    held = {id(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)}
    set_full_state_dict(model, opt, model_state_dict=case()[0], optim_state_dict=case()[1])
    now = {id(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)}
    assert now == held, "optimizer state was reallocated instead of loaded in place"
    loaded_msd, loaded_osd = get_full_state_dict(model, opt)
    if rank == 0:
        assert_nested_close(loaded_msd, good_msd, "model after good load", 0, 0)
        assert_nested_close(loaded_osd, good_osd, "optim after good load", 0, 0)


def test_set_full_state_dict_rejects_bad_input_on_every_rank():
    """Missing/unexpected keys, wrong shapes, another model, bad optimizer state: same error everywhere, nothing written."""
    run_ranks(_bad_input_body, 2)


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    leaves, _ = pytree.tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]
