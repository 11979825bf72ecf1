"""The parameter-major layout (``RaggedShard``): no copy around the collectives, same training.

Each group is one flat buffer of whole parameters; rank ``r`` holds a range
of it cut between rows at the granularity's blocks ([Note: The
parameter-major layout] in fsdp2/runtime/storage/ragged.py). Every case runs
at W = 1, 2, 3 and 4 in one launch per world size and checks, for each
granularity: the placements name the rows each rank holds; training matches
a full-batch unsharded reference (gradients after each backward, losses,
parameters); at W = 2, where a sum of two operands cannot reorder, it matches
the dim-0 layout bit for bit; the all-gather output *is* the unsharded
parameters (no copy-out kernel) and the reduce-scatter input is written
without a rank-major reorder (no ``_chunk_cat``); DCP checkpoints go from
either layout to the other to the bit; and what the layout cannot do yet is
refused naming the parameter.
"""

from __future__ import annotations

import contextlib
import copy
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _impl import fsdp2_only
from _multiproc import launch_dir, run_ranks
from checks import (
    EVERY_COLLECTIVE,
    assert_losses_match,
    check_case,
    on_collectives,
    packed_everywhere,
    train_alone,
    train_steps,
)
from models import (
    assert_params_match,
    build_transformer,
    cpu_mesh,
    full,
    make_pair,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as upstream_fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2
from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, RaggedShard, fully_shard

pytestmark = fsdp2_only  # fsdp2's own layout

STEPS = 3
GRANULARITIES = ["rows", 16, (2, 2), "whole"]


def _ragged(granularity):
    return lambda param: RaggedShard(granularity)


def _check_placements(model, rank: int, world_size: int, granularity) -> None:
    for name, p in model.named_parameters():
        (placement,) = p.placements
        assert isinstance(placement, RaggedShard) and placement.granularity == granularity, name
        bounds = placement.row_bounds
        assert len(bounds) == world_size + 1 and bounds[0] == 0 and bounds[-1] == p.shape[0]
        local = p.to_local()
        assert local.shape == (bounds[rank + 1] - bounds[rank], *p.shape[1:]), name
        assert torch.equal(local, p.full_tensor()[bounds[rank] : bounds[rank + 1]]), name


def _pair_with_dim0(seed: int, **kwargs):
    ref, model = make_pair(lambda: build_transformer(seed=seed))
    dim0 = copy.deepcopy(ref)
    return ref, model, dim0


def _parity(rank, world_size):
    for granularity in GRANULARITIES:
        ref, model, dim0 = _pair_with_dim0(21)
        shard_transformer(model, fully_shard, mesh=cpu_mesh(), shard_placement_fn=_ragged(granularity))
        shard_transformer(dim0, fully_shard, mesh=cpu_mesh())
        _check_placements(model, rank, world_size, granularity)
        batches = [transformer_batch(step, 2 * world_size) for step in range(STEPS)]
        ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size)
        assert_losses_match(ref_losses, losses)
        assert_params_match(ref, model)
        dim0_losses = train_alone(dim0, batches, transformer_loss, rank, world_size)
        if world_size <= 2:  # sums of at most two operands: the same bits as the dim-0 layout
            assert losses == dim0_losses, (granularity, losses, dim0_losses)
            for (name, p), q in zip(model.named_parameters(), dim0.parameters()):
                assert torch.equal(full(p.detach()), full(q.detach())), (granularity, name)


def _mixed_precision(rank, world_size):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _, model, dim0 = _pair_with_dim0(22)
    shard_transformer(model, fully_shard, mesh=cpu_mesh(), mp_policy=mp, shard_placement_fn=_ragged("rows"))
    shard_transformer(dim0, fully_shard, mesh=cpu_mesh(), mp_policy=mp)
    batches = [transformer_batch(step, 2 * world_size) for step in range(STEPS)]
    losses = train_alone(model, batches, transformer_loss, rank, world_size)
    dim0_losses = train_alone(dim0, batches, transformer_loss, rank, world_size)
    for (name, p), q in zip(model.named_parameters(), dim0.parameters()):
        if world_size <= 2:
            assert torch.equal(full(p.detach()), full(q.detach())), name
        else:  # bf16 compute: the fp32 reductions' order shows in the last bits only
            torch.testing.assert_close(full(p.detach()), full(q.detach()), rtol=1e-3, atol=1e-4)
    if world_size <= 2:
        assert losses == dim0_losses


def _accumulation_and_resharding(rank, world_size):
    smaller = {"reshard_after_forward": max(1, world_size // 2)}  # W=4: backward gathers in pairs
    for kwargs, micro in (({"reshard_after_forward": False}, 1), ({}, 2), (smaller, 1)):
        ref, model = make_pair(lambda: build_transformer(seed=23))
        shard_transformer(model, fully_shard, mesh=cpu_mesh(), shard_placement_fn=_ragged(16), **kwargs)
        batches = [transformer_batch(step, 4 * world_size) for step in range(STEPS)]
        ref_losses, losses = train_steps(
            ref, model, batches, transformer_loss, rank, world_size, micro_batches=micro
        )
        assert_losses_match(ref_losses, losses)
        assert_params_match(ref, model)
    # the kept post-forward range, gathered over the smaller group, is the whole output
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _, model, dim0 = _pair_with_dim0(23)
    shard_transformer(model, fully_shard, mesh=cpu_mesh(), shard_placement_fn=_ragged("rows"),
                      mp_policy=mp, **smaller)
    shard_transformer(dim0, fully_shard, mesh=cpu_mesh(), mp_policy=mp, **smaller)
    batches = [transformer_batch(step, 2 * world_size) for step in range(STEPS)]
    losses = train_alone(model, batches, transformer_loss, rank, world_size)
    if world_size <= 2:
        assert losses == train_alone(dim0, batches, transformer_loss, rank, world_size)
        for p, q in zip(model.parameters(), dim0.parameters()):
            assert torch.equal(full(p.detach()), full(q.detach()))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _meta_init_and_checkpointing(rank, world_size):
    """Built on meta, sharded, to_empty, loaded from full weights; blocks under checkpoint_wrapper."""
    ref = build_transformer(seed=29)
    with torch.device("meta"):
        model = build_transformer(seed=29)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    for i, layer in enumerate(list(ref.layers)):
        ref.layers[i] = checkpoint_wrapper(layer)
    shard_transformer(model, fully_shard, mesh=cpu_mesh(), shard_placement_fn=_ragged(16))
    model.to_empty(device="cpu")
    result = model.load_state_dict(ref.state_dict())  # full tensors into the local rows
    assert not result.missing_keys and not result.unexpected_keys, result
    batches = [transformer_batch(step, 2 * world_size) for step in range(STEPS)]
    ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)


def _offload_and_hsdp(rank, world_size):
    """CPUOffloadPolicy (W = 2, 4) and a 2 x 2 HSDP mesh (W = 4): training as the reference."""
    setups = [{"offload_policy": CPUOffloadPolicy()}]
    if world_size == 4:
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        setups.append({"mesh": hsdp})
    for kwargs in setups:
        kwargs.setdefault("mesh", cpu_mesh())
        ref, model = make_pair(lambda: build_transformer(seed=32))
        shard_transformer(model, fully_shard, shard_placement_fn=_ragged("rows"), **kwargs)
        (placement,) = [p for p in model.layers[0].attention.wq.weight.placements
                        if isinstance(p, RaggedShard)]
        assert placement.row_bounds[-1] == 8
        batches = [transformer_batch(step, 2 * world_size) for step in range(STEPS)]
        ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size)
        assert_losses_match(ref_losses, losses)
        assert_params_match(ref, model)


def _no_copies(rank, world_size):
    """No copy-out after the all-gather and no rank-major reorder before the reduce-scatter."""
    seen = {}
    for layout in ("ragged", "dim0"):
        model = build_transformer(seed=24)
        fn = _ragged("rows") if layout == "ragged" else None
        shard_transformer(model, fully_shard, mesh=cpu_mesh(), shard_placement_fn=fn)
        batch = transformer_batch(0, 2 * world_size)
        transformer_loss(model, batch).backward()  # lazy init outside the count
        model.zero_grad()
        with _Ops() as ops:
            transformer_loss(model, batch).backward()
        seen[layout] = set(ops.names)
        if layout == "ragged" and world_size > 1:  # every unsharded parameter views one buffer
            block = model.layers[0]
            block.unshard()
            params = list(block.parameters(recurse=True))
            assert len({p.untyped_storage().data_ptr() for p in params}) == 1
            block.reshard()
    def copies(names):
        return {n.split(".")[0] for n in names} & {"split_with_sizes_copy", "_chunk_cat"}

    assert not copies(seen["ragged"]), seen["ragged"]
    if world_size > 1:  # the dim-0 layout pays both (the counter sees them)
        assert copies(seen["dim0"]) == {"split_with_sizes_copy", "_chunk_cat"}, seen["dim0"]


def _state_dict_and_serialization(rank, world_size):
    model = build_transformer(seed=25)
    shard_transformer(model, fully_shard, mesh=cpu_mesh(), shard_placement_fn=_ragged((2, 2)))
    sd = model.state_dict()
    for name, value in sd.items():
        want = value.full_tensor()
        for copied in (pickle.loads(pickle.dumps(value)), copy.deepcopy(value)):
            assert copied.placements == value.placements, name
            assert torch.equal(copied.full_tensor(), want), name
        assert torch.equal(value.redistribute(placements=[Replicate()]).to_local(), want)
        as_dim0 = value.redistribute(placements=[Shard(0)])
        chunks = want.chunk(world_size)
        assert torch.equal(as_dim0.to_local(), chunks[rank] if rank < len(chunks) else want[:0])
        assert torch.equal(as_dim0.redistribute(placements=value.placements).to_local(),
                           value.to_local()), name
        # accelerate's full-state-dict loader distributes with the parameter's placements:
        # torch's distribute_tensor then makes a plain Shard(0) DTensor, of the same values
        spread = distribute_tensor(want, value.device_mesh, value.placements)
        assert torch.equal(spread.full_tensor(), want), name
    # load_state_dict (no assign) from the same layout, from Shard(0) DTensors, from full tensors
    fulls = {name: value.full_tensor() for name, value in sd.items()}
    sources = {
        "ragged": sd,
        "dim0": {n: distribute_tensor(v, cpu_mesh(), [Shard(0)]) for n, v in fulls.items()},
        "full": fulls,
    }
    for kind, source in sources.items():
        other = build_transformer(seed=77)
        shard_transformer(other, fully_shard, mesh=cpu_mesh(), shard_placement_fn=_ragged((2, 2)))
        result = other.load_state_dict(source)
        assert not result.missing_keys and not result.unexpected_keys, (kind, result)
        for name, value in other.state_dict().items():
            assert torch.equal(value.full_tensor(), fulls[name]), (kind, name)
    # torch's clip_grad_norm_ on the ragged gradients: the norm of the full gradients
    transformer_loss(model, transformer_batch(0, 2 * world_size)).backward()
    fulls = [full(p.grad) for p in model.parameters()]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in fulls]))
    for clip in (fsdp2.clip_grad_norm_, torch.nn.utils.clip_grad_norm_):
        torch.testing.assert_close(full(clip(model.parameters(), max_norm=1e9)), want)
    # elementwise DTensor math keeps the layout; what has no ragged rule is refused
    p = model.layers[0].attention.wq.weight
    doubled = p.detach() * 2 + p.detach()
    assert doubled.placements == p.placements
    assert torch.equal(doubled.full_tensor(), 3 * p.full_tensor())
    with pytest.raises(NotImplementedError, match="RaggedShard placement"):
        p.detach().t()


def _dcp_across_layouts(rank, world_size):
    """DCP from the parameter-major layout to dim-0 and back: parameters and AdamW state to the bit."""
    path = launch_dir("dcp")
    trained = {}
    for layout in ("ragged", "dim0"):
        model = build_transformer(seed=26)
        fn = _ragged(16) if layout == "ragged" else None
        shard_transformer(model, fully_shard, mesh=cpu_mesh(), shard_placement_fn=fn)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_alone(model, [transformer_batch(s, 2 * world_size) for s in range(2)],
                    transformer_loss, rank, world_size, optim)
        trained[layout] = (model, optim)
    for src, dst in (("ragged", "dim0"), ("dim0", "ragged")):
        model, optim = trained[src]
        dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)},
                 checkpoint_id=f"{path}_{src}")
        target = build_transformer(seed=99)  # other values: the load must overwrite them all
        fn = _ragged(16) if dst == "ragged" else None
        shard_transformer(target, fully_shard, mesh=cpu_mesh(), shard_placement_fn=fn)
        target_optim = torch.optim.AdamW(target.parameters(), lr=1e-2)
        train_alone(target, [transformer_batch(9, 2 * world_size)], transformer_loss, rank,
                    world_size, target_optim)  # make its state
        state = {"model": target.state_dict(), "optim": get_optimizer_state_dict(target, target_optim)}
        dcp.load(state, checkpoint_id=f"{path}_{src}")
        target.load_state_dict(state["model"])
        set_optimizer_state_dict(target, target_optim, state["optim"])
        for (name, p), q in zip(target.named_parameters(), model.parameters()):
            assert torch.equal(full(p.detach()), full(q.detach())), (src, dst, name)
        got = get_optimizer_state_dict(target, target_optim)["state"]
        want = get_optimizer_state_dict(model, optim)["state"]
        for name, values in want.items():
            for key, value in values.items():
                assert torch.equal(full(got[name][key]), full(value)), (src, dst, name, key)
        # and both go on alike
        batch = [transformer_batch(5, 2 * world_size)]
        assert train_alone(target, batch, transformer_loss, rank, world_size, target_optim) == \
            train_alone(model, batch, transformer_loss, rank, world_size, optim)


def _muon(rank, world_size):
    """fsdp2.Muon moves each matrix's rows by the ragged bounds: the same updates as on dim-0 shards."""
    results = {}
    for layout, granularity in (("dim0", None), ("rows", "rows"), ("whole", "whole")):
        torch.manual_seed(28)
        model = torch.nn.Sequential(*[torch.nn.Linear(12, 12, bias=False) for _ in range(3)])
        fn = None if granularity is None else _ragged(granularity)
        for layer in model:
            fully_shard(layer, mesh=cpu_mesh(), shard_placement_fn=fn)
        fully_shard(model, mesh=cpu_mesh(), shard_placement_fn=fn)
        muon = fsdp2.Muon(list(model.named_parameters()), lr=0.02, momentum=0.95)
        gen = torch.Generator().manual_seed(3)
        for _ in range(STEPS):
            x = torch.randn(4 * world_size, 12, generator=gen).chunk(world_size)[rank]
            model(x).square().mean().backward()
            calls: list = []
            with on_collectives(lambda kind, *_, log=calls: log.append(kind), EVERY_COLLECTIVE):
                muon.step()
            if layout == "whole":  # each matrix on one rank, stepped there: nothing moves
                assert calls == [], calls
            elif world_size > 1:
                assert "all_to_all" in calls, calls
            muon.zero_grad()
        results[layout] = [full(p.detach()) for p in model.parameters()]
    for layout in ("rows", "whole"):
        for got, want in zip(results[layout], results["dim0"]):
            if world_size <= 2:
                assert torch.equal(got, want), layout
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _dtensor_step(rank, world_size):
    """torch's own AdamW step on the ragged DTensors (flat step off): the flat step's bits,
    also across a state dict loaded between two steps (the step before it replayed)."""
    results = []
    batches = [transformer_batch(s, 2 * world_size) for s in range(STEPS)]
    for flat in (True, False):
        model = build_transformer(seed=33)
        shard_transformer(model, fully_shard, mesh=cpu_mesh(), shard_placement_fn=_ragged(16))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        if not flat:
            fsdp2.disable_flat_step(optim)
        train_alone(model, batches[:1], transformer_loss, rank, world_size, optim)
        saved = copy.deepcopy(optim.state_dict())
        weights = [p.detach().to_local().clone() for p in model.parameters()]
        train_alone(model, batches[1:2], transformer_loss, rank, world_size, optim)
        optim.load_state_dict(saved)  # back one step: the state, then the weights in place
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.to_local().copy_(w)
        train_alone(model, batches[1:], transformer_loss, rank, world_size, optim)
        for p in model.parameters():
            assert isinstance(p.placements[-1], RaggedShard)
            assert isinstance(optim.state[p]["exp_avg"].placements[-1], RaggedShard)
        results.append([full(p.detach()) for p in model.parameters()])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def _refusals(rank, world_size):
    model = build_transformer(seed=27)
    mixed = lambda p: RaggedShard() if p.dim() == 2 else None  # noqa: E731
    with pytest.raises(ValueError, match="one fully_shard call is parameter-major or dim-0"):
        fully_shard(model.layers[0], mesh=cpu_mesh(), shard_placement_fn=mixed)
    # model-parallel dims that split dim 0: tests/test_ragged_model_parallel.py
    with pytest.raises(ValueError, match=r"RaggedShard\(granularity=0\)"):
        RaggedShard(0)
    with pytest.raises(ValueError, match=r"a tile \(rows, cols\)"):
        RaggedShard((1, 1, 1))


CASES = {
    "parity": _parity,
    "mixed_precision": _mixed_precision,
    "accumulation_and_resharding": _accumulation_and_resharding,
    "meta_init_and_checkpointing": _meta_init_and_checkpointing,
    "offload_and_hsdp": _offload_and_hsdp,
    "no_copies": _no_copies,
    "state_dict": _state_dict_and_serialization,
    "dcp": _dcp_across_layouts,
    "muon": _muon,
    "dtensor_step": _dtensor_step,
    "refusals": _refusals,
}
WORLD_SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", list(CASES))
def test_ragged_layout(case, world_size, launch_cases):
    check_case(launch_cases(world_size, CASES), case)


def _snapshot(model, optim) -> tuple[dict, dict]:
    params = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    state = get_optimizer_state_dict(model, optim)["state"]
    states = {n: {k: full(v).clone() for k, v in s.items()} for n, s in state.items()}
    return params, states


def _shard_as(model, layout: str, granularity) -> None:
    """``layout``: dim-0, ragged (fsdp2's plan), packed (the packed plan forced), upstream."""
    fn = None if layout in ("dim0", "upstream") else _ragged(granularity)
    shard = upstream_fully_shard if layout == "upstream" else fully_shard
    with packed_everywhere() if layout == "packed" else contextlib.nullcontext():
        shard_transformer(model, shard, mesh=cpu_mesh(), shard_placement_fn=fn)


def _train_and_save(rank, world_size, path, layout):
    """``layout``: as ``_shard_as``'s, saved by ``dcp.save``; ``LAYOUT/fsdp2``: by fsdp2's
    ``save_checkpoint``."""
    layout, _, saver = layout.partition("/")
    model = build_transformer(seed=30)
    _shard_as(model, layout, 16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_alone(model, [transformer_batch(s, 12) for s in range(2)], transformer_loss, rank,
                world_size, optim)
    if saver == "fsdp2":
        fsdp2.save_checkpoint(path, model, optim)
    else:
        dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)},
                 checkpoint_id=path)
    return _snapshot(model, optim)


def _load(rank, world_size, path, layout):
    layout, _, loader = layout.partition("/")
    model = build_transformer(seed=31)
    _shard_as(model, layout, (2, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_alone(model, [transformer_batch(7, 12)], transformer_loss, rank, world_size, optim)
    if loader == "fsdp2":
        fsdp2.load_checkpoint(path, model, optim)
        return _snapshot(model, optim)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    return _snapshot(model, optim)


def _chunks_over_dim0s(path: str, world_size: int) -> list[str]:
    """Saved chunks with more rows than dim-0's ``ceil(rows / W)`` (see [Note: Ragged rows in
    checkpoints]: a load reads a saved chunk whole)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    over = []
    for fqn, md in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and len(md.size) > 0:
            most = -(-md.size[0] // world_size)
            over += [f"{fqn}: {c.sizes[0]} rows > {most}" for c in md.chunks if c.sizes[0] > most]
    return over


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [((2, "ragged"), (4, "ragged")), ((2, "ragged"), (3, "dim0")), ((4, "dim0"), (3, "ragged")),
     ((3, "ragged"), (1, "dim0")), ((4, "ragged"), (2, "upstream")), ((3, "packed"), (4, "ragged")),
     ((2, "dim0"), (3, "packed")), ((2, "ragged/fsdp2"), (3, "dim0/fsdp2")),
     ((3, "packed/fsdp2"), (2, "upstream"))],
    ids=["ragged2-ragged4", "ragged2-dim0_3", "dim0_4-ragged3", "ragged3-one_process",
         "ragged4-upstream2", "packed3-ragged4", "dim0_2-packed3",
         "save_checkpoint-ragged2-dim0_3", "save_checkpoint-packed3-upstream2"],
)
def test_dcp_across_world_sizes(saved, loaded, tmp_path):
    """DCP saved at one world size and layout loads at another, parameters and AdamW state to the
    bit; ``save_checkpoint`` writes no chunk with more rows than dim-0's."""
    path = str(tmp_path / "ckpt")
    want = run_ranks(_train_and_save, saved[0], path, saved[1])[0]
    if saved[1].endswith("/fsdp2"):  # no saved chunk larger than dim-0's
        assert not _chunks_over_dim0s(path, saved[0])
    got = run_ranks(_load, loaded[0], path, loaded[1])[0]
    for name, value in want[0].items():
        assert torch.equal(got[0][name], value), name
    for name, values in want[1].items():
        for key, value in values.items():
            assert torch.equal(got[1][name][key], value), (name, key)
