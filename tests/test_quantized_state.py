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
- on dim-0 shards fsdp2 gives upstream's ``fully_shard``'s bits (W = 2, 4),
  which at W = 4 are not the single-process ones (the shards fall under
  torchao's 4,096-element threshold, so their state stays fp32);
- DCP checkpoints of the block-aligned state go W = 2 -> W = 4 -> one process
  to the bit, and training goes on with the uninterrupted run's losses; on
  dim-0 shards a load whose blocks moved raises, and one whose blocks did
  not (W = 2 -> one process) loads exactly.

torchao compiles its step per parameter shape, so the cases share one model
and a few launches.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from _impl import fsdp2_only
from checks import check_case
from torch.distributed.checkpoint.state_dict import (
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


def _single(name: str) -> dict:
    """torchao's own single-process step (every rank runs it whole; no collective)."""
    model = _mlp("single")
    optim = _optimizer(name, model)
    losses = _train(model, optim, range(STEPS))
    return {**_snapshot(model, optim, alone=True), "losses": losses}


# ---------------------------------------------------------------- the same state at any W


def _block_aligned_case(name: str):
    def case(rank: int, world_size: int) -> None:
        want = _single(name)
        model = _mlp("ragged")
        optim = _optimizer(name, model)
        losses = _train(model, optim, range(STEPS))
        got = _snapshot(model, optim)
        assert all(v[0] != "fp32" for s in got["states"] for k, v in s.items() if k != "step")
        _assert_same(got, want, f"RaggedShard(256), W={world_size}")
        assert losses == want["losses"]

    return case


def _dim0_case(rank: int, world_size: int) -> None:
    """fsdp2's dim-0 shards give upstream's fully_shard's bits; at W = 4 not the single-process ones."""
    results = {}
    for layout in ("dim0", "upstream"):
        model = _mlp(layout)
        optim = _optimizer("AdamW8bit", model)
        _train(model, optim, range(STEPS))
        results[layout] = _snapshot(model, optim)
    _assert_same(results["dim0"], results["upstream"], f"dim-0, W={world_size}")
    kinds = {v[0] for s in results["dim0"]["states"] for k, v in s.items() if k != "step"}
    want = _single("AdamW8bit")
    same_params = all(torch.equal(a, b) for a, b in zip(results["dim0"]["params"], want["params"]))
    if world_size == 4:  # 3,840-element shards: under torchao's threshold, fp32 state
        assert kinds == {"fp32"} and not same_params, kinds
    else:  # W = 2: shards of whole blocks over 4,096 elements: the single-process state
        assert kinds == {"OptimState8bit"} and same_params, kinds


CASES = {name: _block_aligned_case(name) for name in OPTIMIZERS}
DIM0_CASES = {"dim0_is_upstream": _dim0_case}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_block_aligned_state_is_world_size_free(name, world_size, launch_cases):
    """Codes, scales, fp32 values, step, parameters and losses: torchao's single-process bits."""
    check_case(launch_cases(world_size, CASES, timeout=600), name)


@pytest.mark.parametrize("world_size", [2, 4])
def test_dim0_state_is_upstreams(world_size, launch_cases):
    check_case(launch_cases(world_size, DIM0_CASES, timeout=600), "dim0_is_upstream")


# ---------------------------------------------------------------- checkpoints across W

REFUSAL = "loading it would requantize or dequantize it silently"


def _checkpointed(layout: str) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """A fresh model and AdamW8bit (its state made by DCP's zero step) and what DCP loads into."""
    model = _mlp(layout)
    optim = _optimizer("AdamW8bit", model)
    return model, optim, {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)}


def _save(model, optim, path: str) -> None:
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)},
             checkpoint_id=path)


def _load(model, optim, state: dict, path: str) -> None:
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])


def _save_at_2(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for layout in ("ragged", "dim0"):
        model = _mlp(layout)
        optim = _optimizer("AdamW8bit", model)
        losses = _train(model, optim, range(2))
        _save(model, optim, f"{root}/{layout}2")
        out[layout] = {**_snapshot(model, optim), "losses": losses}
    return out


def _load_at_4(rank: int, world_size: int, root: str) -> dict:
    model, optim, state = _checkpointed("ragged")
    _load(model, optim, state, f"{root}/ragged2")
    loaded = _snapshot(model, optim)
    losses = _train(model, optim, range(2, 3))
    _save(model, optim, f"{root}/ragged4")
    # dim-0 at W = 4: 3,840-element shards keep fp32 state where W = 2 kept blocks
    model, optim, state = _checkpointed("dim0")
    with pytest.raises(ValueError, match=REFUSAL):
        _load(model, optim, state, f"{root}/dim02")
    return {"loaded": loaded, "losses": losses}


def _load_in_one_process(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name in ("ragged4", "dim02"):  # dim-0 at W = 2 kept whole blocks: exact in one process
        model, optim, state = _checkpointed("single")
        _load(model, optim, state, f"{root}/{name}")
        out[name] = _snapshot(model, optim, alone=True)
        if name == "ragged4":
            out["losses"] = _train(model, optim, range(3, 4))
            out["trained"] = _snapshot(model, optim, alone=True)
    model = _mlp("single")
    optim = _optimizer("AdamW8bit", model)
    out["uninterrupted"] = {"losses": _train(model, optim, range(4)),
                            **_snapshot(model, optim, alone=True)}
    return out


@pytest.fixture(scope="module")
def dcp_chain(tmp_path_factory) -> tuple[dict, dict, dict]:
    """Saved at W = 2, loaded and saved again at W = 4, loaded in one process (rank 0's views)."""
    from _multiproc import run_ranks

    root = str(tmp_path_factory.mktemp("quantized_dcp"))
    at2 = run_ranks(_save_at_2, 2, root, timeout=600)[0]
    at4 = run_ranks(_load_at_4, 4, root, timeout=600)[0]
    one = run_ranks(_load_in_one_process, 1, root, timeout=600)[0]
    return at2, at4, one


def test_dcp_block_aligned_state_across_world_sizes(dcp_chain):
    """W = 2 -> W = 4 -> one process: state to the bit, then the uninterrupted run's losses."""
    at2, at4, one = dcp_chain
    saved = {k: v for k, v in at2["ragged"].items() if k != "losses"}
    _assert_same(at4["loaded"], saved, "loaded at W=4")
    uninterrupted = one["uninterrupted"]
    assert at2["ragged"]["losses"] + at4["losses"] + one["losses"] == uninterrupted["losses"]
    _assert_same(one["trained"], uninterrupted, "trained on after the loads")


def test_dcp_dim0_state_loads_only_where_blocks_stay(dcp_chain):
    """dim-0 W = 2 -> W = 4 raised (in the W = 4 launch); W = 2 -> one process is exact."""
    at2, _, one = dcp_chain
    saved = {k: v for k, v in at2["dim0"].items() if k != "losses"}
    _assert_same(one["dim02"], saved, "dim-0 W=2 loaded in one process")
