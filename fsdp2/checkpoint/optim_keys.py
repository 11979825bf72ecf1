"""Optimizer state dicts keyed by parameter index, renamed to parameter names.

[Note: Index-keyed optimizer state]
fsdp2's full optimizer state dicts are keyed by parameter name (the format of
``torch.distributed.checkpoint.state_dict`` and of FSDP1's
``FSDP.optim_state_dict``). Older scripts store them keyed by parameter
*index* instead: a plain ``optimizer.state_dict()`` of the unsharded model,
or FSDP1's ``FSDP.rekey_optim_state_dict(..., OptimStateKeyType.PARAM_ID,
model)``. In both, ``param_groups[i]["params"]`` lists the indices of group
``i``'s parameters in the group's own order (the ``state`` keys are among
them), so the ``j``-th index of saved group ``i`` names the ``j``-th
parameter of the optimizer's group ``i``, whatever numbering the writer used.
That positional match is the whole conversion; it needs the optimizer built
with the same groups, in the same order, as the one that was saved (e.g. on
``model.parameters()``), which the parameter shapes then confirm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

__all__ = ["keyed_by_name"]


def keyed_by_name(
    optim_sd: Any, optim: torch.optim.Optimizer, names: dict[nn.Parameter, str]
) -> Any:
    """``optim_sd`` with parameter indices replaced by names; anything else is returned as is.

    Raises ``ValueError`` when the indices cannot be matched to ``optim``'s
    parameter groups (another number of groups or of parameters in a group,
    state for an index no group lists, or indices mixed with names).
    """
    if not isinstance(optim_sd, Mapping) or "state" not in optim_sd:
        return optim_sd
    groups = list(optim_sd.get("param_groups", []))
    keys = [k for g in groups for k in g.get("params", [])] + list(optim_sd["state"])
    indices = [k for k in keys if isinstance(k, int) and not isinstance(k, bool)]
    if not indices:
        return optim_sd
    if len(indices) != len(keys):
        raise ValueError("the optimizer state dict mixes parameter indices and parameter names")
    if len(groups) != len(optim.param_groups):
        raise ValueError(
            f"the optimizer state dict is keyed by parameter index and has {len(groups)} "
            f"parameter group(s), the optimizer {len(optim.param_groups)}; build the optimizer "
            "with the same groups as the one that was saved"
        )
    to_name: dict[int, str] = {}
    for i, (saved, group) in enumerate(zip(groups, optim.param_groups)):
        ids = list(saved.get("params", []))
        if len(ids) != len(group["params"]):
            raise ValueError(
                f"optimizer group {i}: the state dict lists {len(ids)} parameter indices, the "
                f"optimizer has {len(group['params'])} parameters; build the optimizer with the "
                "same groups as the one that was saved (e.g. on model.parameters())"
            )
        for index, param in zip(ids, group["params"]):
            to_name[index] = names[param]
    unknown = [k for k in optim_sd["state"] if k not in to_name]
    if unknown:
        raise ValueError(
            f"the optimizer state dict has state for parameter indices {unknown[:10]} that no "
            "parameter group lists"
        )
    return {
        "state": {to_name[k]: v for k, v in optim_sd["state"].items()},
        "param_groups": [{**g, "params": [to_name[k] for k in g["params"]]} for g in groups],
    }
