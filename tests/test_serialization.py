"""Sharded state travels like upstream's: torch.save, pickle, copy.deepcopy.

Each case shards the same model twice in one launch, with the implementation
under test and with upstream's ``fully_shard``, and checks on every rank that
``model.state_dict()``, single parameters (the parameter, ``.data``,
``.to_local()``) and ``optimizer.state_dict()`` save, pickle and deep-copy,
that the bytes written match upstream's (a few hundred bytes of metadata per
tensor at most; the data is each rank's padded shard, as upstream's), and that
loaded values equal the saved ones. A state dict saved by one implementation
loads into the other. Cases cover W = 1, 2, 3 (uneven shards, a rank with no
rows), a group of several dtypes, CPU offload, HSDP and a TP 2-D mesh.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import zipfile

import pytest
import torch
import torch.distributed.fsdp as upstream
import torch.nn as nn
from _impl import CPUOffloadPolicy, fully_shard
from checks import check_case
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

# pickle framing and a DTensor's spec differ by a few bytes between objects
METADATA_SLACK = 300  # bytes per tensor


class Mixed(nn.Module):
    """A trainable fp32 linear next to a frozen bf16 one: one group, two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 5)
        self.base = nn.Linear(8, 5).to(torch.bfloat16).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.base(x.to(torch.bfloat16)).float()


def _plain() -> nn.Module:
    # 5 rows: W=2 -> 3, 2; W=3 -> 2, 2, 1. 2 rows at W=3: the last rank has none.
    return nn.Sequential(nn.Linear(8, 5), nn.LayerNorm(5), nn.Linear(5, 2))


def _build(kind: str, shard, world_size: int) -> nn.Module:
    """The case's model, seeded, sharded by ``shard`` (ours or upstream's)."""
    torch.manual_seed(0)
    if kind == "mixed":
        model = nn.Sequential(Mixed(), nn.Linear(5, 2))
    elif kind == "tp":
        model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    else:
        model = _plain()
    kwargs = {}
    if kind == "offload":
        kwargs["offload_policy"] = (
            CPUOffloadPolicy(pin_memory=False)
            if shard is fully_shard
            else upstream.CPUOffloadPolicy(pin_memory=False)
        )
    if kind == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
    elif kind == "tp":
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        kwargs["mesh"] = mesh["dp"]
    for layer in model:
        if any(True for _ in layer.parameters()):
            shard(layer, **kwargs)
    shard(model, **kwargs)
    return model


def _step(model: nn.Module) -> torch.optim.Optimizer:
    """One AdamW step, so the optimizer has state to save."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _data_bytes(data: bytes) -> int:
    """Bytes of tensor data in a ``torch.save`` archive (its storage records)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)


def _load(data: bytes) -> object:
    return torch.load(io.BytesIO(data))


def _num_tensors(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_num_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_num_tensors(v) for v in obj)
    return 0


def _assert_equal(got: object, want: object, where: str) -> None:
    """Same nesting, same tensor kinds, bit-equal local values and placements."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, got, want)
        for k in want:
            _assert_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, DTensor):
        assert isinstance(got, DTensor), (where, type(got))
        assert got.placements == want.placements and got.shape == want.shape, where
        assert torch.equal(got.to_local(), want.to_local()), where
    elif isinstance(want, torch.Tensor):
        assert type(got) is type(want) and torch.equal(got, want), where
    else:
        assert got == want, (where, got, want)


def _outcome(fn, obj: object) -> tuple[str, object]:
    try:
        return "ok", fn(obj)
    except Exception as e:  # compared with upstream's outcome below
        return type(e).__name__, str(e)


def _assert_like_upstream(ours: object, theirs: object, where: str) -> None:
    """torch.save, pickle and deepcopy of ``ours`` do what upstream's do, at upstream's size."""
    slack = METADATA_SLACK * max(1, _num_tensors(ours))
    for op, save, load in (("torch.save", _saved, _load), ("pickle", pickle.dumps, pickle.loads)):
        (kind, data), (ref_kind, ref) = _outcome(save, ours), _outcome(save, theirs)
        assert kind == ref_kind, f"{where}: {op}: {kind} {data}; upstream: {ref_kind} {ref}"
        if kind == "ok":
            assert abs(len(data) - len(ref)) <= slack, (
                f"{where}: {op} wrote {len(data)} B, upstream {len(ref)} B"
            )
            if op == "torch.save":  # the tensor data itself: exactly upstream's
                assert _data_bytes(data) == _data_bytes(ref), (
                    f"{where}: {_data_bytes(data)} B of tensor data, upstream {_data_bytes(ref)} B"
                )
            _assert_equal(load(data), ours, f"{where} ({op} round trip)")
    (kind, copied), (ref_kind, ref) = _outcome(copy.deepcopy, ours), _outcome(copy.deepcopy, theirs)
    assert kind == ref_kind, f"{where}: deepcopy: {kind} {copied}; upstream: {ref_kind} {ref}"
    if kind == "ok":
        _assert_equal(copied, ours, f"{where} (deepcopy)")


def _single_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The first linear's weight, its ``.data`` and ``.to_local()``, and its bias."""
    first = model[0].proj if isinstance(model[0], Mixed) else model[0]
    w = first.weight
    return {"weight": w, "weight.data": w.data, "weight.to_local()": w.to_local(), "bias": first.bias}


def _serializes_like_upstream(kind: str):
    def case(rank: int, world_size: int) -> None:
        ours = _build(kind, fully_shard, world_size)
        theirs = _build(kind, upstream.fully_shard, world_size)
        _assert_like_upstream(ours.state_dict(), theirs.state_dict(), f"{kind}: state_dict")
        for (name, t), u in zip(_single_params(ours).items(), _single_params(theirs).values()):
            _assert_like_upstream(t, u, f"{kind}: {name}")
        opt_ours, opt_theirs = _step(ours), _step(theirs)
        # same training results, so the optimizer states are bit-equal too
        _assert_equal(ours.state_dict(), theirs.state_dict(), f"{kind}: trained")
        _assert_like_upstream(opt_ours.state_dict(), opt_theirs.state_dict(), f"{kind}: optimizer")
        _assert_equal(opt_ours.state_dict(), opt_theirs.state_dict(), f"{kind}: optimizer values")

    return case


def _loads_across_implementations(kind: str):
    def case(rank: int, world_size: int) -> None:
        ours = _build(kind, fully_shard, world_size)
        theirs = _build(kind, upstream.fully_shard, world_size)
        _step(ours)  # ours now differs from theirs
        theirs.load_state_dict(_load(_saved(ours.state_dict())))
        _assert_equal(theirs.state_dict(), ours.state_dict(), f"{kind}: ours -> upstream")
        _step(theirs)
        ours.load_state_dict(_load(_saved(theirs.state_dict())))
        _assert_equal(ours.state_dict(), theirs.state_dict(), f"{kind}: upstream -> ours")
        # and both keep training the same from there
        _step(ours)
        _step(theirs)
        _assert_equal(ours.state_dict(), theirs.state_dict(), f"{kind}: after a step")

    return case


def _state_dict_aliases_live_shard(rank: int, world_size: int) -> None:
    model = _build("plain", fully_shard, world_size)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    sd = model.state_dict()
    with torch.no_grad():
        sd["0.weight"].copy_(torch.full_like(sd["0.weight"], 7.0))
    live = model.state_dict()
    # as upstream: a state-dict tensor is the live shard
    assert torch.equal(live["0.weight"].to_local(), torch.full_like(before["0.weight"], 7.0))
    for k in before:  # and nothing else in the group's buffer moved
        if k != "0.weight":
            assert torch.equal(live[k].to_local(), before[k]), k
    model.load_state_dict(sd)  # its own aliases: a no-op round trip
    assert torch.equal(model[0].weight.to_local(), torch.full_like(before["0.weight"], 7.0))
    sd = {k: v.clone() for k, v in sd.items()}
    with torch.no_grad():
        sd["0.weight"].copy_(torch.full_like(sd["0.weight"], -3.0))
    assert torch.equal(model[0].weight.to_local(), torch.full_like(before["0.weight"], 7.0))
    model.load_state_dict(sd)
    assert torch.equal(model[0].weight.to_local(), torch.full_like(before["0.weight"], -3.0))
    # the gathered weight is the loaded value: the all-gather reads the same memory
    model[0].unshard()
    assert torch.equal(model[0].weight.detach(), torch.full((5, 8), -3.0))
    model[0].reshard()


def _deepcopy_model_raises(rank: int, world_size: int) -> None:
    ours = _build("plain", fully_shard, world_size)
    theirs = _build("plain", upstream.fully_shard, world_size)
    with pytest.raises(Exception) as want:
        copy.deepcopy(theirs)
    with pytest.raises(type(want.value), match=re.escape(str(want.value))):
        copy.deepcopy(ours)


_KINDS_BY_WORLD = {1: ["plain"], 2: ["plain", "mixed", "offload"], 3: ["plain"], 4: ["hsdp", "tp"]}
_CASES = {
    world_size: {
        **{f"save_{kind}": _serializes_like_upstream(kind) for kind in kinds},
        **{f"across_{kind}": _loads_across_implementations(kind) for kind in kinds},
        "aliases": _state_dict_aliases_live_shard,
        "deepcopy_model": _deepcopy_model_raises,
    }
    for world_size, kinds in _KINDS_BY_WORLD.items()
}
_ROWS = [(w, name) for w, cases in _CASES.items() for name in cases]


@pytest.mark.parametrize("world_size,name", _ROWS, ids=[f"ws{w}-{n}" for w, n in _ROWS])
def test_serialization(world_size: int, name: str, launch_cases) -> None:
    """One serialization row (see the module docstring) at one world size."""
    check_case(launch_cases(world_size, _CASES[world_size]), name)
