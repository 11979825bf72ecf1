"""Where collective buffers come from: the process group's allocator, or symmetric memory.

[Note: Communication memory]
``FSDPModule.set_allocate_memory_from_process_group_for_comm(True)`` and
``set_symm_mem_for_comm("NCCL")`` change only *where* the buffers a group's
collectives read and write are allocated, never what is computed. Both
install one of the comms below in place of the default collectives, through
the same path as a user's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
(see [Note: Staged all-gather] in staged_collectives.py): the comm's
``allocate`` provides the all-gather output (this rank's input is its block)
and the reduce-scatter buffers.

- Process-group memory: the backend's own allocator, where it has one. NCCL
  allocates with ``ncclMemAlloc``, which lets it run zero-copy and
  NVLink SHARP / InfiniBand SHARP collectives. gloo has no allocator: there
  the setting is kept (and checked against custom comms, as upstream) but the
  group keeps its default, copy-free collectives, as upstream's allocation
  falls back to ``torch.empty``.
- Symmetric memory (CUDA, NCCL): the all-gather output comes from torch's
  symmetric-memory pool and is registered with the peers before each
  all-gather, so NCCL can use its copy-engine or symmetric-kernel all-gather;
  the reduce-scatter too when ``set_force_sum_reduction_for_comms(True)`` is
  on before the call (NCCL's symmetric reduce-scatter sums only). Choosing the
  backend fails as upstream where torch lacks it (``RuntimeError``, e.g. on
  every CPU-only build); on a non-CUDA mesh where it succeeds it changes
  nothing.

Neither can be combined with a custom comm (upstream's ``AssertionError``,
here an ``FSDPAssertionError``, which is also a ``ValueError``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..._torch_compat import (
    process_group_allocate,
    process_group_allocates,
    symm_mem_empty,
    symm_mem_rendezvous,
)
from ...errors import FSDPAssertionError
from . import collectives


class _BuiltinComm:
    """A built-in comm; ``active`` is False where it would behave like the default."""

    active = True

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group


class _ProcessGroupAlloc(_BuiltinComm):
    """Buffers from the process group's allocator (where it has one for ``device``)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(group)
        self.active = process_group_allocates(group, device)

    def allocate(
        self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _pg_empty(self._group, size, dtype, device)


class ProcessGroupAllocAllGather(_ProcessGroupAlloc):
    """All-gather into a buffer from the process group's allocator."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
        group: dist.ProcessGroup, async_op: bool = False,
    ) -> dist.Work | None:
        return collectives.all_gather(output_tensor, input_tensor, group, async_op)


class ProcessGroupAllocReduceScatter(_ProcessGroupAlloc):
    """Reduce-scatter between buffers from the process group's allocator."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
        group: dist.ProcessGroup, op: Any, async_op: bool = False,
    ) -> None:
        collectives.reduce_scatter(output_tensor, input_tensor, group, op)


class _SymmMem(_BuiltinComm):
    """Buffers in symmetric memory (CUDA)."""

    def allocate(
        self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return symm_mem_empty(_numel(size), dtype, device).view(size)


class SymmMemAllGather(_SymmMem):
    """All-gather into a symmetric-memory buffer, registered with the peers first."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
        group: dist.ProcessGroup, async_op: bool = False,
    ) -> dist.Work | None:
        symm_mem_rendezvous(output_tensor, group)  # the input is a block of the output
        return collectives.all_gather(output_tensor, input_tensor, group, async_op)


class SymmMemReduceScatter(_SymmMem):
    """Reduce-scatter between symmetric-memory buffers (NCCL sums only)."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
        group: dist.ProcessGroup, op: Any, async_op: bool = False,
    ) -> None:
        symm_mem_rendezvous(input_tensor, group)
        symm_mem_rendezvous(output_tensor, group)
        collectives.reduce_scatter(output_tensor, input_tensor, group, op)


def _numel(size: tuple[int, ...]) -> int:
    numel = 1
    for s in size:
        numel *= int(s)
    return numel


def _pg_empty(
    group: dist.ProcessGroup, size: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if process_group_allocates(group, device):
        return process_group_allocate(group, _numel(size), dtype, device).view(size)
    return torch.empty(size, dtype=dtype, device=device)


def effective(comm: Any) -> Any:
    """The comm a collective should go through: ``None`` for the default collectives."""
    if comm is None or not getattr(comm, "active", True):
        return None
    return comm


def check_not_custom(comm: Any, allowed: type, method: str, what: str) -> None:
    """Upstream's check that a built-in comm does not silently replace a user's custom one."""
    if comm is not None and not isinstance(comm, allowed):
        raise FSDPAssertionError(
            f"cannot call {method}() when {what} comm is custom: {type(comm).__name__}. "
            "fsdp2: a custom comm set with set_custom_all_gather / set_custom_reduce_scatter "
            "decides its own buffers; drop it, or allocate its buffers in its allocate()"
        )


def use_process_group_memory(group: Any, enable: bool) -> None:
    """``set_allocate_memory_from_process_group_for_comm`` for one parameter group."""
    method = "set_allocate_memory_from_process_group"
    reduction = group.reduction
    check_not_custom(group.settings.all_gather_comm, ProcessGroupAllocAllGather, method, "all gather")
    check_not_custom(
        reduction.settings.reduce_scatter_comm, ProcessGroupAllocReduceScatter, method,
        "reduce scatter",
    )
    if not enable:
        group.update_settings(all_gather_comm=None)
        reduction.set_reduce_scatter_comm(None)
        return
    device = group.device
    group.update_settings(
        all_gather_comm=ProcessGroupAllocAllGather(group.mesh_info.shard_process_group, device)
    )
    reduction.set_reduce_scatter_comm(
        ProcessGroupAllocReduceScatter(reduction.reduce_scatter_group, device)
    )


def use_symm_mem(group: Any, backend: str) -> None:
    """``set_symm_mem_for_comm`` for one parameter group (see [Note: Communication memory])."""
    from ..._torch_compat import set_symm_mem_backend

    method = "set_symm_mem"
    check_not_custom(group.settings.all_gather_comm, SymmMemAllGather, method, "all gather")
    set_symm_mem_backend(backend)  # upstream's RuntimeError where torch lacks the backend
    if group.device.type != "cuda":
        return  # symmetric memory is CUDA memory: nothing to allocate elsewhere
    all_gather_group = group.mesh_info.shard_process_group
    dist.barrier(group=all_gather_group)  # NCCL communicators must exist before the rendezvous
    group.update_settings(all_gather_comm=SymmMemAllGather(all_gather_group))
    reduction = group.reduction
    check_not_custom(
        reduction.settings.reduce_scatter_comm, SymmMemReduceScatter, method, "reduce scatter"
    )
    if reduction.settings.force_sum_reduction:
        reduction.set_reduce_scatter_comm(SymmMemReduceScatter(reduction.reduce_scatter_group))


def check_max_input_buffers(group: Any) -> None:
    """Upstream's lazy-init check: several reduce-scatter buffers do not fit symmetric memory."""
    settings = group.reduction.settings
    if settings.reduce_scatter_max_input_buffers > 1 and isinstance(
        settings.reduce_scatter_comm, SymmMemReduceScatter
    ):
        raise ValueError(
            "set_reduce_scatter_max_input_buffers(>1) is not supported with "
            "the symmetric-memory reduce-scatter comm, but got "
            f"{settings.reduce_scatter_max_input_buffers} for module "
            f"'{group.module_fqn}' using {type(settings.reduce_scatter_comm).__name__}. Keep "
            "max_input_buffers=1 with symmetric memory, or use the default "
            "reduce-scatter comm."
        )
