"""fully_shard composed with tensor parallelism: FSDP+TP (2x2) and HSDP+TP (2x2x2).

The user applies ``parallelize_module`` on the mesh's tp dim first, then
``fully_shard`` with the data-parallel sub-mesh. Every rank of one data-parallel
index trains on the same slice of the global batch.
"""

from __future__ import annotations

import pytest
import torch
from _impl import fully_shard
from checks import (
    ATOL,
    RTOL,
    assert_losses_match,
    assert_nested_close,
    check_case,
    make_opts,
    train_steps,
)
from models import (
    assert_params_match,
    build_transformer,
    full,
    make_pair,
    rank_slice,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp2 import clip_grad_norm_, get_full_state_dict, set_full_state_dict
from fsdp2._torch_compat import strided_split_factor

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


def _meshes(dp_dims):
    """The (dp..., tp) mesh and its data-parallel sub-mesh."""
    shape = (2, 2, 2) if len(dp_dims) == 2 else (2, 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=(*dp_dims, "tp"))
    return mesh, mesh[dp_dims]


def _parallelize(model, mesh, dp_mesh):
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
    return shard_transformer(model, fully_shard, mesh=dp_mesh)


def _dp_rank(dp_mesh):
    coord = dp_mesh.get_coordinate()
    return coord[0] * dp_mesh.size(1) + coord[1] if dp_mesh.ndim == 2 else coord[0]


def _tp_parity(rank, world_size, dp_dims):
    hsdp = len(dp_dims) == 2
    mesh, dp_mesh = _meshes(dp_dims)
    ref, model = make_pair(lambda: build_transformer(seed=21, hidden=12))
    _parallelize(model, mesh, dp_mesh)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        assert tuple(p.placements) == _expected_placements(name, hsdp), (name, p.placements)
    batches = [transformer_batch(step, 2 * dp_mesh.size()) for step in range(STEPS)]
    ref_losses, losses = train_steps(
        ref, model, batches, transformer_loss, _dp_rank(dp_mesh), dp_mesh.size()
    )
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)  # full_tensor() of every parameter
    # fsdp2.clip_grad_norm_ across the 2-D / 3-D and dp-only meshes in one model
    # (torch.nn.utils.clip_grad_norm_ cannot stack norms from different meshes).
    batch = transformer_batch(STEPS, 2 * dp_mesh.size())
    transformer_loss(ref, batch).backward()
    transformer_loss(model, rank_slice(batch, _dp_rank(dp_mesh), dp_mesh.size())).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    norm = clip_grad_norm_(model.parameters(), 0.1)
    torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=RTOL, atol=ATOL, msg=name)


def _full_state_dict(rank, world_size, dp_dims):
    mesh, dp_mesh = _meshes(dp_dims)
    dp_rank, dp_size = _dp_rank(dp_mesh), dp_mesh.size()
    ref, model = make_pair(lambda: build_transformer(seed=23, hidden=12))
    _parallelize(model, mesh, dp_mesh)
    assert any(strided_split_factor(pl) for p in model.parameters() for pl in p.placements)
    msd, _ = get_full_state_dict(model)
    if rank == 0:
        assert_nested_close(msd, ref.state_dict(), "before training", 0, 0)
    ref_opt, opt = make_opts(ref, model)
    batches = [transformer_batch(step, 2 * dp_size) for step in range(3)]
    train_steps(ref, model, batches[:2], transformer_loss, dp_rank, dp_size, (ref_opt, opt))

    # gathered: DTensor's own full_tensor() bit for bit, the plain reference up to TP's sums
    msd, osd = get_full_state_dict(model, opt)
    params = dict(model.named_parameters())
    fulls = {n: full(p.detach()) for n, p in params.items()}
    states = {n: {k: full(v) for k, v in opt.state[p].items()} for n, p in params.items()}
    ref_msd, ref_osd = ref.state_dict(), get_optimizer_state_dict(ref, ref_opt)
    if rank == 0:
        assert_nested_close({n: msd[n] for n in fulls}, fulls, "model", 0, 0)
        assert_nested_close(osd["state"], states, "optim", 0, 0)
        assert_nested_close(msd, ref_msd, "model vs plain")
        assert_nested_close(osd, ref_osd, "optim vs plain")

    # the plain model's dicts (rank 0 only) into a fresh model on meta: its values exactly
    with torch.device("meta"):
        fresh = _parallelize(build_transformer(seed=99, hidden=12), mesh, dp_mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    set_full_state_dict(fresh, fresh_opt, model_state_dict=ref_msd if rank == 0 else None,
                        optim_state_dict=ref_osd if rank == 0 else None)
    assert_params_match(ref, fresh, 0, 0)
    back = get_full_state_dict(fresh, fresh_opt)
    if rank == 0:
        assert_nested_close(back, (ref_msd, ref_osd), "plain -> sharded -> plain", 0, 0)

    # the sharded model's own dicts into it: it continues bit for bit like the original
    set_full_state_dict(fresh, fresh_opt, model_state_dict=msd if rank == 0 else None,
                        optim_state_dict=osd if rank == 0 else None)
    losses = []
    for m, o in ((model, opt), (fresh, fresh_opt)):
        loss = transformer_loss(m, rank_slice(batches[2], dp_rank, dp_size))
        loss.backward()
        o.step()
        losses.append(loss.item())
    assert losses[0] == losses[1], losses
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name


def _cases(dp_dims: tuple) -> dict:
    return {
        "tp": lambda r, w: _tp_parity(r, w, dp_dims),
        "full_state_dict": lambda r, w: _full_state_dict(r, w, dp_dims),
    }


CASES = {4: _cases(("dp",)), 8: _cases(("replicate", "shard"))}  # by world size


def test_fsdp_tp_2d(launch_cases):
    """FSDP+TP on a 2x2 (dp, tp) mesh: placements, full_tensor(), grads, losses match."""
    check_case(launch_cases(4, CASES[4]), "tp")


@pytest.mark.parametrize("world_size", [8], ids=["2x2x2"])
def test_hsdp_tp_3d(world_size, launch_cases):
    """HSDP+TP on a 2x2x2 (replicate, shard, tp) mesh: placements, full_tensor(), grads, losses."""
    check_case(launch_cases(world_size, CASES[world_size]), "tp")


def test_full_state_dict_fsdp_tp_2d(launch_cases):
    """FSDP+TP (strided shards) on 2x2: full model/optimizer dicts gather exactly, load from a plain model, round-trip."""
    check_case(launch_cases(4, CASES[4]), "full_state_dict")


@pytest.mark.parametrize("world_size", [8], ids=["2x2x2"])
def test_full_state_dict_hsdp_tp_3d(world_size, launch_cases):
    """HSDP+TP on 2x2x2: full model/optimizer dicts gather exactly, load from a plain model, round-trip."""
    check_case(launch_cases(world_size, CASES[world_size]), "full_state_dict")
