"""FSDPParam: the tensors of one sharded parameter and their state transitions.

[Note: Sharded parameter storage]
The sharded parameter is an ``nn.Parameter`` wrapping a ``DTensor`` that is
``Shard(0)`` over the shard group with ``torch.chunk`` semantics: every rank
owns ``ceil(d0 / W)`` rows except at the end, where ranks get fewer or none.
Its local tensor is a *view* into a slot of its group's flat buffer; each slot
holds ``ceil(d0 / W) * prod(rest)`` elements (the padded shard) so every rank
contributes the same number of elements to the collectives. The padding rows
sit past the view and are never visible to users.

[Note: Unsharded parameter lifetime]
The unsharded parameter is created once and written in place after every
all-gather; it is in the group's ``param_dtype`` under mixed precision and on
the device under CPU offload (``param_dtype``, ``unsharded_device``). It
aliases ``padded_full``, a flat buffer of ``W`` padded shards (the padded full
tensor, rank-major), through ``Tensor.set_`` so that the
parameter and the buffer share storage but not a version counter: writing a
fresh all-gather into the buffer never trips autograd's saved-tensor check.
Resharding frees the storage with ``untyped_storage().resize_(0)``; unsharding
resizes it back. Tensors autograd saved from the parameter stay valid because
they point at the same storage object.
"""

from __future__ import annotations

import math
from enum import Enum, auto

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from ._torch_compat import dtensor_like, local_tensor, set_local_tensor
from .mesh import FSDPMeshInfo

_MODULE_SETATTR = nn.Module.__setattr__


class ShardedState(Enum):
    SHARDED = auto()  # sharded DTensor parameters are registered on the modules
    UNSHARDED = auto()  # unsharded parameters are registered and hold data


class FSDPParam:
    """One parameter managed by FSDP: sharded DTensor, padded slot, unsharded view.

    ``module_infos`` lists every ``(module, attribute name)`` that refers to the
    parameter, so tied weights are swapped on all their owners at once.
    """

    def __init__(
        self,
        param: nn.Parameter,
        module_infos: list[tuple[nn.Module, str]],
        mesh_info: FSDPMeshInfo,
        fqn: str,
    ) -> None:
        self.module_infos = module_infos
        self.mesh_info = mesh_info
        self.fqn = fqn
        self.orig_size = param.size()
        self.orig_stride = param.stride()
        self.dtype = param.dtype
        world_size = mesh_info.shard_mesh_size
        rank = mesh_info.shard_mesh_rank
        dim0 = self.orig_size[0]
        self.row_numel = math.prod(self.orig_size[1:])
        self.shard_rows = -(-dim0 // world_size)  # ceil: rows per rank before the end
        self.local_rows = max(0, min(self.shard_rows, dim0 - rank * self.shard_rows))
        self.local_size = torch.Size((self.local_rows, *self.orig_size[1:]))
        self.padded_shard_numel = self.shard_rows * self.row_numel
        self.numel = dim0 * self.row_numel
        self.sharded_param: nn.Parameter = param  # replaced by bind_sharded()
        self.padded_full: torch.Tensor | None = None
        self.unsharded_param: nn.Parameter | None = None
        # Where the unsharded parameter differs from the sharded one (set by the
        # group): its dtype under mixed precision, its device under CPU offload.
        self.param_dtype: torch.dtype | None = None
        self.unsharded_device: torch.device | None = None
        self.state = ShardedState.SHARDED
        self._placements = (Shard(0),)

    # ---- sharded side -------------------------------------------------------

    def local_rows_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's unpadded rows of a full tensor of the original shape."""
        start = min(self.mesh_info.shard_mesh_rank * self.shard_rows, self.orig_size[0])
        return tensor.narrow(0, start, self.local_rows)

    def slot_view(self, slot: torch.Tensor) -> torch.Tensor:
        """The unpadded local shard as a view of this parameter's padded slot."""
        return slot[: self.local_rows * self.row_numel].view(self.local_size)

    def bind_sharded(self, slot: torch.Tensor, source: torch.Tensor) -> None:
        """Create the sharded DTensor parameter as a view of ``slot``.

        ``source`` is the original full parameter; this rank's rows are copied
        into the slot (nothing is copied on ``meta``).
        """
        local = self.slot_view(slot)
        if not local.is_meta and self.local_rows > 0:
            local.copy_(self.local_rows_of(source.detach()))
        dtensor = DTensor.from_local(
            local,
            self.mesh_info.mesh,
            self._placements,
            run_check=False,
            shape=self.orig_size,
            stride=self.orig_stride,
        )
        self.sharded_param = nn.Parameter(dtensor, requires_grad=source.requires_grad)
        # nn.Parameter detaches, which aliases; point it back at the slot view.
        set_local_tensor(self.sharded_param, local)
        self.register(self.sharded_param)

    def rebind_sharded(self, slot: torch.Tensor) -> None:
        """Make the sharded parameter a view of ``slot`` again, keeping its values.

        Needed after ``nn.Module._apply`` (``to_empty``, ``.to``) or
        ``load_state_dict(assign=True)`` replaced the local tensor.
        """
        local = local_tensor(self.sharded_param)
        view = self.slot_view(slot)
        if self.is_view_of_slot(view):
            return
        if not view.is_meta and self.local_rows > 0:
            view.copy_(local)
        set_local_tensor(self.sharded_param, view)
        self.dtype = view.dtype

    def is_view_of_slot(self, view: torch.Tensor) -> bool:
        local = local_tensor(self.sharded_param)
        if local.device != view.device or local.dtype != view.dtype:
            return False
        if view.numel() == 0:
            return local.numel() == 0 and local is view
        return (
            local.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
            and local.storage_offset() == view.storage_offset()
        )

    def adopt_registered(self) -> None:
        """Take over a sharded parameter that replaced ours on the module."""
        module, name = self.module_infos[0]
        registered = module._parameters.get(name)
        if registered is self.sharded_param or registered is self.unsharded_param:
            return
        self._adopt(registered)

    def _adopt(self, new_param: nn.Parameter) -> None:
        if not isinstance(new_param, DTensor) or new_param.size() != self.orig_size:
            raise ValueError(
                f"Parameter '{self.fqn}' was replaced by a tensor that is not a sharded "
                f"DTensor of shape {tuple(self.orig_size)}; load a sharded state dict "
                "(DTensor values) or copy values in place instead"
            )
        if tuple(new_param.placements) != self._placements:
            raise ValueError(
                f"Parameter '{self.fqn}' was replaced by a DTensor with placements "
                f"{new_param.placements}; expected {self._placements}"
            )
        self.sharded_param = new_param
        for module, name in self.module_infos:
            module._parameters[name] = new_param

    # ---- unsharded side -----------------------------------------------------

    def alloc_unsharded(self) -> torch.Tensor:
        """Allocate (or re-allocate) the padded full buffer; returns it flat."""
        world_size = self.mesh_info.shard_mesh_size
        numel = world_size * self.padded_shard_numel
        local = local_tensor(self.sharded_param)
        dtype = self.param_dtype or local.dtype
        device = self.unsharded_device or local.device
        if (
            self.padded_full is None
            or self.padded_full.dtype != dtype
            or self.padded_full.device != device
        ):
            self.padded_full = torch.empty(numel, dtype=dtype, device=device)
            self.unsharded_param = None
        storage = self.padded_full.untyped_storage()
        nbytes = numel * self.padded_full.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        if self.unsharded_param is None:
            alias = torch.empty(0, dtype=dtype, device=device)
            alias.set_(storage, 0, self.orig_size, self.orig_stride)
            self.unsharded_param = nn.Parameter(alias, requires_grad=False)
        # Follow the sharded parameter: users may freeze or unfreeze it any time.
        requires_grad = self.sharded_param.requires_grad
        if self.unsharded_param.requires_grad != requires_grad:
            self.unsharded_param.requires_grad_(requires_grad)
        return self.padded_full

    def free_unsharded(self) -> None:
        """Release the unsharded storage; the parameter object is kept for reuse."""
        if self.padded_full is not None:
            self.padded_full.untyped_storage().resize_(0)

    # ---- state transitions --------------------------------------------------

    def to_unsharded(self) -> None:
        """Register the (already filled) unsharded parameter on its modules."""
        self.register(self.unsharded_param)
        self.state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        """Register the sharded parameter and free the unsharded storage."""
        self.register(self.sharded_param)
        self.free_unsharded()
        self.state = ShardedState.SHARDED

    def register(self, param: nn.Parameter) -> None:
        for module, name in self.module_infos:
            if type(module).__setattr__ is _MODULE_SETATTR:
                module._parameters[name] = param
            else:  # respect modules that intercept attribute writes
                setattr(module, name, param)

    # ---- gradients ------------------------------------------------------------

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Pop the gradient autograd wrote on the unsharded parameter."""
        param = self.unsharded_param
        if param is None or param.grad is None:
            return None
        grad = param.grad
        param.grad = None
        return grad

    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Set or add this rank's reduced gradient rows on the sharded parameter."""
        existing = self.sharded_param.grad
        if existing is None:
            self.sharded_param.grad = dtensor_like(self.sharded_param, local_grad)
        else:
            local_tensor(existing).add_(local_grad)

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn}, size={tuple(self.orig_size)}, {self.state.name})"
