"""Upstream's private names on fsdp2's objects, for the code that reads them.

torch's own code, upstream's tests and some libraries reach past
``fully_shard``'s public API into the objects behind it: torch's pipelining
before 2.15 reduces a stage through ``fully_shard.state(module)`` (its
``_state_ctx.all_states``, each state's ``_fsdp_param_groups`` and their
``post_backward()``, the root's ``_root_post_backward_final_callback()``);
upstream's tests and libraries (Unsloth's FSDP2 recipes, training scripts)
read ``module._get_fsdp_state()``, ``_is_root``, ``_fsdp_param_group``, a
group's ``_module_fqn`` and ``is_unsharded``, a parameter's ``_param_fqn``.
fsdp2 keeps one name per idea in its own classes; this module gives each of
those the upstream name too, read-only, in one place, so that such code runs
unedited (``tests/test_upstream_private_api.py``). What is not here (the
private collectives, ``FSDPParam``'s buffers) has no counterpart to name.
"""

from __future__ import annotations

from .fully_shard import fully_shard
from .module import FSDPModule
from .runtime.group.param_group import FSDPParamGroup
from .runtime.hooks.state import FSDPState, state_of
from .runtime.storage.param import FSDPParam, ShardedState


def _registered(group: FSDPParamGroup) -> ShardedState:
    """Which parameters a group's modules hold (upstream's ``_sharded_state``)."""
    return group.fsdp_params[0].state if group.fsdp_params else ShardedState.SHARDED


def _install() -> None:
    # upstream's ``contract`` adds ``state(module)``: the module's FSDP state, or None
    fully_shard.state = state_of  # type: ignore[attr-defined]
    FSDPModule._get_fsdp_state = FSDPModule._fsdp_state  # type: ignore[attr-defined]
    state_names = {
        "_is_root": lambda s: s.is_root,
        "_state_ctx": lambda s: s.root_steps,  # ``.all_states``: root first
        "_fsdp_param_group": lambda s: s.param_group,  # several groups raise, as upstream
        "_fsdp_param_groups": lambda s: s.param_groups,
    }
    for name, get in state_names.items():
        setattr(FSDPState, name, property(get))
    FSDPState._root_post_backward_final_callback = FSDPState._end_backward  # type: ignore[attr-defined]
    group_names = {
        "_module_fqn": lambda g: g.module_fqn,
        "is_sharded": lambda g: _registered(g) is ShardedState.SHARDED,
        "is_sharded_post_forward": lambda g: _registered(g) is ShardedState.SHARDED_POST_FORWARD,
        "is_unsharded": lambda g: _registered(g) is ShardedState.UNSHARDED,
    }
    for name, get in group_names.items():
        setattr(FSDPParamGroup, name, property(get))
    FSDPParam._param_fqn = property(lambda p: p.fqn)  # type: ignore[attr-defined]


_install()
