"""Which process groups shard and replicate the parameters, and on which device.

[Note: Meshes]
FSDP: a 1-D mesh; its only dim shards. HSDP: a 2-D ``(replicate, shard)``
mesh; parameters are sharded over dim 1 and replicated over dim 0, so each
group all-gathers over its shard group and its gradients are reduce-scattered
over the shard group and then all-reduced over the replicate group.
``reshard_after_forward=k``: after forward each rank keeps its share over a
group of ``k`` consecutive ranks of its shard group (the post-forward group),
and the backward all-gather runs over that smaller group. Creating process
groups is collective, so they are all made at ``fully_shard`` time and cached.

[Note: Process-group caches are per world]
A cached process group belongs to the world (default process group) it was
made in. Ranks may be threads of one process (torch's threaded process group,
as upstream's own tests run), each with a world of its own, and one process may
destroy its process group and initialize another; in both cases a group from
another world must never be handed out. So the post-forward groups are cached
per world object (``dist.group.WORLD``, which is thread-local under the
threaded group), in a weak dictionary so a destroyed world's groups go with it,
and every rank creates its own groups. The lock guards the dictionary only,
never ``new_group``: that is a rendezvous the other ranks' threads must reach.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..._torch_compat import concatenate_meshes
from ...errors import FSDPAssertionError
from ...identity_cache import IdentityCache


@dataclass(frozen=True)
class FSDPMeshInfo:
    """The shard (and, for HSDP, replicate) dims of a data-parallel mesh, resolved at init."""

    mesh: DeviceMesh
    shard_mesh_dim: int
    shard_process_group: dist.ProcessGroup
    shard_mesh_size: int
    shard_mesh_rank: int
    replicate_mesh_dim: int | None = None
    replicate_process_group: dist.ProcessGroup | None = None
    replicate_mesh_size: int = 1
    replicate_mesh_rank: int = 0
    # dp_mesh_dims with replicate dims only (DDP): the shard group is this rank alone
    replicate_only: bool = False

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_mesh_dim is not None


@dataclass(frozen=True)
class PostForwardMeshInfo:
    """The smaller group a parameter stays sharded over between forward and backward."""

    process_group: dist.ProcessGroup
    size: int
    rank: int


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole default process group."""
    if not dist.is_initialized():
        raise ValueError(
            "fully_shard needs an initialized process group when no mesh is given: "
            "call torch.distributed.init_process_group() first or pass mesh=..."
        )
    device_type = "cpu"
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            device_type = accelerator.type
    return init_device_mesh(device_type, (dist.get_world_size(),))


def mesh_info_for(mesh: DeviceMesh) -> FSDPMeshInfo:
    """Validate ``mesh`` for FSDP (1-D) or HSDP (2-D) and describe its dims."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return FSDPMeshInfo(
            mesh=mesh,
            shard_mesh_dim=0,
            shard_process_group=mesh.get_group(0),
            shard_mesh_size=mesh.size(0),
            shard_mesh_rank=mesh.get_local_rank(0),
        )
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise FSDPAssertionError(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified\n"
                f"fully_shard got a 2-D mesh without dim names {mesh}; HSDP needs named dims: "
                "init_device_mesh(device, (replicate, shard), "
                "mesh_dim_names=('replicate', 'shard'))"
            )
        return FSDPMeshInfo(
            mesh=mesh,
            shard_mesh_dim=1,
            shard_process_group=mesh.get_group(1),
            shard_mesh_size=mesh.size(1),
            shard_mesh_rank=mesh.get_local_rank(1),
            replicate_mesh_dim=0,
            replicate_process_group=mesh.get_group(0),
            replicate_mesh_size=mesh.size(0),
            replicate_mesh_rank=mesh.get_local_rank(0),
        )
    raise ValueError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}\n"
        f"A 1-D mesh shards (FSDP), a 2-D (replicate, shard) mesh replicates and shards "
        f"(HSDP); this one is {mesh.ndim}-D. With tensor parallelism apply parallelize_module "
        "on the tp sub-mesh first and pass the data-parallel sub-mesh, e.g. mesh['dp'] or "
        "mesh['replicate', 'shard']"
    )


# world (default process group) -> (ranks, size) -> its post-forward group; see
# [Note: Process-group caches are per world].
_PostForwardGroups = dict[tuple[tuple[int, ...], int], PostForwardMeshInfo]
_POST_FORWARD_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, _PostForwardGroups] = (
    weakref.WeakKeyDictionary()
)
_POST_FORWARD_GROUPS_LOCK = threading.Lock()


def post_forward_mesh_info(mesh_info: FSDPMeshInfo, size: int) -> PostForwardMeshInfo:
    """The post-forward group of ``size`` consecutive ranks of this rank's shard group.

    Only the members of each new group take part in creating it, so meshes
    that cover part of the world (e.g. the dp sub-mesh under TP) work too.
    """
    shard_ranks = mesh_info.mesh.mesh.movedim(mesh_info.shard_mesh_dim, -1)
    # This rank's row along the shard dim, as global ranks in shard-rank order.
    rank = dist.get_rank()
    row = next(r for r in shard_ranks.reshape(-1, mesh_info.shard_mesh_size).tolist() if rank in r)
    start = (mesh_info.shard_mesh_rank // size) * size
    ranks = tuple(row[start : start + size])
    key = (ranks, size)
    world = dist.group.WORLD
    with _POST_FORWARD_GROUPS_LOCK:
        info = _POST_FORWARD_GROUPS.get(world, {}).get(key)
    if info is None:
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        info = PostForwardMeshInfo(group, size, mesh_info.shard_mesh_rank - start)
        with _POST_FORWARD_GROUPS_LOCK:
            _POST_FORWARD_GROUPS.setdefault(world, {})[key] = info
    return info


def spmd_mesh_for(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of both data-parallel and tensor-parallel dims, data-parallel dims first."""
    if dp_mesh.device_type != tp_mesh.device_type:
        raise ValueError(
            f"fully_shard's mesh is on '{dp_mesh.device_type}' but a parameter's DTensor mesh "
            f"is on '{tp_mesh.device_type}'; build both from one init_device_mesh call"
        )
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise ValueError(
            "fully_shard with DTensor (tensor parallel) parameters needs named mesh dims: "
            "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), then "
            "parallelize_module(..., mesh['tp']) and fully_shard(..., mesh=mesh['dp'])"
        )
    try:
        return concatenate_meshes([dp_mesh, tp_mesh])
    except RuntimeError as e:
        raise ValueError(
            f"fully_shard's mesh {dp_mesh} and the parameters' tensor-parallel mesh {tp_mesh} "
            f"do not come from one parent mesh with disjoint dims: {e}"
        ) from e


# mesh -> {dim order: the same ranks' mesh with its dims in that order}; by identity: an
# equal mesh over other process groups is another mesh (see [Note: Caches keyed by identity])
_REORDERED: IdentityCache[dict[tuple[int, ...], DeviceMesh]] = IdentityCache()


def reordered_mesh(mesh: DeviceMesh, order: tuple[int, ...]) -> DeviceMesh:
    """``mesh`` with its dims in ``order``, over the same process groups (none is made).

    DTensor applies placements in mesh order: a parameter-major shard *within*
    each model-parallel row shard is plain nested sharding once those dims come
    first (see [Note: Model-parallel parameters on the parameter-major layout]
    in ragged.py).
    """
    meshes = _REORDERED.get(mesh)
    if meshes is None:
        meshes = _REORDERED.set(mesh, {})
    if order not in meshes:
        names = mesh.mesh_dim_names
        meshes[order] = DeviceMesh.from_group(
            [mesh.get_group(i) for i in order], mesh.device_type,
            mesh=mesh.mesh.permute(order).contiguous(),
            mesh_dim_names=tuple(names[i] for i in order),
        )
    return meshes[order]


def device_for(mesh: DeviceMesh) -> torch.device:
    """The device parameters live on: CPU, or this rank's current accelerator."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type, None)
    if module is not None and hasattr(module, "current_device"):
        return torch.device(mesh.device_type, module.current_device())
    return torch.device(mesh.device_type)
