"""fsdp2.patch_torch(): upstream's FSDP2 names routed to fsdp2, and restored.

The bookkeeping tests run in the pytest process itself and check object
identity in torch's modules (they always restore, even on failure). The
multi-rank cases share one 2-rank launch: a library-style module that binds
``from torch.distributed.fsdp import fully_shard, FSDPModule`` at import
time, imported while patched, shards with fsdp2; and a short training run
through the patched upstream names gives the very same losses and
parameters as calling the implementation under test directly.
"""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed.fsdp
from _impl import MixedPrecisionPolicy, fsdp2_only, fully_shard
from checks import check_case, train_alone
from models import (
    build_transformer,
    cpu_mesh,
    rank_slice,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.tensor import DTensor

import fsdp2

NAMES = (
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "DataParallelMeshDims",
    "share_comm_ctx",
)
# Where user code imports them from, and which of the names each module binds.
MODULES = {
    "torch.distributed.fsdp": set(NAMES),
    "torch.distributed._composable.fsdp": set(NAMES)
    - {"UnshardHandle", "DataParallelMeshDims", "share_comm_ctx"},
    "torch.distributed._composable.fsdp.fully_shard": {
        "fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
    },
}


def _modules():
    return {name: importlib.import_module(name) for name in MODULES}


def _snapshot():
    """(module name, attribute) -> the object bound there now, for every module above."""
    return {
        (mod_name, name): vars(mod).get(name, "<unbound>")
        for mod_name, mod in _modules().items()
        for name in NAMES
    }


@pytest.fixture
def torch_names():
    """torch's objects before the test; fails the test (after restoring them) if it leaks a patch."""
    before = _snapshot()
    assert torch.distributed.fsdp.fully_shard is not fsdp2.fully_shard, "a patch leaked into this test"
    yield before
    after = _snapshot()
    for (mod_name, name), obj in before.items():
        if obj != "<unbound>":
            setattr(sys.modules[mod_name], name, obj)
    assert after == before, "torch's names were not restored"


def _assert_patched(before):
    for mod_name, bound in MODULES.items():
        module = sys.modules[mod_name]
        for name in NAMES:
            if name in bound:
                got = vars(module)[name]
                assert got is getattr(fsdp2, name), f"{mod_name}.{name} is {got!r}, not fsdp2's"
            else:  # patch only names the module binds; add none
                assert name not in vars(module), f"patch added {mod_name}.{name}"
    # upstream's private implementation package is left alone
    private = importlib.import_module("torch.distributed.fsdp._fully_shard")
    assert private.fully_shard is before[("torch.distributed.fsdp", "fully_shard")]
    assert private.FSDPModule is before[("torch.distributed.fsdp", "FSDPModule")]


def _assert_restored(before):
    assert _snapshot() == before  # the very same objects (dict == compares by identity here)
    for key, obj in _snapshot().items():
        assert obj is before[key], key


@fsdp2_only
def test_patch_replaces_every_name_in_every_module_and_undo_restores(torch_names):
    """Every public name is fsdp2's in all three modules while patched; undo puts torch's back."""
    for mod_name, bound in MODULES.items():  # the expectations match this torch
        assert bound <= set(vars(importlib.import_module(mod_name))), mod_name
    handle = fsdp2.patch_torch()
    try:
        assert handle.active
        _assert_patched(torch_names)
    finally:
        handle.undo()
    assert not handle.active
    _assert_restored(torch_names)


@fsdp2_only
def test_context_manager_restores_on_exit_and_on_error(torch_names):
    """`with patch_torch():` patches inside the block and restores on exit, also after an error."""
    with fsdp2.patch_torch() as handle:
        _assert_patched(torch_names)
        assert handle.active
    assert not handle.active
    _assert_restored(torch_names)
    with pytest.raises(KeyError), fsdp2.patch_torch():
        _assert_patched(torch_names)
        raise KeyError("boom")
    _assert_restored(torch_names)


@fsdp2_only
def test_repeated_and_nested_patches_keep_the_originals(torch_names):
    """A second patch neither stacks nor loses torch's objects; the last undo restores them."""
    first = fsdp2.patch_torch()
    second = fsdp2.patch_torch()
    try:
        _assert_patched(torch_names)
        second.undo()
        second.undo()  # harmless; must not release `first` as well
        _assert_patched(torch_names)
        with fsdp2.patch_torch():
            with fsdp2.patch_torch():
                _assert_patched(torch_names)
            _assert_patched(torch_names)  # inner exit leaves the outer patch in place
        _assert_patched(torch_names)
    finally:
        first.undo()
        second.undo()
    _assert_restored(torch_names)
    with fsdp2.patch_torch():  # patching again after a full undo works
        _assert_patched(torch_names)
    _assert_restored(torch_names)


_FRESH_PROCESS = """
import sys, fsdp2, torch.distributed.fsdp as F
assert "torch.distributed._composable.fsdp" not in sys.modules
original = F.fully_shard
with fsdp2.patch_torch():
    import torch.distributed._composable.fsdp as legacy
    assert legacy.fully_shard is fsdp2.fully_shard
assert legacy.fully_shard is original and F.fully_shard is original, legacy.fully_shard
"""


@fsdp2_only
def test_legacy_alias_first_imported_by_the_patch_is_restored_too():
    """In a fresh process the patch imports the legacy alias itself; undo restores torch's there too."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]


_LIBRARY = '''
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, UnshardHandle, fully_shard
from torch.distributed._composable.fsdp import fully_shard as legacy_fully_shard


def shard(model, mesh, mp_policy=None):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
    legacy_fully_shard(model, mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
    assert isinstance(model, FSDPModule)
    return model
'''


def _import_library(name: str) -> types.ModuleType:
    """A module whose source binds torch's FSDP2 names at import, like torchtune's."""
    module = types.ModuleType(name)
    exec(compile(_LIBRARY, f"<{name}>", "exec"), module.__dict__)
    return module


@fsdp2_only
def test_import_order_rule(torch_names):
    """A library imported before the patch keeps torch's names; one imported while patched keeps fsdp2's."""
    before_lib = _import_library("lib_before")
    with fsdp2.patch_torch():
        during_lib = _import_library("lib_during")
        assert before_lib.fully_shard is torch_names[("torch.distributed.fsdp", "fully_shard")]
    assert during_lib.fully_shard is fsdp2.fully_shard
    assert during_lib.legacy_fully_shard is fsdp2.fully_shard
    assert during_lib.FSDPModule is fsdp2.FSDPModule


def _library_case(rank, world_size):
    # Upstream's policy created before the patch (e.g. an accelerate plugin
    # built too early) is still understood by fsdp2 while patched.
    early_policy = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with fsdp2.patch_torch():
        lib = _import_library("toy_library")
        assert lib.fully_shard is fsdp2.fully_shard and lib.FSDPModule is fsdp2.FSDPModule
        model = lib.shard(build_transformer(seed=3), cpu_mesh(), mp_policy=early_policy)
        assert isinstance(model, fsdp2.FSDPModule)
        assert isinstance(model, torch.distributed.fsdp.FSDPModule)
        assert all(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in model.layers)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        handle = model.layers[0].unshard(async_op=True)
        assert isinstance(handle, lib.UnshardHandle)
        handle.wait()
        dtypes = []
        model.layers[0].register_forward_hook(lambda mod, args, out: dtypes.append(out.dtype))
        batch = rank_slice(transformer_batch(0, 2 * world_size), rank, world_size)
        transformer_loss(model, batch).backward()
        assert dtypes == [torch.bfloat16], dtypes  # the early upstream policy took effect
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    # after the patch: the name is torch's class again, fsdp2's module is not one of its
    assert torch.distributed.fsdp.FSDPModule is not fsdp2.FSDPModule
    assert not isinstance(model, torch.distributed.fsdp.FSDPModule)


def _batches(world_size):
    return [transformer_batch(step, 2 * world_size) for step in range(3)]


def _training_case(rank, world_size):
    policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = build_transformer(seed=7)
    direct = shard_transformer(
        copy.deepcopy(base), fully_shard, mesh=cpu_mesh(), mp_policy=MixedPrecisionPolicy(**policy)
    )
    with fsdp2.patch_torch():
        upstream = torch.distributed.fsdp  # looked up at call time, as libraries do
        patched = shard_transformer(
            copy.deepcopy(base), upstream.fully_shard, mesh=cpu_mesh(),
            mp_policy=upstream.MixedPrecisionPolicy(**policy),
        )
        assert isinstance(patched, fsdp2.FSDPModule), type(patched).__mro__
        patched_losses = train_alone(patched, _batches(world_size), transformer_loss, rank,
                                     world_size)
    direct_losses = train_alone(direct, _batches(world_size), transformer_loss, rank, world_size)
    assert patched_losses == direct_losses, (patched_losses, direct_losses)
    for (name, p), q, p0 in zip(patched.named_parameters(), direct.parameters(), base.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        assert not torch.equal(p.full_tensor(), p0), f"{name} did not train"


def _spmd_case(rank, world_size):
    """dp_mesh_dims and share_comm_ctx through the patched names, and an early upstream dims object."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module

    early_dims = torch.distributed.fsdp.DataParallelMeshDims(shard="dp")  # made before the patch
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    with fsdp2.patch_torch():
        upstream = torch.distributed.fsdp
        assert upstream.DataParallelMeshDims is fsdp2.DataParallelMeshDims
        assert upstream.share_comm_ctx is fsdp2.share_comm_ctx
        chunks = []
        for dims in (upstream.DataParallelMeshDims(shard="dp"), early_dims):
            chunk = build_transformer(seed=5).layers[0]
            distribute_module(chunk, mesh)
            chunks.append(upstream.fully_shard(chunk, mesh=mesh, dp_mesh_dims=dims))
            assert isinstance(chunk, fsdp2.FSDPModule)
            assert all(p.placements[0].is_shard() for p in chunk.parameters())
        upstream.share_comm_ctx(chunks)  # upstream's would refuse fsdp2 modules


CASES = {"library": _library_case, "training": _training_case, "spmd": _spmd_case}


@fsdp2_only
def test_library_binding_names_while_patched_shards_with_fsdp2(launch_cases):
    """`from torch.distributed.fsdp import fully_shard, FSDPModule` while patched yields fsdp2 modules."""
    check_case(launch_cases(2, CASES), "library")


def test_training_through_patched_names_matches_direct_calls(launch_cases):
    """2-rank bf16 training via torch.distributed.fsdp's patched names: same losses as direct calls."""
    check_case(launch_cases(2, CASES), "training")


@fsdp2_only
def test_dp_mesh_dims_and_share_comm_ctx_through_patched_names(launch_cases):
    """DataParallelMeshDims / share_comm_ctx looked up in torch.distributed.fsdp while patched are fsdp2's."""
    check_case(launch_cases(2, CASES), "spmd")
