"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), resumable at any world size.

[Note: Sharded checkpoints]
The state is already sharded: ``model.state_dict()`` holds DTensors and so do
the optimizer's states. ``torch.distributed.checkpoint.state_dict`` keys the
optimizer state by parameter name, and DCP writes every rank's shards with
their global offsets, so a checkpoint saved at world size W loads at any W'
(each rank reads the byte ranges its new shards cover). Nothing is gathered.

These two functions are that recipe plus the check DCP lacks: before anything
is read, the checkpoint's metadata is compared with the model and optimizer,
and every missing, unexpected or resized tensor is reported by name in one
``ValueError`` (DCP itself ignores tensors the model lacks and stops at the
first problem). Values are read in place into the live parameters and
optimizer states, so only an I/O error while reading can leave a partial load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

# torch.distributed.checkpoint is imported inside the functions: it adds about
# half a second to `import fsdp2` and most runs never touch it.

__all__ = ["save_checkpoint", "load_checkpoint"]

_MAX_LISTED = 10


def save_checkpoint(
    checkpoint_id: str | os.PathLike,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save a sharded checkpoint of ``model`` (and ``optim``) to the directory ``checkpoint_id``.

    Collective: every rank calls it and writes its own shards (DCP's format,
    one file per rank plus metadata). ``extra`` holds anything else to resume
    with: values DCP can save (tensors, numbers, ...) and objects with
    ``state_dict``/``load_state_dict`` such as an LR scheduler.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optim is not None:
        state["optim"] = get_optimizer_state_dict(model, optim)
    if extra:
        state["extra"] = {k: _state_of(v) for k, v in extra.items()}
    dcp.save(state, checkpoint_id=checkpoint_id)


def load_checkpoint(
    checkpoint_id: str | os.PathLike,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    strict: bool = True,
) -> None:
    """Load a checkpoint written by :func:`save_checkpoint`, at any world size.

    Collective. The model (sharded with ``fully_shard`` on the new mesh, or
    plain) and the optimizer (built on its parameters) are filled in place.
    ``extra`` must have the keys that were saved: plain values are replaced
    in the dict, objects with ``load_state_dict`` (a scheduler) load theirs.

    Raises:
        ValueError: the checkpoint does not match the model or optimizer
            (missing, unexpected or resized tensors, all named); nothing was
            loaded. ``strict=False`` skips model keys missing on either side.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    model_sd = get_model_state_dict(model)
    problems = _compare("model", model_sd, saved, strict)
    if not strict:
        model_sd = {k: v for k, v in model_sd.items() if f"model.{k}" in saved}
    state: dict[str, Any] = {"model": model_sd}
    if extra:
        state["extra"] = {k: _state_of(v) for k, v in extra.items()}
        problems += _compare("extra", state["extra"], saved, strict=True, unexpected=False)
    fresh = optim is not None and not optim.state
    try:
        if optim is not None:
            # Creates the optimizer's states if it has none yet, as targets to read into.
            state["optim"] = get_optimizer_state_dict(model, optim)
            if not any(k.startswith("optim.") for k in saved):
                problems.append("the checkpoint has no optimizer state: pass optim=None")
            else:
                problems += _compare("optim", state["optim"], saved, strict=True)
        if problems:
            raise ValueError(
                f"load_checkpoint: {os.fspath(checkpoint_id)} does not match the "
                "model/optimizer; nothing was loaded.\n  " + "\n  ".join(problems)
            )
        dcp.load(state, checkpoint_id=checkpoint_id)
    except BaseException:
        if fresh:
            optim.state.clear()  # leave the optimizer as it was
        raise
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
    if optim is not None:
        set_optimizer_state_dict(model, optim, state["optim"])
    for key, value in (extra or {}).items():
        if _is_stateful(value):
            value.load_state_dict(state["extra"][key])
        else:
            extra[key] = state["extra"][key]


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _state_of(value: Any) -> Any:
    # DCP only unpacks Stateful objects at the top level; nested ones would be
    # pickled whole (an LR scheduler with its lambdas cannot be).
    return value.state_dict() if _is_stateful(value) else value


def _compare(
    prefix: str, state: Any, saved: Mapping[str, Any], strict: bool, unexpected: bool = True
) -> list[str]:
    """What differs between ``state`` (flattened the way DCP does) and the checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    expected: dict[str, Any] = {}
    _flatten(prefix, state, expected)
    problems = []
    missing = [k for k in expected if k not in saved]
    if missing and strict:
        problems.append(_listing("missing (in the model, not in the checkpoint)", missing))
    extra = [k for k in saved if k.startswith(prefix + ".") and k not in expected]
    if extra and strict and unexpected:
        problems.append(_listing("unexpected (in the checkpoint, not in the model)", extra))
    resized = []
    for key, value in expected.items():
        meta = saved.get(key)
        if meta is None or not isinstance(value, torch.Tensor):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            resized.append(f"{key}: not a tensor in the checkpoint")
        elif tuple(meta.size) != tuple(value.shape):
            resized.append(f"{key}: {tuple(meta.size)} in the checkpoint, "
                           f"{tuple(value.shape)} in the model")
    if resized:
        problems.append(_listing("size mismatches", resized))
    return problems


def _flatten(path: str, value: Any, out: dict[str, Any]) -> None:
    # DCP's key scheme: dict keys and list indices joined by dots; a list is a
    # leaf unless it holds tensors or containers.
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{path}.{k}", v, out)
    elif isinstance(value, list) and any(
        isinstance(v, (torch.Tensor, Mapping, list)) for v in value
    ):
        for i, v in enumerate(value):
            _flatten(f"{path}.{i}", v, out)
    else:
        out[path] = value


def _listing(what: str, items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = f" ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"{what}: {shown}{more}"
