"""All-gather extensions: local shards whose own hooks decide what FSDP all-gathers.

[Note: All-gather extensions]
A sharded parameter's local tensor may define

    fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)
        -> (all_gather_inputs: tuple[Tensor, ...], metadata)
    fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, *, out=None)
        -> (unsharded_tensor, inner_tensors) | None

(``fsdp_pre_all_gather(mesh)`` alone is accepted too, as upstream does.)
Whether a parameter has them is decided per parameter on its sharded local
tensor when the group adopts its parameters, i.e. at lazy init (also an
explicit ``unshard()`` before the first forward) and after they were
replaced, as upstream decides at lazy init. Two kinds qualify: a tensor
subclass defining the hooks (sharded with its own ops at ``fully_shard``,
below), and a plain local tensor object the hooks were bound onto after
``fully_shard`` or after ``to_empty()`` (``local.fsdp_pre_all_gather =
fn.__get__(local)``, upstream's own test pattern; hooks on the original
parameter before ``fully_shard`` are ignored, as upstream, since sharding
makes new tensors). A plain tensor with hooks stays a view of the group's
flat buffer; when adoption moves the buffer (after ``nn.Module.to_empty``,
``.to()``), the hooked object keeps its identity and only its storage moves
(``Tensor.set_``), so the bound methods keep seeing the live shard. A
parameter whose local tensor was replaced by one without hooks loses its
extension. Hooks bound after the first forward take effect only once the
parameters are next replaced (upstream fails there). The hooks receive the
1-D shard mesh, also on an HSDP mesh.
Before each all-gather the pre hook turns this rank's shard into the tensors
to send, e.g. int8 data plus per-row scales instead of fp32. On a rank whose
shard is shorter than the padded shard (dim 0 not divisible by ``W``), every
input must have the padded shard's size, as upstream requires. FSDP gathers all inputs of the group in
one collective (as bytes when their dtypes differ) and hands each hook the
gathered tensors, dim 0 being ``W`` times the input's (also at ``W = 1``,
where upstream passes only the first: a bug we do not copy). The first post hook
returns the unsharded tensor (padded rows allowed; FSDP views the first
``outer_size`` rows) and the tensors to free on reshard; later calls get
``out=`` the existing unsharded parameter and must fill it in place.

The sharded local tensor is built with exactly upstream's ops on the subclass,
in its order and under ``no_grad``: ``torch.chunk`` of the parameter
(``aten.split``; ``new_empty(0)`` on a chunk for a rank past the last one),
``new_zeros`` of the padded shard, ``narrow(...).copy_(chunk)``, ``view(-1)``,
and a ``narrow`` view kept as the local tensor. The subclass's
``__torch_dispatch__`` must implement these natively: a subclass that falls
back to a plain tensor for ``split`` and drops the ``copy_`` ends up with an
all-zero shard, here as upstream. The hooks get what upstream passes: the
group's ``MixedPrecisionPolicy`` and ``param_dtype`` (``None`` when it equals
the parameter's dtype or that is not floating point: then the parameter's
dtype), and the post hook runs in the caller's grad mode (enabled in forward),
so a hook writing ``out=`` a parameter that requires grad must do so under
``no_grad`` or through ``.data``.

[Note: Subclasses on the parameter-major layout]
On a ``RaggedShard`` group a subclass parameter's local tensor is its run of
rows (``new_zeros`` of that size, ``copy_`` of ``narrow``-ed rows: ops any
such subclass implements), outside the group's buffer as on the dim-0 layout.
Ranks hold different row counts, so FSDP pads each pre-hook input (whose dim
0 must start with the shard's rows; padding of the hook's own after them is
kept, up to the largest rank's rows) with zero rows to the largest rank's,
and hands the post hook each rank's rows without the padding: the whole
parameter, as on one process. Before the first collective of such a
parameter the ranks agree that every rank's inputs qualify (one all-reduce),
so a hook that does not raises on every rank instead of leaving the others
in the collective. Its first post hook's tensor is the unsharded parameter
(the group's buffer keeps an unused place for it).

Subclass parameters live outside the group's flat buffer (see
[Note: Sharded parameter storage] in param.py), so a group with one needs a
copy-in (see [Note: Staged all-gather] in staged_collectives.py); so does a
group with a hooked plain tensor, whose slot in the buffer is then not read.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ...api import MixedPrecisionPolicy
from ...errors import FSDPAssertionError

_PRE = "fsdp_pre_all_gather"
_POST = "fsdp_post_all_gather"


def has_extension(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a sharded parameter's local tensor) defines the all-gather hooks.

    Class methods of a subclass and methods set on one plain tensor object
    (``t.fsdp_pre_all_gather = fn.__get__(t)``) count alike.
    """
    return hasattr(tensor, _PRE) or hasattr(tensor, _POST)


def needs_own_shard(tensor: torch.Tensor) -> bool:
    """A tensor subclass with the hooks: sharded with its own ops, outside the flat buffer.

    A plain tensor with hooks patched onto it stays a view of the group's
    flat buffer; only what is gathered changes.
    """
    return has_extension(tensor) and type(tensor) not in (torch.Tensor, nn.Parameter)


def check_extension(tensor: torch.Tensor, fqn: str) -> None:
    """Fail early, naming the parameter, if the hooks are incomplete or mis-declared."""
    if not (hasattr(tensor, _PRE) and hasattr(tensor, _POST)):
        missing = _POST if hasattr(tensor, _PRE) else _PRE
        raise FSDPAssertionError(
            f"Both {_PRE} and {_POST} should be defined if using all-gather extensions: "
            f"{tensor}\n"
            f"Parameter '{fqn}' ({type(tensor).__name__}) defines only one all-gather "
            f"extension hook; define {missing} too (both {_PRE} and {_POST} are needed)"
        )
    signature = inspect.signature(getattr(tensor, _PRE))
    num_args = len(signature.parameters)
    if num_args not in (1, 5):
        raise FSDPAssertionError(
            f"Invalid {_PRE}: {signature}\nExpects {_PRE}(self, mesh: DeviceMesh, "
            "outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, "
            "mp_policy: MixedPrecisionPolicy)\n"
            f"Parameter '{fqn}': {type(tensor).__name__}.{_PRE} takes {num_args} arguments; "
            "expected fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, "
            "mp_policy)"
        )


class ExtensionState:
    """Per-parameter bookkeeping between the pre and post hooks of one all-gather.

    ``outputs`` are the flat all-gather outputs of this parameter, created on
    the first all-gather and re-allocated (storage resize) on later ones;
    ``inner`` are the tensors the first post hook asked FSDP to free on reshard.
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        self.module = module
        self.mesh = mesh
        # Set by the group: its policy, and the dtype handed to the post hook.
        self.mp_policy = MixedPrecisionPolicy()
        self.param_dtype: torch.dtype | None = None
        self.metadata: Any = None
        self.input_sizes: list[torch.Size] = []
        self.outputs: list[torch.Tensor] = []
        self._inner: list[tuple[torch.Tensor, int]] = []  # (tensor, storage bytes)
        # A subclass on the parameter-major layout: every rank's row count and this
        # rank's (see [Note: Subclasses on the parameter-major layout]); what was wrong
        # with this rank's last inputs; whether the ranks agreed that nothing was
        self.rows: tuple[tuple[int, ...], int] | None = None
        self.problem: str | None = None
        self.agreed = False

    def pre_all_gather(
        self,
        local: torch.Tensor,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        padded_size: torch.Size | None,
        fqn: str,
    ) -> list[torch.Tensor]:
        """Run the pre hook; return its inputs flattened (1-D, contiguous).

        ``padded_size``: the padded shard's size on dim-0 groups; ``None`` on
        parameter-major ones, where the inputs' sizes are the hook's to keep
        equal across ranks (see [Note: Extensions on the parameter-major layout]).
        """
        hook = getattr(local, _PRE)
        if len(inspect.signature(hook).parameters) == 1:
            inputs, self.metadata = hook(self.mesh)
        else:
            inputs, self.metadata = hook(
                self.mesh, outer_size, outer_stride, self.module, self.mp_policy
            )
        inputs = list(inputs)
        # Like upstream: a rank holding fewer rows than the padded shard must send
        # inputs of exactly the padded shard's size (so every rank sends as much).
        uneven = padded_size is not None and local.size() != padded_size
        if uneven and any(t.size() != padded_size for t in inputs):
            raise FSDPAssertionError(
                "When a parameter is unevenly sharded by FSDP "
                f"(orig size={outer_size}, FSDP world size={self.mesh.size()}), {_PRE} must "
                f"return all-gather inputs with the padded sharded size {padded_size} but got "
                f"{[t.size() for t in inputs]}\n"
                f"Parameter '{fqn}' is sharded unevenly (local {tuple(local.shape)}, padded "
                f"{tuple(padded_size)}): {_PRE} must then return inputs of the padded "
                f"size, got {[tuple(t.shape) for t in inputs]}; pad them, or shard a "
                "dim 0 that divides evenly by the shard mesh size"
            )
        if self.rows is not None:
            inputs = self._padded_rows(inputs, fqn)
        self.input_sizes = [t.size() for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def _padded_rows(self, inputs: list[torch.Tensor], fqn: str) -> list[torch.Tensor]:
        """Each input (this rank's rows first, then any padding of the hook's own)
        zero-padded to the largest rank's rows. A problem is recorded, not raised: the
        ranks agree on it before the collective (``ragged_staged.agree_on_inputs``)."""
        counts, rank = self.rows
        most = max(counts)
        out = []
        self.problem = None
        for t in inputs:
            if t.dim() == 0 or not counts[rank] <= t.size(0) <= most:
                self.problem = (
                    f"Parameter '{fqn}' is a tensor subclass on the parameter-major layout "
                    f"(RaggedShard): {_PRE} must return inputs whose dim 0 holds the shard's "
                    f"rows first ({counts[rank]} here, at most {most} with padding), got "
                    f"{[tuple(x.shape) for x in inputs]}; return None from "
                    "shard_placement_fn for it (the dim-0 layout)"
                )
                t = t.new_zeros(most)  # a placeholder: the ranks raise before sending it
            elif most > t.size(0):
                t = torch.cat([t, t.new_zeros(most - t.size(0), *t.shape[1:])])
            out.append(t)
        return out

    def alloc_outputs(self, inputs: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
        """Flat ``(W * numel,)`` outputs matching ``inputs``' dtypes, storage (re)allocated."""
        if len(self.outputs) != len(inputs) or any(
            o.dtype != t.dtype or o.numel() != world_size * t.numel()
            for o, t in zip(self.outputs, inputs)
        ):
            self.outputs = [t.new_empty(world_size * t.numel()) for t in inputs]
        for out in self.outputs:
            _alloc_storage(out, out.numel() * out.element_size())
        return self.outputs

    def post_all_gather(
        self,
        local: torch.Tensor,
        unsharded: nn.Parameter | None,
    ) -> torch.Tensor | None:
        """Run the post hook; return the new unsharded tensor on the first call, else ``None``."""
        gathered = tuple(
            out.view(-1, *size[1:]) for out, size in zip(self.outputs, self.input_sizes)
        )
        if self.rows is not None:  # each rank's rows, without the padding between them
            counts, _ = self.rows
            most = max(counts)
            gathered = tuple(
                torch.cat([t.narrow(0, r * most, n) for r, n in enumerate(counts)])
                for t in gathered
            )
        hook = getattr(local, _POST)
        param_dtype = self.param_dtype or local.dtype
        if unsharded is not None:
            for tensor, nbytes in self._inner:
                _alloc_storage(tensor, nbytes)
            hook(gathered, self.metadata, param_dtype, out=unsharded)
            self.metadata = None
            return None
        tensor, inner = hook(gathered, self.metadata, param_dtype)
        self.metadata = None
        self._inner = [(t, t.untyped_storage().nbytes()) for t in inner]
        return tensor

    def free(self) -> None:
        """Release the gathered outputs and the post hook's inner tensors (reshard)."""
        for t in self.outputs:
            t.untyped_storage().resize_(0)
        for t, _ in self._inner:
            t.untyped_storage().resize_(0)


def _alloc_storage(tensor: torch.Tensor, nbytes: int) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)
