"""User-facing values: mixed precision and offload policies, data-parallel mesh dims."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from ._torch_compat import upstream_shard_placement_result
from .ragged_placement import RaggedShardBase, keep_ragged_placements
from .versions import upstream_has

DtypeOrNone = torch.dtype | None  # None: keep the dtype the tensor already has


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How parameters, gradients and activations are cast around FSDP.

    Mixed precision applies at module boundaries, not per op (unlike
    autocast): the sharded parameters stay in their original dtype (the
    optimizer's master copy), the all-gather casts them to ``param_dtype``,
    and casts happen only where a module's inputs come in and outputs leave.

    Attributes:
        param_dtype: dtype of the unsharded parameters (all-gather and
            compute). ``None`` keeps the original dtype. Non-floating-point
            parameters are never cast.
        reduce_dtype: dtype of the gradient reduction, and of gradients
            accumulated while ``set_requires_gradient_sync(False)``. ``None``
            follows the installed torch's upstream: from torch 2.15 the
            parameters' original dtype (fp32 gradients for fp32 parameters
            under ``param_dtype=torch.bfloat16``; pass
            ``reduce_dtype=torch.bfloat16`` for the older behaviour), before
            2.15 ``param_dtype``. Gradients of several dtypes in one group
            are reduced in their promoted dtype. The reduced gradient is cast
            to the original dtype on the sharded parameter.
        output_dtype: dtype the module's floating-point outputs are cast to.
            ``None`` leaves outputs alone. Lets modules with different
            policies follow each other (e.g. an fp32 norm feeding a bf16 block).
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype`` (when that is set).
        param_dtype_override_fn: keyword only; called once per parameter by
            ``fully_shard`` with the parameter. Returning the parameter's own
            dtype keeps that parameter in it (e.g. an fp32 norm or router in
            a bf16 block); ``None`` or ``param_dtype`` uses ``param_dtype``;
            anything else is a ``ValueError``. It must answer the same on
            every rank. Forward inputs are still cast to ``param_dtype``.
            (torch 2.15's field; fsdp2 offers it on every torch.)
    """

    param_dtype: DtypeOrNone = None
    reduce_dtype: DtypeOrNone = None
    output_dtype: DtypeOrNone = None
    cast_forward_inputs: bool = True
    # In the repr where torch's policy has the field, so reprs match the installed torch's.
    param_dtype_override_fn: Callable[[nn.Parameter], DtypeOrNone] | None = field(
        default=None, kw_only=True,
        repr=upstream_has("MixedPrecisionPolicy.param_dtype_override_fn"),
    )


@dataclass(frozen=True)
class GradientCommPolicy:
    """What a gradient reduce-scatter sends: fewer bytes on the wire, the sum in ``reduce_dtype``.

    For ``FSDPModule.set_gradient_comm_policy``. Each rank encodes every
    slice of its gradient once (``payload``), one all-to-all delivers each
    slice's ``W`` encodings to its owner, which decodes them and adds them in
    rank order in the reduce dtype (``MixedPrecisionPolicy.reduce_dtype``,
    the gradient's own by default): deterministic, and never summed in the
    payload dtype (upstream's ``reduce_dtype=torch.bfloat16`` sums in bf16 at
    every ring hop). HSDP: the reduce-scatter is encoded, the replica
    all-reduce runs in the reduce dtype. See docs/mixed-precision.md.

    Attributes:
        payload: ``torch.bfloat16`` (2 bytes an element), ``torch.float8_e4m3fn``,
            ``torch.float8_e5m2`` or ``torch.int8`` (1 byte an element and one
            float32 scale per block).
        block_size: elements per scale (float8 and int8); blocks start
            afresh at every parameter's edge, so a scale never spans two
            parameters or two ranks.
        error_feedback: keep what each encoding lost and add it to the next
            reduction (costs the group's unsharded gradient size in the
            reduce dtype, per rank, for the module's life).
    """

    payload: torch.dtype = torch.bfloat16
    block_size: int = 128
    error_feedback: bool = False

    def __post_init__(self) -> None:
        payloads = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
        if self.payload not in payloads:
            raise ValueError(
                f"GradientCommPolicy: payload {self.payload} is not one of "
                + ", ".join(str(p) for p in payloads)
            )
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"GradientCommPolicy: block_size must be an int >= 1, got {self.block_size!r}")


@dataclass
class OffloadPolicy:
    """Base offload policy: no offloading (sharded state stays on the device)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in host memory.

    Sharded parameters are copied to the device for each all-gather; reduced
    gradients are copied back to the host; the optimizer steps on CPU tensors
    (so its state lives on the CPU too). With a CPU mesh the copies vanish.
    Parameters must be on the CPU (or ``meta``) when training starts.

    Attributes:
        pin_memory: pin the host copies so host/device copies can overlap
            compute. Turn off when host memory is scarce. Ignored when the
            device is the CPU itself (nothing to copy, nothing to pin).
    """

    pin_memory: bool = True


@dataclass(frozen=True)
class OptimizerOffloadPolicy:
    """Where an optimizer's state lives, for ``enable_local_shard_step(optim, offload=...)``.

    Parameters and gradients stay where ``fully_shard`` put them; only the
    optimizer's per-parameter state (Adam's moments, SGD's momentum, ...)
    moves, in *units* of consecutive parameters of one parameter group (one
    contiguous region each), and the step runs unit by unit on the host.
    See ``docs/optimizers.md``.

    Attributes:
        tier: ``"host"``: each unit's state in one host buffer (pinned when a
            GPU is present), the gradient shard copied down and the updated
            parameter shard copied back up around its step. ``"nvme"``: each
            unit's state in files under ``directory``, mapped in for its step
            and written back behind it, so host memory holds a few units, not
            the model's state.
        directory: where the ``"nvme"`` tier keeps its files (one folder per
            rank); required for it, unused by ``"host"``. It must be writable,
            have room for the state (reserved when stepping is enabled) and
            belong to one job at a time.
        pin_memory: pin the host buffers of the ``"host"`` tier (only where a
            GPU is present).
        units_in_memory: ``"nvme"``: how many units may be read ahead of or
            written back behind the one stepping (at least 1).
        unit_bytes: about how many bytes of state one unit holds; a larger
            parameter is a unit of its own.
    """

    tier: Literal["host", "nvme"] = "host"
    directory: str | os.PathLike | None = None
    pin_memory: bool = True
    units_in_memory: int = 2
    unit_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.tier not in ("host", "nvme"):
            raise ValueError(f"OptimizerOffloadPolicy.tier must be 'host' or 'nvme', got {self.tier!r}")
        if self.tier == "nvme" and self.directory is None:
            raise ValueError(
                "OptimizerOffloadPolicy(tier='nvme') needs a directory: pass "
                "directory='/path/on/a/local/nvme/disk'"
            )
        if self.units_in_memory < 1:
            raise ValueError(
                f"OptimizerOffloadPolicy.units_in_memory must be at least 1, got {self.units_in_memory}"
            )
        if self.unit_bytes <= 0:
            raise ValueError(f"OptimizerOffloadPolicy.unit_bytes must be positive, got {self.unit_bytes}")


@dataclass
class DataParallelMeshDims:
    """Which dims of a full SPMD mesh are data parallel, for ``fully_shard(dp_mesh_dims=...)``.

    With ``dp_mesh_dims`` the ``mesh`` given to ``fully_shard`` is the whole
    SPMD mesh (data-parallel and e.g. tensor-parallel dims), and every
    parameter is already a ``DTensor`` on it, ``Replicate()`` on the dims named
    here. See [Note: SPMD meshes] in ``dp_mesh_dims.py``.

    Attributes:
        shard: the dim name(s) FSDP shards parameters over; several names are
            flattened into one shard dim. ``None``: no sharding (replicate only,
            like DDP).
        replicate: the dim name(s) parameters stay replicated over (HSDP, or
            DDP when ``shard`` is ``None``); several names are flattened.
            At least one of ``shard`` and ``replicate`` must be set.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims; "
                "e.g. DataParallelMeshDims(shard='dp') or "
                "DataParallelMeshDims(shard='dp_shard', replicate='dp_replicate')"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """The shard dim names as a tuple (empty when ``shard`` is ``None``)."""
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """The replicate dim names as a tuple (empty when ``replicate`` is ``None``)."""
        return _names(self.replicate)


@dataclass
class _ShardPlacementResult:
    """What ``shard_placement_fn`` may return to put a parameter on a mesh of its own.

    torch's ``ShardPlacementResult`` where torch has it (2.12 and later; the
    same class object), this dataclass with the same fields otherwise. See
    [Note: Per-parameter meshes] in ``runtime/meshes/param_meshes.py``.

    Attributes:
        placement: the tensor dim to shard on, ``Shard(dim)``; ``None`` means ``Shard(0)``.
        mesh_info: the mesh to shard over, as torch's ``FSDPMeshInfo`` /
            ``HSDPMeshInfo`` (e.g. ``FSDPMeshInfo(mesh=sparse["efsdp"], shard_mesh_dim=0)``
            or ``_get_mesh_info(mesh, dp_mesh_dims)``). Parameters on the same
            process groups must share one mesh-info object.
    """

    placement: Shard | None
    mesh_info: object


ShardPlacementResult: type = upstream_shard_placement_result() or _ShardPlacementResult
if ShardPlacementResult is _ShardPlacementResult:
    _ShardPlacementResult.__name__ = _ShardPlacementResult.__qualname__ = "ShardPlacementResult"


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _from_upstream(policy: object) -> object:
    """torch.distributed.fsdp's policy objects as ours, so a partly switched script works."""
    if is_upstream_instance(policy, "MixedPrecisionPolicy"):
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
            param_dtype_override_fn=getattr(policy, "param_dtype_override_fn", None),
        )
    if is_upstream_instance(policy, "CPUOffloadPolicy"):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if is_upstream_instance(policy, "OffloadPolicy"):
        return OffloadPolicy()
    if is_upstream_instance(policy, "DataParallelMeshDims"):  # torch 2.12 and later
        return DataParallelMeshDims(shard=policy.shard, replicate=policy.replicate)
    return policy


def is_upstream_instance(obj: object, name: str) -> bool:
    """Whether ``obj`` is an instance of torch.distributed.fsdp's class ``name``.

    Decided by the classes' defining modules, not by looking the name up in
    ``torch.distributed.fsdp``: ``patch_torch()`` points that name at ours.
    """
    return any(
        cls.__name__ == name and cls.__module__.startswith("torch.distributed.fsdp")
        for cls in type(obj).__mro__
    )


def resolve_dp_mesh_dims(dims: object) -> DataParallelMeshDims:
    """``dp_mesh_dims`` as ours (upstream's class is accepted too), checked for its type."""
    if not isinstance(dims, DataParallelMeshDims):
        dims = _from_upstream(dims)
    if not isinstance(dims, DataParallelMeshDims):
        raise ValueError(
            f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims or None, got {dims!r}; "
            "e.g. dp_mesh_dims=DataParallelMeshDims(shard='dp')"
        )
    return dims


def resolve_policies(
    mp_policy: object, offload_policy: object
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """Validate the policies (accepting upstream's policy classes too) and return ours.

    Malformed policies raise an error naming the argument and the fix.
    """
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        mp_policy = _from_upstream(mp_policy)
    if not isinstance(offload_policy, OffloadPolicy):
        offload_policy = _from_upstream(offload_policy)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(
            f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}; "
            "e.g. mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
        )
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, name)
        if dtype is None:
            continue
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"fully_shard: MixedPrecisionPolicy.{name} must be None or a floating-point "
                f"torch.dtype (e.g. torch.bfloat16, torch.float32), got {dtype!r}"
            )
    override_fn = mp_policy.param_dtype_override_fn
    if override_fn is not None and not callable(override_fn):
        raise ValueError(
            "fully_shard: MixedPrecisionPolicy.param_dtype_override_fn must be None or a "
            f"callable taking a parameter and returning a torch.dtype or None, got {override_fn!r}"
        )
    if not isinstance(mp_policy.cast_forward_inputs, bool):
        raise ValueError(
            "fully_shard: MixedPrecisionPolicy.cast_forward_inputs must be a bool, got "
            f"{mp_policy.cast_forward_inputs!r}"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(
            f"fully_shard: offload_policy must be an OffloadPolicy, got {offload_policy!r}; "
            "pass OffloadPolicy() (no offload) or CPUOffloadPolicy()"
        )
    if isinstance(offload_policy, CPUOffloadPolicy) and not isinstance(
        offload_policy.pin_memory, bool
    ):
        raise ValueError(
            "fully_shard: CPUOffloadPolicy.pin_memory must be a bool, got "
            f"{offload_policy.pin_memory!r}"
        )
    return mp_policy, offload_policy


Granularity = str | int | tuple[int, int]


class RaggedShard(RaggedShardBase):
    """The parameter-major layout: return it from ``shard_placement_fn`` for every parameter of a call.

    The group's parameters then sit whole, in registration order, in one
    flat buffer; rank ``r`` holds the range ``[r * S, (r + 1) * S)`` of it,
    cut only between rows and at ``granularity``'s blocks (``"rows"``; an
    ``int`` block of elements such as 256; a tile such as ``(128, 128)``;
    ``"whole"``: one rank holds the parameter). The all-gather output *is*
    the unsharded parameters and the gradients are reduce-scattered from
    their own order, so neither collective needs a reordering copy. The
    sharded parameter is a DTensor whose placement is a ``RaggedShard`` with
    ``row_bounds`` set: rank ``r`` holds rows ``[row_bounds[r],
    row_bounds[r + 1])``. See docs/layouts.md.
    """

    def __init__(self, granularity: Granularity = "rows", row_bounds: tuple[int, ...] = ()) -> None:
        super().__init__(0)
        keep_ragged_placements()  # DTensor ops on these keep them (or refuse)
        ok = granularity in ("rows", "whole") if isinstance(granularity, str) else (
            isinstance(granularity, int) and not isinstance(granularity, bool) and granularity >= 1
        ) or (
            isinstance(granularity, tuple) and len(granularity) == 2
            and all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in granularity)
        )
        if not ok:
            raise ValueError(
                f"RaggedShard(granularity={granularity!r}): expected 'rows', 'whole', a block "
                "size in elements (int >= 1) or a tile (rows, cols)"
            )
        self.granularity = granularity
        self.row_bounds = tuple(int(b) for b in row_bounds)

    def __repr__(self) -> str:
        bounds = f", row_bounds={self.row_bounds}" if self.row_bounds else ""
        return f"RaggedShard(granularity={self.granularity!r}{bounds})"

    __str__ = __repr__

    def __reduce__(self) -> tuple:
        return (RaggedShard, (self.granularity, self.row_bounds))

    def __hash__(self) -> int:
        return super().__hash__()
