"""A test-only process-group backend: collectives through shared memory, waits by spinning.

Why: on a small VM a gloo collective costs 0.6 ms (all-gather of 64 floats,
W=2) to 1.6 ms (all-reduce), almost all of it threads and processes waking
each other (a pipe round trip between two processes is 86 us there); the
suite makes tens of thousands of them. Here each rank publishes its input in
a shared-memory file and spins (yielding the core) until every rank of the
group has published, then reads what it needs: 0.09 ms an all-gather at W=2.
``run_ranks`` uses it by default; ``FSDP2_TEST_BACKEND=gloo`` (or
``run_ranks(..., backend="gloo")``) runs on gloo instead (see CONTRIBUTING.md).

What it promises is what the library may rely on from gloo: every
collective, point-to-point and object collective ``torch.distributed``
offers on CPU tensors, with gloo's results (``tests/test_shm_backend.py``
compares them op by op); sums in rank order (deterministic at a given W);
gloo's refusals (``PREMUL_SUM``, float8); ranks that disagree on a
collective's kind or size get a ``RuntimeError`` on every rank; a wait longer
than the group's timeout raises. Collectives run when called (an
``async_op`` returns completed work), as on torch's threaded process group; a
send is buffered, so it never waits. Data moves with numpy on the tensors'
memory, so profilers, dispatch modes and memory trackers see no more ops than
they see inside gloo (none).

The protocol, per group: a header with a row per rank (its count of
collectives arrived, and for each of two alternating slots the payload's
file generation, size and signature). Collective ``k`` writes the payload in
slot ``k % 2`` of the rank's own file, then bumps the count. Slot ``k % 2``
is written again only at ``k + 2``, after every rank arrived at ``k + 1``,
i.e. finished reading ``k``: no second barrier. A payload that outgrows its
slot moves to a new file (a new generation). Stores are ordered on x86
(TSO), which the protocol relies on: elsewhere ``run_ranks`` uses gloo.
"""

from __future__ import annotations

import ctypes
import datetime
import math
import mmap
import os
import platform
import tempfile
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

NAME = "fsdp2_shm"
DIR_ENV = "FSDP2_TEST_SHM_DIR"  # where the groups' files live (run_ranks makes and removes it)
_ROW = 16  # int64 fields per rank in the header
_ARRIVED, _GEN, _NBYTES, _SIG = 0, 1, 3, 5  # _GEN, _NBYTES: one per slot; _SIG: 3 per slot
_ALL_TO_ALL, _ALL_GATHER, _ALL_REDUCE, _BARRIER, _BROADCAST = 1, 2, 3, 4, 5
_GATHER, _REDUCE, _REDUCE_SCATTER, _SCATTER = 6, 7, 8, 9
_NUMPY = {  # the dtypes numpy computes as torch does; bfloat16 below; float8: refused, as gloo
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
    torch.int64: np.int64, torch.bool: np.bool_, torch.complex64: np.complex64,
    torch.complex128: np.complex128, torch.bfloat16: np.uint16,
}
_CODES = {dtype: i + 1 for i, dtype in enumerate(_NUMPY)}


def available() -> bool:
    """Whether this machine orders stores as the protocol needs (x86)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def register() -> None:
    """Make ``init_process_group(NAME, ...)`` and its subgroups use this backend (idempotent)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
    # torch 2.15 hooks a flight recorder onto groups of backends that do not record
    # themselves; it keys entries by a name C++ keeps in the backends a Python group lacks
    recording = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if recording is not None:
        recording.add(NAME)


def _create(options, backend_options) -> ShmGroup:
    return ShmGroup(options.store, options.group_rank, options.group_size, options.timeout,
                    options.group_id)


def _done(result) -> dist.Work:
    future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _raw(t: torch.Tensor) -> np.ndarray:
    """``t``'s memory as bytes, without a torch op (profilers and dispatch modes see none)."""
    if t.dtype not in _NUMPY:
        raise RuntimeError(f"{NAME}: unsupported dtype {t.dtype} (gloo has none either)")
    if not t.is_contiguous():
        raise RuntimeError(f"{NAME}: tensors must be contiguous (gloo's rule too)")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(t.data_ptr()))


def _typed(raw: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return raw.view(_NUMPY[dtype])


def _bf16_add(acc: np.ndarray, other: np.ndarray) -> None:
    """``acc += other`` on bfloat16 bits as torch computes it: in float32, rounded to nearest even."""
    wide = (acc.astype(np.uint32) << 16).view(np.float32) + (other.astype(np.uint32) << 16).view(
        np.float32
    )
    bits = wide.view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    acc[...] = np.where(np.isnan(wide), 0x7FC0, rounded).astype(np.uint16)


_COMBINE = {  # ReduceOp -> (combine(acc, other), whether to divide by W after)
    dist.ReduceOp.SUM: (np.add, False), dist.ReduceOp.AVG: (np.add, True),
    dist.ReduceOp.PRODUCT: (np.multiply, False), dist.ReduceOp.MAX: (np.maximum, False),
    dist.ReduceOp.MIN: (np.minimum, False), dist.ReduceOp.BAND: (np.bitwise_and, False),
    dist.ReduceOp.BOR: (np.bitwise_or, False), dist.ReduceOp.BXOR: (np.bitwise_xor, False),
}


def _combiner(op, dtype: torch.dtype):
    known = [k for k in _COMBINE if op == k]  # (a ReduceOp equals its RedOpType; hashes differ)
    if not known:
        raise RuntimeError(f"{NAME}: cannot use reduce op {op} (gloo refuses it too)")
    combine, average = _COMBINE[known[0]]
    if dtype == torch.bfloat16 and combine is not np.add:
        raise RuntimeError(f"{NAME}: only SUM and AVG on bfloat16 here")
    return combine, average


def _poll(ready, timeout_s: float, what: str) -> None:
    """Wait until ``ready()``: spin yielding the core for a millisecond, then sleep, longer and longer.

    Most collectives of the suite's small models complete within the spin;
    a rank that waits longer (the other compiles, writes a checkpoint) sleeps
    so that it does not take a core from them.
    """
    if ready():
        return
    start = time.monotonic()
    spins, nap = 0, 5e-5
    while not ready():
        spins += 1
        if spins < 500:
            os.sched_yield()
            continue
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise RuntimeError(f"{NAME}: timed out after {timeout_s:.0f} s waiting for {what}")
        if waited < 1e-3:
            os.sched_yield()
        else:
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)


class _Done(dist.Work):
    """Completed work that also takes ``wait(timeout)`` (torchft's transports pass one)."""

    def __init__(self, result) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self._result)
        return future


class _RecvWork(_Done):
    """A receive that completes when its message's file appears (waits poll, as collectives do)."""

    def __init__(self, path: str, tensor: torch.Tensor, timeout_s: float) -> None:
        super().__init__([tensor])
        self._path, self._tensor, self._timeout_s = path, tensor, timeout_s
        self._received = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._received:
            limit = timeout.total_seconds() if timeout else self._timeout_s
            _poll(lambda: os.path.exists(self._path), limit, f"recv {self._path}")
            _raw(self._tensor)[...] = np.fromfile(self._path, dtype=np.uint8)
            os.unlink(self._path)
            self._received = True
        return True

    def is_completed(self) -> bool:
        return self._received

    def get_future(self) -> torch.futures.Future:
        self.wait()
        return super().get_future()


class ShmGroup(dist.ProcessGroup):
    """One process group's ranks exchanging payloads through shared-memory files."""

    def __init__(self, store, rank: int, world_size: int, timeout: datetime.timedelta,
                 name: str) -> None:
        super().__init__(rank, world_size)
        self._rank, self._size, self._name = rank, world_size, name
        self._timeout_s = timeout.total_seconds()
        if rank == 0:
            fd, path = tempfile.mkstemp(prefix="group", dir=os.environ[DIR_ENV])
            os.ftruncate(fd, world_size * _ROW * 8)
            os.close(fd)
            store.set("fsdp2_shm_header", path)
        self._path = store.get("fsdp2_shm_header").decode()
        with open(self._path, "r+b") as f:
            self._header_map = mmap.mmap(f.fileno(), world_size * _ROW * 8)
        self._header = memoryview(self._header_map).cast("q")
        self._count = 0
        self._maps: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._sent: dict[tuple[int, int], int] = {}
        self._received: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        # bytes before the data of payloads that carry offsets: W + 1 of them, any dtype aligned
        self._prefix = -(-8 * (world_size + 1) // 64) * 64
        store.set(f"fsdp2_shm_ready{rank}", "1")  # every rank mapped the header before any writes
        store.wait([f"fsdp2_shm_ready{r}" for r in range(world_size)])

    # ---- the protocol ----

    def _segment(self, rank: int, slot: int, nbytes: int = 0) -> np.ndarray:
        """``rank``'s slot as bytes; for this rank, grown to ``nbytes`` first if needed."""
        gen = self._header[rank * _ROW + _GEN + slot]
        cached = self._maps.get((rank, slot))
        if rank == self._rank and (cached is None or cached[1].size < nbytes):
            gen += 1
            size = max(nbytes, 2 * (cached[1].size if cached else 0), 1 << 16)
            with open(f"{self._path}.r{rank}s{slot}g{gen}", "w+b") as f:
                f.truncate(size)
                cached = (gen, np.frombuffer(mmap.mmap(f.fileno(), size), dtype=np.uint8))
            if gen > 1:  # every reader finished with the old one (see the module docstring)
                os.unlink(f"{self._path}.r{rank}s{slot}g{gen - 1}")
            self._header[rank * _ROW + _GEN + slot] = gen
            self._maps[rank, slot] = cached
        elif cached is None or cached[0] != gen:
            with open(f"{self._path}.r{rank}s{slot}g{gen}", "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                cached = (gen, np.frombuffer(mmap.mmap(f.fileno(), size), dtype=np.uint8))
            self._maps[rank, slot] = cached
        return cached[1]

    def _exchange(self, kind: int, parts: list[np.ndarray], signature: tuple[int, int],
                  offsets: list[int] | None = None) -> int:
        """Publish this rank's payload (``parts`` back to back), wait for every rank; its slot.

        ``signature`` (dtype code, element count; ``(0, 0)``: any) must match
        across ranks; ``offsets`` (int64) are written before the data.
        """
        self._count += 1
        slot = self._count % 2
        base = self._prefix if offsets is not None else 0
        nbytes = base + sum(p.size for p in parts)
        if nbytes:
            segment = self._segment(self._rank, slot, nbytes)
            if offsets is not None:
                segment[:8 * len(offsets)].view(np.int64)[:] = offsets
            at = base
            for p in parts:
                segment[at:at + p.size] = p
                at += p.size
        row = self._rank * _ROW
        self._header[row + _NBYTES + slot] = nbytes
        sig = row + _SIG + 3 * slot
        self._header[sig], self._header[sig + 1], self._header[sig + 2] = kind, *signature
        self._header[row + _ARRIVED] = self._count
        _poll(self._all_arrived, self._timeout_s, f"collective {self._count} of {self._path}")
        self._check(kind, slot)
        return slot

    def _all_arrived(self) -> bool:
        count = self._count
        return all(self._header[r * _ROW] >= count for r in range(self._size))

    def _check(self, kind: int, slot: int) -> None:
        at = _SIG + 3 * slot
        sigs = [tuple(self._header[r * _ROW + at:r * _ROW + at + 3]) for r in range(self._size)]
        if {s[0] for s in sigs} != {kind} or len({s for s in sigs if s[1:] != (0, 0)}) > 1:
            raise RuntimeError(
                f"{NAME}: ranks called different collectives or sizes at collective "
                f"{self._count} (kind, dtype, numel per rank: {sigs})"
            )

    def _bytes_of(self, rank: int, slot: int, start: int = 0, nbytes: int | None = None):
        """Bytes ``[start, start + nbytes)`` of ``rank``'s payload."""
        if nbytes is None:
            nbytes = self._header[rank * _ROW + _NBYTES + slot] - start
        if nbytes == 0:  # (a rank that sent nothing may have no file yet)
            return np.empty(0, np.uint8)
        return self._segment(rank, slot)[start:start + nbytes]

    def _offset(self, rank: int, slot: int, index: int) -> int:
        return int(self._segment(rank, slot)[:self._prefix].view(np.int64)[index])

    @staticmethod
    def _signature(t: torch.Tensor) -> tuple[int, int]:
        return _CODES.get(t.dtype, 99), t.numel()

    def _reduce_into(self, out: torch.Tensor, slot: int, op, start: int = 0) -> None:
        """``out`` = the reduction over ranks, in rank order, of each payload's bytes from ``start``."""
        combine, average = _combiner(op, out.dtype)
        nbytes = out.numel() * out.element_size()
        acc = _typed(self._bytes_of(0, slot, start, nbytes), out.dtype).copy()
        for rank in range(1, self._size):
            other = _typed(self._bytes_of(rank, slot, start, nbytes), out.dtype)
            if out.dtype == torch.bfloat16:
                _bf16_add(acc, other)
            else:
                with np.errstate(all="ignore"):  # (overflow to inf: torch does not warn)
                    combine(acc, other, out=acc)
        if average:
            if out.dtype == torch.bfloat16:  # (torch's bf16 division: in float32, rounded)
                acc = _bf16_div(acc, self._size)
            elif np.issubdtype(acc.dtype, np.floating) or np.issubdtype(acc.dtype, np.complexfloating):
                acc /= self._size
            else:
                acc //= self._size
        _typed(_raw(out), out.dtype)[...] = acc

    def _copy_into(self, out: torch.Tensor, rank: int, slot: int, start: int = 0) -> None:
        raw = _raw(out)
        raw[...] = self._bytes_of(rank, slot, start, raw.size)

    # ---- collectives (method names: torch's Python process-group trampoline) ----

    def allreduce(self, tensors, opts=None):
        with self._lock:
            for t in tensors:
                slot = self._exchange(_ALL_REDUCE, [_raw(t)], self._signature(t))
                self._reduce_into(t, slot, _op(opts))
            return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None):
        with self._lock:
            for t in tensors:
                slot = self._exchange(_REDUCE, [_raw(t)], self._signature(t))
                if self._rank == _root(opts):
                    self._reduce_into(t, slot, _op(opts))
            return _done(tensors)

    def barrier(self, opts=None):
        with self._lock:
            self._exchange(_BARRIER, [], (0, 0))
            return _done(None)

    def broadcast(self, tensors, opts=None):
        with self._lock:
            for t in tensors:
                root = _root(opts)
                slot = self._exchange(_BROADCAST, [_raw(t)] if self._rank == root else [], (0, 0))
                if self._rank != root:
                    self._copy_into(t, root, slot)
            return _done(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        with self._lock:
            for outs, t in zip(output_tensors, input_tensors):
                slot = self._exchange(_ALL_GATHER, [_raw(t)], self._signature(t))
                for rank, out in enumerate(outs):
                    self._copy_into(out, rank, slot)
            return _done(output_tensors)

    def all_gather_single(self, output, input, opts=None):
        with self._lock:
            slot = self._exchange(_ALL_GATHER, [_raw(input)], self._signature(input))
            raw = _raw(output)
            chunk = raw.size // self._size
            for rank in range(self._size):
                raw[rank * chunk:(rank + 1) * chunk] = self._bytes_of(rank, slot, 0, chunk)
            return _done([output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self.all_gather_single(output, input, opts)
        return _done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        with self._lock:
            for out, ins in zip(outputs, input_lists):
                slot = self._exchange(_REDUCE_SCATTER, [_raw(t) for t in ins], self._signature(out))
                start = sum(t.numel() * t.element_size() for t in ins[:self._rank])
                self._reduce_into(out, slot, _op(opts), start)
            return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        with self._lock:
            slot = self._exchange(_REDUCE_SCATTER, [_raw(input)], self._signature(input))
            start = self._rank * output.numel() * output.element_size()
            self._reduce_into(output, slot, _op(opts), start)
            return _done([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(output, input, opts)
        return _done(outputs)

    def gather(self, output_tensors, input_tensors, opts=None):
        with self._lock:
            (t,) = input_tensors
            slot = self._exchange(_GATHER, [_raw(t)], self._signature(t))
            if self._rank == _root(opts):
                for rank, out in enumerate(output_tensors[0]):
                    self._copy_into(out, rank, slot)
            return _done(output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        with self._lock:
            root = _root(opts)
            parts = [_raw(t) for t in input_tensors[0]] if self._rank == root else []
            offsets = _cumulative([p.size for p in parts], self._prefix) if parts else None
            slot = self._exchange(_SCATTER, parts, (0, 0), offsets)
            (out,) = output_tensors
            self._copy_into(out, root, slot, self._offset(root, slot, self._rank))
            return _done(output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        with self._lock:
            row_in = math.prod(input.shape[1:]) * input.element_size()
            row_out = math.prod(output.shape[1:]) * output.element_size()
            ins = input_split_sizes or [input.shape[0] // self._size] * self._size
            outs = output_split_sizes or [output.shape[0] // self._size] * self._size
            offsets = _cumulative([n * row_in for n in ins], self._prefix)
            slot = self._exchange(_ALL_TO_ALL, [_raw(input)], (0, 0), offsets)
            raw, at = _raw(output), 0
            for rank, rows in enumerate(outs):
                start = self._offset(rank, slot, self._rank)
                raw[at:at + rows * row_out] = self._bytes_of(rank, slot, start, rows * row_out)
                at += rows * row_out
            return _done([output])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        with self._lock:
            parts = [_raw(t) for t in input_tensors]
            offsets = _cumulative([p.size for p in parts], self._prefix)
            slot = self._exchange(_ALL_TO_ALL, parts, (0, 0), offsets)
            for rank, out in enumerate(output_tensors):
                self._copy_into(out, rank, slot, self._offset(rank, slot, self._rank))
            return _done(output_tensors)

    # ---- point to point: buffered sends, receives that poll ----

    def _message(self, src: int, dst: int, tag: int, seq: int) -> str:
        return f"{self._path}.p2p.{src}.{dst}.{tag}.{seq}"

    def send(self, tensors, dst: int, tag: int = 0):
        for t in tensors:
            seq = self._sent[dst, tag] = self._sent.get((dst, tag), 0) + 1
            path = self._message(self._rank, dst, tag, seq)
            _raw(t).tofile(path + ".tmp")
            os.rename(path + ".tmp", path)  # appears whole
        return _Done(tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        (t,) = tensors
        seq = self._received[src, tag] = self._received.get((src, tag), 0) + 1
        return _RecvWork(self._message(src, self._rank, tag, seq), t, self._timeout_s)

    # ---- identity ----

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return NAME

    @property
    def group_name(self) -> str:  # (torch keeps it in the backends a Python group has none of)
        return self._name

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device) -> ShmGroup:
        return self  # its own backend: what callers ask of one is below

    def supports_tensor_alloc(self, device) -> bool:
        return False  # (as gloo: no allocator of its own)

    def __repr__(self) -> str:
        return f"ShmGroup(rank={self._rank}, size={self._size})"


def _bf16_div(acc: np.ndarray, divisor: int) -> np.ndarray:
    wide = (acc.astype(np.uint32) << 16).view(np.float32) / np.float32(divisor)
    bits = wide.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _op(opts):
    return dist.ReduceOp.SUM if opts is None else opts.reduceOp


def _root(opts) -> int:
    return 0 if opts is None else opts.rootRank


def _cumulative(sizes: list[int], base: int) -> list[int]:
    offsets = [base]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return offsets
