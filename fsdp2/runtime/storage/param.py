"""FSDPParam: the tensors of one sharded parameter and their state transitions.

[Note: Sharded parameter storage]
The sharded parameter is an ``nn.Parameter`` wrapping a ``DTensor`` that is
``Shard(0)`` over the shard group with ``torch.chunk`` semantics: every rank
owns ``ceil(d0 / W)`` rows except at the end, where ranks get fewer or none.
Its local tensor is a *view* into a slot of its group's flat buffer; each slot
holds ``ceil(d0 / W) * prod(rest)`` elements (the padded shard) so every rank
contributes the same number of elements to the collectives. The padding rows
sit past the view and are never visible to users.

Each sharded parameter's local tensor has a *storage of its own* over its
slot's memory (``own_storage`` in shard_storage.py), not the flat buffer's
storage at an offset. Anything that works per storage then sees just this
parameter's padded shard, as with upstream (whose shards are separate
allocations): ``torch.save``, ``pickle`` and ``copy.deepcopy`` write and copy
the padded shard, transports that ship ``untyped_storage()`` (torchft) send
it, and a state-dict tensor can neither resize nor replace the group's
buffer. It still aliases the live shard, as upstream's does: writing into it
writes the parameter. The flat buffer stays the all-gather input, with no
copy-in. Holding such a tensor keeps the group's whole buffer allocated.

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

[Note: Other shard dims and tensor parallelism]
``shard_placement_fn`` may pick ``Shard(k)`` with ``k > 0``; like upstream
this needs ``size(k)`` to divide evenly. The shard is then still one
contiguous block of the slot, but the all-gathered blocks are not the
parameter's memory layout: ``padded_full`` is a staging buffer and one copy
puts the blocks in place in the parameter's own storage; gradients are
permuted into rank-major blocks the same way before the reduce-scatter.
A tensor-parallel parameter arrives as a DTensor on the TP mesh; FSDP shards
its *local* tensor exactly like a plain tensor. The sharded parameter is a
DTensor on the (data-parallel, TP) mesh; where TP already splits the FSDP dim,
the FSDP placement is a strided shard so ``full_tensor()`` reassembles it.
The unsharded parameter is again a DTensor on the TP mesh, as the TP module
expects.
"""

from __future__ import annotations

import math
from enum import Enum, auto

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..._torch_compat import (
    dtensor_parameter,
    local_tensor,
    set_local_tensor,
    set_requires_grad,
    strided_shard,
)
from ...errors import FSDPAssertionError
from ..meshes.mesh import FSDPMeshInfo
from .extensions import ExtensionState, check_extension, has_extension, needs_own_shard
from .param_uid import original_uid
from .ragged_rows import RaggedRows, same_placements
from .shard_layout import ShardLayout
from .shard_storage import alias_parameter, can_own_storage, own_storage
from .sharded_grad import local_grad

_MODULE_SETATTR = nn.Module.__setattr__


class ShardedState(Enum):
    SHARDED = auto()  # sharded DTensor parameters are registered on the modules
    UNSHARDED = auto()  # unsharded parameters are registered and hold data
    # sharded parameters registered; the group keeps this rank's share over the
    # smaller post-forward group for the backward all-gather
    SHARDED_POST_FORWARD = auto()


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
        shard_dim: int = 0,
        spmd_mesh: DeviceMesh | None = None,
        placements: tuple[Placement, ...] | None = None,
        dp_dims: frozenset[int] = frozenset(),
        rows: RaggedRows | None = None,
    ) -> None:
        self.module_infos = module_infos
        self.orig_uid = original_uid(param)
        self.mesh_info = mesh_info
        self.fqn = fqn
        # Tensor parallel: shard the TP-local tensor, keep the TP spec for the
        # unsharded parameter (see [Note: Other shard dims and tensor parallelism]).
        self.tp_spec: tuple[DeviceMesh, tuple[Placement, ...]] | None = None
        if isinstance(param, DTensor):
            self.tp_spec = (param.device_mesh, tuple(param.placements))
            self.global_size, self.global_stride = param.size(), param.stride()
            param = param.to_local()
        self.orig_size = param.size()
        self.orig_stride = param.stride()
        if self.tp_spec is None:
            self.global_size, self.global_stride = self.orig_size, self.orig_stride
        self.dtype = param.dtype
        self.shard_dim = shard_dim
        # The parameter-major layout's run of rows, or torch.chunk's (see [Note: The
        # parameter-major layout] in ragged.py)
        self.ragged = rows is not None
        self.layout: ShardLayout | RaggedRows = rows or ShardLayout(
            self.orig_size, shard_dim, mesh_info.shard_mesh_size, mesh_info.shard_mesh_rank
        )
        self.row_numel, self.shard_rows = self.layout.row_numel, self.layout.shard_rows
        self.local_rows, self.local_size = self.layout.local_rows, self.layout.local_size
        self.padded_shard_numel = self.layout.padded_shard_numel
        self.numel = self.orig_size[shard_dim] * self.row_numel
        self.sharded_param: nn.Parameter = param  # replaced by bind_sharded()
        self.padded_full: torch.Tensor | None = None
        self._unsharded_data: torch.Tensor | None = None  # own storage when shard_dim > 0
        self.unsharded_param: nn.Parameter | None = None
        self._held_grad: torch.Tensor | None = None  # no-sync gradients in the reduce dtype
        self._aliased: torch.Tensor | None = None  # the shard the unsharded param views (W=1)
        self._gathered_from: torch.Tensor | None = None  # parameter-major: the group's output
        # Where the unsharded parameter differs from the sharded one (set by the
        # group): its dtype under mixed precision, its device under CPU offload.
        self.param_dtype: torch.dtype | None = None
        # MixedPrecisionPolicy.param_dtype_override_fn kept this parameter's own dtype.
        self.keeps_dtype = False
        self.keep_unsharded_storage = False
        # torch >= 2.15: the dtype new unsharded gradients accumulate in (set by the group).
        self.grad_dtype: torch.dtype | None = None
        self.unsharded_device: torch.device | None = None
        self.state = ShardedState.SHARDED
        self._spmd_mesh = spmd_mesh if spmd_mesh is not None else mesh_info.mesh
        # dp_mesh_dims: the layout dp_mesh_dims.py chose, and which of the parameter's mesh
        # dims are data parallel (their gradient placements are FSDP's to reduce).
        self._placements = placements if placements is not None else self._sharded_placements()
        self.dp_dims = dp_dims
        # See [Note: All-gather extensions] in extensions.py. A subclass with the
        # hooks gets its own padded shard; any other parameter sits in the group's
        # flat buffer, and whether its local tensor has hooks is decided later.
        self.extension: ExtensionState | None = None
        self.in_flat = not needs_own_shard(param)
        if not self.in_flat:
            self._init_extension(param)

    def decide_extension(self) -> bool:
        """Decide whether the local shard has all-gather hooks; returns whether it sits in the buffer.

        Runs when the group adopts its parameters (lazy init, and after they
        were replaced): hooks added to the plain local tensor after
        ``fully_shard`` or ``to_empty()`` take effect here, and an extension
        whose local tensor was replaced by one without hooks is dropped.
        """
        local = local_tensor(self.sharded_param)
        if has_extension(local):
            if self.extension is None:
                self._init_extension(local)
                self._forget_unsharded()  # the first post hook builds the unsharded tensor
        elif self.extension is not None:
            self.extension = None
            self._forget_unsharded()
        return not needs_own_shard(local)

    def _forget_unsharded(self) -> None:
        self._gathered_from = None
        self.unsharded_param = None
        self.padded_full = None
        self._unsharded_data = None
        self._aliased = None

    def _init_extension(self, param: torch.Tensor) -> None:
        check_extension(param, self.fqn)
        if self.shard_dim != 0 or self.tp_spec is not None:
            raise NotImplementedError(
                f"Parameter '{self.fqn}': all-gather extensions need Shard(0) and no "
                "tensor parallelism; drop shard_placement_fn for it"
            )
        mesh = self.mesh_info.mesh
        if mesh.ndim > 1:
            mesh = mesh[mesh.mesh_dim_names[self.mesh_info.shard_mesh_dim]]
        self.extension = ExtensionState(self.module_infos[0][0], mesh)
        if self.ragged and needs_own_shard(param):  # See [Note: Subclasses on the
            bounds = self.layout.row_bounds  # parameter-major layout] in extensions.py
            counts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
            self.extension.rows = (counts, self.layout.rank)

    @property
    def flat_numel(self) -> int:
        """Elements this parameter occupies in its group's flat buffer (0: outside it)."""
        return self.padded_shard_numel if self.in_flat else 0

    def _sharded_placements(self) -> tuple[Placement, ...]:
        fsdp: Placement = Shard(self.shard_dim)
        tp_placements: tuple[Placement, ...] = ()
        if self.tp_spec is not None:
            tp_mesh, tp_placements = self.tp_spec
            split = math.prod(
                tp_mesh.size(i)
                for i, pl in enumerate(tp_placements)
                if isinstance(pl, Shard) and pl.dim == self.shard_dim
            )
            if split > 1:
                fsdp = strided_shard(self.shard_dim, split)
        dp = (Replicate(), fsdp) if self.mesh_info.is_hsdp else (fsdp,)
        return dp + tp_placements

    # ---- sharded side -------------------------------------------------------

    def slot_view(self, slot: torch.Tensor) -> torch.Tensor:
        """The unpadded local shard as a view of this parameter's padded slot."""
        return slot[: self.local_rows * self.row_numel].view(self.local_size)

    def local_view(self, slot: torch.Tensor) -> torch.Tensor:
        """The local shard as a view of ``slot``'s memory through a storage of its own.

        See [Note: Sharded parameter storage]. An empty slot (a parameter-major
        rank holding no row of the parameter) gets a tensor of no memory: a
        view of it would keep the buffer it was cut from alive after the group
        moved (an arena, ``.to``), and an empty tensor is every empty slot's
        view (its data pointer is null). A padded slot keeps its storage, as
        upstream's empty shard does (``torch.save`` writes its padding).
        """
        if slot.numel() == 0:
            return torch.empty(self.local_size, dtype=slot.dtype, device=slot.device)
        return self.slot_view(own_storage(slot))

    def bind_sharded(self, slot: torch.Tensor, source: torch.Tensor) -> None:
        """Create the sharded DTensor parameter as a view of ``slot``.

        ``source`` is the original full parameter; this rank's rows are copied
        into the slot (nothing is copied on ``meta``).
        """
        if isinstance(source, DTensor):
            source = source.to_local()
        if not self.in_flat:
            local = self._extension_shard(source)
        else:
            local = self.local_view(slot)
        if not local.is_meta and self.local_rows > 0 and self.in_flat:
            local.copy_(self.layout.local_rows_of(source.detach()))
        dtensor = DTensor.from_local(
            local,
            self._spmd_mesh,
            self._placements,
            run_check=False,
            shape=self.global_size,
            stride=self.global_stride,
        )
        if self.ragged:  # a detach would relabel the placement plain Shard(0)
            self.sharded_param = dtensor_parameter(dtensor, local, source.requires_grad)
        else:
            self.sharded_param = nn.Parameter(dtensor, requires_grad=source.requires_grad)
            # nn.Parameter detaches, which aliases; point it back at the slot view.
            set_local_tensor(self.sharded_param, local)
        self.register(self.sharded_param)

    @torch.no_grad()
    def _extension_shard(self, source: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a subclass parameter: a view of its own padded shard.

        Applies exactly upstream's ops to the subclass, in its order (see
        [Note: All-gather extensions] in extensions.py).
        """
        if self.ragged:  # See [Note: Subclasses on the parameter-major layout]
            local = source.new_zeros(self.local_size)
            if self.local_rows > 0:
                local.copy_(source.narrow(0, self.layout.row_start, self.local_rows))
            return local
        chunks = torch.chunk(source, self.mesh_info.shard_mesh_size, dim=0)
        rank = self.mesh_info.shard_mesh_rank
        chunk = chunks[rank] if rank < len(chunks) else chunks[0].new_empty(0)
        padded = source.new_zeros(torch.Size([self.shard_rows, *self.orig_size[1:]]))
        if chunk.numel() > 0:
            padded.narrow(0, 0, self.local_rows).copy_(chunk)
        padded.view(-1)  # upstream keeps this flat view; a subclass must support it there
        return padded.narrow(0, 0, self.local_rows)

    def unshard_extension(self) -> None:
        """After copy-out: build (first time) or refill the unsharded parameter via the post hook."""
        local = local_tensor(self.sharded_param)
        # In the caller's grad mode, as upstream (see [Note: All-gather extensions]).
        tensor = self.extension.post_all_gather(local, self.unsharded_param)
        if tensor is not None:
            view = torch.as_strided(tensor, self.orig_size, self.orig_stride, 0)
            self.unsharded_param = nn.Parameter(view, requires_grad=False)
        self._sync_requires_grad()

    def rebind_sharded(self, slot: torch.Tensor) -> None:
        """Make the sharded parameter a view of ``slot`` again, keeping its values.

        Needed after ``nn.Module._apply`` (``to_empty``, ``.to``) or
        ``load_state_dict(assign=True)`` replaced the local tensor.
        """
        if not self.in_flat:
            return  # outside the flat buffer: its own padded shard
        local = local_tensor(self.sharded_param)
        if self.is_view_of_slot(slot):
            return
        view = self.local_view(slot)
        if not view.is_meta and self.local_rows > 0:
            view.copy_(local)
        if self.extension is not None and not view.is_meta:
            # The hooks live on this very tensor object (e.g. patched onto it
            # after to_empty): keep the object and move its storage instead.
            with torch.no_grad():
                local.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())
        else:
            set_local_tensor(self.sharded_param, view)
        self.dtype = view.dtype

    def place_sharded(self, slot: torch.Tensor) -> None:
        """Make the sharded parameter a view of ``slot`` without copying (``to_empty``).

        Its values become the slot's; a new DTensor is swapped into the same
        parameter object (``torch.utils.swap_tensors``, as ``nn.Module._apply``
        does), so the parameter moves to the slot's device and every holder of
        it (modules, optimizers) sees the change.
        """
        param = self.sharded_param
        view = self.local_view(slot)
        torch.utils.swap_tensors(param, dtensor_parameter(param, view, param.requires_grad))
        self.dtype = view.dtype

    def is_view_of_slot(self, slot: torch.Tensor) -> bool:
        """Whether the local shard is already ``local_view(slot)``'s memory."""
        local = local_tensor(self.sharded_param)
        if local.device != slot.device or local.dtype != slot.dtype:
            return False
        if local.size() != self.local_size or not local.is_contiguous():
            return False
        if slot.numel() == 0:
            return local.untyped_storage().nbytes() == 0  # holds no buffer (see local_view)
        if can_own_storage(slot):
            # See [Note: Sharded parameter storage]: the slot's memory, its own storage.
            # (No view of the slot made to compare: lazy init checks every parameter.)
            storage = local.untyped_storage()
            return local.data_ptr() == slot.data_ptr() and storage.nbytes() == slot.nbytes
        view = self.slot_view(slot)
        if view.numel() == 0:
            return local.numel() == 0 and local is view
        # Fake tensors (the planner, fsdp2.plan) all report data pointer 0: compare
        # the storage objects themselves, which torch keeps one per storage.
        return (
            local.storage_offset() == view.storage_offset()
            and local.untyped_storage() is view.untyped_storage()
        )

    def adopt_registered(self) -> None:
        """Take over a sharded parameter that replaced ours on the module."""
        module, name = self.module_infos[0]
        registered = module._parameters.get(name)
        if registered is self.sharded_param or registered is self.unsharded_param:
            return
        self._adopt(registered)

    def _adopt(self, new_param: nn.Parameter) -> None:
        if not isinstance(new_param, DTensor) or new_param.size() != self.global_size:
            raise ValueError(
                f"Parameter '{self.fqn}' was replaced by a tensor that is not a sharded "
                f"DTensor of shape {tuple(self.global_size)}; load a sharded state dict "
                "(DTensor values) or copy values in place instead"
            )
        if self.ragged and not same_placements(new_param.placements, self._placements):
            raise ValueError(
                f"Parameter '{self.fqn}' was replaced by a DTensor with placements "
                f"{new_param.placements}; expected {self._placements} (the parameter-major "
                "layout's rows); load a DTensor state dict through DCP, or copy values in place"
            )
        if tuple(new_param.placements) != self._placements:
            local = local_tensor(new_param)
            if self.shard_dim > 0 and local.size() != self.local_size:  # upstream's symptom
                raise FSDPAssertionError(
                    f"Shard({self.shard_dim}) requires even sharding: "
                    f"local_tensor.size()={local.size()!r}\n"
                    f"Parameter '{self.fqn}' was replaced by a DTensor with placements "
                    f"{new_param.placements}; expected {self._placements}"
                )
            raise ValueError(
                f"Parameter '{self.fqn}' was replaced by a DTensor with placements "
                f"{new_param.placements}; expected {self._placements}"
            )
        self.sharded_param = new_param
        for module, name in self.module_infos:
            module._parameters[name] = new_param

    # ---- unsharded side -----------------------------------------------------

    def view_gathered(self, output: torch.Tensor, start: int) -> None:
        """The parameter-major layout: the unsharded parameter views the group's all-gather output.

        See [Note: The parameter-major layout] in ragged.py. Called before each
        all-gather; the view is made once per output buffer and outlives its
        storage being freed and re-grown.
        """
        if self._gathered_from is output and self.unsharded_param is not None:
            self._sync_requires_grad()
            return
        self._gathered_from = output
        self.padded_full = output[start : start + self.numel]
        self.unsharded_param = self._make_unsharded(output, start)
        self._sync_requires_grad()

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
        if self.unsharded_param is None and self.shard_dim == 0:
            self.unsharded_param = self._make_unsharded(self.padded_full, 0)
        if self.unsharded_param is not None:
            self._sync_requires_grad()
        return self.padded_full

    def _make_unsharded(self, like: torch.Tensor, offset: int) -> nn.Parameter:
        param = alias_parameter(like, offset, self.orig_size, self.orig_stride)
        if self.tp_spec is not None:
            tp_mesh, tp_placements = self.tp_spec
            alias = param.data
            dtensor = DTensor.from_local(
                alias, tp_mesh, tp_placements, run_check=False,
                shape=self.global_size, stride=self.global_stride,
            )
            param = nn.Parameter(dtensor, requires_grad=False)
            set_local_tensor(param, alias)
        if self.grad_dtype is not None and self.grad_dtype != param.dtype:
            param.grad_dtype = self.grad_dtype  # See [Note: Gradient accumulation dtype]
        return param

    def finish_copy_out(self) -> None:
        """Shard dim > 0: put the gathered rank-major blocks in the parameter's layout.

        See [Note: Other shard dims and tensor parallelism]. Dim 0 needs
        nothing: the parameter views the gathered buffer itself.
        """
        if self.shard_dim == 0:
            return
        staging = self.padded_full
        if (
            self._unsharded_data is None
            or self._unsharded_data.dtype != staging.dtype
            or self._unsharded_data.device != staging.device
        ):
            self._unsharded_data = torch.empty(
                self.numel, dtype=staging.dtype, device=staging.device
            )
            self.unsharded_param = self._make_unsharded(self._unsharded_data, 0)
        storage = self._unsharded_data.untyped_storage()
        nbytes = self.numel * self._unsharded_data.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        full = self._unsharded_data.view(self.orig_size)
        self.layout.rank_blocks(full).copy_(staging.view(self.layout.block_shape()))
        staging.untyped_storage().resize_(0)  # the staging copy is no longer needed
        self._sync_requires_grad()

    def gathered_blocks(self, start: int, stop: int) -> torch.Tensor:
        """Rank blocks ``[start, stop)`` of the unsharded parameter, ``(stop - start, padded shard numel)``."""
        if self.shard_dim == 0:
            return self.padded_full.view(self.mesh_info.shard_mesh_size, -1)[start:stop]
        full = self._unsharded_data.view(self.orig_size)
        return self.layout.rank_blocks(full)[start:stop].reshape(stop - start, -1)

    def alias_shard(self) -> None:
        """Shard group of one rank: the unsharded parameter views the shard itself.

        The shard is then the whole parameter, so there is nothing to gather,
        copy or free; ``padded_full`` stays ``None`` so resharding frees nothing.
        """
        local = local_tensor(self.sharded_param)
        if self.unsharded_param is None or self._aliased is not local:
            self.unsharded_param = self._make_unsharded(local, local.storage_offset())
            self._aliased = local
        self._sync_requires_grad()

    def _sync_requires_grad(self) -> None:
        # Follow the sharded parameter: users may freeze or unfreeze it any time.
        requires_grad = self.sharded_param.requires_grad
        if self.unsharded_param.requires_grad != requires_grad:
            set_requires_grad(self.unsharded_param, requires_grad)

    def free_unsharded(self) -> None:
        """Release the unsharded storage; the parameter object is kept for reuse.

        With ``keep_unsharded_storage`` (``FSDPModule.set_keep_unsharded_storage``)
        the storage stays allocated, so the next unshard writes the same memory
        (stable data pointers, e.g. for CUDA graphs).
        """
        if self.keep_unsharded_storage:
            return
        if self.padded_full is not None:
            self.padded_full.untyped_storage().resize_(0)
        if self._unsharded_data is not None:
            self._unsharded_data.untyped_storage().resize_(0)
        if self.extension is not None:
            self.extension.free()

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
        """Pop the gradient autograd wrote on the unsharded parameter (plus any held one)."""
        param = self.unsharded_param
        grad = None if param is None else param.grad
        if grad is not None:
            param.grad = None
            grad = local_grad(grad, self.tp_spec, self.dp_dims)
        held, self._held_grad = self._held_grad, None
        if held is None:
            return grad
        if grad is not None:
            held.add_(grad)
        return held

    def zero_unsharded_grad(self) -> torch.Tensor | None:
        """A zero gradient in the unsharded parameter's layout, if it is trainable and gathered."""
        param = self.unsharded_param
        if param is None or not self.sharded_param.requires_grad:
            return None
        return local_grad(torch.zeros_like(param), self.tp_spec, self.dp_dims)

    def negative_zero_grad(self) -> torch.Tensor | None:
        """``-0.0`` in the unsharded gradient's local layout, padded to whole chunks on dim 0.

        For a trainable, gathered parameter that got no gradient on this rank;
        see [Note: Gradients of parameters used on some ranks] in unused_grads.py.
        """
        param = self.unsharded_param
        if param is None or not self.sharded_param.requires_grad:
            return None
        local = local_tensor(param) if isinstance(param, DTensor) else param
        size = list(self.orig_size)
        if self.shard_dim == 0:
            size[0] = self.layout.gathered_rows
        return torch.full(size, -0.0, dtype=local.dtype, device=local.device)

    def hold_grad_in(self, dtype: torch.dtype) -> None:
        """Move the unsharded gradient aside, accumulated in ``dtype`` (no-sync micro-batches)."""
        param = self.unsharded_param
        grad = None if param is None else param.grad
        if grad is None:
            return
        param.grad = None
        grad = local_grad(grad, self.tp_spec, self.dp_dims)
        if self._held_grad is None:
            self._held_grad = grad.to(dtype)
        else:
            self._held_grad.add_(grad)

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn}, size={tuple(self.orig_size)}, {self.state.name})"
