"""Which process group shards the parameters, and on which device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class FSDPMeshInfo:
    """The shard dimension of a data-parallel mesh, resolved once at init."""

    mesh: DeviceMesh
    shard_mesh_dim: int
    shard_process_group: dist.ProcessGroup
    shard_mesh_size: int
    shard_mesh_rank: int


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
    """Validate ``mesh`` for FSDP and describe its shard dimension."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 2:
        raise NotImplementedError(
            "HSDP (a 2-D (replicate, shard) mesh) is not supported yet; pass a 1-D mesh"
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"fully_shard expects a 1-D mesh (FSDP), got a {mesh.ndim}-D mesh {mesh}; "
            "for tensor parallelism pass the data-parallel sub-mesh, e.g. mesh['dp']"
        )
    return FSDPMeshInfo(
        mesh=mesh,
        shard_mesh_dim=0,
        shard_process_group=mesh.get_group(0),
        shard_mesh_size=mesh.size(0),
        shard_mesh_rank=mesh.get_local_rank(0),
    )


def device_for(mesh: DeviceMesh) -> torch.device:
    """The device parameters live on: CPU, or this rank's current accelerator."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type, None)
    if module is not None and hasattr(module, "current_device"):
        return torch.device(mesh.device_type, module.current_device())
    return torch.device(mesh.device_type)
