"""Implementation-agnostic counters: bytes copied, bytes communicated, live bytes.

All three see the *local* tensors: a dispatch mode that meets a ``DTensor``
returns ``NotImplemented``, so DTensor unwraps itself and the mode then sees
the plain ops it runs on local shards.

``CopyCounter`` sums the bytes *written* by copy-like aten ops (below). For an
op that mutates an argument (``copy_``, ``_foreach_copy_``, ``out=`` variants)
it counts the mutated tensors; otherwise the returned tensors. Fills
(``zero_``, ``fill_``, ``new_zeros``, ``empty``) and views are not copies.
Nothing that runs inside a ``torch.distributed`` collective call is counted
(gloo copies its result into the output in ``work.wait()``): that is part of
the collective. ``fsdp::all_gather_copy_in`` counts the bytes of its inputs
(it writes only this rank's slot of the output it is given).

``CommCounter`` wraps the ``torch.distributed`` collective functions on both
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (both libraries
look them up there at call time). Bytes per call are the *logical* size on
this rank: all-gather -> output bytes (W x input), reduce-scatter -> input
bytes (W x output), all-reduce / broadcast -> tensor bytes.

``LiveBytes`` tracks every tensor storage an op reads or writes (and storages
resized with ``UntypedStorage.resize_``, which is how both libraries free and
re-allocate unsharded parameters); a weakref finalizer drops a storage when it
dies. ``peak`` is the most bytes alive at once, checked after every op.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fsdp2._torch_compat import in_backward

COPY_OPS = (
    "copy_",
    "_foreach_copy_",
    "_foreach_copy",
    "split_with_sizes_copy",
    "split_copy",
    "unbind_copy",
    "cat",
    "stack",
    "_chunk_cat",
    "clone",
    "_to_copy",
    "constant_pad_nd",
    "index_copy",
    "index_copy_",
    "slice_scatter",
    "select_scatter",
    "as_strided_scatter",
    "diagonal_scatter",
    "narrow_copy",
    "view_copy",
    "lift_fresh_copy",
    "index_put",
    "index_put_",
    # torch's fully_shard wraps its copies in custom ops (fsdp::...); the mode sees
    # only the wrapper, so count the wrapper.
    "chunk_cat",
    "all_gather_copy_in",
)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _has_dtensor(types) -> bool:
    return any(issubclass(t, DTensor) for t in types)


class CopyCounter(TorchDispatchMode):
    """Bytes written by copy-like ops, per op name."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._comms = CommCounter()  # only to know when we are inside a collective

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def __enter__(self) -> CopyCounter:
        self._comms.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._comms.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _has_dtensor(types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "all_gather_copy_in":
            self.bytes[name] += sum(_nbytes(t) for t in args[0])
            self.calls[name] += 1
        elif name in COPY_OPS and not self._comms.inside:
            written = []
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = (
                        kwargs[arg.name]
                        if arg.name in kwargs
                        else (args[i] if i < len(args) else None)
                    )
                    written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            if not written:
                written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.bytes[name] += sum(_nbytes(t) for t in written)
            self.calls[name] += 1
        return out


_GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
_LISTS = ("all_gather", "reduce_scatter")
_SINGLES = ("all_reduce", "broadcast")


class CommCounter:
    """Context manager counting calls and logical bytes of ``torch.distributed`` collectives."""

    def __init__(self) -> None:
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._local = threading.local()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def inside(self) -> bool:
        """Whether this thread is inside a collective call right now."""
        return getattr(self._local, "depth", 0) > 0

    def _size(self, name: str, args: tuple, kwargs: dict) -> int:
        def arg(i: int, *keys: str):
            for key in keys:
                if key in kwargs:
                    return kwargs[key]
            return args[i]

        if name in _GATHERS:
            return _nbytes(arg(0, "output_tensor", "output"))
        if name in _SCATTERS:
            return _nbytes(arg(1, "input", "input_tensor"))
        if name in _LISTS:  # list of W tensors: the gathered outputs / scattered inputs
            tensors = arg(0, "tensor_list") if name == "all_gather" else arg(1, "input_list")
            return sum(_nbytes(t) for t in tensors)
        return _nbytes(arg(0, "tensor"))

    def _wrap(self, name: str, orig):
        def counted(*args, **kwargs):
            if getattr(self._local, "depth", 0) == 0:  # outermost call only
                self.bytes[name] += self._size(name, args, kwargs)
                self.calls[name] += 1
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._local.depth -= 1

        return counted

    def __enter__(self) -> CommCounter:
        c10d = dist.distributed_c10d
        for name in _GATHERS + _SCATTERS + _LISTS + _SINGLES:
            for module in (dist, c10d):
                orig = getattr(module, name, None)
                if orig is not None:
                    self._saved.append((module, name, orig))
                    setattr(module, name, self._wrap(name, orig))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, orig in reversed(self._saved):
            setattr(module, name, orig)
        self._saved.clear()


class LiveBytes(TorchDispatchMode):
    """Live tensor-storage bytes on this process; ``peak`` since the last ``reset_peak``.

    ``tag(t)`` marks a storage (e.g. parameters, gradients) so that
    ``peak_untagged`` reports the most bytes alive at once in everything else.
    """

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._tagged: set[int] = set()
        self.current = self.peak = 0
        self.tagged = self.peak_untagged = 0
        self.peak_at = ""  # the op (and pass) that reached ``peak``
        self._op = ""
        self._orig_resize = None

    def reset_peak(self) -> None:
        self.peak = self.current
        self.peak_untagged = self.current - self.tagged

    def _drop(self, key: int) -> None:
        size = self._sizes.pop(key, 0)
        self.current -= size
        if key in self._tagged:
            self._tagged.discard(key)
            self.tagged -= size

    @staticmethod
    def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        return None if t.device.type == "meta" else t.untyped_storage()

    def see(self, t: torch.Tensor) -> None:
        st = self._storage(t)
        if st is not None:
            self._see_storage(st)

    def tag(self, t: torch.Tensor) -> None:
        st = self._storage(t)
        if st is None:
            return
        self._see_storage(st)
        key = id(st)
        if key not in self._tagged:
            self._tagged.add(key)
            self.tagged += self._sizes[key]

    def _see_storage(self, st: torch.UntypedStorage) -> None:
        key, size = id(st), st.nbytes()
        old = self._sizes.get(key)
        if old is None:
            weakref.finalize(st, self._drop, key)
            old = self._sizes[key] = 0
        if old != size:
            self._sizes[key] = size
            self.current += size - old
            if key in self._tagged:
                self.tagged += size - old
            if self.current > self.peak:
                self.peak = self.current
                phase = "backward" if in_backward() else "forward/other"
                self.peak_at = f"{self._op} ({phase})"
            self.peak_untagged = max(self.peak_untagged, self.current - self.tagged)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _has_dtensor(types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self._op = func.overloadpacket.__name__
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self.see(t)
        return out

    def __enter__(self) -> LiveBytes:
        orig = self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            result = orig(st, size)
            tracker._op = "UntypedStorage.resize_"
            tracker._see_storage(st)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        super().__exit__(*exc)
