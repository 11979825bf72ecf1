"""A stream-order checker that runs on CPU: simulated streams, vector clocks, every op's accesses.

``StreamChecker`` is a stream backend of simulated streams and events: while
it is entered, fsdp2's comm contexts take it as their backend on CPU (it
stands in for ``fsdp2.runtime.comm.comm_context.stream_backend_for``, as it stands
in for the collectives), so ``CommContext`` is active on CPU; every named wait
goes through it, and it leaves out the one named by ``skip``. It records, through a ``TorchDispatchMode``, which memory each op reads and
writes (its storages, from its schema's alias info, as torch's CUDA sanitizer
does) on the stream it was issued on. Memory is tracked by address range, not
by storage object: fsdp2's sharded parameters own DLPack storages over their
group's flat buffer (fsdp2/runtime/storage/shard_storage.py), so storages whose ranges
overlap share one allocation's history; a non-resizable (DLPack) storage going
away frees nothing. Within an allocation each access covers the bytes of the
tensor it was made through, and only overlapping accesses are ordered against
each other: the groups of an arena (fsdp2/runtime/storage/arena.py) are slices of
one allocation that different streams use at once. Each stream keeps a vector clock; event records copy
it, waits merge it, ``Event.synchronize`` merges it into every later op.
Collectives are modelled as NCCL runs them: the process group's own stream
waits for the issuing stream, runs the collective's reads and writes, and the
issuing stream waits for it on return (synchronous) or at ``Work.wait()``.

An access to memory last written (or, for a write, read) on another stream
without a happens-before edge is an error naming both ops and streams. A
storage freed (dropped, or ``resize_(0)``) is returned to the pool of the
stream that allocated it (for a storage grown by ``resize_``, the stream current
at the resize), as the caching allocator does; the next allocation on that
stream must be ordered after every other stream's use of it.
"""

from __future__ import annotations

import bisect
import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp2.runtime.comm import comm_context


class StreamOrderError(AssertionError):
    pass


class SimEvent:
    def __init__(self, checker: StreamChecker) -> None:
        self.checker = checker
        self.clock: dict[int, int] = {}

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream or self.checker.current
        self.clock = dict(self.checker.clock(stream))

    def wait(self, stream: SimStream | None = None) -> None:
        (stream or self.checker.current).wait_event(self)

    def synchronize(self) -> None:
        _merge(self.checker.host, self.clock)

    def query(self) -> bool:
        return True


class SimStream:
    def __init__(self, checker: StreamChecker, sid: int, name: str) -> None:
        self.checker, self.id, self.name = checker, sid, name

    def wait_stream(self, other: SimStream) -> None:
        _merge(self.checker.clock(self), self.checker.clock(other))

    def wait_event(self, event: SimEvent) -> None:
        _merge(self.checker.clock(self), event.clock)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event or SimEvent(self.checker)
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"stream {self.id} ({self.name})"


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


@dataclass
class _Access:
    stream: SimStream
    tick: int
    op: str
    lo: int = 0  # the bytes accessed: [lo, hi)
    hi: int = 0

    def overlaps(self, lo: int, hi: int) -> bool:
        return self.lo < hi and lo < self.hi

    def inside(self, lo: int, hi: int) -> bool:
        return lo <= self.lo and self.hi <= hi


@dataclass(eq=False)
class _Region:
    """A range of memory: one allocation and every storage seen over it (DLPack aliases)."""

    start: int
    end: int
    alloc: SimStream
    owners: int = 0  # live storages that own the memory (resizable ones)
    # the writes and reads no later access covered (see StreamChecker.access)
    write: list[_Access] = field(default_factory=list)
    reads: list[_Access] = field(default_factory=list)

    def accesses(self) -> list[_Access]:
        return self.write + self.reads


class StreamChecker(TorchDispatchMode):
    """Use as a context manager around training; ``errors`` lists the races found."""

    def __init__(self, raise_first: bool = False, skip: str | None = None) -> None:
        super().__init__()
        self.raise_first = raise_first
        assert skip is None or skip in comm_context.EDGES, skip
        self.skip = skip  # the one named wait this backend leaves out
        self.errors: list[str] = []
        self._clocks: dict[int, dict[int, int]] = {}
        self.host: dict[int, int] = {}
        self._streams: list[SimStream] = []
        self.default = self.new_stream(name="compute")
        self.current = self.default
        # Memory is tracked by address range, not by storage object: fsdp2's sharded
        # parameters own DLPack storages over their group's flat buffer (shard_storage.py).
        self._regions: dict[int, _Region] = {}  # by start; disjoint
        self._starts: list[int] = []  # sorted
        self._seen: dict[int, tuple[int, int, _Region, bool]] = {}  # storage -> ptr, nbytes, region, owns
        self._watched: set[int] = set()
        self._pending_free: dict[int, list[tuple[str, _Region]]] = {}
        self._grown_on: dict[int, SimStream] = {}  # storage -> the stream resize_ grew it on
        self._pg_streams: dict[int, SimStream] = {}
        self._paused = 0
        self._exit: contextlib.ExitStack | None = None

    # ---- the backend fsdp2's stream layer calls -----------------------------------

    def new_stream(self, name: str = "fsdp") -> SimStream:
        names = {1: "copy_in", 2: "all_gather", 3: "reduce_scatter", 4: "all_reduce"}
        stream = SimStream(self, len(self._streams), names.get(len(self._streams), name)
                           if name == "fsdp" else name)
        self._streams.append(stream)
        self._clocks[stream.id] = {}
        return stream

    def current_stream(self) -> SimStream:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: SimStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def new_event(self) -> SimEvent:
        return SimEvent(self)

    def wait_stream(self, edge: str | None, waiter: SimStream, waited: SimStream) -> None:
        if edge is None or edge != self.skip:
            waiter.wait_stream(waited)

    def wait_event(self, edge: str | None, waiter: SimStream, event: SimEvent) -> None:
        if edge is None or edge != self.skip:
            waiter.wait_event(event)

    def synchronize(self, edge: str | None, event: SimEvent) -> None:
        if edge is None or edge != self.skip:
            event.synchronize()

    def wait_work(self, edge: str | None, work) -> None:
        if edge is None or edge != self.skip:
            work.wait()
        else:  # the real collective still finishes: only the simulated edge is left out
            real = getattr(work, "work", work)
            if real is not None:
                real.wait()

    def clock(self, stream: SimStream) -> dict[int, int]:
        return self._clocks[stream.id]

    # ---- recording ----------------------------------------------------------------

    def _error(self, message: str) -> None:
        self.errors.append(message)
        if self.raise_first:
            raise StreamOrderError(message)

    def _tick(self, stream: SimStream) -> int:
        clock = self._clocks[stream.id]
        _merge(clock, self.host)  # issued after a host synchronize
        clock[stream.id] = clock.get(stream.id, 0) + 1
        return clock[stream.id]

    def _ordered(self, access: _Access, stream: SimStream) -> bool:
        return access.stream is stream or self._clocks[stream.id].get(access.stream.id, 0) >= access.tick

    def _region(self, storage: torch.UntypedStorage, stream: SimStream) -> _Region | None:
        try:
            key, ptr, nbytes = storage._cdata, storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a wrapper subclass's storage: no memory of its own
            return None
        if nbytes == 0 or ptr == 0:
            return None
        seen = self._seen.get(key)
        if seen is not None and seen[0] == ptr and seen[1] == nbytes:
            return seen[2]
        owns = storage.resizable()  # DLPack storages are not: they alias an allocation
        if owns:
            self._allocated(stream)
        end = ptr + nbytes
        i = bisect.bisect_left(self._starts, end)
        overlapping = []
        while i > 0 and self._regions[self._starts[i - 1]].end > ptr:
            overlapping.append(self._regions[self._starts[i - 1]])
            i -= 1
        if len(overlapping) == 1 and overlapping[0].start <= ptr and end <= overlapping[0].end:
            region = overlapping[0]
        else:  # a new allocation, or a range joining others: one region over all of them
            # a storage grown by resize_ was allocated where it grew, not where first used
            alloc = self._grown_on.pop(key, stream) if owns else stream
            region = _Region(min([ptr] + [r.start for r in overlapping]),
                             max([end] + [r.end for r in overlapping]), alloc)
            for old in overlapping:
                self._drop(old)
                region.owners += old.owners
                if old.owners:
                    region.alloc = old.alloc
                region.write += old.write
                region.reads += old.reads
            for k, (p, n, r, o) in list(self._seen.items()):
                if r in overlapping:
                    self._seen[k] = (p, n, region, o)
            self._regions[region.start] = region
            bisect.insort(self._starts, region.start)
        if owns:
            region.owners += 1
        self._seen[key] = (ptr, nbytes, region, owns)
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(storage, self._finalized, key)
        return region

    def _drop(self, region: _Region) -> None:
        if self._regions.get(region.start) is region:
            del self._regions[region.start]
            self._starts.pop(bisect.bisect_left(self._starts, region.start))

    def _allocated(self, stream: SimStream) -> None:
        """A new allocation on ``stream`` may reuse memory freed to its pool."""
        for op, region in self._pending_free.pop(stream.id, []):
            for access in region.accesses():
                if not self._ordered(access, stream):
                    self._error(
                        f"memory freed after '{op}' is reused by {stream} while '{access.op}' "
                        f"on {access.stream} may still use it"
                    )

    def _finalized(self, key: int) -> None:
        self._watched.discard(key)
        self._freed(key)

    def _freed(self, key: int, op: str = "free") -> None:
        seen = self._seen.pop(key, None)
        if seen is None or not seen[3]:
            return  # an alias going away frees nothing
        region = seen[2]
        region.owners -= 1
        if region.owners <= 0:
            self._drop(region)
            self._pending_free.setdefault(region.alloc.id, []).append((op, region))

    def access(self, t: torch.Tensor, write: bool, op: str,
               stream: SimStream | None = None) -> None:
        """``op`` reads (or writes) the bytes ``t`` covers, on ``stream``."""
        stream = stream or self.current
        storage = t.untyped_storage()
        region = self._region(storage, stream)
        if region is None:
            return
        lo, hi = _extent(t)
        tick = self._clocks[stream.id].get(stream.id, 0)
        here = _Access(stream, tick, op, lo, hi)
        for last in region.write:
            if last.overlaps(lo, hi) and not self._ordered(last, stream):
                self._error(
                    f"'{op}' on {stream} {'writes' if write else 'reads'} memory that "
                    f"'{last.op}' wrote on {last.stream} with no ordering edge"
                )
        if write:
            for read in region.reads:
                if read.overlaps(lo, hi) and not self._ordered(read, stream):
                    self._error(
                        f"'{op}' on {stream} writes memory that '{read.op}' read on "
                        f"{read.stream} with no ordering edge"
                    )
            # what this write covers is checked (ordered, or reported): it alone stands for it
            region.write = [a for a in region.write if not a.inside(lo, hi)] + [here]
            region.reads = [a for a in region.reads if not a.inside(lo, hi)]
        else:  # a stream's later read of the same bytes stands for its earlier ones
            region.reads = [
                a for a in region.reads if a.stream is not stream or not a.inside(lo, hi)
            ] + [here]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused:
            return out
        stream = self.current
        self._tick(stream)
        name = str(func.overloadpacket.__name__)
        schema = func._schema
        written = set()  # (storage, bytes) this op writes through its arguments
        for i, arg in enumerate(schema.arguments):
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            if value is None:
                continue
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            for t in _tensors(value):
                if is_write:
                    written.add((t.untyped_storage()._cdata, _extent(t)))
                self.access(t, is_write, name, stream)
        for t in _tensors(out):
            key = t.untyped_storage()._cdata
            if key not in self._seen:  # a new tensor; an in-place result is its argument
                self.access(t, True, name, stream)
            elif (key, _extent(t)) not in written and key in {k for k, _ in written}:
                self.access(t, True, name, stream)
        return out

    # ---- collectives, as NCCL runs them -------------------------------------------

    def _pg_stream(self, group) -> SimStream:
        key = id(group) if group is not None else 0
        if key not in self._pg_streams:
            self._pg_streams[key] = self.new_stream(name=f"process group {len(self._pg_streams)}")
        return self._pg_streams[key]

    def _collective(self, fn, name, reads, writes, pg_group, async_op, args, kwargs):
        issuer, pg = self.current, self._pg_stream(pg_group)
        pg.wait_stream(issuer)
        self._tick(pg)
        for t in reads:
            self.access(_base(t), False, name, pg)
        for t in writes:
            self.access(_base(t), True, name, pg)
        self._paused += 1
        try:
            work = fn(*args, **kwargs)
        finally:
            self._paused -= 1
        if not async_op:
            if work is not None:
                work.wait()
            issuer.wait_stream(pg)
            return None
        return _SimWork(self, work, pg.record_event())

    @contextlib.contextmanager
    def _patched_collectives(self):
        checker = self
        originals = {}

        def wrap(name, read_key, write_key, inplace=False):
            fn = getattr(dist, name, None)
            if fn is None:
                return
            originals[name] = fn

            def wrapper(*args, **kwargs):
                names = [write_key, read_key] if not inplace else [write_key]
                bound = dict(zip(names, args))
                bound.update(kwargs)
                out = bound[write_key]
                ins = [out] if inplace else [bound[read_key]]
                return checker._collective(
                    fn, name, ins, [out], bound.get("group"), bound.get("async_op", False),
                    args, kwargs,
                )

            setattr(dist, name, wrapper)

        wrap("all_gather_into_tensor", "input_tensor", "output_tensor")
        wrap("all_gather_single", "input", "output")
        wrap("reduce_scatter_tensor", "input", "output")
        wrap("reduce_scatter_single", "input", "output")
        wrap("all_reduce", None, "tensor", inplace=True)
        original_resize = torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            if not checker._paused:
                if nbytes == 0:
                    checker._freed(storage._cdata, "resize_(0)")
                else:  # the caching allocator grows it on the current stream
                    checker._allocated(checker.current)
                    checker._grown_on[storage._cdata] = checker.current
            return original_resize(storage, nbytes)

        torch.UntypedStorage.resize_ = resize_
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
            torch.UntypedStorage.resize_ = original_resize

    def __enter__(self):
        self._exit = contextlib.ExitStack()
        original = comm_context.stream_backend_for
        comm_context.stream_backend_for = lambda device: self
        self._exit.callback(setattr, comm_context, "stream_backend_for", original)
        self._exit.enter_context(self._patched_collectives())
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._exit.close()


class _SimWork:
    def __init__(self, checker: StreamChecker, work, event: SimEvent) -> None:
        self.checker, self.work, self.event = checker, work, event

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            self.work.wait()
        self.checker.current.wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return True


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t``'s elements span: from its first to one past its last."""
    try:
        lo = t.data_ptr()
    except RuntimeError:  # no memory of its own: its storage's
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    if t.numel() == 0:
        return lo, lo
    span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return lo, lo + span * t.element_size()


def _tensors(value) -> list[torch.Tensor]:
    # an op's argument is a tensor, a flat list of them, or something else (the checker
    # sees every op: the first two skip pytree)
    if isinstance(value, torch.Tensor):
        leaves = (value,)
    elif isinstance(value, (list, tuple)) and not any(isinstance(v, (list, tuple, dict)) for v in value):
        leaves = value
    else:
        leaves, _ = tree_flatten(value)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = _base(leaf)
            if leaf.device.type != "meta":
                out.append(leaf)
    return out

