"""torchao's low-bit AdamW state on sharded parameters: block-aligned shards give W-free state.

torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8`` quantize each rank's
local shard in blocks counted from the shard's first element, and keep fp32
where the shard is small ([Note: Quantized state on block-aligned shards] in
fsdp2/optim/quantized_state.py). On the issue's MLP (96 -> 160 -> 96 -> 96,
no biases; each step's gradients set to the same full tensors at every world
size, so that only the optimizer can differ):

- on ``RaggedShard(256)`` (one group, so some ranks hold no rows of some
  parameters) the state (codes, scales, fp32 values, step) and the
  parameters equal torchao's single-process step's to the bit at W = 1, 2
  and 4, for all three optimizers;
- on dim-0 shards fsdp2 gives upstream's ``fully_shard``'s bits (all three
  optimizers, W = 2 and 4), which at W = 4 are not the single-process ones
  (the shards fall under torchao's 4,096-element threshold, so their state
  stays fp32);
- DCP checkpoints of the block-aligned state go W = 2 -> W = 4 -> one process
  to the bit (``dcp`` with ``get/set_optimizer_state_dict``, and W = 2 -> 4
  through ``fsdp2.save_checkpoint`` / ``load_checkpoint``), and training goes
  on with the uninterrupted run's losses; on
  dim-0 shards a load whose blocks moved raises, and one whose blocks did
  not (W = 2 -> one process) loads exactly.

Every case shares one model and one launch per world size (W = 2, then 4,
then 1, the order the checkpoints go in), torchao's step run eagerly (see
``_launch``); the launches return snapshots and the tests compare them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from _impl import fsdp2_only
from _multiproc import run_ranks
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard as upstream_fully_shard
from torch.distributed.tensor import DTensor

import fsdp2

pytestmark = fsdp2_only  # fsdp2's block-aligned layout

OPTIMIZERS = ("AdamW8bit", "AdamW4bit", "AdamWFp8")
STEPS = 3
BATCH = torch.Generator().manual_seed(5)
X, Y = torch.randn(8, 96, generator=BATCH), torch.randn(8, 96, generator=BATCH)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    import torchao.optim  # the test extras pin it

    return getattr(torchao.optim, name)(model.parameters(), lr=1e-2)


def _mlp(layout: str) -> nn.Module:
    """The issue's MLP, whole (``"single"``) or sharded as one group on the default group."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160, bias=False), nn.Linear(160, 96, bias=False),
                          nn.Linear(96, 96, bias=False))
    if layout != "single":
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
        if layout == "ragged":
            fsdp2.fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: fsdp2.RaggedShard(256))
        else:
            (fsdp2.fully_shard if layout == "dim0" else upstream_fully_shard)(model, mesh=mesh)
    return model


def _rows(p: DTensor, rank: int) -> tuple[int, int]:
    """The rows ``rank`` holds of ``p``: its ragged bounds, or torch.chunk's."""
    bounds = getattr(p.placements[0], "row_bounds", ())
    if bounds:
        return bounds[rank], bounds[rank + 1]
    per = -(-p.shape[0] // p.device_mesh.size())
    return min(rank * per, p.shape[0]), min((rank + 1) * per, p.shape[0])


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    """Each step's gradients set to the same full tensors at every W; the loss after each step."""
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=gen)
            if isinstance(p, DTensor):
                lo, hi = _rows(p, dist.get_rank())
                grad = DTensor.from_local(grad[lo:hi].clone(), p.device_mesh, p.placements,
                                          run_check=False, shape=p.shape, stride=p.stride())
            p.grad = grad
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            losses.append(F.mse_loss(model(X), Y).item())
        if hasattr(model, "reshard"):  # a root keeps its parameters gathered after forward
            model.reshard()
    return losses


def _local_parts(value: torch.Tensor) -> tuple | None:
    """A state tensor's local part as (kind, tensors...); ``None`` where it holds no element."""
    local = value.to_local() if isinstance(value, DTensor) else value
    if local.numel() == 0:
        return None
    if type(local) is torch.Tensor:
        return ("fp32", local.detach().clone().reshape(-1))
    codes = local.codes.reshape(-1)
    codes = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes  # fp8: pickles
    return (type(local).__name__, codes.clone(), local.scale.clone())


def _snapshot(model: nn.Module, optim: torch.optim.Optimizer, alone: bool = False) -> dict:
    """Full parameters and, per parameter and key, every rank's state parts joined in rank order.

    ``alone``: this rank's model is whole (no collective).
    """
    params = [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
              for p in model.parameters()]
    mine = [{k: _local_parts(v) for k, v in optim.state[p].items()} for p in model.parameters()]
    every = [mine]
    if not alone:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    states = []
    for i, state in enumerate(mine):
        joined = {}
        for key in state:
            if key == "step":
                joined[key] = state[key][1]
                continue
            parts = [rank[i][key] for rank in every if rank[i][key] is not None]
            kinds = {part[0] for part in parts}
            assert len(kinds) == 1, f"param {i} {key}: state kept as {kinds} across ranks"
            joined[key] = (parts[0][0],) + tuple(
                torch.cat([part[j] for part in parts]) for j in range(1, len(parts[0])))
        states.append(joined)
    return {"params": params, "states": states}


def _assert_same(got: dict, want: dict, where: str) -> None:
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        assert torch.equal(a, b), f"{where}: parameter {i} differs"
    for i, (a, b) in enumerate(zip(got["states"], want["states"])):
        assert list(a) == list(b), (where, i, list(a), list(b))
        for key in b:
            if key == "step":
                assert torch.equal(a[key], b[key]), (where, i, key)
                continue
            assert a[key][0] == b[key][0], f"{where}: param {i} {key} kept as {a[key][0]}, not {b[key][0]}"
            for x, y in zip(a[key][1:], b[key][1:]):
                assert torch.equal(x, y), f"{where}: param {i} {key} ({a[key][0]}) differs"


def _trained(layout: str, name: str, save_after: int | None = None, path: str = "") -> tuple:
    """``STEPS`` steps on ``layout``: model, optim, losses, and (with ``save_after``) the
    snapshot DCP saved to ``path`` after that many steps."""
    model = _mlp(layout)
    optim = _optimizer(name, model)
    if save_after is None:
        return model, optim, _train(model, optim, range(STEPS)), None
    losses = _train(model, optim, range(save_after))
    _save(model, optim, path)
    if layout == "ragged":  # and through fsdp2's own helper
        fsdp2.save_checkpoint(f"{path}_helper", model, optim)
    else:  # and as a flattened optimizer state dict
        _save(model, optim, f"{path}_flat", FLAT)
    saved = _snapshot(model, optim)
    return model, optim, losses + _train(model, optim, range(save_after, STEPS)), saved


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # torchtitan's form


def _save(model, optim, path: str, options: StateDictOptions | None = None) -> None:
    optim_state = get_optimizer_state_dict(model, optim, options=options)
    dcp.save({"model": model.state_dict(), "optim": optim_state}, checkpoint_id=path)


def _loaded(layout: str, path: str, options: StateDictOptions | None = None) -> tuple:
    """A fresh model and AdamW8bit (its state made by DCP's zero step), loaded from ``path``."""
    model = _mlp(layout)
    optim = _optimizer("AdamW8bit", model)
    state = {"model": model.state_dict(),
             "optim": get_optimizer_state_dict(model, optim, options=options)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optim, state["optim"], options=options)
    return model, optim


def _launch(rank: int, world_size: int, root: str) -> dict:
    """Everything one world size runs, torchao's compiled step run eagerly; rank 0's snapshots.

    torchao compiles its step per parameter shape (a C++ build each on the
    CPU: minutes on a cold cache); ``force_eager`` runs the same ops, in
    fsdp2 and in the single-process reference alike, so the comparisons hold
    as they do compiled (the benchmark steps compiled; the compile-cache keys
    of uneven shards are tests/test_torch_compat.py's).
    """
    with torch.compiler.set_stance("force_eager"):
        return _launch_eager(rank, world_size, root)


def _launch_eager(rank: int, world_size: int, root: str) -> dict:
    """W = 2 saves the block-aligned and the dim-0 AdamW8bit runs after 2 steps;
    W = 4 loads the first, steps once and saves it again, and tries the
    second; one process loads both and steps once more.
    """
    out: dict = {"ragged": {}}
    for name in OPTIMIZERS:
        save = 2 if world_size == 2 and name == "AdamW8bit" else None
        model, optim, losses, saved = _trained("ragged", name, save, f"{root}/ragged2")
        out["ragged"][name] = {**_snapshot(model, optim), "losses": losses}
        if saved is not None:
            out["saved"] = saved
    if world_size > 1:  # dim-0 shards, fsdp2's and upstream's
        for layout in ("dim0", "upstream"):
            out[layout] = {}
            for name in OPTIMIZERS:
                save = 2 if (world_size, layout, name) == (2, "dim0", "AdamW8bit") else None
                model, optim, _, saved = _trained(layout, name, save, f"{root}/dim02")
                out[layout][name] = _snapshot(model, optim)
                out[f"{layout}_group_keys"] = set(optim.state_dict()["param_groups"][0])
                if saved is not None:
                    out["dim0_saved"] = saved
    if world_size == 4:
        model, optim = _loaded("ragged", f"{root}/ragged2")
        out["loaded"] = _snapshot(model, optim)
        out["losses"] = _train(model, optim, range(2, 3))
        _save(model, optim, f"{root}/ragged4")
        out["saved"] = _snapshot(model, optim)
        model = _mlp("ragged")
        optim = _optimizer("AdamW8bit", model)
        fsdp2.load_checkpoint(f"{root}/ragged2_helper", model, optim)
        out["helper_loaded"] = _snapshot(model, optim)
        out["refused"] = []  # dim-0 at W = 4: fp32 state where W = 2 kept blocks
        for suffix, options in (("", None), ("_flat", FLAT)):
            try:
                _loaded("dim0", f"{root}/dim02{suffix}", options)
                out["refused"].append(None)
            except ValueError as e:
                out["refused"].append(str(e))
    if world_size == 1:
        out["single"] = {}
        for name in OPTIMIZERS:  # torchao's own single-process step
            model, optim, losses, _ = _trained("single", name)
            out["single"][name] = {**_snapshot(model, optim, alone=True), "losses": losses}
            out["single_group_keys"] = set(optim.state_dict()["param_groups"][0])
            if name == "AdamW8bit":  # and one step more: the uninterrupted run
                losses = losses + _train(model, optim, range(STEPS, STEPS + 1))
                out["uninterrupted"] = {**_snapshot(model, optim, alone=True), "losses": losses}
        model, optim = _loaded("single", f"{root}/ragged4")
        out["loaded"] = _snapshot(model, optim, alone=True)
        out["losses"] = _train(model, optim, range(STEPS, STEPS + 1))
        out["trained"] = _snapshot(model, optim, alone=True)
        model, optim = _loaded("single", f"{root}/dim02")  # W = 2's shards held whole blocks
        out["dim0_loaded"] = _snapshot(model, optim, alone=True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    """Rank 0's results at W = 2, 4 and 1, run in that order (the checkpoints' order)."""
    root = str(tmp_path_factory.mktemp("quantized_state"))
    return {ws: run_ranks(_launch, ws, root, timeout=900)[0] for ws in (2, 4, 1)}


def _kinds(snapshot: dict) -> set[str]:
    return {v[0] for state in snapshot["states"] for k, v in state.items() if k != "step"}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_block_aligned_state_is_world_size_free(name, world_size, runs):
    """Codes, scales, fp32 values, step, parameters and losses: torchao's single-process bits."""
    got, want = runs[world_size]["ragged"][name], runs[1]["single"][name]
    assert _kinds(want) == {f"OptimState{name[5:]}"}, _kinds(want)  # quantized, every tensor
    _assert_same(got, want, f"{name} on RaggedShard(256), W={world_size}")
    assert got["losses"] == want["losses"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_dim0_state_is_upstreams(name, world_size, runs):
    """fsdp2's dim-0 shards give upstream's bits; at W = 4 not the single-process ones."""
    run, want = runs[world_size], runs[1]["single"][name]
    got = run["dim0"][name]
    _assert_same(got, run["upstream"][name], f"{name} on dim-0 against upstream, W={world_size}")
    same = all(torch.equal(a, b) for a, b in zip(got["params"], want["params"]))
    if world_size == 4:  # 3,840-element shards: under torchao's threshold, fp32 state
        assert _kinds(got) == {"fp32"} and not same
    else:  # W = 2: shards of whole blocks over 4,096 elements: the single-process state
        _assert_same(got, want, f"{name} on dim-0 W=2 against one process")


def test_dcp_block_aligned_state_across_world_sizes(runs):
    """W = 2 -> W = 4 -> one process: state to the bit, then the uninterrupted run's losses."""
    _assert_same(runs[4]["loaded"], runs[2]["saved"], "W=2's checkpoint loaded at W=4")
    _assert_same(runs[4]["helper_loaded"], runs[2]["saved"], "fsdp2.load_checkpoint at W=4")
    _assert_same(runs[1]["loaded"], runs[4]["saved"], "W=4's checkpoint loaded in one process")
    uninterrupted = runs[1]["uninterrupted"]
    losses = runs[2]["ragged"]["AdamW8bit"]["losses"][:2] + runs[4]["losses"] + runs[1]["losses"]
    assert losses == uninterrupted["losses"]
    _assert_same(runs[1]["trained"], uninterrupted, "trained on after the loads")


def test_dcp_dim0_state_loads_only_where_blocks_stay(runs):
    """dim-0 W = 2 -> W = 4 raises naming the parameter (nested and flattened optimizer state
    dicts); W = 2 -> one process is exact."""
    for refused in runs[4]["refused"]:  # nested and flattened optimizer state dicts
        assert refused is not None and REFUSAL in refused and "parameter 0" in refused, refused
    _assert_same(runs[1]["dim0_loaded"], runs[2]["dim0_saved"], "dim-0 W=2 loaded in one process")


REFUSAL = "loading it would requantize or dequantize it silently"


def test_units_entry_only_on_fsdp2_models(runs):
    """The units entry rides only on optimizers of fsdp2-sharded parameters: torchao over
    upstream's fully_shard or a plain model keeps torchao's own state dict."""
    from fsdp2.optim.quantized_state import UNITS_KEY

    assert UNITS_KEY in runs[2]["dim0_group_keys"]
    assert UNITS_KEY not in runs[2]["upstream_group_keys"]
    assert UNITS_KEY not in runs[1]["single_group_keys"]
