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

``CommCounter`` wraps the ``torch.distributed`` collective functions with the
wrappers the planner uses (``fsdp2/plan/collective_calls.py``). Bytes per call
are the *logical* size on this rank: all-gather -> output bytes (W x input),
reduce-scatter -> input bytes (W x output), all-reduce / broadcast -> tensor bytes.

``LiveBytes`` tracks every tensor storage an op reads or writes (and storages
resized with ``UntypedStorage.resize_``, which is how both libraries free and
re-allocate unsharded parameters); a weakref finalizer drops a storage when it
dies. ``peak`` is the most bytes alive at once, checked after every op.
"""

from __future__ import annotations

import collections
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fsdp2._torch_compat import in_backward
from fsdp2.plan.collective_calls import CollectiveCalls, call_tensors

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


class CommCounter:
    """Context manager counting calls and logical bytes of ``torch.distributed`` collectives."""

    def __init__(self, also: tuple[str, ...] = ()) -> None:
        """``also``: collectives counted beyond the default ones (``"all_to_all_single"``:
        its input bytes)."""
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._calls = CollectiveCalls(self._count, also)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def inside(self) -> bool:
        """Whether this thread is inside a collective call right now."""
        return self._calls.inside

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        self.bytes[name] += call_tensors(name, args, kwargs)[1]
        self.calls[name] += 1

    def __enter__(self) -> CommCounter:
        self._calls.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._calls.__exit__(*exc)


class LiveBytes(TorchDispatchMode):
    """Live tensor-storage bytes on this process; ``peak`` since the last ``reset_peak``.

    ``tag(t)`` marks a storage (e.g. parameters, gradients) so that
    ``peak_untagged`` reports the most bytes alive at once in everything else.
    """

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}  # resizable storages seen, by id
        self._owners: dict[int, weakref.ref] = {}  # see _owner
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
        self._refs.pop(key, None)
        size = self._sizes.pop(key, 0)
        self.current -= size
        if key in self._tagged:
            self._tagged.discard(key)
            self.tagged -= size

    def _storage(self, t: torch.Tensor) -> torch.UntypedStorage | None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if t.device.type == "meta" or isinstance(t, FakeTensor):
            return None  # (DTensor's sharding propagation computes on fake tensors: no memory)
        st = t.untyped_storage()
        return st if st.resizable() else self._owner(st)

    def _owner(self, st: torch.UntypedStorage) -> torch.UntypedStorage:
        """The counted storage whose memory ``st`` aliases, else ``st``.

        A storage that cannot be resized does not own its memory (DLPack,
        from_blob): fsdp2's sharded parameters alias their group's flat buffer
        this way, and only that buffer's bytes are live.
        """
        key = id(st)
        owner = self._owners.get(key)
        if owner is None:
            start, stop = st.data_ptr(), st.data_ptr() + st.nbytes()
            for ref in self._refs.values():
                cand = ref()
                if (
                    cand is not None and cand.nbytes() > 0
                    and cand.data_ptr() <= start and stop <= cand.data_ptr() + cand.nbytes()
                ):
                    owner = ref
                    break
            else:
                owner = weakref.ref(st)
            self._owners[key] = owner
            weakref.finalize(st, self._owners.pop, key, None)
        owned = owner()
        return st if owned is None else owned

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
            if st.resizable():
                self._refs[key] = weakref.ref(st)
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
