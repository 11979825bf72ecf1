"""The flat optimizer step, on by default: no call from the user.

[Note: The flat step by default]
``enable_local_shard_step`` makes ``optimizer.step()`` run on fsdp2's flat
shard buffers, but only a user who knows to call it gets that, and the stacks
that run fsdp2 unedited (accelerate, torchtune, torchtitan, Lightning) never
will. So importing fsdp2 registers one global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``). At an
optimizer's first ``step()`` it decides, once: if the optimizer is one of
torch's elementwise ones (``step_plan.is_elementwise``: its own class, not a
subclass) and at least one param group holds only parameters in fsdp2 flat
buffers, it attaches a ``StepEngine`` in ``flat_groups_only`` mode with its own
pre- and post-hook on that optimizer. torch iterates the optimizer's own hooks
after the global ones, so the engine's pre-hook already runs in that first
step, and lets the optimizer step the DTensors itself that once: the engine
wraps ``optimizer.step`` so that a step that raises gives the groups their
parameters back at once (``StepEngine.wrap_step``), and the step already
running cannot be wrapped. The runs adopt the state that first step made at
the second (see [Note: The state a caller holds is the state] in
state_views.py). Anything else (other optimizers, parameters sharded by upstream's
``fully_shard`` or not sharded, groups that mix them) steps as the optimizer
would without fsdp2, and costs one dictionary look-up per step.

What stays as without the engine:

- **User step hooks** see the DTensor parameters: before each step the
  global hook keeps the engine's pre-hook last and its post-hook first among
  the optimizer's own (``keep_step_hooks_innermost`` in _torch_compat).
- **A ``closure``**, a compiled ``step()``, a ``capturable`` group and any
  step while ``set_flat_step_default(False)`` is in force run the
  optimizer's own step on the DTensors (see [Note: Calls the engine steps
  aside for] in step_engine.py); the runs then rebuild from the
  per-parameter state at their next flat step, as after anything else that
  wrote the state (see [Note: State the run did not write] in flat_run.py).
- **Changed parameters** (``add_param_group``, a group's list edited, a
  buffer re-allocated) are planned again at the next step (``GroupPlan.holds``);
  a group that is no longer wholly flat steps as the optimizer would.
- **``zero_grad``** (an instance attribute wrapping the optimizer's own):
  where the last step found a run's gradients to be views of one flat
  gradient, one ``zero_()`` of it (``set_to_none=False``) or dropping its
  views (``True``, the flat gradient freed at once); the rest as torch does.
- ``optimizer.state``, ``state_dict()``, ``load_state_dict()``, DCP,
  ``torch.save`` and schedulers see what they see with
  ``enable_local_shard_step`` (see [Note: Flat optimizer steps] in flat_run.py):
  the same keys, types and values as the optimizer's own step, the keys in
  its order (``_keep_key_order`` in step_engine.py), every tensor with a
  storage of its own and DTensor specs made as its step makes them
  (``dtensor_state_like`` in _torch_compat/dtensor.py), so the pickled bytes are
  the same too. A default that changed any of this would break stacks
  that never asked for it.

It is on unless switched off: ``FSDP2_FLAT_STEP=0`` in the environment (read
when an optimizer first steps; for stacks one cannot edit) or
``set_flat_step_default(False)`` for the process (``True`` overrides the
environment the other way). ``disable_flat_step(optimizer)`` keeps one
optimizer off. An explicit ``enable_local_shard_step(optimizer, ...)``
replaces the default for that optimizer.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .._torch_compat import keep_step_hooks_innermost
from ..runtime.storage.flat_shard import flat_shard_of, flat_slot_of
from .quantized_state import is_block_quantized, use_block_aligned_state
from .step_engine import StepEngine
from .step_plan import is_elementwise

__all__ = ["disable_flat_step", "flat_step_engine", "set_flat_step_default"]

logger = logging.getLogger("fsdp2.optim.local_shard_step")  # the name users filter on

ENV_VAR = "FSDP2_FLAT_STEP"
_ATTR = "_fsdp2_flat_step"  # on the optimizer: its DefaultStep, or OFF (never pickled)
OFF = "off"  # decided: the optimizer steps without the default engine
_default_on: bool | None = None  # set_flat_step_default; None: the environment decides


class DefaultStep:
    """One optimizer's default engine and the hooks that run it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.engine = StepEngine(optimizer, flat_buffers=True, flat_groups_only=True)
        self._stepping = False
        # the step that attaches the engine is torch's own: see [Note: The flat step by default]
        self._first = True
        self._hooks: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self.before_step),
            optimizer.register_step_post_hook(self.after_step),
            optimizer.register_load_state_dict_post_hook(self.engine.after_load),
            # a step that raised left stand-ins: see StepEngine.recover
            optimizer.register_state_dict_pre_hook(self.engine.recover),
            optimizer.register_load_state_dict_pre_hook(self.engine.recover),
        ]
        self._unwrap_zero_grad = self.engine.wrap_zero_grad()
        self._unwrap_step = self.engine.wrap_step()  # a step that raises: see StepEngine.wrap_step

    def keep_innermost(self, optimizer: torch.optim.Optimizer) -> None:
        keep_step_hooks_innermost(optimizer, self._hooks[0].id, self._hooks[1].id)

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return  # traced as torch's own step; See [Note: Calls the engine steps aside for]
        if self._first:
            self._first = False
            return
        if _default_on is False:
            self.engine.recover()
            self.engine.forget_runs()  # the optimizer steps the DTensors; see the note
            return
        self._stepping = True  # a closure: the engine steps aside itself
        self.engine.before_step(optimizer, args, kwargs)

    def after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        if self._stepping:  # (the engine's after_step does nothing while Dynamo traces)
            self._stepping = False
            self.engine.after_step(optimizer)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._unwrap_zero_grad()
        self._unwrap_step()


def set_flat_step_default(enabled: bool) -> None:
    """Turn the flat optimizer step by default on or off for this process.

    On (the default; ``FSDP2_FLAT_STEP=0`` in the environment is off): an elementwise
    ``torch.optim`` optimizer over parameters sharded by fsdp2's
    ``fully_shard`` steps on the groups' flat shard buffers, the same updates
    bit for bit (see [Note: The flat step by default]). Off: every optimizer
    steps on the DTensors as torch's does, from its next ``step()`` on
    (``enable_local_shard_step`` still works). Overrides the environment variable.
    """
    global _default_on
    _default_on = bool(enabled)


def disable_flat_step(optimizer: torch.optim.Optimizer) -> None:
    """Keep ``optimizer`` on its own step (on the DTensors), whatever the default says.

    Removes the default engine if it was attached; its state stays where it is
    (per-parameter DTensors), so nothing changes but the speed.
    """
    current = optimizer.__dict__.get(_ATTR)
    if isinstance(current, DefaultStep):
        current.remove()
    optimizer.__dict__[_ATTR] = OFF


def flat_step_engine(optimizer: torch.optim.Optimizer) -> StepEngine | None:
    """The default ``StepEngine`` attached to ``optimizer`` (after its first step), or ``None``."""
    current = optimizer.__dict__.get(_ATTR)
    return current.engine if isinstance(current, DefaultStep) else None


def _default_enabled() -> bool:
    if _default_on is not None:
        return _default_on
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _wholly_flat(group: dict) -> bool:
    params = group["params"]
    return bool(params) and all(
        isinstance(p, DTensor) and flat_slot_of(p) is not None for p in params
    )


def _holds_fsdp2_params(optimizer: torch.optim.Optimizer) -> bool:
    return any(
        isinstance(p, DTensor) and flat_shard_of(p) is not None
        for group in optimizer.param_groups for p in group["params"]
    )


def _pending_adoption(optimizer: torch.optim.Optimizer) -> bool:
    """Whether some parameter is fsdp2's, replaced since its group last adopted it.

    ``model.load_state_dict`` marks its groups so; the next forward makes the
    parameters views of their flat buffers again.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            flat = flat_shard_of(p) if isinstance(p, DTensor) else None
            if flat is not None and flat.needs_adoption:
                return True
    return False


def _on_any_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """The global step pre-hook: decide once per optimizer, then keep its hooks innermost."""
    if torch.compiler.is_compiling():
        return  # traced as torch's own step; See [Note: Calls the engine steps aside for]
    current = optimizer.__dict__.get(_ATTR)
    if current is None:
        if is_block_quantized(optimizer) and _holds_fsdp2_params(optimizer):
            # torchao's low-bit state: not a flat step, its layout; models sharded otherwise
            # (upstream's, or none) keep torchao's own. See [Note: Quantized state on
            # block-aligned shards]
            use_block_aligned_state(optimizer)
        if not _default_enabled():
            return  # undecided: a later switch-on still applies
        if is_elementwise(optimizer) and any(_wholly_flat(g) for g in optimizer.param_groups):
            current = DefaultStep(optimizer)
            logger.debug("%s steps on fsdp2's flat buffers by default", type(optimizer).__name__)
        elif is_elementwise(optimizer) and _pending_adoption(optimizer):
            return  # e.g. loaded right before this step (torchft's heal): decide at a later one
        else:
            current = OFF
        optimizer.__dict__[_ATTR] = current
    if current is not OFF:
        current.keep_innermost(optimizer)


def install() -> None:
    """Register the global step pre-hook once per process (importing fsdp2 does)."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_on_any_step)


_handle: RemovableHandle | None = None
install()
