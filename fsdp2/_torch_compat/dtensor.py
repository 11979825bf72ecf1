"""DTensor's and DeviceMesh's private parts, re-exported by the package.

Local tensors and specs read and built without DTensor's autograd functions
(the hooks and the optimizer step touch them every step), the strided and
own-rows placements, the mesh helpers, and the sharding propagator and
redistribute planner that ``ragged_placement.py``'s rules wrap. Each names
the private symbol it wraps and the torch versions it was checked on (see
the package's docstring for the releases checked).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..identity_cache import IdentityCache


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


# a parameter spec -> the spec its optimizer state carries (one per value, as torch's step
# makes); by identity: see [Note: Caches keyed by identity] in identity_cache.py
_STATE_SPECS: IdentityCache = IdentityCache()


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
        _STATE_SPECS.set(spec, state_spec)
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


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over all of ``mesh``'s dims (one process group per flattened row).

    Creating it is collective over the ranks of the root mesh, like any mesh
    slicing that makes groups. Wraps ``DeviceMesh._flatten`` (torch 2.6 - 2.15).
    """
    return mesh._flatten(name)


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


def gather_rows_on_mesh_dim(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """``tensor`` concatenated on dim 0 over ``mesh``'s dim ``mesh_dim``, as DTensor's own
    redistribution gathers (functional collectives, private: ``all_gather_single`` from
    torch 2.13, whose ``all_gather_tensor`` then warns it is deprecated; before, the latter)."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    gathered = gather(tensor, 0, (mesh, mesh_dim))
    return gathered.wait() if hasattr(gathered, "wait") else gathered


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
