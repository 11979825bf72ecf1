"""fully_shard composed with tensor parallelism: FSDP+TP (2x2) and HSDP+TP (2x2x2).

The user applies ``parallelize_module`` on the mesh's tp dim first, then
``fully_shard`` with the data-parallel sub-mesh. Every rank of one data-parallel
index trains on the same slice of the global batch.
"""

from __future__ import annotations

import pytest
from _impl import fully_shard
from _multiproc import RankError, run_ranks
from checks import assert_losses_match, check_case, run_cases, train_steps
from models import (
    assert_params_match,
    build_transformer,
    make_pair,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

STEPS = 3
TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def _expected_placements(name: str, hsdp: bool) -> tuple:
    if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")):
        dp, tp = (_StridedShard(0, split_factor=2),), (Shard(0),)
    elif name.endswith(("wo.weight", "w2.weight")):
        dp, tp = (Shard(0),), (Shard(1),)
    else:  # not tensor parallel: sharded over the data-parallel mesh only
        dp, tp = (Shard(0),), ()
    return ((Replicate(),) if hsdp else ()) + dp + tp


def _tp_parity(rank, world_size, dp_dims):
    hsdp = len(dp_dims) == 2
    shape = (2, 2, 2) if hsdp else (2, 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=(*dp_dims, "tp"))
    dp_mesh = mesh[dp_dims]
    ref, model = make_pair(lambda: build_transformer(seed=21, hidden=12))
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        assert tuple(p.placements) == _expected_placements(name, hsdp), (name, p.placements)
    dp_rank = dp_mesh.get_coordinate()
    dp_rank = dp_rank[0] * dp_mesh.size(1) + dp_rank[1] if hsdp else dp_rank[0]
    batches = [transformer_batch(step, 2 * dp_mesh.size()) for step in range(STEPS)]
    ref_losses, losses = train_steps(
        ref, model, batches, transformer_loss, dp_rank, dp_mesh.size()
    )
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)  # full_tensor() of every parameter


_LAUNCHES: dict = {}


def _result(world_size: int, dp_dims: tuple):
    if world_size not in _LAUNCHES:
        cases = {"tp": lambda r, w: _tp_parity(r, w, dp_dims)}
        try:
            _LAUNCHES[world_size] = (True, run_ranks(run_cases, world_size, cases))
        except RankError as e:
            _LAUNCHES[world_size] = (False, str(e))
    return _LAUNCHES[world_size]


def test_fsdp_tp_2d():
    """FSDP+TP on a 2x2 (dp, tp) mesh: placements, full_tensor(), grads, losses match."""
    check_case(_result(4, ("dp",)), "tp")


@pytest.mark.parametrize("world_size", [8], ids=["2x2x2"])
def test_hsdp_tp_3d(world_size):
    """HSDP+TP on a 2x2x2 (replicate, shard, tp) mesh: placements, full_tensor(), grads, losses."""
    check_case(_result(world_size, ("replicate", "shard")), "tp")
