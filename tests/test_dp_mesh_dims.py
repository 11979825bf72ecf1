"""fully_shard(mesh=<full SPMD mesh>, dp_mesh_dims=DataParallelMeshDims(...)).

Parameters are DTensors on the whole mesh (``distribute_module``, with a
tensor-parallel split on a ``tp`` dim where there is one); each rank feeds its
data-parallel slice of the batch as a Replicate DTensor, the ranks of one
data-parallel index the same slice. Every layout trains against a
single-process reference on the whole batch and, in the same launch, against
upstream ``fully_shard`` given the same mesh object: losses, gradients and
parameters equal upstream's to the bit, and the sharded parameters have
upstream's meshes and placements. W = 2: FSDP and DDP over one dim; W = 4:
FSDP x TP, HSDP as two named dims, two shard dims flattened, HSDP x TP, two
replicate dims flattened. The errors upstream raises for bad input are
raised here too, with its class and message.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.fsdp as upstream
import torch.nn as nn
from _impl import DataParallelMeshDims, MixedPrecisionPolicy, fully_shard
from checks import check_case
from models import assert_grads_match, assert_params_match, global_mean
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

STEPS = 3
_MESHES: dict = {}


def _mesh(sizes, names):
    """One mesh object per layout and process: upstream demands the params' very mesh object."""
    if (sizes, names) not in _MESHES:
        _MESHES[(sizes, names)] = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    return _MESHES[(sizes, names)]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(8, 12)
        self.mid_proj = nn.Linear(12, 6)
        self.out_proj = nn.Linear(6, 3)

    def forward(self, x):
        return self.out_proj(torch.tanh(self.mid_proj(torch.tanh(self.in_proj(x)))))


def _tp_partition(name, module, mesh):
    """Column-parallel in_proj, row-parallel mid_proj on the last mesh dim; the rest replicated."""
    if not isinstance(module, nn.Linear):
        return
    prefix = [Replicate()] * (mesh.ndim - 1)
    for param_name, param in list(module.named_parameters(recurse=False)):
        tp = Replicate()
        if param_name == "weight" and name == "in_proj":
            tp = Shard(0)
        elif param_name == "weight" and name == "mid_proj":
            tp = Shard(1)
        dparam = distribute_tensor(param.detach(), mesh, [*prefix, tp])
        module.register_parameter(param_name, nn.Parameter(dparam))


def _avoid_tp_dim(param):
    """Upstream's recipe: shard dim 1 where TP already shards dim 0."""
    return Shard(1) if any(isinstance(p, Shard) and p.dim == 0 for p in param.placements) else None


def _dp_index(mesh, dims) -> tuple[int, int]:
    """This rank's data-parallel index and the number of data-parallel ranks."""
    index, size = 0, 1
    for name in (*dims.replicate_names, *dims.shard_names):
        n = mesh.size(mesh.mesh_dim_names.index(name))
        index, size = index * n + mesh.get_local_rank(name), size * n
    return index, size


def _distribute_and_shard(model, shard_fn, dims_cls, mesh, dims_kw, tp, **kwargs):
    """Distribute on the whole mesh (tensor-parallel or replicated), then shard in_proj and
    the root on its data-parallel dims."""
    distribute_module(model, mesh, _tp_partition if tp else None)
    for module in (model.in_proj, model):
        shard_fn(module, mesh=mesh, dp_mesh_dims=dims_cls(**dims_kw), **kwargs)
    return model


def _train_on_dtensor_inputs(model, ref, mesh, dims, check_ref=True):
    """STEPS of Adam on the data-parallel slice, fed as Replicate DTensors on the whole mesh.

    Returns (losses, grads, params) as full tensors, every step's gradients among them
    (``checks.train_steps`` feeds plain tensors and keeps no gradients).
    """
    index, size = _dp_index(mesh, dims)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * size, 8, generator=g), torch.randn(4 * size, 3, generator=g)
        ref_loss = ((ref(x) - y) ** 2).mean()
        ref_loss.backward()
        xs, ys = (DTensor.from_local(t.chunk(size)[index], mesh, [Replicate()] * mesh.ndim,
                                     run_check=False) for t in (x, y))
        loss = ((model(xs).float() - ys) ** 2).mean()
        loss.backward()
        losses.append(global_mean(loss.full_tensor()))  # each rank's loss is its slice's
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        if check_ref:
            assert_grads_match(ref, model, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(losses[-1], ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    if check_ref:
        assert_params_match(ref, model)
    params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return losses, grads, params


def _parity(sizes, names, dims_kw, tp=False, **kwargs):
    """Train ours and upstream on one mesh; both match the reference, and each other bitwise."""
    mp = kwargs.pop("mp", None)
    check_ref = mp is None

    def case(rank, world_size):
        mesh = _mesh(sizes, names)
        dims = DataParallelMeshDims(**dims_kw)
        torch.manual_seed(0)
        ref = _Net()
        ours_kw, theirs_kw = dict(kwargs), dict(kwargs)
        if mp is not None:
            ours_kw["mp_policy"] = MixedPrecisionPolicy(**mp)
            theirs_kw["mp_policy"] = upstream.MixedPrecisionPolicy(**mp)
        ours = _distribute_and_shard(copy.deepcopy(ref), fully_shard, DataParallelMeshDims,
                                     mesh, dims_kw, tp, **ours_kw)
        theirs = _distribute_and_shard(copy.deepcopy(ref), upstream.fully_shard,
                                       upstream.DataParallelMeshDims, mesh, dims_kw, tp,
                                       **theirs_kw)
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), name
            assert p.device_mesh.mesh_dim_names == q.device_mesh.mesh_dim_names, name
            assert p.device_mesh == q.device_mesh, name
            assert tuple(p.placements) == tuple(q.placements), (name, p.placements, q.placements)
            assert torch.equal(p.to_local(), q.to_local()), name
        results = [
            _train_on_dtensor_inputs(model, copy.deepcopy(ref), mesh, dims, check_ref)
            for model in (ours, theirs)
        ]
        assert_same_run(*results)

    return case


def assert_same_run(run, other) -> None:
    """Two ``_train_on_dtensor_inputs`` results: losses, every step's gradients and the
    parameters, to the bit."""
    (losses, grads, params), (o_losses, o_grads, o_params) = run, other
    assert all(torch.equal(a, b) for a, b in zip(losses, o_losses)), (losses, o_losses)
    for step, (g, o_g) in enumerate(zip(grads, o_grads)):
        for name in g:
            assert torch.equal(g[name], o_g[name]), (step, name)
    for name in params:
        assert torch.equal(params[name], o_params[name]), name


# ---- bad input: upstream's class and message ----------------------------------------


def _raises(exc_type, match, fn):
    try:
        fn()
    except exc_type as e:
        assert match in str(e), (match, str(e))
        return
    raise AssertionError(f"expected {exc_type.__name__} containing {match!r}")


def _errors(rank, world_size):
    mesh = _mesh((world_size,), ("dp",))
    plain = _Net()
    dims = DataParallelMeshDims(shard="dp")

    def distributed(placement=None):
        placement = placement or Replicate()
        model = _Net()
        distribute_module(model, mesh, lambda n, m, msh: [
            m.register_parameter(k, nn.Parameter(distribute_tensor(v.detach(), msh, [placement])))
            for k, v in list(m.named_parameters(recurse=False))
        ])
        return model

    unnamed = init_device_mesh("cpu", (world_size,))
    _raises(ValueError, "mesh must have mesh_dim_names when dp_mesh_dims is provided",
            lambda: fully_shard(distributed(), mesh=unnamed, dp_mesh_dims=dims))
    _raises(ValueError, "Mesh dim name 'nope' not found in mesh.mesh_dim_names",
            lambda: fully_shard(distributed(), mesh=mesh,
                                dp_mesh_dims=DataParallelMeshDims(shard="nope")))
    _raises(RuntimeError, "Slicing overlapping dim_names ('dp', 'dp') is not allowed",
            lambda: fully_shard(distributed(), mesh=mesh,
                                dp_mesh_dims=DataParallelMeshDims(shard=("dp", "dp"))))
    _raises(RuntimeError, "Cannot concatenate overlapping meshes",
            lambda: fully_shard(distributed(), mesh=mesh,
                                dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="dp")))
    _raises(ValueError, "When dp_mesh_dims is provided, all parameters must be DTensors",
            lambda: fully_shard(plain, mesh=mesh, dp_mesh_dims=dims))
    # Two equal meshes, the parameters on the first. (DTensor's op caches hand
    # out the mesh object first used for equal meshes: this name is fresh.)
    first = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dq",))
    elsewhere = _Net()
    distribute_module(elsewhere, first)
    second = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dq",))
    assert elsewhere.in_proj.weight.device_mesh is first and second is not first
    _raises(ValueError, "Expected param's DTensor mesh to be the same mesh passed to fully_shard",
            lambda: fully_shard(elsewhere, mesh=second,
                                dp_mesh_dims=DataParallelMeshDims(shard="dq")))
    _raises(ValueError, "Expected Replicate() on DP shard dim 'dp' (index 0) but got S(0)",
            lambda: fully_shard(distributed(Shard(0)), mesh=mesh, dp_mesh_dims=dims))
    _raises(NotImplementedError, "reshard_after_forward as int is not yet supported with SPMD mesh",
            lambda: fully_shard(distributed(), mesh=mesh, dp_mesh_dims=dims,
                                reshard_after_forward=world_size))


CASES_2 = {
    "fsdp": _parity((2,), ("dp",), dict(shard="dp")),
    "fsdp_keep_unsharded": _parity((2,), ("dp0",), dict(shard="dp0"), reshard_after_forward=False),
    "ddp": _parity((2,), ("ddp",), dict(replicate="ddp")),
    "errors": _errors,
}
CASES_4 = {
    "fsdp_tp": _parity((2, 2), ("dp", "tp"), dict(shard="dp"), tp=True),
    "fsdp_tp_dim1": _parity((2, 2), ("dp1", "tp1"), dict(shard="dp1"), tp=True,
                            shard_placement_fn=_avoid_tp_dim),
    "fsdp_tp_bf16": _parity((2, 2), ("dp2", "tp2"), dict(shard="dp2"), tp=True,
                            mp=dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    "hsdp": _parity((2, 2), ("replicate", "shard"), dict(shard="shard", replicate="replicate")),
    "flattened_shard": _parity((2, 2), ("a", "b"), dict(shard=("a", "b"))),
    "hsdp_tp": _parity((1, 2, 2), ("rep", "fsdp", "tp3"), dict(shard="fsdp", replicate="rep"),
                       tp=True),
    "flattened_replicate": _parity((1, 2, 2), ("r1", "r2", "s"),
                                   dict(shard="s", replicate=("r1", "r2"))),
}


@pytest.mark.parametrize("name", ["fsdp", "fsdp_keep_unsharded", "ddp"])
def test_one_dim_layouts_match_upstream_and_reference(name, launch_cases):
    """W=2: FSDP (also reshard_after_forward=False) and DDP via dp_mesh_dims, vs upstream and reference."""
    check_case(launch_cases(2, CASES_2), name)


@pytest.mark.parametrize("name", list(CASES_4))
def test_multi_dim_layouts_match_upstream_and_reference(name, launch_cases):
    """W=4: FSDP x TP (also Shard(1), bf16), HSDP dims, flattened dims, HSDP x TP vs upstream."""
    check_case(launch_cases(4, CASES_4), name)


def test_bad_dp_mesh_dims_raise_upstreams_errors(launch_cases):
    """Unnamed mesh, unknown or repeated dim, plain params, another mesh, a sharded dp dim, int reshard."""
    check_case(launch_cases(2, CASES_2), "errors")


def test_dp_mesh_dims_needs_a_dim():
    """DataParallelMeshDims() without shard or replicate raises upstream's ValueError."""
    _raises(ValueError, "At least one of shard or replicate must be set in DataParallelMeshDims",
            DataParallelMeshDims)
