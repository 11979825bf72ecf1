"""Every private torch symbol ``fsdp2/_torch_compat/`` wraps exists on the installed torch.

The wrappers' docstrings state the releases they were checked on; this test
is that check, run on each torch CI tests (and by hand on others). A symbol
that moved fails here by name, before any behaviour test fails obscurely.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# (module, dotted attribute path); each is named in a wrapper's docstring.
PRIVATE_SYMBOLS = [
    ("torch.distributed.tensor", "DTensor._spec"),
    ("torch.distributed._composable.contract", "REGISTRY_KEY"),
    ("torch.distributed._composable.contract", "RegistryItem"),
    ("torch.distributed._composable.contract", "_get_registry"),
    ("torch._C", "_DisableFuncTorch"),
    ("torch._C", "DisableTorchFunctionSubclass"),
    ("torch._C", "_disabled_torch_function_impl"),
    ("torch", "Tensor._base"),
    ("torch", "Tensor._version"),
    ("torch", "_C._storage_Use_Count"),
    ("torch._C", "_are_functorch_transforms_active"),
    ("torch._C", "_current_graph_task_id"),
    ("torch.autograd.variable", "Variable._execution_engine.queue_callback"),
    ("torch", "_chunk_cat"),
    ("torch.autograd", "_profiler_enabled"),
    ("torch", "_foreach_mul_"),
    ("torch", "_foreach_norm"),
    ("torch.distributed._functional_collectives", "all_gather_single"),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"),
    ("torch.distributed.device_mesh", "DeviceMesh._get_root_mesh"),
    ("torch.distributed.tensor.placement_types", "_StridedShard"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.utils._pytree", "tree_flatten"),
    ("torch.utils._pytree", "tree_unflatten"),
    ("torch.distributed", "_make_nccl_premul_sum"),
    ("torch.distributed", "ProcessGroup._get_backend"),
    ("torch.distributed._symmetric_memory", "set_backend"),
    ("torch.distributed._symmetric_memory", "get_mem_pool"),
    ("torch.distributed._symmetric_memory", "rendezvous"),
    ("torch.distributed.pipelining.stage", "PipelineStage._post_metadata_inference_cleanup"),
    ("torch.distributed.fsdp.wrap", "_Policy._run_policy"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    ("torch._guards", "detect_fake_mode"),
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch._functorch.eager_transforms", "enable_inplace_requires_grad"),
    # ShardWithOwnRows and the wrappers ragged_placement.py's rules go through
    ("torch.distributed.tensor.placement_types", "Shard._local_shard_size_and_offset"),
    ("torch.distributed.tensor.placement_types", "Shard._to_replicate_tensor"),
    ("torch.distributed.tensor.placement_types", "Shard._replicate_to_shard"),
    ("torch.distributed.tensor.placement_types", "Shard._split_tensor"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached"),
    ("torch.distributed.tensor._op_schema", "OpSchema"),
    ("torch.distributed.tensor._op_schema", "OutputSharding"),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos_non_cached"),
    ("torch.distributed.tensor._redistribute", "_TransformInfo"),
    # cache_keys_see_local_tensors
    ("torch.distributed.tensor", "DTensor._stable_hash_for_caching"),
    # set_writer_file_system (an instance attribute: checked on an instance below)
    ("torch.distributed.checkpoint.filesystem", "FileSystem.create_stream"),
]
if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 12):
    PRIVATE_SYMBOLS.append(("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult"))


@pytest.mark.parametrize(("module", "path"), PRIVATE_SYMBOLS, ids=[p for _, p in PRIVATE_SYMBOLS])
def test_private_symbol_exists(module: str, path: str) -> None:
    obj = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(obj, part), f"{module}.{path}: {part!r} is gone in torch {torch.__version__}"
        obj = getattr(obj, part)


def test_local_tensor_attribute() -> None:
    # DTensor._local_tensor is an instance attribute: check it on a real one.
    import torch.distributed as dist

    from fsdp2._torch_compat import local_tensor

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        dt = DTensor.from_local(torch.arange(4.0), mesh)
        assert local_tensor(dt) is dt._local_tensor
        assert torch.equal(local_tensor(dt), torch.arange(4.0))
    finally:
        dist.destroy_process_group()


def test_optimizer_step_hook_dicts() -> None:
    # Optimizer._optimizer_step_pre_hooks / _post_hooks are instance attributes: check them here.
    from fsdp2._torch_compat import keep_step_hooks_innermost

    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    order = []
    mine = opt.register_step_pre_hook(lambda *a: order.append("mine-pre"))
    opt.register_step_pre_hook(lambda *a: order.append("user-pre"))
    opt.register_step_post_hook(lambda *a: order.append("user-post"))
    mine_post = opt.register_step_post_hook(lambda *a: order.append("mine-post"))
    keep_step_hooks_innermost(opt, mine.id, mine_post.id)
    opt.step()
    assert order == ["user-pre", "mine-pre", "mine-post", "user-post"]


def test_cache_keys_see_local_tensors() -> None:
    # Two DTensors of one spec (uneven shards) must not share an AOTAutograd cache key.
    import torch.distributed as dist

    from fsdp2._torch_compat import cache_keys_see_local_tensors

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        cache_keys_see_local_tensors()

        def key(rows: int) -> str:
            local = torch.zeros(rows, 4)
            dt = DTensor.from_local(local, mesh, run_check=False, shape=(8, 4), stride=(4, 1))
            return dt._stable_hash_for_caching()

        assert key(3) != key(5)  # the same spec, other local rows: other graphs
        assert key(3) == key(3)  # stable: the cache still hits
    finally:
        dist.destroy_process_group()


def test_storage_shared_counts_tensors() -> None:
    """storage_shared: a tensor alone on its storage is not shared; a second view makes it so."""
    from fsdp2._torch_compat import storage_shared

    t = torch.zeros(4)
    assert not storage_shared(t)
    v = t.view(2, 2)
    assert storage_shared(t) and storage_shared(v)
    del v
    assert not storage_shared(t)


def test_set_writer_file_system_reaches_every_file_operation(tmp_path) -> None:
    """The writer's ``fs`` exists, and the file system set there is the one the writer uses."""
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
    from torch.distributed.checkpoint.planner import SavePlan

    from fsdp2._torch_compat import set_writer_file_system

    writer = FileSystemWriter(tmp_path)
    assert isinstance(writer.fs, FileSystem)
    seen = []

    class Recording(FileSystem):
        def mkdir(self, path):
            seen.append(path)
            super().mkdir(path)

    set_writer_file_system(writer, Recording())
    writer.reset(tmp_path / "sub")
    writer.set_up_storage_writer(True)
    writer.prepare_local_plan(SavePlan([]))
    assert seen and (tmp_path / "sub").is_dir()
