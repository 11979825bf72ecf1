"""Every use of a private torch API, in one place: this package.

Each helper names the private symbol it wraps and the torch versions it was
checked on. If a future torch release moves one of these, this package is
the only code that changes. DTensor's and DeviceMesh's private parts (local
tensors and specs, strided and own-rows placements, the sharding
propagator and redistribute planner) are in ``dtensor.py``, re-exported
here; everything else (autograd, storages, process groups, optimizers'
hooks, fake tensors, DCP's writer, pipelining) is below.

Checked on torch 2.11, 2.13, 2.14 and 2.15, each range below ending at 2.15:
2.13 and 2.15 run the whole suite in CI; ``tests/test_torch_compat.py``
looks up every private symbol named here (run on 2.13, 2.14 and 2.15); 2.11
(the GPU machine's) was audited by reading. Every symbol below predates 2.11
(the newest are ``DeviceMesh._concatenate``, symmetric memory's
``set_backend`` / ``get_mem_pool`` and ``torch.cuda.use_mem_pool``, all 2.9)
or is looked up with a fallback (``Backend.supports_tensor_alloc``,
``DeviceMesh._concatenate``); the public collectives fall back from
``all_gather_single`` / ``reduce_scatter_single`` (2.13) to
``all_gather_into_tensor`` / ``reduce_scatter_tensor``. What 2.11 lacks is
upstream's ``DataParallelMeshDims`` and ``share_comm_ctx`` (2.12 / 2.13):
fsdp2 has its own, and only recognises upstream's where torch has it.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

# Checked on torch 2.6 - 2.15.
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401

from .dtensor import (  # noqa: F401 (re-exported: the one place to import them from)
    ShardWithOwnRows,
    cache_keys_see_local_tensors,
    concatenate_meshes,
    dtensor_like,
    dtensor_parameter,
    dtensor_spec,
    dtensor_state_like,
    flatten_mesh,
    gather_rows_on_mesh_dim,
    is_dtensor_spec,
    is_strided_shard,
    local_tensor,
    local_tensors,
    op_schema_like,
    same_dtensor_spec,
    same_dtensor_specs,
    set_local_tensor,
    strided_shard,
    strided_split_factor,
    transform_info,
    upstream_shard_placement_result,
    with_output_spec,
    wrap_redistribute_planning,
    wrap_sharding_propagation,
)


def fast_grad_access() -> Any:
    """A context in which reading or setting a DTensor parameter's ``.grad`` skips the Python round.

    ``DTensor.__torch_function__`` is torch's disabled implementation, yet a
    ``.grad`` read or write on a DTensor still goes through the
    ``__torch_function__`` protocol (about 0.5 us and, when setting ``None``,
    more): the optimizer step and ``zero_grad`` do it for every parameter.
    Under ``torch._C.DisableTorchFunctionSubclass`` (torch 2.0 - 2.15) the
    access is the plain tensor's; torch function *modes* still see it. Where
    DTensor ever handles ``__torch_function__`` itself, this is a no-op.
    """
    if DTensor.__torch_function__ is torch._C._disabled_torch_function_impl:
        return torch._C.DisableTorchFunctionSubclass()
    return contextlib.nullcontext()


def version_counters(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's in-place write counter, in one pass looped in C.

    Wraps ``Tensor._version`` (torch 1.x - 2.15; checked on 2.13 and 2.15):
    every in-place op bumps it, views share their base's, a storage of one's
    own (DLPack) has its own. No public API tells that a tensor was written.
    """
    return list(map(_VERSION, tensors))


_VERSION = operator.attrgetter("_version")


def storage_shared(t: torch.Tensor) -> bool:
    """Whether some tensor (or storage object) other than ``t`` uses ``t``'s storage.

    Wraps ``torch._C._storage_Use_Count`` (torch 2.1 - 2.15; checked on 2.13
    and 2.15): the C++ reference count of the storage, counting each tensor
    (not each Python reference) that uses it and the temporary storage object
    this call makes. No public API tells whether a tensor's memory is also
    reached through another tensor.
    """
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2


def set_writer_file_system(writer: Any, file_system: Any) -> None:
    """Make DCP's ``FileSystemWriter`` open, rename and remove its files through ``file_system``.

    Sets the writer's ``fs`` attribute, through which ``_FileSystemWriter``
    does all its file operations (torch 2.4 - 2.15; checked on 2.13 and
    2.15). DCP's public hook on streams (``_extensions``) transforms each
    item's bytes and records itself in the metadata, which readers must then
    know; it cannot observe a file as written.
    """
    if not hasattr(writer, "fs"):
        raise RuntimeError(
            f"torch {torch.__version__}: FileSystemWriter has no 'fs' attribute any more; "
            "save with checksums=False, or use a torch fsdp2 supports"
        )
    writer.fs = file_system


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (views of views included), or ``None``.

    Wraps ``Tensor._base`` (torch 1.x - 2.15): the flat step finds the
    reduce-scatter output its gradients view without making a tensor.
    """
    return tensor._base


def mark_composable_api(module: nn.Module, api: str = "fully_shard") -> None:
    """Record in torch's composable-API registry of ``module`` that ``api`` was applied.

    torch's own composable APIs read it: ``replicate()`` leaves the parameters
    of modules marked ``fully_shard`` to FSDP (and refuses to wrap such a
    module itself). Wraps ``torch.distributed._composable.contract.REGISTRY_KEY``
    and ``RegistryItem`` (torch 2.2 - 2.15).
    """
    from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem

    registry = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
    registry.setdefault(api, RegistryItem())


def composable_apis(module: nn.Module) -> tuple[str, ...]:
    """Names of torch composable APIs applied to ``module`` (e.g. ``"replicate"``).

    Reads ``torch.distributed._composable.contract._get_registry`` (torch 2.2 - 2.15).
    """
    from torch.distributed._composable.contract import _get_registry

    return tuple(_get_registry(module) or ())


_F = TypeVar("_F", bound=Callable[..., Any])


def outside_functorch(fn: _F) -> _F:
    """``fn``, run with ``torch.func`` transforms (``jvp``, ``vmap``, ...) switched off.

    Inside a transform every op's output is wrapped for that transform
    (a functorch ``TensorWrapper``, whose storage cannot be read); FSDP's
    bookkeeping on its own buffers (all-gathers, copies, views of the flat
    shard, swapping parameters) must make plain tensors, which the model's
    forward then uses like any other parameter. One C call when no transform
    is active (these run on every hook). Wraps
    ``torch._C._are_functorch_transforms_active`` and
    ``torch._C._DisableFuncTorch`` (torch 2.0 - 2.15).
    """
    active, disabled = torch._C._are_functorch_transforms_active, torch._C._DisableFuncTorch

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if active():
            with disabled():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def set_requires_grad(tensor: torch.Tensor, requires_grad: bool) -> None:
    """``tensor.requires_grad_(requires_grad)``, also while a ``torch.func`` transform runs.

    functorch refuses ``requires_grad_`` inside a transform (meant for the
    transform's own wrapped tensors); FSDP's unsharded parameters are plain
    tensors made with the transform switched off (``outside_functorch``) and
    follow their sharded parameter's flag. Wraps
    ``torch._functorch.eager_transforms.enable_inplace_requires_grad``
    (torch 2.0 - 2.15).
    """
    if torch._C._are_functorch_transforms_active():
        from torch._functorch.eager_transforms import enable_inplace_requires_grad

        with enable_inplace_requires_grad(True):
            tensor.requires_grad_(requires_grad)
    else:
        tensor.requires_grad_(requires_grad)


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform is running; wraps
    ``torch._C._are_functorch_transforms_active`` (torch 2.0 - 2.15)."""
    return torch._C._are_functorch_transforms_active()


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current autograd backward pass finishes.

    Wraps ``Variable._execution_engine.queue_callback`` (torch 1.x - 2.15);
    must be called from inside a backward pass (e.g. a tensor hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """Whether the autograd engine is executing a backward pass on this thread.

    Wraps ``torch._C._current_graph_task_id`` (torch 2.0 - 2.15). Used to tell
    an activation-checkpointing recompute (forward inside backward) apart from
    a real forward.
    """
    return torch._C._current_graph_task_id() != -1


def chunk_cat(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Write ``torch.chunk(t, num_chunks)`` of every tensor, rank-major, into ``out``.

    ``out`` has shape ``(num_chunks, sum of padded chunk numels)``; chunk ``r``
    of every tensor lands in row ``r`` with zero padding. One kernel for the
    whole reduce-scatter copy-in. Wraps ``torch._chunk_cat`` (torch 2.4 - 2.15).
    """
    torch._chunk_cat(tensors, dim=0, num_chunks=num_chunks, out=out)


def foreach_mul(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """Batched ``t.mul_(scalar)``; wraps ``torch._foreach_mul_`` (2.0 - 2.15)."""
    torch._foreach_mul_(tensors, scalar)


def foreach_norm(tensors: list[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """Batched ``torch.linalg.vector_norm(t, ord)``; wraps ``torch._foreach_norm`` (2.0 - 2.15)."""
    return list(torch._foreach_norm(tensors, ord))


def post_accumulate_grad_hooks(param: torch.Tensor) -> list[Callable[[torch.Tensor], Any]]:
    """Hooks registered with ``param.register_post_accumulate_grad_hook``, in order.

    Reads ``Tensor._post_accumulate_grad_hooks`` (torch 2.1 - 2.15; ``None``
    until a hook is registered).
    """
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []


def keep_step_hooks_innermost(optimizer: torch.optim.Optimizer, pre_id: int, post_id: int) -> None:
    """Make the step pre-hook ``pre_id`` run last and the post-hook ``post_id`` first.

    Reorders ``Optimizer._optimizer_step_pre_hooks`` / ``_optimizer_step_post_hooks``
    (``OrderedDict``s keyed by ``RemovableHandle.id``; torch 2.0 - 2.15), so hooks
    around a swap of the param groups' tensors never see the swapped-in ones.
    """
    pre = optimizer._optimizer_step_pre_hooks
    if pre_id in pre and next(reversed(pre)) != pre_id:
        pre.move_to_end(pre_id)
    post = optimizer._optimizer_step_post_hooks
    if post_id in post and next(iter(post)) != post_id:
        post.move_to_end(post_id, last=False)


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``, the base class of modes that see every aten op.

    The planner's tracker and the tests use it (to count ops and live bytes). Wraps
    ``torch.utils._python_dispatch.TorchDispatchMode`` (torch 2.0 - 2.15).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def premul_sum_op(scale: float) -> Any:
    """A reduce op that multiplies every input by ``scale`` and sums (NCCL only).

    Wraps ``torch.distributed._make_nccl_premul_sum`` (torch 1.13 - 2.15).
    """
    import torch.distributed as dist

    return dist._make_nccl_premul_sum(scale)


def process_group_allocates(group: Any, device: torch.device) -> bool:
    """Whether ``group``'s backend allocates communication buffers on ``device`` itself.

    NCCL does (``ncclMemAlloc``: zero-copy and SHARP-capable buffers); gloo
    does not. Wraps ``ProcessGroup._get_backend`` (torch 2.6 - 2.15) and
    ``Backend.supports_tensor_alloc`` (torch 2.8 - 2.15; older: ``False``).
    """
    try:
        backend = group._get_backend(device)
    except RuntimeError:  # no backend for this device type
        return False
    supports = getattr(backend, "supports_tensor_alloc", None)
    return bool(supports is not None and supports(device))


def process_group_allocate(
    group: Any, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A flat tensor allocated by ``group``'s backend (see ``process_group_allocates``).

    Wraps ``ProcessGroup._get_backend`` and ``Backend.allocate_tensor``
    (torch 2.8 - 2.15).
    """
    return group._get_backend(device).allocate_tensor(numel, dtype=dtype, device=device)


def set_symm_mem_backend(backend: str) -> None:
    """Select the symmetric-memory allocation backend (e.g. ``"NCCL"``).

    Raises ``RuntimeError`` ("SymmetricMemory does not find allocation backend
    ...") where torch was built without it, e.g. every CPU-only build.
    Wraps ``torch.distributed._symmetric_memory.set_backend`` (torch 2.9 - 2.15).
    """
    from torch.distributed import _symmetric_memory

    _symmetric_memory.set_backend(backend)


def symm_mem_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat tensor in symmetric memory, from torch's per-device symmetric pool (CUDA).

    Wraps ``torch.distributed._symmetric_memory.get_mem_pool`` and
    ``torch.cuda.use_mem_pool`` (torch 2.9 - 2.15).
    """
    from torch.distributed import _symmetric_memory

    with torch.cuda.use_mem_pool(_symmetric_memory.get_mem_pool(device)):
        return torch.empty(numel, dtype=dtype, device=device)


def symm_mem_rendezvous(tensor: torch.Tensor, group: Any) -> None:
    """Exchange ``tensor``'s symmetric-memory handles over ``group`` (collective).

    Wraps ``torch.distributed._symmetric_memory.rendezvous`` (torch 2.9 - 2.15).
    """
    from torch.distributed import _symmetric_memory

    _symmetric_memory.rendezvous(tensor, group=group.group_name)


def after_stage_metadata_inference(stage_cls: type, fn: Callable[[Any], None]) -> None:
    """Make ``stage_cls`` (a ``PipelineStage`` subclass) call ``fn(stage)`` after metadata inference.

    torch 2.13's ``PipelineStage`` infers shapes on the first step by running
    one real forward and backward, then cleans up upstream's FSDP modules in
    ``PipelineStage._post_metadata_inference_cleanup`` (torch 2.13 - 2.15; absent
    before, where nothing is inferred this way and ``fn`` is never needed).
    """
    name = "_post_metadata_inference_cleanup"
    base = getattr(stage_cls, name, None)
    if base is None:
        return

    def cleanup(self: Any) -> None:
        base(self)
        fn(self)

    setattr(stage_cls, name, cleanup)


def run_module_wrap_policy(
    policy: Any, root: nn.Module, root_kwargs: dict[str, Any]
) -> dict[nn.Module, dict[str, Any]] | None:
    """The modules an FSDP1 policy object selects, with each one's keyword arguments.

    FSDP1's module-level policies (``ModuleWrapPolicy``, ``CustomPolicy``)
    subclass ``torch.distributed.fsdp.wrap._Policy`` and answer
    ``_run_policy(root, ignored_modules, root_kwargs)`` with ``{module:
    kwargs}``; ``None`` for any other policy (the plain callables, which
    ``shard_model`` walks itself). Wraps ``_Policy`` and ``_Policy._run_policy``
    (torch 2.1 - 2.15).
    """
    from torch.distributed.fsdp.wrap import _Policy

    if not isinstance(policy, _Policy):
        return None
    return policy._run_policy(root, set(), dict(root_kwargs))


def fake_tensor_mode() -> Any:
    """A new ``FakeTensorMode``: tensors with shapes, dtypes and devices but no data.

    Only the planner (``fsdp2.plan``) uses it, to run a training step of any
    size without memory. Wraps ``torch._subclasses.fake_tensor.FakeTensorMode``
    (torch 2.1 - 2.15).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Join torch's fake process group as ``rank`` of ``world_size``.

    Its collectives return at once and move nothing (outputs keep whatever
    they held); only the planner and the benchmarks use it. Wraps
    ``torch.testing._internal.distributed.fake_pg.FakeStore`` and the
    ``"fake"`` backend it registers (torch 2.2 - 2.15).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def fake_tensors_active() -> bool:
    """Whether tensors made now are fake (a ``FakeTensorMode`` is active, or tracing uses one).

    Such tensors have no data to compare or move (``fsdp2.plan``, memory
    trackers, tracing). Wraps ``torch._guards.detect_fake_mode`` (torch 2.1 - 2.15).
    """
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def default_store() -> Any:
    """The key-value store of the default process group, shared by every rank of the world.

    The rendezvous store (TCPStore, FileStore, HashStore for thread ranks) that
    ``init_process_group`` made or was given; the divergence check exchanges
    through it instead of a collective. Wraps ``torch.distributed.distributed_c10d.
    _get_default_store`` (checked on torch 2.13 and 2.15).
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def profiler_enabled() -> bool:
    """Whether a profiler is recording (so ``record_function`` ranges are worth opening).

    Wraps ``torch.autograd._profiler_enabled`` (torch 2.0 - 2.15), a C call far
    cheaper than entering ``record_function`` on every hook.
    """
    return torch.autograd._profiler_enabled()
