"""Lazy-init check that every parameter under a root belongs to exactly one FSDP group.

[Note: A parameter belongs to one group]
A parameter shared by several modules (a tied embedding and output head) is
one parameter only while one ``fully_shard`` call manages all of its
holders: that call swaps the sharded parameter into every one of them. Given
to separate calls (``fully_shard(m.tok); fully_shard(m.out)``), each call
shards the original on its own and the two copies train apart: a silently
wrong model. Like upstream, FSDP remembers each original parameter by a
number set on it (``original_uid``) and, at the root's lazy init
(before any group is checked for ``meta`` parameters), raises upstream's
``ValueError`` naming the second parameter when two groups hold the same
original. Walking the registered parameters once more, it also rejects two
ways upstream lets a shared parameter split silently:

- a module that still holds the unsharded original of a managed parameter
  (``ignored_params`` left it out of one call while another sharded it);
- a module that holds a group's sharded parameter without being one of the
  places the group manages (weights tied after ``fully_shard``).

Both raise the same ``ValueError`` with the reason after upstream's message.
The cure is one group for all holders: ``fully_shard([module_a, module_b])``,
or sharding their common parent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

from ..storage.param_uid import ORIG_UID_ATTR

if TYPE_CHECKING:
    from ..group.param_group import FSDPParamGroup
    from ..storage.param import FSDPParam


def check_shared_params(
    named_modules: list[tuple[str, nn.Module]],
    groups: list[FSDPParamGroup],
    module_fqns: dict[nn.Module, str],
) -> None:
    """``ValueError`` if a parameter under the root is in two groups or held outside its group.

    ``named_modules``: the root's ``named_modules()`` (walked once by lazy init
    for all its checks). See [Note: A parameter belongs to one group].
    """
    by_uid: dict[int, tuple[FSDPParam, FSDPParamGroup]] = {}
    by_object: dict[int, FSDPParam] = {}  # id of a sharded/unsharded parameter -> its FSDPParam
    holders: set[tuple[int, str]] = set()
    for group in groups:
        for p in group.fsdp_params:
            first = by_uid.get(p.orig_uid)
            if first is not None:
                other, other_group = first
                raise ValueError(
                    _upstream_message(_fqn(p, module_fqns))
                    + f"\n'{_fqn(p, module_fqns)}' and '{_fqn(other, module_fqns)}' are one "
                    f"parameter, sharded by two fully_shard calls (on "
                    f"{_modules(group, module_fqns)} and on {_modules(other_group, module_fqns)}); "
                    "shard all modules that hold it in one call."
                )
            by_uid[p.orig_uid] = (p, group)
            by_object[id(p.sharded_param)] = p
            if p.unsharded_param is not None:
                by_object[id(p.unsharded_param)] = p
            holders.update((id(module), name) for module, name in p.module_infos)
    for prefix, module in named_modules:
        for name, param in module._parameters.items():
            if param is None:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            owner = by_object.get(id(param))
            if owner is not None:
                if (id(module), name) not in holders:
                    raise ValueError(
                        _upstream_message(fqn)
                        + f"\n'{fqn}' holds the sharded parameter of "
                        f"'{_fqn(owner, module_fqns)}' but is not one of the places its group "
                        "manages: weights tied after fully_shard stay untied. Tie them before "
                        "calling fully_shard."
                    )
                continue
            uid = param.__dict__.get(ORIG_UID_ATTR)
            if uid is not None and uid in by_uid:
                raise ValueError(
                    _upstream_message(fqn)
                    + f"\n'{fqn}' is still the unsharded original of "
                    f"'{_fqn(by_uid[uid][0], module_fqns)}', which an FSDP group shards: one "
                    "fully_shard call left it out (ignored_params) while another sharded it. "
                    "Pass a shared parameter in ignored_params to every fully_shard call that "
                    "sees it, or to none."
                )


def _upstream_message(fqn: str) -> str:
    return (
        f"Parameter '{fqn}' is shared with a parameter already managed by another FSDP group. "
        "For shared/tied parameters, use fully_shard([module_a, module_b]) to place them in "
        "the same FSDP group."
    )


def _fqn(p: FSDPParam, module_fqns: dict[nn.Module, str]) -> str:
    module, name = p.module_infos[0]
    prefix = module_fqns.get(module, "")
    return f"{prefix}.{name}" if prefix else name


def _modules(group: FSDPParamGroup, module_fqns: dict[nn.Module, str]) -> str:
    names = [f"'{module_fqns[m]}'" if module_fqns.get(m) else "the root" for m in group.modules]
    return ", ".join(names)
