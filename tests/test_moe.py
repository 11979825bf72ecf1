"""Mixture-of-experts models sharded as torchtitan shards them: several meshes in one call.

``examples/moe.py``'s model: top-1 routing, experts a ``DTensor`` ``Shard(0)``
on an expert-parallel mesh ``ep`` with all-to-all dispatch, and per block one
``fully_shard`` whose ``shard_placement_fn`` returns a ``ShardPlacementResult``
per parameter: experts on ``efsdp`` (``Shard(1)`` when ``efsdp * ep`` ranks
outnumber the experts), the rest on ``dp``. Every case trains against a
single-process reference on the whole batch; where it runs under fsdp2 it
also trains upstream's ``fully_shard`` on the same meshes and requires the
same losses and parameters to the bit, and the same collectives in the same
order. Expert gradients come from all ranks of their ``ep`` group, so they
are summed and divided by the world size (``set_gradient_divide_factor(W)``
and, on gloo, ``set_force_sum_reduction_for_comms``), as the reference's mean.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as upstream
from _impl import IMPL, ShardPlacementResult, fully_shard
from _multiproc import launch_dir, run_ranks
from checks import (
    ATOL,
    RTOL,
    assert_losses_match,
    check_case,
    full_params,
    on_collectives,
    train_alone,
    train_steps,
)
from models import (
    assert_params_match,
    expert_parallel,
    expert_placement,
    full,
    moe_batch,
    moe_loss,
    moe_meshes,
    shard_moe,
    toy_moe,
)
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from fsdp2 import Muon, clip_grad_norm_, enable_local_shard_step, load_latest, save_checkpoint

pytestmark = pytest.mark.skipif(
    ShardPlacementResult is None, reason="torch before 2.12 has no ShardPlacementResult"
)
if ShardPlacementResult is not None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        ShardPlacementResult as UpstreamResult,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

STEPS = 3
PER_RANK = 8


def _set_divide_factor(model, factor: float) -> None:
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(factor)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _sharded(ref, fs, result_cls, dp, sparse, ep, world_size, division="world", **kwargs):
    """``division``: "world" (sum / W), "off" (sum; torchtitan's, the loss over all ranks), None."""
    model = copy.deepcopy(ref)
    if ep > 1:
        expert_parallel(model, sparse["ep"])
    shard_moe(model, fs, result_cls, FSDPMeshInfo, dp, sparse, **kwargs)
    if ep > 1 and division == "world":
        _set_divide_factor(model, float(world_size))
    elif division == "off":
        _set_divide_factor(model, 1.0)
    return model


def _sharded_loss(world_size: int):
    """The reference's mean loss; on a sharded model, this rank's share of it (division off)."""

    def loss_fn(model, batch):
        sharded = isinstance(model.head.weight, DTensor)
        return moe_loss(model, batch) / (world_size if sharded else 1)

    return loss_fn


def _impls():
    """(fully_shard, ShardPlacementResult) under test, and upstream's beside it under fsdp2."""
    ours = [(fully_shard, ShardPlacementResult)]
    return ours + ([(upstream.fully_shard, UpstreamResult)] if IMPL == "fsdp2" else [])


def _parity(ep, num_experts, placement, steps=STEPS, division="world", shard_kw=None,
            setup=None, check_ref=True, **train):
    """Train every implementation against the reference; implementations equal bitwise."""

    def case(rank, world_size):
        dp, sparse = moe_meshes("cpu", ep)
        ref = toy_moe(num_experts=num_experts)
        batches = [moe_batch(s, PER_RANK * world_size) for s in range(steps)]
        loss_fn = _sharded_loss(world_size) if division == "off" else moe_loss
        runs = []
        for fs, result_cls in _impls():
            model = _sharded(ref, fs, result_cls, dp, sparse, ep, world_size, division,
                             **(shard_kw or {}))
            experts = model.layers[0].moe.experts.w1
            assert experts.placements[0] in (placement, Shard(placement.dim)) or (
                experts.placements[0].dim == placement.dim
            ), experts.placements
            assert_params_match(ref, model, rtol=0, atol=0)
            reference = copy.deepcopy(ref)
            more = setup(model, reference) if setup is not None else {}
            if not check_ref:
                reference = None
            ref_losses, losses = train_steps(reference, model, batches, loss_fn, rank,
                                             world_size, mean=division != "off", **train, **more)
            if reference is None:
                runs.append((losses, full_params(model)))
                continue
            if division == "off":  # each rank's share: their sum is the global mean
                losses = torch.tensor(losses)
                dist.all_reduce(losses)
                losses = losses.tolist()
            assert_losses_match(ref_losses, losses)
            assert_params_match(reference, model)
            runs.append((losses, full_params(model)))
        _assert_runs_bitwise_equal(runs)

    return case


def _assert_runs_bitwise_equal(runs: list) -> None:
    """Every run's (losses, full parameters) equals the first run's to the bit."""
    for losses, params in runs[1:]:
        assert losses == runs[0][0], (losses, runs[0][0])
        for name, value in params.items():
            assert torch.equal(value, runs[0][1][name]), name


def _unused_params(model, ref):
    for m in (model, *model.layers):
        m.set_reduce_scatter_unused_params(True)
    return {}


def _explicit_prefetch(model, ref=None):
    """torchtitan's lists: each block prefetches the next in forward, the previous in backward."""
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
    return {}


def _checkpointed(model, ref):
    model.checkpoint_layers = ref.checkpoint_layers = True
    return {}


def _clipped(model, ref):
    """One clip_grad_norm_ over parameters on dp, efsdp x ep: the reference's norm, once."""

    def clip():
        norm = clip_grad_norm_(model.parameters(), 0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(norm.full_tensor() if isinstance(norm, DTensor) else norm,
                                   ref_norm, rtol=1e-5, atol=1e-6)

    return {"after_backward": clip}


def _flat_step(model, ref):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    enable_local_shard_step(opt)
    return {"opts": (torch.optim.AdamW(ref.parameters(), lr=1e-2), opt)}


def _muon_experts(ep, num_experts):
    """fsdp2.Muon on the block matrices of a MoE as fully_shard lays them out (expert stacks
    split over ep and efsdp), on synthetic full gradients: every matrix, each expert of a
    stack on its own, equal to the bit to torch.optim.Muon on plain matrices."""

    def case(rank, world_size):
        dp, sparse = moe_meshes("cpu", ep)
        ref = toy_moe(num_experts=num_experts)
        model = _sharded(ref, fully_shard, ShardPlacementResult, dp, sparse, ep, world_size)
        hidden = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2 and "layers." in n]
        w1 = dict(hidden)["layers.0.moe.experts.w1"]
        assert len(w1.placements) == 2 and w1.placements[1] == Shard(0), w1.placements
        fulls = [full(p.detach()).clone() for _, p in hidden]
        refs = [torch.nn.Parameter(m) for f in fulls for m in (f.unbind(0) if f.ndim == 3 else [f])]
        hyper = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
        muon, ref_muon = Muon(hidden, **hyper), torch.optim.Muon(refs, **hyper)
        gen = torch.Generator().manual_seed(5)
        for step in range(STEPS):
            grads = [torch.randn(f.shape, generator=gen) for f in fulls]
            for (_, p), g in zip(hidden, grads):
                replicated = distribute_tensor(g, p.device_mesh, [Replicate()] * p.device_mesh.ndim)
                p.grad = replicated.redistribute(p.device_mesh, p.placements)
            per_matrix = [m for g in grads for m in (g.unbind(0) if g.ndim == 3 else [g])]
            for q, g in zip(refs, per_matrix):
                q.grad = g.clone()
            muon.step()
            ref_muon.step()
            got = [full(p.detach()) for _, p in hidden]
            got = [m for g in got for m in (g.unbind(0) if g.ndim == 3 else [g])]
            for i, (a, b) in enumerate(zip(got, refs)):
                assert torch.equal(a, b.detach()), f"step {step}: matrix {i} differs"

    return case


def _dcp_round_trip(rank, world_size):
    """state_dict() through DCP into a model of other values: the same parameters, bitwise."""
    dp, sparse = moe_meshes("cpu", 2)
    model = _sharded(toy_moe(), fully_shard, ShardPlacementResult, dp, sparse, 2, world_size)
    train_alone(model, [moe_batch(0, PER_RANK * world_size)], moe_loss, rank, world_size)
    folder = launch_dir("dcp")
    dcp.save({"model": model.state_dict()}, checkpoint_id=folder)
    other = _sharded(toy_moe(seed=1), fully_shard, ShardPlacementResult, dp, sparse, 2,
                     world_size)
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    other.load_state_dict(state["model"])
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert p.placements == q.placements and torch.equal(p.to_local(), q.to_local()), name
    batch = moe_batch(1, PER_RANK * world_size)
    assert train_alone(model, [batch], moe_loss, rank, world_size) == train_alone(
        other, [batch], moe_loss, rank, world_size)


def _collective_order(ep, num_experts, setup=None, **kwargs):
    """One step's collectives (kind, ranks, numel), in order, equal to upstream's."""

    def case(rank, world_size):
        if IMPL != "fsdp2":
            return
        dp, sparse = moe_meshes("cpu", ep)
        ref = toy_moe(num_experts=num_experts)
        batch = moe_batch(0, PER_RANK * world_size)
        logs = []
        for fs, result_cls in _impls():
            model = _sharded(ref, fs, result_cls, dp, sparse, ep, world_size, **kwargs)
            if setup is not None:
                setup(model)
            log = []

            def record(kind, args, kwargs, log=log):
                group = kwargs.get("group")
                t = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
                log.append((kind, tuple(dist.get_process_group_ranks(group)), t.numel()))

            tokens, targets = (t.chunk(world_size)[rank] for t in batch)
            with on_collectives(record):
                for _ in range(2):
                    moe_loss(model, (tokens, targets)).backward()
            logs.append(log)
        assert logs[0] == logs[1], "\n".join(f"{a} | {b}" for a, b in zip(*logs))

    return case


_MESHES: dict = {}


def _mesh(sizes, names):
    """One mesh object per layout and process: ``distribute_module`` on a second, equal mesh
    leaves the parameters on the first, and the SPMD path demands the very mesh object."""
    if (sizes, names) not in _MESHES:
        _MESHES[(sizes, names)] = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    return _MESHES[(sizes, names)]


def _spmd_sharded(ref, fs, result_cls, dense, sparse, world_size):
    """torchtitan's full-DTensor recipe: parameters DTensors on their whole mesh, mesh infos
    from torch's ``_get_mesh_info(mesh, DataParallelMeshDims(...))``: dense on ``dp`` of
    ``dense``, experts (``Shard(0)`` on ``ep``) on ``efsdp`` of ``sparse``."""
    model = copy.deepcopy(ref)
    for layer in model.layers:
        experts = layer.moe.experts
        for name in ("w1", "w2"):
            full = getattr(experts, name).detach()
            value = distribute_tensor(full, sparse, [Replicate(), Shard(0)])
            setattr(experts, name, torch.nn.Parameter(value))
        layer.moe.ep_group = sparse["ep"].get_group()
    distribute_module(model, dense)  # the rest: Replicate on dense
    dims, expert_dims = upstream.DataParallelMeshDims(shard="dp"), upstream.DataParallelMeshDims(
        shard="efsdp")
    dp_info, expert_info = _get_mesh_info(dense, dims), _get_mesh_info(sparse, expert_dims)
    assert dp_info.is_spmd_mesh and expert_info.spmd_mesh is sparse
    placement = expert_placement(model.layers[0].moe.num_experts, sparse)
    for layer in model.layers:
        experts = set(layer.moe.experts.parameters())

        def place(p, experts=experts):
            if p in experts:
                return result_cls(placement=placement, mesh_info=expert_info)
            return result_cls(placement=Shard(0), mesh_info=dp_info)

        fs(layer, mesh=dense, dp_mesh_dims=dims, shard_placement_fn=place)
    fs(model, mesh=dense, dp_mesh_dims=dims)
    _set_divide_factor(model, float(world_size))
    return model


def _spmd_parity(ep, num_experts):
    """DataParallelMeshDims mesh infos: the reference's training, upstream's to the bit."""

    def case(rank, world_size):
        dense = _mesh((world_size,), ("dp",))
        sparse = _mesh((world_size // ep, ep), ("efsdp", "ep"))

        def loss_fn(model, batch):  # a sharded model takes its tokens as Replicate DTensors
            tokens, targets = batch
            if not isinstance(model.head.weight, DTensor):
                return moe_loss(model, batch)
            tokens = DTensor.from_local(tokens, dense, [Replicate()], run_check=False)
            return torch.nn.functional.cross_entropy(model(tokens).to_local(), targets)

        ref = toy_moe(num_experts=num_experts)
        batches = [moe_batch(s, PER_RANK * world_size) for s in range(STEPS)]
        runs = []
        for fs, result_cls in _impls():
            model = _spmd_sharded(ref, fs, result_cls, dense, sparse, world_size)
            w1 = model.layers[0].moe.experts.w1
            assert w1.device_mesh == sparse, w1.device_mesh
            efsdp_placement, ep_placement = w1.placements  # Shard(0) on efsdp: a strided shard
            assert efsdp_placement.dim == expert_placement(num_experts, sparse).dim, w1.placements
            assert ep_placement == Shard(0), w1.placements
            assert model.head.weight.device_mesh == dense
            assert_params_match(ref, model, rtol=0, atol=0)
            reference = copy.deepcopy(ref)
            ref_losses, losses = train_steps(reference, model, batches, loss_fn, rank, world_size)
            assert_losses_match(ref_losses, losses)
            assert_params_match(reference, model)
            runs.append((losses, full_params(model)))
        _assert_runs_bitwise_equal(runs)

    return case


def _profile_labels(rank, world_size):
    """One step's ``FSDP::`` profiler ranges: upstream's labels, ``[pg=N]`` (each group's shard
    size) on every group of a call with several (``dp`` 4 ranks, ``efsdp`` 2)."""
    dp, sparse = moe_meshes("cpu", 2)
    labels = []
    for fs, result_cls in _impls():
        model = _sharded(toy_moe(), fs, result_cls, dp, sparse, 2, world_size)
        tokens, targets = (t.chunk(world_size)[rank] for t in moe_batch(0, PER_RANK * world_size))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            moe_loss(model, (tokens, targets)).backward()
        labels.append(sorted({e.key for e in prof.key_averages() if e.key.startswith("FSDP::")}))
    for pg in (2, 4):
        assert f"FSDP::pre_forward (layers.0) [pg={pg}]" in labels[0], labels[0]
    assert "FSDP::pre_forward" in labels[0], labels[0]  # the root: one group, no [pg=]
    for other in labels[1:]:
        assert other == labels[0], sorted(set(other) ^ set(labels[0]))


def _refusals(rank, world_size):
    """Upstream's classes and messages."""
    dp, sparse = moe_meshes("cpu", 2)
    dp_info = FSDPMeshInfo(mesh=dp, shard_mesh_dim=0)
    ef_info = FSDPMeshInfo(mesh=sparse["efsdp"], shard_mesh_dim=0)
    ef_twin = FSDPMeshInfo(mesh=sparse["efsdp"], shard_mesh_dim=0)

    def raises(exc, text, fn):
        try:
            fn()
        except exc as e:
            assert text in str(e), (text, str(e))
            return
        raise AssertionError(f"expected {exc.__name__}: {text}")

    same_pg = "Params sharing the same process group must use the same FSDPMeshInfo object"
    model = toy_moe()
    block = model.layers[0]
    w1 = block.moe.experts.w1
    raises(ValueError, same_pg, lambda: fully_shard(block, mesh=dp, shard_placement_fn=lambda p: (
        ShardPlacementResult(Shard(0), ef_info if p is w1 else ef_twin))))
    model = toy_moe()
    block = model.layers[0]
    raises(ValueError, same_pg, lambda: fully_shard(block, mesh=dp, shard_placement_fn=lambda p: (
        None if p is block.norm.weight else ShardPlacementResult(Shard(0), dp_info))))
    efsdp = sparse["efsdp"].size()
    if efsdp > 1:  # the world size named is the parameter's own mesh's (efsdp), not dp's
        linear = torch.nn.Linear(3, 5)
        uneven = (f"FSDP does not support uneven sharding on dim 1: torch.Size([5, 3]) "
                  f"(world size: {efsdp})")
        raises(NotImplementedError, uneven, lambda: fully_shard(
            linear, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(
                Shard(p.dim() - 1), ef_info)))
    model = toy_moe()
    shard_moe(model, fully_shard, ShardPlacementResult, FSDPMeshInfo, dp, sparse)
    block = model.layers[0]
    for method, arg, what in (("set_custom_all_gather", object(), "custom comm"),
                              ("set_custom_reduce_scatter", object(), "custom comm"),
                              ("set_all_reduce_hook", lambda t: None, "hook")):
        text = (f"{method} is not supported with multiple param groups (from per-param mesh via "
                f"shard_placement_fn). The {what} would be ambiguous across groups with "
                "different meshes.")
        raises(ValueError, text, lambda m=method, a=arg: getattr(block, m)(a))
    model = toy_moe()
    raises(ValueError, "should be a factor of 2, not 4", lambda: shard_moe(
        model, fully_shard, ShardPlacementResult, FSDPMeshInfo, dp, sparse,
        reshard_after_forward=4))


CASES_4 = {
    "ep2_shard0": _parity(2, 4, Shard(0)),
    "ep2_shard1": _parity(2, 2, Shard(1)),
    # an efsdp of one rank: division off, as torchtitan (upstream divides a factor
    # twice on a one-rank group with force-sum reductions)
    "ep4_efsdp1": _parity(4, 4, Shard(0), division="off"),
    "ep1_shard1_plain": _parity(1, 2, Shard(1)),
    "spmd_ep2_shard0": _spmd_parity(2, 4),
    "spmd_ep2_shard1": _spmd_parity(2, 2),
    "order_ep2": _collective_order(2, 4),
    "order_ep2_shard1": _collective_order(2, 2),
    "order_prefetch": _collective_order(2, 4, setup=_explicit_prefetch),
    "order_raf2": _collective_order(2, 4, reshard_after_forward=2),
    "refusals": _refusals,
    "profile_labels": _profile_labels,
}
_UP = upstream  # upstream's policy objects: fsdp2 accepts them too
COMPOSE_4 = {
    "raf_true": _parity(2, 4, Shard(0), shard_kw={"reshard_after_forward": True}),
    "raf_false": _parity(2, 4, Shard(0), shard_kw={"reshard_after_forward": False}),
    "raf_2": _parity(2, 4, Shard(0), shard_kw={"reshard_after_forward": 2}),
    "mixed_precision": _parity(2, 4, Shard(0), check_ref=False, shard_kw={
        "mp_policy": _UP.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                              reduce_dtype=torch.float32)}),
    "cpu_offload": _parity(2, 4, Shard(0), shard_kw={"offload_policy": _UP.CPUOffloadPolicy(pin_memory=False)}),
    "explicit_prefetch": _parity(2, 4, Shard(0), setup=_explicit_prefetch),
    "division_off": _parity(2, 4, Shard(0), division="off"),
    "unused_params": _parity(2, 4, Shard(0), setup=_unused_params),
    "accumulation": _parity(2, 4, Shard(0), micro_batches=2),
    "activation_checkpointing": _parity(2, 2, Shard(1), setup=_checkpointed),
    "clip_grad_norm": _parity(2, 4, Shard(0), setup=_clipped),
    "flat_step": _parity(2, 2, Shard(1), setup=_flat_step),
    "muon_experts_shard0": _muon_experts(2, 4),
    "muon_experts_shard1": _muon_experts(2, 2),
    "dcp_round_trip": _dcp_round_trip,
}
CASES_2 = {
    "ep2_shard0": _parity(2, 2, Shard(0), division="off"),
    "ep1_plain": _parity(1, 4, Shard(0)),
    "order_ep2": _collective_order(2, 2),
    "refusals": _refusals,
}


@pytest.mark.parametrize("name", [n for n in CASES_4
                                  if not n.startswith(("order", "refusals", "profile"))])
def test_parity_w4(name, launch_cases):
    """W=4: MoE training equals the reference (and upstream, to the bit)."""
    check_case(launch_cases(4, CASES_4), name)


@pytest.mark.parametrize("name", [n for n in CASES_2 if not n.startswith(("order", "refusals"))])
def test_parity_w2(name, launch_cases):
    """W=2: MoE training equals the reference (and upstream, to the bit)."""
    check_case(launch_cases(2, CASES_2), name)


@pytest.mark.parametrize("name", list(COMPOSE_4))
def test_composes_w4(name, launch_cases):
    """W=4, ep=2: reshard_after_forward, mixed precision, offload, prefetch, accumulation, ..."""
    check_case(launch_cases(4, COMPOSE_4), name)


@pytest.mark.parametrize("world_size", [2, 4])
def test_collective_order_matches_upstream(world_size, launch_cases):
    """Forward, backward and prefetch collectives: upstream's groups, sizes and order."""
    cases = CASES_4 if world_size == 4 else CASES_2
    for name in cases:
        if name.startswith("order"):
            check_case(launch_cases(world_size, cases), name)


@pytest.mark.parametrize("world_size", [2, 4])
def test_refusals(world_size, launch_cases):
    """Same process group under two mesh infos, the three setters, uneven dims, int raf."""
    cases = CASES_4 if world_size == 4 else CASES_2
    check_case(launch_cases(world_size, cases), "refusals")


def test_profiler_labels_match_upstream(launch_cases):
    """Profiler ranges of a module with several groups carry upstream's `` [pg=N]``."""
    check_case(launch_cases(4, CASES_4), "profile_labels")


def test_shard_placement_result_is_torchs():
    """fsdp2.ShardPlacementResult is torch's class where torch has it."""
    import fsdp2

    assert fsdp2.ShardPlacementResult is UpstreamResult


# ---- checkpoints resharded to another world size and another expert mesh

_SAVED_AT, _TOTAL_STEPS = 2, 4


def _moe_run(ep, world_size, seed):
    """(model, optimizer, train): a MoE sharded at ``ep`` and its training loop (global losses)."""
    dp, sparse = moe_meshes("cpu", ep)
    division = "off" if ep == world_size > 1 else "world"  # efsdp of one rank: as ep4_efsdp1
    model = _sharded(toy_moe(seed=seed), fully_shard, ShardPlacementResult, dp, sparse, ep,
                     world_size, division)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank = dist.get_rank()

    def train(batches):
        if division == "world":
            return train_alone(model, batches, moe_loss, rank, world_size, opt)
        shares = torch.tensor(train_alone(model, batches, _sharded_loss(world_size), rank,
                                          world_size, opt, mean=False))
        dist.all_reduce(shares)
        return shares.tolist()

    return model, opt, train


def _full_optim_state(model, opt) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor as a full tensor, by ``fqn/key``."""
    _, osd = get_state_dict(model, opt)
    return {f"{fqn}/{key}": full(value).clone() for fqn, state in osd["state"].items()
            for key, value in state.items() if torch.is_tensor(value)}


def _moe_batches():
    return [moe_batch(s, 16) for s in range(_TOTAL_STEPS)]  # 16 tokens: any of 1, 2, 4 ranks


def _save_moe(rank, world_size, root, ep):
    """Train, ``save_checkpoint(step=...)``, train on: (uninterrupted losses, saved state)."""
    model, opt, train = _moe_run(ep, world_size, seed=0)
    losses = train(_moe_batches()[:_SAVED_AT])
    saved = full_params(model), _full_optim_state(model, opt)
    assert any("experts.w1/exp_avg" in k for k in saved[1]), sorted(saved[1])
    save_checkpoint(root, model, opt, step=_SAVED_AT)
    losses += train(_moe_batches()[_SAVED_AT:])
    return losses, saved, full_params(model)


def _resume_moe(rank, world_size, root, ep, uninterrupted):
    """``load_latest`` into a model of other values on another mesh: the saved state to the
    bit, then the uninterrupted run's losses and parameters."""
    losses, (params, optim_state), final = uninterrupted
    model, opt, train = _moe_run(ep, world_size, seed=1)
    w1 = model.layers[0].moe.experts.w1
    assert load_latest(root, model, opt) == _SAVED_AT
    for name, value in full_params(model).items():
        torch.testing.assert_close(value, params[name], rtol=0, atol=0, msg=name)
    state = _full_optim_state(model, opt)
    assert sorted(state) == sorted(optim_state), (sorted(state), sorted(optim_state))
    for key, value in state.items():
        torch.testing.assert_close(value, optim_state[key], rtol=0, atol=0, msg=key)
    resumed = train(_moe_batches()[_SAVED_AT:])
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[_SAVED_AT:]),
                               rtol=RTOL, atol=ATOL)
    for name, value in full_params(model).items():
        torch.testing.assert_close(value, final[name], rtol=RTOL, atol=ATOL, msg=name)
    return w1.device_mesh.mesh_dim_names, w1.placements


def _save_then_resume_at_ep4(rank, world_size, root):
    uninterrupted = _save_moe(rank, world_size, root, ep=2)
    dist.barrier()
    return uninterrupted, _resume_moe(rank, world_size, root, 4, uninterrupted)


def test_checkpoint_resharded_to_other_expert_meshes(tmp_path):
    """save_checkpoint at W=4 (ep=2, efsdp=2); load_latest at W=4 ep=4 (efsdp=1) and at W=2
    with plain experts on dp: model and AdamW state to the bit, then the same training."""
    root = str(tmp_path / "moe")
    uninterrupted, layout = run_ranks(_save_then_resume_at_ep4, 4, root)[0]
    assert layout[0] == ("efsdp", "ep"), layout
    layout = run_ranks(_resume_moe, 2, root, 1, uninterrupted)[0]
    assert layout[0] == ("dp",), layout
