"""The parameter-major layout (``RaggedShard``) with model-parallel parameters.

Tensor parallelism (``parallelize_module`` on a tp mesh, then ``fully_shard``
on the data-parallel sub-mesh) and ``dp_mesh_dims`` meshes (parameters
DTensors on the whole SPMD mesh): the layout plans each parameter by its
local (model-parallel) rows, and the sharded DTensor carries the
``RaggedShard`` on the data-parallel dim beside the model-parallel
placements. Each configuration trains against the single-process reference
and, in the same launch, against the dim-0 layout on the same mesh: losses,
gradients and parameters to the bit (the same sums, elementwise Adam).
Checkpoints and state dicts go between the layouts. A tensor-parallel dim
that splits dim 0 (``ColwiseParallel``) puts the rows within each TP shard:
the sharded DTensor then lives on the same ranks' mesh with the tp dim first
(see [Note: Model-parallel parameters on the parameter-major layout] in
fsdp2/runtime/storage/ragged.py); on a ``dp_mesh_dims`` mesh too, flattened
shard dims included.
"""

from __future__ import annotations

import copy
import os

import pytest
import test_dp_mesh_dims as spmd_cases
import test_tensor_parallel as tp_cases
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _impl import fsdp2_only
from _multiproc import launch_dir
from checks import assert_losses_match, check_case, train_steps
from models import (
    assert_params_match,
    build_transformer,
    make_pair,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import fsdp2
from fsdp2 import DataParallelMeshDims, RaggedShard, fully_shard
from fsdp2.quant import gather_fp8_tiles

pytestmark = fsdp2_only  # fsdp2's own layout

RAGGED = {"shard_placement_fn": lambda p: RaggedShard()}


def _split_columns(name, module, mesh):
    """Every Linear weight split by columns on the last (tp) mesh dim (dim 0 whole), the
    rest replicated: a model-parallel layout the parameter-major rows compose with."""
    if not isinstance(module, nn.Linear):
        return
    prefix = [Replicate()] * (mesh.ndim - 1)
    for param_name, param in list(module.named_parameters(recurse=False)):
        last = Shard(1) if param_name == "weight" else Replicate()
        module.register_parameter(
            param_name, nn.Parameter(distribute_tensor(param.detach(), mesh, [*prefix, last])))


def _spmd(sizes, names, dims_kw, tp=None):
    """dp_mesh_dims: the reference's training, and the dim-0 layout's to the bit."""

    def case(rank, world_size):
        mesh = spmd_cases._mesh(sizes, names)
        torch.manual_seed(0)
        ref = spmd_cases._Net()
        runs = []
        for extra in ({}, RAGGED):
            model = copy.deepcopy(ref)
            distribute_module(model, mesh, tp)
            for module in (model.in_proj, model):
                fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims_kw),
                            **extra)
            runs.append(spmd_cases._train_on_dtensor_inputs(
                model, copy.deepcopy(ref), mesh, DataParallelMeshDims(**dims_kw)))
            if extra:  # the shard dim carries the rows; the others are the parameter's own
                weight = model.in_proj.weight
                assert any(isinstance(pl, RaggedShard) for pl in weight.placements), weight
        spmd_cases.assert_same_run(*runs)

    return case


def _tp_model(mesh, dp_mesh, seed, ragged, plan=tp_cases.TP_PLAN):
    model = build_transformer(seed=seed, hidden=12)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    return shard_transformer(model, fully_shard, mesh=dp_mesh, **(RAGGED if ragged else {}))


def _tensor_parallel(rank, world_size):
    """FSDP x TP (2 x 2), ColwiseParallel and RowwiseParallel: both layouts train as the
    reference does, to each other's bits; a column-parallel weight's rows lie within its
    TP shard, on the same ranks' mesh with the tp dim first."""
    mesh, dp_mesh = tp_cases._meshes(("dp",))
    dp_rank, dp_size = tp_cases._dp_rank(dp_mesh), dp_mesh.size()
    batches = [transformer_batch(step, 2 * dp_size) for step in range(3)]
    runs = []
    for ragged in (False, True):
        ref, model = make_pair(lambda: build_transformer(seed=21, hidden=12))
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], tp_cases.TP_PLAN)
        shard_transformer(model, fully_shard, mesh=dp_mesh, **(RAGGED if ragged else {}))
        ref_losses, losses = train_steps(ref, model, batches, transformer_loss, dp_rank, dp_size)
        assert_losses_match(ref_losses, losses)
        assert_params_match(ref, model)
        runs.append((losses, {n: p.full_tensor() for n, p in model.named_parameters()}))
    wo, wq = model.layers[0].attention.wo.weight, model.layers[0].attention.wq.weight
    assert isinstance(wo.placements[0], RaggedShard) and wo.placements[1] == Shard(1), wo
    assert wo.device_mesh.mesh_dim_names == ("dp", "tp"), wo.device_mesh
    assert wq.placements[0] == Shard(0) and isinstance(wq.placements[1], RaggedShard), wq
    assert wq.device_mesh.mesh_dim_names == ("tp", "dp"), wq.device_mesh
    (losses, params), (r_losses, r_params) = runs
    assert losses == r_losses
    for name, value in params.items():
        assert torch.equal(value, r_params[name]), name


def _state_dicts(rank, world_size):
    """Into the parameter-major layout from dim-0 DTensors, full tensors and a DCP checkpoint,
    and back through DCP and through ``save_checkpoint``: the same parameters, bit for bit."""
    mesh, dp_mesh = tp_cases._meshes(("dp",))
    source = _tp_model(mesh, dp_mesh, 21, ragged=False)
    train_steps(None, source, [transformer_batch(0, 4)], transformer_loss,
                tp_cases._dp_rank(dp_mesh), dp_mesh.size())
    want = {n: p.full_tensor() for n, p in source.named_parameters()}

    def check(model, how):
        for name, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), want[name]), (how, name)

    target = _tp_model(mesh, dp_mesh, 5, ragged=True)
    target.load_state_dict(source.state_dict())
    check(target, "dim-0 DTensors")
    target = _tp_model(mesh, dp_mesh, 6, ragged=True)
    target.load_state_dict({k: v.full_tensor() for k, v in source.state_dict().items()})
    check(target, "full tensors")
    for saved, ragged, seed in ((source, True, 7), (None, False, 8)):  # dim-0 -> ragged -> dim-0
        saved = saved if saved is not None else target
        folder = launch_dir(f"from-seed-{seed}")
        dcp.save(saved.state_dict(), checkpoint_id=folder)
        target = _tp_model(mesh, dp_mesh, seed, ragged=ragged)
        state = target.state_dict()
        dcp.load(state, checkpoint_id=folder)
        target.load_state_dict(state)
        check(target, f"DCP into {'ragged' if ragged else 'dim-0'}")
    # fsdp2's save writes a rank's ragged rows in pieces (tensor-parallel ones included)
    ragged = _tp_model(mesh, dp_mesh, 9, ragged=True)
    ragged.load_state_dict(source.state_dict())
    folder = os.path.join(launch_dir("save_checkpoint"), "ckpt")
    fsdp2.save_checkpoint(folder, ragged)
    target = _tp_model(mesh, dp_mesh, 10, ragged=False)
    fsdp2.load_checkpoint(folder, target)
    check(target, "save_checkpoint of ragged, into dim-0")


def _refusals(rank, world_size):
    """fp8 tiles of a tensor-parallel weight (on either layout): refused by name."""
    mesh, dp_mesh = tp_cases._meshes(("dp",))
    for ragged in (False, True):
        model = _tp_model(mesh, dp_mesh, 21, ragged=ragged)
        with pytest.raises(ValueError, match="'attention.wq.weight' is tensor-parallel"):
            gather_fp8_tiles(model.layers[0], tile=2)


CASES_2 = {"spmd_fsdp": _spmd((2,), ("rdp",), dict(shard="rdp"))}
CASES_4 = {
    "spmd_fsdp_tp": _spmd((2, 2), ("rdp4", "rtp4"), dict(shard="rdp4"), tp=_split_columns),
    # in_proj column-parallel (Shard(0) on tp, after dp): the sharded mesh puts tp first
    "spmd_fsdp_colwise": _spmd((2, 2), ("rdp5", "rtp5"), dict(shard="rdp5"),
                               tp=spmd_cases._tp_partition),
    "spmd_hsdp": _spmd((2, 2), ("rrep", "rshard"), dict(shard="rshard", replicate="rrep")),
    "spmd_flattened_shard": _spmd((2, 2), ("ra", "rb"), dict(shard=("ra", "rb"))),
    # two shard dims flattened, then a column-parallel dim: it moves before the flattened one
    "spmd_flattened_colwise": _spmd((2, 1, 2), ("ra9", "rb9", "rtp9"),
                                    dict(shard=("ra9", "rb9")), tp=spmd_cases._tp_partition),
    "tensor_parallel": _tensor_parallel,
    "state_dicts": _state_dicts,
    "refusals": _refusals,
}


def test_dp_mesh_dims_fsdp(launch_cases):
    check_case(launch_cases(2, CASES_2), "spmd_fsdp")


@pytest.mark.parametrize("case", list(CASES_4))
def test_model_parallel_at_four_ranks(case, launch_cases):
    check_case(launch_cases(4, CASES_4), case)
