"""Seeing every ``torch.distributed`` collective call, and the logical bytes it moves.

One place for the planner's ``StepTracker`` and the benchmarks' ``CommCounter``
(``benchmarks/instruments.py``), so a simulated step and a measured one count
bytes the same way. The functions are wrapped on both ``torch.distributed``
and ``torch.distributed.distributed_c10d`` (libraries look them up on either
at call time); a call made inside another (a list all-gather implemented with
a tensor one) is seen once, at the outermost. Bytes are the *logical* size on
this rank: all-gather -> output bytes (W x input), reduce-scatter -> input
bytes (W x output), all-reduce / broadcast -> tensor bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
_LISTS = ("all_gather", "reduce_scatter")
_SINGLES = ("all_reduce", "broadcast")
COLLECTIVES = _GATHERS + _SCATTERS + _LISTS + _SINGLES
KIND = {
    **dict.fromkeys(_GATHERS + ("all_gather",), "all_gather"),
    **dict.fromkeys(_SCATTERS + ("reduce_scatter",), "reduce_scatter"),
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def call_tensors(name: str, args: tuple, kwargs: dict) -> tuple[list[Any], int]:
    """The tensors a call to collective ``name`` reads or writes, and its logical bytes."""

    def arg(i: int, *keys: str) -> Any:
        for key in keys:
            if key in kwargs:
                return kwargs[key]
        return args[i] if i < len(args) else None

    if name in _GATHERS:
        tensors = [arg(0, "output_tensor", "output"), arg(1, "input_tensor", "input")]
        return tensors, nbytes(tensors[0])
    if name in _SCATTERS:
        tensors = [arg(0, "output"), arg(1, "input", "input_tensor")]
        return tensors, nbytes(tensors[1])
    if name == "all_gather":  # a list of W outputs
        tensors = [*arg(0, "tensor_list"), arg(1, "tensor")]
        return tensors, sum(nbytes(t) for t in tensors[:-1])
    if name == "all_to_all_single":  # what this rank sends (its slices for every rank)
        tensors = [arg(0, "output"), arg(1, "input")]
        return tensors, nbytes(tensors[1])
    if name == "reduce_scatter":  # a list of W inputs
        tensors = [arg(0, "output"), *arg(1, "input_list")]
        return tensors, sum(nbytes(t) for t in tensors[1:])
    tensors = [arg(0, "tensor")]
    return tensors, nbytes(tensors[0])


def call_group(args: tuple, kwargs: dict) -> dist.ProcessGroup:
    """The process group a collective call runs over (the default one if none is given)."""
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return group or dist.group.WORLD


class CollectiveCalls:
    """Context manager: ``on_call(name, args, kwargs)`` before each outermost collective call."""

    def __init__(self, on_call: Callable[[str, tuple, dict], None], also: tuple[str, ...] = ()) -> None:
        self._on_call = on_call
        self._names = COLLECTIVES + also  # ``also``: e.g. "all_to_all_single" (not counted by default)
        self._saved: list[tuple[Any, str, Any]] = []
        self._local = threading.local()

    @property
    def inside(self) -> bool:
        """Whether this thread is inside a collective call right now."""
        return getattr(self._local, "depth", 0) > 0

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def seen(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self._on_call(name, args, kwargs)
            self._local.depth = depth + 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._local.depth = depth

        return seen

    def __enter__(self) -> CollectiveCalls:
        for name in self._names:
            for module in (dist, dist.distributed_c10d):
                orig = getattr(module, name, None)
                if orig is not None:
                    self._saved.append((module, name, orig))
                    setattr(module, name, self._wrap(name, orig))
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, orig in reversed(self._saved):
            setattr(module, name, orig)
        self._saved.clear()
