"""The tensors inside forward inputs and outputs, whatever structure holds them.

Modules pass activations as tensors, tuples, dicts, namedtuples and also
dataclasses (often nested), which ``torch.utils._pytree`` does not look into.
FSDP must still find every tensor: to cast it (mixed precision), to move it
to the device, and to hook the outputs that start a group's backward. One
walk covers them all: tensors; dataclass instances (rebuilt with
``dataclasses.replace``); dicts (an ``OrderedDict`` keeps its type);
namedtuples; lists, tuples and sets. A ``PackedSequence`` is returned as it
is, after ``fn`` saw its data (so its backward is hooked but it is never
cast, as upstream). Anything else is a leaf returned as it is.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with every tensor ``t`` inside it replaced by ``fn(t)``, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, PackedSequence):
        fn(value.data)
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: map_tensors(fn, getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, dict):
        items = ((key, map_tensors(fn, item)) for key, item in value.items())
        return value.__class__(items) if isinstance(value, OrderedDict) else dict(items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_tensors(fn, x) for x in value))
    if isinstance(value, (list, tuple, set)):
        return type(value)(map_tensors(fn, x) for x in value)
    return value


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``value``, in the order ``map_tensors`` visits them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, PackedSequence):
        yield value.data
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors_in(getattr(value, f.name))
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            yield from tensors_in(item)
