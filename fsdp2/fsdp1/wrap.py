"""``shard_model``: FSDP1's ``auto_wrap_policy`` for ``fully_shard``.

[Note: Auto-wrap policies]
FSDP1 takes an ``auto_wrap_policy`` and wraps the modules it selects bottom
up, each wrapper owning the parameters of its subtree that no wrapper below
already owns. ``fully_shard`` groups parameters the same way (a call takes
what no earlier call on a descendant took), so a policy maps onto it
directly: select the modules exactly as FSDP1 does, then call ``fully_shard``
on them in post-order (children before parents), and last on the root.

Two kinds of policy exist, and both are selected the way FSDP1 selects them:
the policy objects (``ModuleWrapPolicy``, ``CustomPolicy``) answer
``{module: kwargs}`` for the whole tree at once (see
``_torch_compat.run_module_wrap_policy``); the plain callables
(``size_based_auto_wrap_policy``, ``transformer_auto_wrap_policy``,
``lambda_auto_wrap_policy``, ``always_wrap_policy``, or any
``fn(module=, recurse=, nonwrapped_numel=)``) are asked per module, first with
``recurse=True`` (descend?) and, after the children were decided, with
``recurse=False`` and the numel the children left unwrapped (wrap this one?).
The root is always sharded last, with the keyword arguments given to
``shard_model`` (FSDP1 also builds its root from the constructor's arguments,
whatever the policy says about it). ``ModuleList`` and ``ModuleDict``, which
have no forward, are never sharded on their own (see ``_callable``).

A tied parameter is owned by the first selected module (in post-order) that
contains it. If another module outside that one's subtree also holds it, the
owner's group would free it while the other module still reads it: FSDP1
fails then at run time, and ``fully_shard`` refuses it at the first forward.
``shard_model`` raises before sharding anything, naming the parameter, both
modules and the fix (do not select the owner, so the common ancestor owns it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from .._torch_compat import run_module_wrap_policy

__all__ = ["shard_model"]

# fully_shard's keyword arguments, which CustomPolicy's per-module dicts may override.
_FULLY_SHARD_KWARGS = (
    "mesh",
    "reshard_after_forward",
    "shard_placement_fn",
    "mp_policy",
    "offload_policy",
    "ignored_params",
    "dp_mesh_dims",
)
# FSDP1 constructor arguments and what to pass to fully_shard instead.
_FSDP1_HINTS = {
    "sharding_strategy": "reshard_after_forward=True (FULL_SHARD) / False (SHARD_GRAD_OP), "
    "and a 2-D (replicate, shard) mesh for HYBRID_SHARD",
    "mixed_precision": "mp_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)",
    "cpu_offload": "offload_policy=CPUOffloadPolicy()",
    "process_group": "mesh=init_device_mesh(...)",
    "device_mesh": "mesh=...",
    "ignored_modules": "ignored_params={p for m in modules for p in m.parameters()}",
}
_MAX_LISTED = 5


def shard_model(
    model: nn.Module,
    *,
    auto_wrap_policy: Any,
    mesh: Any = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply ``fully_shard`` to the modules an FSDP1 auto-wrap policy selects, then to the root.

    The FSDP1 way of saying where the groups are, for ``fully_shard``:
    ``FSDP(model, auto_wrap_policy=policy, **kw)`` becomes ``shard_model(model,
    auto_wrap_policy=policy, mesh=mesh, **fully_shard_kwargs)``. Modules are
    chosen exactly as FSDP1 chooses them (see [Note: Auto-wrap policies]) and
    sharded bottom up, each taking the parameters of its subtree that no
    module below took; the root takes the rest.

    Args:
        model: the model to shard in place (its root is always sharded).
        auto_wrap_policy: one of torch's policies from
            ``torch.distributed.fsdp.wrap``: ``ModuleWrapPolicy(classes)``,
            ``CustomPolicy(fn)`` (``fn(module)`` returns ``True``, ``False`` or a
            dict of ``fully_shard`` keyword arguments overriding those given
            here for that module), or a callable policy such as
            ``functools.partial(size_based_auto_wrap_policy, min_num_params=N)``,
            ``functools.partial(transformer_auto_wrap_policy,
            transformer_layer_cls={Block})`` or ``functools.partial(
            lambda_auto_wrap_policy, lambda_fn=fn)``; or a plain set of module
            classes (like ``ModuleWrapPolicy``).
        mesh: the device mesh of every ``fully_shard`` call (default: a 1-D
            mesh over the default process group).
        **fully_shard_kwargs: any other ``fully_shard`` argument
            (``reshard_after_forward``, ``mp_policy``, ``offload_policy``,
            ``shard_placement_fn``, ``ignored_params``, ``dp_mesh_dims``), for
            every call.

    Returns:
        ``model``, now an ``FSDPModule``.

    Raises:
        ValueError: an argument that is not ``fully_shard``'s (FSDP1's names
            come with their fsdp2 equivalent), a policy of another kind, or a
            tied parameter the policy would split across groups (named, with
            the modules holding it). Nothing is sharded then.
    """
    from ..fully_shard import fully_shard

    _check_kwargs(fully_shard_kwargs, "shard_model")
    root_kwargs = dict(fully_shard_kwargs, mesh=mesh)
    ignored = set(fully_shard_kwargs.get("ignored_params") or ())
    targets = _select(model, auto_wrap_policy, root_kwargs, ignored)
    names = {module: name for name, module in model.named_modules()}
    for module, kwargs in targets.items():
        _check_kwargs(kwargs, f"auto_wrap_policy's arguments for '{names[module]}'")
    _check_tied(model, list(targets), ignored, names)
    for module, kwargs in targets.items():
        fully_shard(module, **kwargs)
    fully_shard(model, **root_kwargs)
    return model


def _select(
    model: nn.Module, policy: Any, root_kwargs: dict[str, Any], ignored: set
) -> dict[nn.Module, dict[str, Any]]:
    """The modules to shard below the root, in post-order, with their ``fully_shard`` arguments."""
    order = _post_order(model)
    chosen = run_module_wrap_policy(policy, model, root_kwargs)
    if chosen is None and _is_class_set(policy):
        classes = tuple(policy)
        chosen = {m: dict(root_kwargs) for m in order if isinstance(m, classes)}
    elif chosen is None and callable(policy):
        picked: list[nn.Module] = []
        _walk(model, model, policy, ignored, picked, set())
        chosen = {m: dict(root_kwargs) for m in picked}
    elif chosen is None:
        raise ValueError(
            f"shard_model: auto_wrap_policy must be a policy from torch.distributed.fsdp.wrap "
            f"(ModuleWrapPolicy, CustomPolicy, or a callable such as functools.partial("
            f"size_based_auto_wrap_policy, min_num_params=...)) or a set of module classes, "
            f"got {policy!r}"
        )
    return {m: chosen[m] for m in order if m in chosen and m is not model and _callable(m)}


def _callable(module: nn.Module) -> bool:
    """False for ``ModuleList`` / ``ModuleDict``: never run, so never a group of their own.

    FSDP1 wraps them when a policy says so (``always_wrap_policy``), which
    changes nothing once their children are wrapped; ``fully_shard`` refuses
    them, and their own parameters, if any, go to the next selected ancestor.
    """
    container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
    return not (container and type(module).forward is nn.Module.forward)


def _is_class_set(policy: Any) -> bool:
    if not isinstance(policy, (set, frozenset, list, tuple)) or not policy:
        return False
    return all(isinstance(c, type) and issubclass(c, nn.Module) for c in policy)


def _walk(
    root: nn.Module,
    module: nn.Module,
    policy: Callable[..., bool],
    ignored: set,
    picked: list[nn.Module],
    seen: set[nn.Module],
) -> int:
    """FSDP1's recursion for callable policies; returns the numel the subtree's wrappers took."""
    seen.add(module)
    numel = sum(p.numel() for p in module.parameters() if p not in ignored)
    if not policy(module=module, recurse=True, nonwrapped_numel=numel):
        return 0
    wrapped = 0
    for child in module.children():
        if child not in seen:  # a module reused in two places is decided once
            wrapped += _walk(root, child, policy, ignored, picked, seen)
    if module is not root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
        picked.append(module)
        return numel
    return wrapped


def _post_order(model: nn.Module) -> list[nn.Module]:
    order: list[nn.Module] = []
    seen: set[nn.Module] = set()

    def visit(module: nn.Module) -> None:
        seen.add(module)
        for child in module.children():
            if child not in seen:
                visit(child)
        order.append(module)

    visit(model)
    return order


def _check_kwargs(kwargs: dict[str, Any], where: str) -> None:
    unknown = [k for k in kwargs if k not in _FULLY_SHARD_KWARGS]
    if not unknown:
        return
    hints = [f"{k} -> {_FSDP1_HINTS[k]}" for k in unknown if k in _FSDP1_HINTS]
    raise ValueError(
        f"{where}: {', '.join(repr(k) for k in unknown)} "
        f"{'is not a fully_shard argument' if len(unknown) == 1 else 'are not fully_shard arguments'}"
        f" (fully_shard takes {', '.join(_FULLY_SHARD_KWARGS)})"
        + (f"; FSDP1's arguments map as {'; '.join(hints)}" if hints else "")
        + " (see docs/migrating-from-fsdp1.md)"
    )


def _check_tied(
    model: nn.Module, targets: list[nn.Module], ignored: set, names: dict[nn.Module, str]
) -> None:
    """Refuse a selection that puts a tied parameter in a group some of its holders are outside."""
    holders: dict[nn.Parameter, list[nn.Module]] = {}
    for module in names:
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(param, []).append(module)
    owned: set[nn.Parameter] = set(ignored)
    problems = []
    for target in targets:
        subtree = set(target.modules())
        for name, param in target.named_parameters():
            if param in owned:
                continue
            owned.add(param)
            outside = [names[m] for m in holders.get(param, []) if m not in subtree]
            if outside:
                problems.append(
                    f"'{_join(names[target], name)}' is also held by "
                    f"{', '.join(repr(o) for o in outside)}, outside '{names[target]}'"
                )
    if problems:
        raise ValueError(
            "shard_model: the auto_wrap_policy splits tied (shared) parameters across groups: "
            + "; ".join(problems[:_MAX_LISTED])
            + ". A tied parameter must sit in one group with every module that uses it: leave "
            "the module holding it out of the policy, so that a common ancestor (e.g. the "
            "root) owns it"
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
