"""FSDPModule: the control surface of every sharded module.

``fully_shard`` swaps a module's class for a subclass of ``(FSDPModule,
original class)``, so every method here is available on the module itself.
The setters only record a choice, on the module's FSDP state or through the
methods of its parameter group (``update_settings``) and of the group's gradient
reduction (see group_settings.py); the hooks read it on the next use. Methods taking ``recurse`` apply to
every FSDP module in the subtree; the others to this module's group only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.nn as nn

from .api import GradientCommPolicy
from .errors import FSDPAssertionError
from .handles import GradientReductionHandle, UnshardHandle, group_unshard_handle, reduction_handle
from .runtime.comm.comm_memory import use_process_group_memory, use_symm_mem
from .runtime.comm.staged_collectives import AllGather, ReduceScatter, check_comm
from .runtime.group.arenas import materialize_in_arenas
from .runtime.group.param_group import FSDPParamGroup
from .runtime.hooks.state import FSDPState, state_of
from .runtime.meshes.param_meshes import check_one_group

__all__ = ["FSDPModule"]


class FSDPModule:
    """Mixin added to every module passed to :func:`fully_shard`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Building an instance of the swapped class (e.g. nn.Sequential slicing
        # calls type(self)(...)) yields the original class: FSDP state is only
        # ever attached by fully_shard.
        orig_cls = cls.__mro__[2]
        obj = orig_cls.__new__(orig_cls, *args, **kwargs)
        obj.__init__(*args, **kwargs)
        return obj

    def _fsdp_state(self) -> FSDPState:
        state = state_of(self)
        if state is None:
            raise AssertionError(f"{type(self).__name__} is an FSDPModule without FSDP state")
        return state

    def _states(self, recurse: bool) -> list[FSDPState]:
        """This module's FSDP state and, with ``recurse``, those of FSDP modules below it."""
        if not recurse:
            return [self._fsdp_state()]
        states: dict[FSDPState, None] = {}
        for module in self.modules():
            state = state_of(module)
            if state is not None:
                states.setdefault(state)
        return list(states)

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [g for s in self._states(recurse) for g in s.param_groups]

    # ---- unshard / reshard ------------------------------------------------------

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        for group in self._groups(recurse=False):
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now and register them unsharded (not recursive).

        The module's next forward uses them without a second all-gather. With
        ``async_op=True`` the all-gather runs in the background and an
        :class:`UnshardHandle` is returned; the forward waits for it, or call
        its ``wait()`` to use the parameters before that. Otherwise this
        returns ``None`` once the parameters are registered.
        """
        _check_bool(async_op, "unshard", "async_op")
        state = self._fsdp_state()
        for group in state.param_groups:
            if state.is_root is None:  # before the first forward's lazy init
                group.adopt_params(force=True)  # also decides all-gather extensions
                group.check_materialized()
                group.check_dtypes()
            group.unshard(async_op=async_op)
        handle = group_unshard_handle(state.param_groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward, make the next step start clean.

        Call it on the root module (``RuntimeError`` otherwise): it waits for
        in-flight all-gathers, reshards every group and drops per-iteration
        bookkeeping. The failed step's unreduced gradients are dropped,
        including those held by ``set_requires_gradient_sync(False)``: restart
        an accumulation sequence. Gradients already reduced onto the sharded
        parameters stay; call ``optimizer.zero_grad()`` to drop them too.
        """
        self._fsdp_state().reset_iter_state()

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Make the caller end each backward with :meth:`finalize_backward` (root only).

        For schedules that reduce gradients as a step of their own (pipeline
        schedules, torchtitan's trainer): while enabled, the end of a backward
        reduces and reshards only what it must, and groups autograd did not
        reach wait, unreduced, for :meth:`finalize_backward`, which must then
        run after the step's last backward and before the gradients are read
        or cleared. It supersedes :meth:`set_is_last_backward`. Set it before
        forward: changing it during a backward, or after a backward started
        in the other mode (until finalized or reset), raises ``RuntimeError``,
        as does calling it on a module that is not the root.
        (torch 2.15's API; fsdp2 offers it on every torch.)
        """
        _check_bool(enabled, "set_manual_backward_finalization", "enabled")
        self._fsdp_state().set_manual_backward_finalization(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Reduce the gradients backward left pending, reshard, and end the backward iteration.

        Needs :meth:`set_manual_backward_finalization` ``(True)`` (set before
        forward) and runs on the root after the step's last backward; before
        the root's first forward it does nothing. After backwards with
        ``set_requires_gradient_sync(False)``, turn sync back on first: the
        gradients held since then are reduced once per group. With
        ``async_op=True`` the reductions are started and a
        :class:`GradientReductionHandle` is returned: call its ``wait()``
        before using the gradients or running the model again. Otherwise
        this returns ``None`` when done. Raises ``RuntimeError`` (upstream's
        messages) while a backward runs, before the previous handle was
        waited on, or for HSDP groups whose all-reduce is turned off.
        (torch 2.15's API; fsdp2 offers it on every torch.)
        """
        _check_bool(async_op, "finalize_backward", "async_op")
        state = self._fsdp_state()
        token = state.finalize_backward(wait=not async_op)
        if not async_op:
            return None
        return reduction_handle(state if token is not None else None, token)

    def finish_backward(self) -> None:
        """:meth:`finalize_backward` (synchronous) without requiring manual finalization mode.

        fsdp2's name from before torch 2.15 named the idea, kept as an alias:
        after backwards with ``set_requires_gradient_sync(False)``, turn sync
        back on and call this on the root to reduce-scatter the accumulated
        gradients once per group (resharding per ``set_reshard_after_backward``).
        """
        self._fsdp_state().finish_backward()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep the unsharded parameters' memory allocated across reshard and unshard.

        By default resharding frees it. Kept, every unshard writes the same
        memory (stable data pointers, as CUDA graph capture needs) at the cost
        of holding the unsharded parameters all the time.
        (torch 2.15's API; fsdp2 offers it on every torch.)
        """
        _check_bool(keep, "set_keep_unsharded_storage", "keep")
        for group in self._groups(recurse):
            group.set_keep_unsharded_storage(keep)

    # ---- schedule ---------------------------------------------------------------

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules``' parameters, in order, right after this module's in forward.

        Each listed module's own pre-forward then waits for its all-gather
        instead of issuing one. ``[next_module]`` issues the default order's
        next all-gather earlier; two or more overlap more at the cost of memory.
        """
        self._fsdp_state().forward_prefetch = _prefetch_groups(
            modules, "set_modules_to_forward_prefetch"
        )

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules``' parameters, in order, right after this module's in backward.

        Replaces the default for this module (prefetching the module that ran
        just before it in forward); ``[]`` restores the default.
        """
        self._fsdp_state().backward_prefetch = _prefetch_groups(
            modules, "set_modules_to_backward_prefetch", last_group_first=True
        )

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free the unsharded parameters after forward (and gather again in backward).

        Overrides the ``fully_shard`` argument, including the root's default
        of ``False``; e.g. ``False`` for evaluation, ``True`` again for training.
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        _check_bool(recurse, "set_reshard_after_forward", "recurse")
        for group in self._groups(recurse):
            if group.mesh_info.replicate_only:
                raise FSDPAssertionError(
                    f"set_reshard_after_forward: '{group.module_fqn or type(self).__name__}' "
                    "uses dp_mesh_dims with replicate dims only (DDP), whose parameters are "
                    "never sharded; there is nothing to reshard"
                )
        for state in self._states(recurse):
            state.auto_reshard_after_forward = False
            for group in state.param_groups:
                group.update_settings(reshard_after_forward=reshard_after_forward)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free the unsharded parameters after backward.

        ``False`` keeps them for the next forward (no all-gather there), e.g.
        between gradient-accumulation micro-batches; they are stale after an
        optimizer step, so turn it back on for the last micro-batch.
        """
        _check_bool(reshard_after_backward, "set_reshard_after_backward", "reshard_after_backward")
        _check_bool(recurse, "set_reshard_after_backward", "recurse")
        for group in self._groups(recurse):
            group.update_settings(reshard_after_backward=reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward all-gathers this module's parameters (not recursive).

        ``False`` is for modules whose backward does not read their parameters
        (e.g. an embedding): their gradients are still reduced.
        """
        _check_bool(unshard_in_backward, "set_unshard_in_backward", "unshard_in_backward")
        for group in self._groups(recurse=False):
            group.update_settings(unshard_in_backward=unshard_in_backward)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Upstream's private switch (recursive): with ``True`` the hooks' and prefetches'
        all-gathers run on the current stream as async collectives instead of on FSDP's
        all-gather streams (no inter-stream fragmentation; overlap needs explicit
        prefetching). The same values either way."""
        for group in self._groups(recurse=True):
            group.update_settings(unshard_async_op=bool(async_op))  # upstream takes any truthy value

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step (default ``True``).

        With ``False`` (e.g. pipeline micro-batches run several backwards after
        their forwards) the end of backward keeps the forward order that drives
        backward prefetching for the backwards still to come.
        """
        _check_bool(is_last_backward, "set_is_last_backward", "is_last_backward")
        self._fsdp_state().set_is_last_backward(is_last_backward)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """An event recorded after the optimizer step for the next forward's all-gathers to wait on.

        By default the root's first all-gather is ordered after everything
        already queued on the current stream; with an event it waits only for
        that event. Used once: set a new event every step. On CPU the wait is
        a no-op.
        """
        if not callable(getattr(event, "wait", None)):
            raise ValueError(
                f"set_post_optim_event expects an event with a wait() method (torch.Event), "
                f"got {type(event).__name__}"
            )
        self._fsdp_state().set_post_optim_event(event)

    # ---- gradient reduction -------------------------------------------------------

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduces gradients (``False``: accumulate locally, no communication).

        While off, each backward adds to the unsharded gradients kept on every
        rank; the next backward with it on reduce-scatters the sum once per
        group. The equivalent of ``no_sync()`` in DDP and FSDP1.
        """
        _check_bool(
            requires_gradient_sync, "set_requires_gradient_sync", "requires_gradient_sync"
        )
        _check_bool(recurse, "set_requires_gradient_sync", "recurse")
        for group in self._groups(recurse):
            group.reduction.set_requires_gradient_sync(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces gradients over the replicate dim.

        Turn it off for all but the last micro-batch of gradient accumulation:
        gradients are still reduce-scattered over the shard dim and kept aside
        (not on ``.grad``) until the next backward that all-reduces.
        """
        _check_bool(requires_all_reduce, "set_requires_all_reduce", "requires_all_reduce")
        _check_bool(recurse, "set_requires_all_reduce", "recurse")
        for group in self._groups(recurse):
            group.reduction.set_requires_all_reduce(requires_all_reduce)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the world size (not recursive)."""
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not math.isfinite(factor)
            or factor <= 0
        ):
            raise ValueError(
                f"set_gradient_divide_factor expects a positive finite number, got {factor!r}"
            )
        for group in self._groups(recurse=False):
            group.reduction.set_gradient_divide_factor(float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated: use :meth:`set_gradient_divide_factor`."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            DeprecationWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Use only ``SUM`` in the collectives and divide separately (not recursive).

        See [Note: Gradient divide factors] in ``reduce_op.py``.
        """
        _check_bool(enable, "set_force_sum_reduction_for_comms", "enable")
        for group in self._groups(recurse=False):
            group.reduction.set_force_sum_reduction(enable)

    def set_all_reduce_hook(
        self,
        hook: Callable[[torch.Tensor], None],
        *,
        stream: torch.Stream | None = None,
    ) -> None:
        """Call ``hook(reduce_output)`` on this module's reduced gradients (not recursive).

        ``reduce_output`` is this rank's flat reduce-scatter output for the
        whole group (with padding), before any post-division; the hook may
        modify it in place, e.g. to all-reduce it over another group (custom
        HSDP). ``stream``: the accelerator stream to run it on (default: the
        current one, or the one given before); not with a native HSDP mesh,
        where the hook runs after the all-reduce. ``None`` as ``hook`` removes
        it (a stream given before must then be unused: the next backward
        raises otherwise, as upstream).
        """
        if hook is not None and not callable(hook):
            raise ValueError(f"set_all_reduce_hook expects a callable, got {type(hook).__name__}")
        check_one_group(self._fsdp_state().param_groups, "set_all_reduce_hook", "hook")
        groups = self._groups(recurse=False)
        if stream is not None and any(group.mesh_info.is_hsdp for group in groups):
            # upstream's text exactly (its tests compare str(error)), checked first as
            # upstream does; ours in a note
            error = ValueError("stream cannot be set when using native HSDP")
            note = ("On a 2-D (replicate, shard) mesh the hook runs after FSDP's own "
                    "all-reduce, on its stream: pass stream=None")
            error.__notes__ = [note]  # what add_note (Python 3.11+) sets
            raise error
        if stream is not None and not callable(getattr(stream, "wait_stream", None)):
            raise ValueError(
                f"set_all_reduce_hook expects stream to be a stream or None, got "
                f"{type(stream).__name__}"
            )
        for group in groups:
            # as upstream: a later call without a stream keeps the one given before
            group.reduction.set_all_reduce_hook(hook, stream)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce zeros for every trainable parameter that got no gradient in this backward.

        Upstream's opt-in for ranks that use different parameters (mixture of
        experts, multi-modal branches). fsdp2 already reduces such parameters
        by default, as DDP's ``find_unused_parameters`` (a parameter unused on
        every rank keeps ``grad is None``; see [Note: Gradients of parameters
        used on some ranks] in reduction.py). With ``True`` every trainable
        gathered parameter is reduced, even on a rank with no gradient in the
        group at all, and a parameter unused on every rank gets a zero
        gradient instead of none, as upstream.
        """
        _check_bool(
            reduce_scatter_unused_params,
            "set_reduce_scatter_unused_params",
            "reduce_scatter_unused_params",
        )
        _check_bool(recurse, "set_reduce_scatter_unused_params", "recurse")
        for group in self._groups(recurse):
            group.reduction.set_reduce_scatter_unused_params(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reductions may be in flight at once, their buffers held (``>= 1``, default 1).

        Before a reduction the compute stream waits for the oldest in flight
        until fewer than ``max_input_buffers`` remain, so more trades memory
        for fewer stalls on an exposed reduce-scatter (accelerators; on CPU
        nothing changes). As upstream, the root's first forward reads it, once,
        as the largest value over its modules, and refuses more than 1 with the
        symmetric-memory reduce-scatter.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        _check_bool(recurse, "set_reduce_scatter_max_input_buffers", "recurse")
        for group in self._groups(recurse):
            group.reduction.set_reduce_scatter_max_input_buffers(max_input_buffers)

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Reduce-scatter gradients over a process group of its own (``False``: the shard group).

        The new group has the same ranks as the shard group; one is made per
        set of ranks and call (creating it is collective over those ranks:
        call this on every rank alike). On NCCL, where one communicator runs
        one collective at a time, backward's reduce-scatters can then overlap
        its all-gathers; results are the same either way.
        """
        _check_bool(enable, "set_separate_reduce_scatter_group", "enable")
        _check_bool(recurse, "set_separate_reduce_scatter_group", "recurse")
        new_groups: dict = {}
        for group in self._groups(recurse):
            group.reduction.set_separate_reduce_scatter_group(enable, new_groups)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's collective buffers with the process group's allocator.

        Not recursive.

        On NCCL this enables zero-copy and SHARP collectives; backends without
        an allocator (gloo) keep the default, copy-free collectives. Cannot be
        combined with :meth:`set_custom_all_gather` / :meth:`set_custom_reduce_scatter`.
        See [Note: Communication memory] in comm_memory.py.
        """
        _check_bool(enable, "set_allocate_memory_from_process_group_for_comm", "enable")
        for group in self._groups(recurse=False):
            use_process_group_memory(group, enable)

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """All-gather this module's parameters through symmetric memory (CUDA, NCCL).

        Not recursive.

        NCCL can then use its copy-engine (zero-CTA policy) or symmetric-kernel
        all-gather. Where torch lacks the backend (e.g. a CPU-only build) this
        raises upstream's ``RuntimeError``; on a non-CUDA mesh it changes
        nothing. Cannot be combined with custom comms.
        See [Note: Communication memory] in comm_memory.py.
        """
        for group in self._groups(recurse=False):
            use_symm_mem(group, backend)

    # ---- nn.Module integration ------------------------------------------------------

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Run this module's all-gathers through ``comm`` (see staged_collectives.py).

        ``comm.allocate(size, *, dtype, device)`` provides the output buffer
        (this rank's input is its block ``rank``); ``comm(output_tensor=,
        input_tensor=, group=, async_op=)`` runs the collective.
        """
        check_one_group(self._fsdp_state().param_groups, "set_custom_all_gather", "custom comm")
        check_comm(comm, "set_custom_all_gather")
        for group in self._groups(recurse=False):
            group.update_settings(all_gather_comm=comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Run this module's gradient reduce-scatters through ``comm``.

        ``comm.allocate(size, *, dtype, device)`` provides the input and
        output buffers; ``comm(output_tensor=, input_tensor=, group=, op=)``
        runs the collective.
        """
        check_one_group(
            self._fsdp_state().param_groups, "set_custom_reduce_scatter", "custom comm"
        )
        check_comm(comm, "set_custom_reduce_scatter")
        for group in self._groups(recurse=False):
            group.reduction.set_reduce_scatter_comm(comm)

    def set_gradient_comm_policy(self, policy: GradientCommPolicy | None) -> None:
        """Reduce-scatter this module's gradients in ``policy.payload`` (``None``: as sent today).

        fsdp2's own (see ``GradientCommPolicy``): each slice encoded once,
        exchanged by all-to-all, summed by its owner in the reduce dtype. This
        module's groups only (call it on each ``fully_shard``-ed module); a
        custom reduce-scatter comm on the same module is refused.
        """
        if policy is not None and not isinstance(policy, GradientCommPolicy):
            raise TypeError(f"set_gradient_comm_policy expects a GradientCommPolicy or None, got {policy!r}")
        for group in self._groups(recurse=False):
            group.reduction.set_grad_comm(policy)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # to_empty(), .to() and friends replace local tensors, module by
        # module: the group adopts them once it is next needed (see
        # [Note: Materialization in any order] in flat_shard.py).
        self.reshard()
        result = super()._apply(*args, **kwargs)
        for group in self._groups(recurse=False):
            group.mark_params_replaced()
        return result

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Any:
        """``nn.Module.to_empty``, allocating the FSDP groups' shards in one buffer per mesh and dtype.

        The groups whose modules all lie under this one get their flat buffers
        as slices of one uninitialized allocation on ``device`` (an arena, see
        [Note: Arenas] in runtime/storage/arena.py) that their sharded
        parameters view (what they would otherwise become at the first
        forward, with a copy); everything else is moved as
        ``nn.Module.to_empty`` does.
        """
        placed: set[nn.Parameter] = set()
        inside = set(self.modules()) if recurse else set()
        if recurse:
            whole = []
            for group in self._groups(recurse=True):
                owners = {m for p in group.fsdp_params for m, _ in p.module_infos}
                if owners.union(group.modules) <= inside:
                    whole.append(group)
            # one allocation per mesh and dtype: see [Note: Arenas] in arena.py
            placed = materialize_in_arenas(whole, torch.device(device))
        # nn.Module._apply would rebuild each placed parameter: hide them from it.
        hidden = [
            (m, name, p) for m in inside for name, p in m._parameters.items() if p in placed
        ]
        for m, name, _ in hidden:
            m._parameters[name] = None
        try:
            return super().to_empty(device=device, recurse=recurse)
        finally:
            for m, name, p in hidden:
                m._parameters[name] = p


def _check_bool(value: Any, method: str, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{method}: {name} must be a bool, got {type(value).__name__} {value!r}")


def _prefetch_groups(
    modules: Iterable[Any], method: str, last_group_first: bool = False
) -> tuple[FSDPParamGroup, ...]:
    """The parameter groups of a prefetch list, after checking it names FSDP modules only.

    Every group of each module, in group order (backward: the last group first, as upstream).
    """
    if isinstance(modules, nn.Module) and not isinstance(modules, (nn.ModuleList, nn.Sequential)):
        raise ValueError(
            f"{method} expects a list of FSDP modules, got a single {type(modules).__name__}; "
            "pass [module]"
        )
    try:
        items = list(modules)
    except TypeError:
        raise ValueError(
            f"{method} expects a list of FSDP modules, got {type(modules).__name__}"
        ) from None
    groups = []
    for i, module in enumerate(items):
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"Expects FSDPModule but got {type(module)}: {module}\n"
                f"{method}: item {i} ({type(module).__name__}) is not an FSDP module; "
                "call fully_shard on it first, or leave it out of the list"
            )
        own = module._fsdp_state().param_groups
        groups.extend(reversed(own) if last_group_first else own)
    return tuple(groups)
