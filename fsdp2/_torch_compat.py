"""Every use of a private torch API, in one place.

Each helper names the private symbol it wraps and the torch versions it was
checked on. If a future torch release moves one of these, this is the only
file that changes.

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
import dataclasses
import functools
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

# Checked on torch 2.6 - 2.15.
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401


def set_local_tensor(dtensor: DTensor, local: torch.Tensor) -> None:
    """Point ``dtensor`` at a new local tensor without changing its metadata.

    Wraps ``DTensor._local_tensor`` (torch 2.4 - 2.15). Used to keep sharded
    parameters as views of one group buffer after ``nn.Module._apply`` or
    ``load_state_dict(assign=True)`` replaced their local tensors.
    """
    dtensor._local_tensor = local


def local_tensor(dtensor: DTensor) -> torch.Tensor:
    """The local tensor of ``dtensor`` itself (no autograd, no alias).

    ``DTensor.to_local()`` is public but goes through an autograd function and
    costs tens of microseconds; hooks read this on every step.
    Wraps ``DTensor._local_tensor`` (torch 2.4 - 2.15).
    """
    return dtensor._local_tensor


def same_dtensor_spec(a: DTensor, b: DTensor) -> bool:
    """Whether ``a`` and ``b`` carry the same spec object (``dtensor_like`` shares it).

    An identity test, no property calls: the optimizer step checks it per
    parameter. Reads ``DTensor._spec`` (torch 2.4 - 2.15).
    """
    return a._spec is b._spec


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


def same_dtensor_specs(a: list[DTensor], b: list[DTensor]) -> bool:
    """``same_dtensor_spec`` over two lists, looped in C (the flat step checks every gradient).

    Reads ``DTensor._spec`` (torch 2.4 - 2.15).
    """
    spec = operator.attrgetter("_spec")
    return all(map(operator.is_, map(spec, a), map(spec, b)))


def local_tensors(dtensors: list[DTensor]) -> list[torch.Tensor]:
    """``local_tensor`` of each, looped in C. Reads ``DTensor._local_tensor`` (torch 2.4 - 2.15)."""
    return list(map(operator.attrgetter("_local_tensor"), dtensors))


def dtensor_like(template: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``template``'s mesh, placements, shape and stride around ``local``.

    ``DTensor.from_local`` does the same through an autograd function and a
    spec rebuild (tens of microseconds); gradients are built every step.
    Wraps ``DTensor(local, spec, requires_grad=...)`` and ``DTensor._spec``
    (torch 2.4 - 2.15).
    """
    return DTensor(local, template._spec, requires_grad=False)


# a parameter spec -> the spec its optimizer state carries (one per value, as torch's step makes)
_STATE_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def dtensor_state_like(template: DTensor, local: torch.Tensor) -> DTensor:
    """``dtensor_like`` for optimizer state: the spec a plain step's state would carry.

    A plain step makes state with ``torch.zeros_like(param)``; its DTensor
    spec comes out of the sharding propagator's cache: an object other than
    the parameter's, shared by the state of every parameter with an equal
    spec. ``pickle`` (``torch.save``, torchft's transports) writes each object
    once, so the parameter's own spec would change the bytes a state dict
    pickles to next to its model's. The spec is taken from that same call,
    run once per parameter spec on a ``meta`` stand-in (no memory). Wraps
    ``DTensor(local, spec, ...)``, ``DTensor._spec`` and ``DTensorSpec``
    caching its hash in ``_hash`` (torch 2.4 - 2.15).
    """
    spec = template._spec
    state_spec = _STATE_SPECS.get(spec)
    if state_spec is None:
        if any(isinstance(pl, ShardWithOwnRows) for pl in spec.placements):
            state_spec = spec  # the parameter's own: its placement says which rows
        else:
            probe = DTensor(torch.empty(local.shape, dtype=local.dtype, device="meta"), spec,
                            requires_grad=False)
            state_spec = torch.zeros_like(probe, memory_format=torch.preserve_format)._spec
            hash(state_spec)  # cached in the spec (``_hash``), as the step's next op leaves it
        _STATE_SPECS[spec] = state_spec
    return DTensor(local, state_spec, requires_grad=False)


def dtensor_parameter(template: DTensor, local: torch.Tensor, requires_grad: bool) -> DTensor:
    """A leaf DTensor parameter like ``template`` around ``local`` itself.

    ``nn.Parameter(dtensor)`` detaches the DTensor (a dispatch, ~0.2 ms) and
    the detached copy no longer holds ``local``; ``to_empty`` builds one per
    parameter. Wraps ``DTensor(local, spec, requires_grad=...)``,
    ``DTensor._spec`` and the ``_is_param`` flag ``nn.Parameter`` sets on
    tensor subclasses (torch 2.4 - 2.15).
    """
    param = DTensor(local, template._spec, requires_grad=requires_grad)
    param._is_param = True
    return param


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


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are the dims of ``meshes`` (sub-meshes of one root), in order.

    Wraps ``DeviceMesh._concatenate`` (torch 2.9 - 2.15); older versions slice
    the root mesh (``DeviceMesh._get_root_mesh``) by the dims' names.
    """
    concat = getattr(DeviceMesh, "_concatenate", None)
    if concat is not None:
        return concat(meshes)
    names = tuple(name for m in meshes for name in m.mesh_dim_names)
    return meshes[0]._get_root_mesh()[names]


def strided_shard(dim: int, split_factor: int) -> Placement:
    """FSDP's shard of a tensor dim that tensor parallelism already split ``split_factor`` ways.

    Wraps ``torch.distributed.tensor.placement_types._StridedShard`` (torch
    2.5 - 2.15): the FSDP shard is taken within each TP shard, so
    ``full_tensor()`` must undo TP's split first.
    """
    return _StridedShard(dim, split_factor=split_factor)


def strided_split_factor(placement: Placement) -> int | None:
    """The ``split_factor`` of a strided shard (see ``strided_shard``); ``None`` for any other.

    Wraps ``isinstance(placement, _StridedShard)`` and ``_StridedShard.split_factor``
    (torch 2.5 - 2.15). Older releases make it a subclass of ``Shard``, 2.13
    does not: ask this before ``isinstance(placement, Shard)``. Older releases
    also accept only even splits, where their layout and 2.13's agree.
    """
    if isinstance(placement, _StridedShard):
        return int(placement.split_factor)
    return None


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


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over all of ``mesh``'s dims (one process group per flattened row).

    Creating it is collective over the ranks of the root mesh, like any mesh
    slicing that makes groups. Wraps ``DeviceMesh._flatten`` (torch 2.6 - 2.15).
    """
    return mesh._flatten(name)


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


def upstream_shard_placement_result() -> type | None:
    """torch's ``ShardPlacementResult``, or ``None`` on a torch without it.

    Wraps ``torch.distributed.fsdp._fully_shard._fsdp_common.ShardPlacementResult``
    (torch 2.12 - 2.15; checked on 2.13 and 2.15): fsdp2 re-exports the same
    class object so ``isinstance`` holds whichever import a script uses.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:
        return None
    return ShardPlacementResult


class ShardWithOwnRows(Shard):
    """``Shard`` whose rows per rank its subclass decides, through public-named hooks.

    DTensor asks a ``Shard`` placement which rows each rank holds and how to
    split or gather them through private methods; this overrides them
    (``Shard._local_shard_size_and_offset``, ``Shard._split_tensor``,
    ``Shard._to_replicate_tensor``, ``Shard._replicate_to_shard``; torch 2.13 -
    2.15, checked on both; the signatures are 2.13's, which 2.15 keeps) to call
    ``rows_of``, ``split``, ``gathered`` and ``rows_for``, which the subclass
    (``fsdp2.ragged_placement.RaggedShardBase``) implements.
    """

    def rows_of(self, rank: int) -> tuple[int, int]:  # (size, offset)
        raise NotImplementedError

    def split(self, tensor: torch.Tensor, with_padding: bool, contiguous: bool) -> tuple:
        raise NotImplementedError

    def gathered(self, local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
        raise NotImplementedError

    def rows_for(self, local: torch.Tensor, shard_index: int) -> torch.Tensor:
        raise NotImplementedError

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int):
        return self.rows_of(rank)

    def _split_tensor(self, tensor, num_chunks, *, with_padding=True, contiguous=True):
        return self.split(tensor, with_padding, contiguous)

    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        return self.gathered(local_tensor, mesh, mesh_dim)

    def _replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        return self.rows_for(local_tensor, shard_index)


def is_strided_shard(placement: object) -> bool:
    """``isinstance(placement, _StridedShard)`` (torch 2.6 - 2.15)."""
    return isinstance(placement, _StridedShard)


def is_dtensor_spec(value: object) -> bool:
    """Whether ``value`` is a ``DTensorSpec`` (``torch.distributed.tensor._dtensor_spec``,
    torch 2.4 - 2.15)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return isinstance(value, DTensorSpec)


def dtensor_spec(mesh: DeviceMesh, placements: tuple, tensor_meta: Any) -> Any:
    """``DTensorSpec(mesh, placements, tensor_meta=...)`` (torch 2.4 - 2.15)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return DTensorSpec(mesh, placements, tensor_meta=tensor_meta)


def op_schema_like(op_schema: Any, args_schema: Any, kwargs_schema: Any) -> Any:
    """``op_schema``'s op and schema info over other arguments (``OpSchema``, torch 2.13 -
    2.15, checked on both)."""
    from torch.distributed.tensor._op_schema import OpSchema

    return OpSchema(op_schema.op, args_schema, kwargs_schema, schema_info=op_schema.schema_info)


def with_output_spec(result: Any, output_spec: Any) -> Any:
    """A new ``OutputSharding`` like ``result`` with ``output_spec`` (torch 2.13 - 2.15)."""
    return dataclasses.replace(result, output_spec=output_spec)


def wrap_sharding_propagation(wrap: Callable[[Callable[[Any], Any]], Callable[[Any], Any]]) -> None:
    """Replace DTensor's sharding propagation (cached and not) by ``wrap`` of each.

    Wraps ``DTensor._op_dispatcher.sharding_propagator``'s
    ``propagate_op_sharding`` and ``propagate_op_sharding_non_cached``
    (torch 2.13 - 2.15, checked on both).
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    cached = propagator.propagate_op_sharding
    propagator.propagate_op_sharding_non_cached = wrap(propagator.propagate_op_sharding_non_cached)
    propagator.propagate_op_sharding = wrap(cached)


def wrap_redistribute_planning(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace DTensor's redistribute planners by ``wrap`` of each.

    Wraps ``torch.distributed.tensor._redistribute._gen_transform_infos`` and
    ``_gen_transform_infos_non_cached`` (torch 2.13 - 2.15, checked on both).
    """
    from torch.distributed.tensor import _redistribute

    _redistribute._gen_transform_infos = wrap(_redistribute._gen_transform_infos)
    _redistribute._gen_transform_infos_non_cached = wrap(
        _redistribute._gen_transform_infos_non_cached
    )


def transform_info(mesh_dim: int, src_dst: tuple, logical_shape: list[int]) -> Any:
    """One redistribute step (``_redistribute._TransformInfo``, torch 2.13 - 2.15)."""
    from torch.distributed.tensor import _redistribute

    return _redistribute._TransformInfo(mesh_dim, src_dst, logical_shape)


_LOCAL_CACHE_KEYS_INSTALLED = False


def cache_keys_see_local_tensors() -> None:
    """Make the compile cache tell DTensors apart by their local tensors too; installed once.

    AOTAutograd's on-disk cache keys a DTensor input by
    ``DTensor._stable_hash_for_caching`` (torch 2.13 - 2.15, checked on both):
    the spec (mesh, placements, *global* shape) and, on 2.15, the local
    device. Two DTensors of one spec whose local tensors differ (uneven
    shards: other rows on another rank, or on the same rank for two
    same-shaped parameters of a parameter-major group; a quantized local
    tensor on one rank and a plain one on another) then share one key, and a
    compile reuses a graph made for the other's local tensor: a size assertion
    or an ``AttributeError`` inside the compiled step (torchao's low-bit
    optimizers compile their step per parameter). This appends the local
    tensor's type, shape and stride to the key. Keys only get more specific:
    a DTensor whose local tensor matches compiles and caches as before.
    """
    global _LOCAL_CACHE_KEYS_INSTALLED
    if _LOCAL_CACHE_KEYS_INSTALLED:
        return
    import hashlib

    original = DTensor._stable_hash_for_caching

    def stable_hash_for_caching(self: DTensor) -> str:
        local = self._local_tensor
        seen = f"{original(self)}|{type(local).__qualname__}|{tuple(local.shape)}|{local.stride()}"
        return hashlib.blake2b(seen.encode(), digest_size=16).hexdigest()

    DTensor._stable_hash_for_caching = stable_hash_for_caching
    _LOCAL_CACHE_KEYS_INSTALLED = True
