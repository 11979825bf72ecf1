"""FSDPState: the hooks of one fully_shard call, root lazy init, end of backward.

[Note: One training step]
root pre-forward   lazy init once (root, FQNs, no parameter in two groups,
                   meta and dtype checks, root keeps its
                   parameters unsharded after forward unless told otherwise,
                   every rank shards the same model: see [Note: Divergence
                   check at lazy init] in divergence.py);
                   wait for the user's post-optimizer event, if one was set
pre-forward        cast floating inputs (mixed precision); unshard the group;
                   start the all-gathers of the explicit forward prefetch
                   list; wrap inputs that need grad in a function whose
                   backward is this group's post-backward
post-forward       reshard if asked; record the forward order; hook outputs;
                   cast floating outputs (mixed precision)
pre-backward       (first gradient reaching an output) unshard again if
                   needed, prefetch the explicit backward prefetch list or, by
                   default, the group that ran before in forward
post-backward      reshard, reduce-scatter, accumulate sharded gradients
final callback     (queued once per backward on the autograd engine) finish
                   groups whose inputs needed no grad, reset per-step state
                   (the forward order is kept while is_last_backward is off)

[Note: Manual backward finalization]
torch 2.15's ``set_manual_backward_finalization(True)`` (on the root, before
forward) hands the end of the step to the caller, for schedules that reduce as
a step of their own. The mode a backward starts in is fixed until the step
ends (``manual_active``). In manual mode the final callback of each backward
only finishes the backward pass: groups autograd did not reach run their
post-backward if gradient sync is off (holding gradients, as always), and are
otherwise marked ``post_backward_pending`` instead of reducing;
``is_last_backward`` is ignored. ``finalize_backward()`` then runs the pending
post-backwards (groups that held gradients without sync are pending too), in
reverse lazy-init order as autograd would reach them, reshards the others as
``reshard_after_backward`` says, and ends the step. With ``async_op=True`` it
stops before ending the step and hands out a token; the handle's ``wait()``
ends it, and ``reset_iter_state()`` drops the token, which invalidates the
handle. fsdp2's older ``finish_backward()`` is the same finalization without
requiring the mode (``fsdp2.pipelining`` drives it with ``set_is_last_backward``).

[Note: Groups run in parts]
A group of several modules (``fully_shard([norm, head])``) is in use from the
pre-forward of the first of its modules to run until every one of them has
run (``_modules_to_run``); its post-forward runs then. A module of the group
may also run on its own, outside the root's forward: the chunked-loss pattern,
where the model's forward stops after ``norm`` and the training loop calls
``head`` once per chunk of the hidden states, often with a backward per chunk.
As upstream:
- the root's post-forward finishes every group the forward left in use
  (reshard, record the forward order, hook the root's outputs);
- every module's pre-forward unshards the group (a no-op while it is
  unsharded), because a backward between two calls may have resharded it;
- a call that finds the group not in forward starts a new use: its inputs get
  their own post-backward, so each chunk's backward reduces (or, without
  gradient sync, holds in the reduce dtype) the gradients of that chunk;
- a module that already ran in this use only casts its output; the group's
  post-forward waits for the modules still to run, which for a standalone
  ``head`` call never come: the group stays unsharded until its
  post-backward, ``reshard()`` or the next forward's post-forward;
- the end of backward forgets the modules still to run, so the next step
  starts a fresh use.

[Note: Several groups in one state]
A call whose parameters shard over several meshes has one group per mesh
(see [Note: Per-parameter meshes] in param_meshes.py); the state runs them
in upstream's order: pre-forward, post-forward and pre-backward go through
groups 0..N-1, the post-backward node reduces N-1..0, the end-of-backward
callback finishes each state's groups N-1..0, ``finalize_backward`` walks
states and groups in reverse. Only the last group waits for room among the
reductions in flight, and only group 1 prefetches by default (see [Note:
Default backward prefetch] in backward_prefetch.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn

from ..._torch_compat import (
    in_backward,
    queue_backward_callback,
)
from ...api import MixedPrecisionPolicy
from ..comm.comm_context import CommContext
from ..comm.comm_memory import check_max_input_buffers
from ..common.mixed_precision import cast_args, cast_floating, input_cast_dtype
from ..common.profiler_ranges import log_hook, record_function
from ..common.tensor_tree import map_tensors
from ..group.arenas import join_arenas
from ..group.param_group import FSDPParamGroup
from ..group.step_state import TrainingState
from ..storage.ragged import load_rows
from .divergence import check_same_model
from .post_backward_node import register_post_backward
from .pre_backward_hooks import hook_outputs
from .shared_params import check_shared_params

logger = logging.getLogger(__name__)

_STATE_ATTR = "_fsdp2_state"


def state_of(module: nn.Module) -> FSDPState | None:
    """The FSDP state attached to ``module`` by ``fully_shard``, if any."""
    return module.__dict__.get(_STATE_ATTR)


class _RootSteps:
    """Shared by every state under one root: its states and the control of its steps.

    Each state starts with its own; lazy init makes every state under the
    root share the root's (settings made on a sub-module before that carry
    over). The streams and the forward order are the ``CommContext``.
    """

    def __init__(self, root: FSDPState) -> None:
        self.root = root
        self.all_states: list[FSDPState] = []
        self.callback_queued = False
        self.is_last_backward = True
        # See [Note: Manual backward finalization]
        self.manual_finalization = False
        self.manual_active: bool | None = None  # the mode the running backward started in
        self.pending_reduction: object | None = None  # the async finalize's handle token


class FSDPState:
    """Forward/backward hooks for the modules of one ``fully_shard`` call."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        param_groups: list[FSDPParamGroup],
        comm_ctx: CommContext,
        auto_reshard_after_forward: bool,
        mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    ) -> None:
        self.modules = modules
        # See [Note: Several groups in one state]; empty when the call manages no parameter
        self.param_groups = param_groups
        for index, group in enumerate(param_groups):
            group.place(index, len(param_groups))
        self.auto_reshard_after_forward = auto_reshard_after_forward
        # Mixed precision casts of this state's module inputs and outputs (None: no cast).
        self._input_dtype = input_cast_dtype(mp_policy)
        self._output_dtype = mp_policy.output_dtype
        self.is_root: bool | None = None
        # Root only, on accelerators: forward inputs are moved there (as upstream).
        self._input_device: torch.device | None = None
        self.root_steps = _RootSteps(self)
        # This call's own (its group's too) until the root's lazy init hands the root's
        self.comm_ctx = comm_ctx
        self._modules_to_run: set[nn.Module] = set()
        # Explicit prefetch lists (FSDPModule.set_modules_to_*_prefetch).
        self.forward_prefetch: tuple[FSDPParamGroup, ...] = ()
        self.backward_prefetch: tuple[FSDPParamGroup, ...] = ()
        # Set on the root only: waited for in the next root pre-forward.
        self.post_optim_event: Any = None
        # Hooks stay eager under torch.compile (they swap parameters and run
        # collectives): dynamo skips them, so a compiled block traces only its
        # own compute. Instance attributes, so every caller gets these.
        self._pre_forward = torch.compiler.disable(self._pre_forward)
        self._post_forward = torch.compiler.disable(self._post_forward)
        self._pre_backward = torch.compiler.disable(self._pre_backward)
        self._end_backward = torch.compiler.disable(self._end_backward)  # the root's callback
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward, prepend=False)
        for group in param_groups:
            _register_state_dict_hooks(group)

    @property
    def param_group(self) -> FSDPParamGroup | None:
        """The state's only group (``None``: no parameters); several raise, as upstream."""
        groups = self.param_groups
        if len(groups) > 1:
            raise AssertionError(
                f"FSDP expects one param group per state, got {len(groups)} (per-param mesh); "
                "use param_groups"
            )
        return groups[0] if groups else None

    # ---- lazy init ------------------------------------------------------------

    def _lazy_init(self) -> None:
        """Runs on the first forward: this state is the root of everything below it."""
        if len(self.modules) != 1:
            names = ", ".join(type(m).__name__ for m in self.modules)
            raise RuntimeError(
                f"FSDP requires a single root module but got {self.modules}\n"
                f"The first FSDP forward ran on a group of several modules ({names}); "
                "call fully_shard on the model's root module and run forward through it"
            )
        root_module = self.modules[0]
        ctx = self.root_steps
        named_modules = list(root_module.named_modules())  # one walk for every check below
        for _, module in named_modules:
            state = state_of(module)
            if state is not None and state is not self and state.root_steps.manual_finalization:
                raise RuntimeError(
                    "set_manual_backward_finalization must be called on the root FSDP module\n"
                    f"It was set on '{type(module).__name__}', which is not the root of "
                    f"'{type(root_module).__name__}': call it on the root"
                )
        ctx.all_states = []
        module_fqns: dict[nn.Module, str] = {}
        for name, module in named_modules:
            module_fqns.setdefault(module, name)
            state = state_of(module)
            if state is None or state in ctx.all_states:
                continue
            if state is not self and state.is_root is not None:
                raise RuntimeError(
                    f"FSDP state has already been lazily initialized for {name}\n"
                    "FSDP requires running forward through the root module first\n"
                    f"'{name}' ran forward as its own root before '{type(root_module).__name__}' "
                    "did; run the first forward through the root module"
                )
            if state is not self:
                self._adopt_settings(state)
            state.is_root = state is self
            state.root_steps = ctx
            state.comm_ctx = self.comm_ctx
            ctx.all_states.append(state)
        self.is_root = True
        if self.auto_reshard_after_forward:
            # The root is needed first in backward; resharding it would only
            # cost an extra all-gather.
            for group in self.param_groups:
                group.update_settings(reshard_after_forward=False)
        groups = [g for s in ctx.all_states for g in s.param_groups]
        devices = {g.device for g in groups}
        if len(devices) == 1 and next(iter(devices)).type != "cpu":
            self._input_device = next(iter(devices))
        try:
            local_error = None
            try:
                check_shared_params(named_modules, groups, module_fqns)
                for state in ctx.all_states:
                    state._lazy_init_group(module_fqns)
                # buffers the adoptions above re-allocated: see [Note: Arenas] in arena.py
                join_arenas(groups, fresh_only=True)
                self.comm_ctx.max_reduce_scatter_inputs = max(
                    g.reduction.settings.reduce_scatter_max_input_buffers for g in groups
                ) if groups else 1  # one cap over the shared reductions in flight, as upstream
            except Exception as e:  # raised on every rank below; see [Note: Divergence check ...]
                local_error = e
            check_same_model(type(root_module).__name__, groups, local_error)
        except BaseException:
            for state in ctx.all_states:
                state.is_root = None  # the user may fix the error: lazy init runs again
            raise
        logger.debug("lazy init: root %s with %d FSDP states", type(root_module).__name__,
                     len(ctx.all_states))

    def _lazy_init_group(self, module_fqns: dict[nn.Module, str]) -> None:
        """Name this state's groups and their parameters by FQN under the root, then validate them."""
        for group in self.param_groups:
            group.set_comm_ctx(self.comm_ctx)
            group.set_fqns(module_fqns)
            # Parameters may have been replaced in any way since fully_shard.
            group.adopt_params(force=True)
            group.check_materialized()
            group.check_offloaded()
            group.check_dtypes()
            check_max_input_buffers(group)

    def _adopt_settings(self, state: FSDPState) -> None:
        """Carry root-level settings made on ``state`` before lazy init over to this root."""
        own = state.root_steps
        if not own.is_last_backward:
            self.root_steps.is_last_backward = False
        if state.post_optim_event is not None and self.post_optim_event is None:
            self.post_optim_event = state.post_optim_event
        state.post_optim_event = None

    # ---- control surface (called by FSDPModule) ---------------------------------

    def share_comm_ctx(self, other: FSDPState) -> None:
        """``share_comm_ctx``: use ``other``'s comm context (streams, forward order) from now on.

        Applies to this state's group, and, for a root or before lazy init, to
        what lazy init and the end of backward use; other states under an
        initialized root keep theirs, as upstream.
        """
        self.comm_ctx = other.comm_ctx
        for group in self.param_groups:
            group.set_comm_ctx(other.comm_ctx)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        self.root_steps.is_last_backward = is_last_backward

    def set_post_optim_event(self, event: Any) -> None:
        self.root_steps.root.post_optim_event = event

    def _wait_post_optim_event(self) -> None:
        # All-gathers run on the current stream, so that stream waits for the
        # event; on CPU ``wait()`` is a no-op. Each event is used once.
        event, self.post_optim_event = self.post_optim_event, None
        event.wait()

    # ---- forward hooks --------------------------------------------------------

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        groups = self.param_groups
        cast = None
        if self._input_dtype is not None:
            args, kwargs = cast = cast_args(args, kwargs, self._input_dtype)
        if in_backward():
            # Activation-checkpoint recompute: only make the parameters available.
            for group in groups:
                group.unshard()
                group.wait_for_unshard()
            return cast
        if self.is_root is None:
            self._lazy_init()
        if self._input_device is not None:
            device = self._input_device
            args, kwargs = cast = map_tensors(lambda t: t.to(device), (args, kwargs))
        if self.is_root and self.root_steps.pending_reduction is not None:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before forward\n"
                "Call wait() on the GradientReductionHandle that finalize_backward(async_op=True) "
                "returned before the next forward"
            )
        if self.is_root:
            log_hook("FSDP::root_pre_forward")
            with record_function("FSDP::root_pre_forward"):
                if self.comm_ctx.active:  # See [Note: Streams] in comm_context.py
                    event, self.post_optim_event = self.post_optim_event, None
                    self.comm_ctx.before_root_forward(event)
                elif self.post_optim_event is not None:
                    self._wait_post_optim_event()
        # See [Note: Groups run in parts]
        starts_use = not self._modules_to_run
        if len(self.modules) > 1 and starts_use:
            self._modules_to_run.update(self.modules)
        uses = []
        if groups:
            starts_use = groups[0].step.training_state != TrainingState.FORWARD
        for group in groups:  # See [Note: Several groups in one state]
            group.pre_forward()  # every module: the group may have been resharded since
            several = len(group.modules) > 1
            uses.append((group, group.step.record_module_run(module, starts_use, several)))
        if not starts_use:
            return cast
        for target in self.forward_prefetch:
            target.prefetch(in_backward=False)
        if groups and torch.is_grad_enabled():
            hooked = register_post_backward(tuple(uses), args, kwargs)
            if hooked is None:
                for group, use in uses:
                    group.step.add_use_without_node(use)
            return hooked or cast
        return cast

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():
            return self._cast_output(output)
        if len(self.modules) > 1:
            if module not in self._modules_to_run:
                return self._cast_output(output)  # a module of this use that already ran
            self._modules_to_run.discard(module)
            if self._modules_to_run:
                # Other modules of this group still have to run.
                return self._cast_output(output)
        output = self._finish_forward(output)
        if self.is_root:
            # Groups of several modules that did not all run: finish them now.
            for state in self.root_steps.all_states:
                if state._modules_to_run:
                    log_hook("FSDP::force_complete_post_forward")
                    state._modules_to_run.clear()
                    output = state._cast_output(state._finish_forward(output))
        return self._cast_output(output)

    def _cast_output(self, output: Any) -> Any:
        if self._output_dtype is None:
            return output
        return cast_floating(output, self._output_dtype)

    def _finish_forward(self, output: Any) -> Any:
        for group in self.param_groups:
            group.post_forward()
        if torch.is_grad_enabled():
            output = hook_outputs(output, self._pre_backward, self.modules)
        return output

    # ---- backward hooks -------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> None:
        ctx = self.root_steps
        if not ctx.callback_queued:
            ctx.callback_queued = True
            if ctx.manual_active is None:
                ctx.manual_active = ctx.manual_finalization
            queue_backward_callback(ctx.root._end_backward)
        explicit = self.backward_prefetch
        started = [group.pre_backward(default_prefetch=not explicit) for group in self.param_groups]
        if started and not any(started):
            return None  # this use's backward already started
        for target in explicit:
            target.prefetch(in_backward=True)
        return None

    def _end_backward(self) -> None:
        """After the whole backward: reduce what is left and, after the last one, end the step."""
        with record_function("FSDP::root_post_backward_callback"):
            log_hook("FSDP::root_post_backward")
            self._root_post_backward()

    def _root_post_backward(self) -> None:
        ctx = self.root_steps
        manual = bool(ctx.manual_active)
        # Root first, then the order lazy init found the states in (as upstream):
        # the order of the reductions of groups autograd did not reach.
        for state in ctx.all_states:
            state._modules_to_run.clear()  # uses of a group's modules outside the root forward
            for group in reversed(state.param_groups):
                group.end_backward(defer_reduction=manual)
        self.comm_ctx.after_backward()
        if ctx.is_last_backward and not manual:
            self._end_step()
        ctx.callback_queued = False

    def _end_step(self) -> None:
        ctx = self.root_steps
        for state in ctx.all_states:
            for group in state.param_groups:
                group.end_step()
        self.comm_ctx.after_backward()
        self.comm_ctx.post_forward_order.clear()
        ctx.manual_active = None

    # ---- manual backward finalization --------------------------------------------

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """See ``FSDPModule.set_manual_backward_finalization`` and [Note: Manual backward finalization]."""
        self._check_root("set_manual_backward_finalization")
        ctx = self.root_steps
        if enabled != ctx.manual_finalization and in_backward():
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode during backward\n"
                "Set it before forward (or after finalize_backward), not from a backward hook"
            )
        if ctx.manual_active is not None and enabled != ctx.manual_active:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode after backward starts\n"
                "A backward already ran in the other mode: finish it (finalize_backward, or "
                "the last backward) or call reset_iter_state() first"
            )
        ctx.manual_finalization = enabled

    def finalize_backward(self, wait: bool = True, require_manual: bool = True) -> object | None:
        """Reduce what backward left pending, reshard; with ``wait``, also end the step.

        Returns the token a ``GradientReductionHandle`` waits on when not ``wait``.
        """
        self._check_root("finalize_backward")
        if self.is_root is None:
            return None  # no forward ran yet: nothing to reduce
        ctx = self.root_steps
        self._check_can_finalize(require_manual)
        logger.debug("finalize_backward %s", type(self.modules[0]).__name__)
        for state in reversed(ctx.all_states):  # as autograd would reach them
            for group in reversed(state.param_groups):
                group.finalize_backward()
        if wait:
            self._end_step()
            return None
        ctx.pending_reduction = token = object()
        return token

    def wait_for_reduction(self, token: object) -> None:
        """``GradientReductionHandle.wait``: end the step an async finalize started."""
        ctx = self.root_steps
        if ctx.pending_reduction is not token:
            raise RuntimeError(
                "This gradient reduction handle was invalidated\n"
                "reset_iter_state() ran after finalize_backward(async_op=True) returned it"
            )
        self._end_step()
        ctx.pending_reduction = None

    def _check_can_finalize(self, require_manual: bool) -> None:
        ctx = self.root_steps
        if ctx.pending_reduction is not None:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before finalizing backward "
                "again\nCall wait() on the GradientReductionHandle of the previous "
                "finalize_backward(async_op=True)"
            )
        manual = ctx.manual_active if ctx.manual_active is not None else ctx.manual_finalization
        if require_manual and not manual:
            raise RuntimeError(
                "FSDP finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) before forward"
            )
        if ctx.callback_queued:
            raise RuntimeError(
                "FSDP finalize_backward must be called after backward completes\n"
                "It was called while a backward is running (e.g. from a hook)"
            )
        for group in (g for s in ctx.all_states for g in s.param_groups):
            name = group.module_fqn or "<root>"
            if group.reduction.holds_partial_reduction:
                raise RuntimeError(
                    "FSDP manual backward finalization does not support partial gradient "
                    f"reductions for parameter group {name!r}. Use automatic backward "
                    "finalization for this configuration"
                )
            settings = group.reduction.settings
            if (
                group.step.post_backward_pending and settings.reduce_grads
                and group.mesh_info.replicate_only and not settings.all_reduce_grads
            ):
                raise RuntimeError(
                    "FSDP manual backward finalization requires all-reduce for parameter group "
                    f"{name!r}. Call set_requires_all_reduce(True) before finalization"
                )

    def finish_backward(self) -> None:
        """``FSDPModule.finish_backward``: ``finalize_backward`` in either finalization mode."""
        self.finalize_backward(require_manual=False)

    def _check_root(self, method: str) -> None:
        if self.is_root is False:
            root = self.root_steps.root.modules[0]
            where = self.param_groups[0].module_fqn if self.param_groups else ""
            raise RuntimeError(
                f"{method} must be called on the root FSDP module\n"
                f"{method}() was called on '{where or type(self.modules[0]).__name__}', "
                "not on the root: call it on the "
                f"{type(root).__name__} that fully_shard was applied to last (the model)"
            )

    def reset_iter_state(self) -> None:
        """Drop every per-iteration trace (after an exception in forward or backward)."""
        self._check_root("reset_iter_state")
        if self.is_root is None:
            return  # no forward ran yet: nothing to reset
        ctx = self.root_steps
        for state in ctx.all_states:
            state._modules_to_run.clear()
            for group in state.param_groups:
                group.reset_iter_state()
        self.comm_ctx.after_backward()  # reductions the failed step left in flight
        self.comm_ctx.post_forward_order.clear()
        ctx.callback_queued = False
        ctx.manual_active = None
        ctx.pending_reduction = None  # invalidates an outstanding GradientReductionHandle


def _register_state_dict_hooks(group: FSDPParamGroup) -> None:
    """Keep ``state_dict`` / ``load_state_dict`` on the sharded parameters.

    Saving or loading between forward and backward would otherwise see the
    unsharded parameters of a group kept unsharded after forward; and
    ``load_state_dict(assign=True)`` registers new parameter objects, which
    the group adopts when next needed (see [Note: Materialization in any
    order] in flat_shard.py).
    """

    def before_save(*args: Any, **kwargs: Any) -> None:
        group.wait_for_replica_gather()
        group.reshard()
        group.adopt_params()

    loaded_here: list[str] = []  # parameter-major keys this load wrote itself

    def before_load(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                    *args: Any) -> None:
        group.wait_for_replica_gather()
        group.reshard()
        if group.order.ragged and not local_metadata.get("assign_to_params_buffers", False):
            loaded_here.extend(load_rows(module, group.fsdp_params, state_dict, prefix, args[-1]))

    def after_load(module: nn.Module, incompatible: Any) -> None:
        group.mark_params_replaced()
        if loaded_here:
            handled = set(loaded_here)
            loaded_here.clear()
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in handled]

    holders = {module: None for p in group.fsdp_params for module, _ in p.module_infos}
    for module in holders:
        module.register_state_dict_pre_hook(before_save)
        module.register_load_state_dict_pre_hook(before_load)
        module.register_load_state_dict_post_hook(after_load)
