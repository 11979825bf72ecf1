"""Where an optimizer's state lives: the tiers of the step engine (memory, host, disk).

[Note: Optimizer state tiers]
An optimizer's per-parameter state (Adam's two moments, SGD's momentum, ...)
is two or three times the parameters, and it is touched once per step, by an
elementwise kernel. So it need not stay in device memory, nor even in host
memory. Each tier is a ``StateTier``: ``views(unit)`` (a unit's state
tensors), ``prefetch(unit)``, ``release(unit)``, ``wait()``, ``close()``.
The step engine (step_engine.py) cuts every param group once (step_plan.py);
``MemoryTier`` leaves the state where the optimizer made it (in flat run
buffers or local tensors, ``in_units`` false: one optimizer call over all
runs), while the store tiers step the parameters in *units* (a run, or part
of one; see [Note: Stepping in units] in unit_step.py) and keep each unit's
parameter-shaped state tensors in one contiguous region per dtype:

- ``HostStore``: a host buffer per unit and dtype (pinned where a GPU is
  present), the state tensors views of it, resident all the time.
- ``DiskStore``: a file per unit and dtype under the policy's directory (a
  folder per rank). A unit's state tensors are views of a fresh *mapping* of
  its files (``torch.from_file(shared=True)``), which holds no memory until it
  is touched. The disk works behind the step (see [Note: Overlapping the
  disk with the step]): while one unit steps, a reader thread maps the next
  unit's files and faults their pages in, and a writer thread writes the
  units stepped before it back and drops them from the page cache
  (``fsync``, ``DONTNEED``), at most ``units_in_memory`` units at a time.
  Host memory then holds a few units, not the model's state. What the
  units' kernels allocated is freed as each unit ends, and
  ``release_free_heap`` hands the heap the C allocator kept for it back to
  the system (glibc keeps freed blocks below its adaptive mmap threshold
  resident). The space is reserved up front (``posix_fallocate``), so a
  full disk fails before the first step, not in the middle of one.

What a unit works on (its mapped views, the state a first step creates
before it moves in) is counted in ``live`` (``LiveBytes``) until freed: a few
units, first step and loads included. The files are working storage, never a
checkpoint: ``save_checkpoint`` reads the state past the mappings, a tensor
at a time (see [Note: Streaming file-backed state] in
checkpoint/streaming.py), and a new run
rewrites the files before using them, so nothing a killed run left behind is
ever read as state. Each rank's folder holds an ``OWNER`` claim (host, pid,
the model's layout fingerprint): a second live job (or optimizer) on the same
folder, or files of another model, is refused with the path to clean up; a
claim whose process is gone (dead, a zombie, or its pid reused) is taken over,
by the rule of [Note: Claim files] in ``fsdp2/claim_file.py``.

[Note: Overlapping the disk with the step]
Stepped in plain order, a unit's step would wait for its pages to come off
the disk (a page fault at a time, on the stepping thread) and for the units
before it to be written. Instead each unit goes through three threads:

- ``prefetch(u)`` hands unit ``u`` to a reader thread, which maps its files
  and faults every page in, writable (``madvise(MADV_POPULATE_WRITE)``; a
  read of one byte per page where the kernel lacks it): the disk reads
  while the unit before it steps. ``views(u)`` then takes those mappings
  (waiting if the read is not done), or maps the files itself where nothing
  was prefetched (the plain order). The engine prefetches unit ``i + 1``
  before unit ``i`` steps, and unit 0 of the next step as a step ends, so
  the first unit is read during the next forward and backward.
- ``release(u)`` hands the unit to the writer thread (``fsync``, then
  ``DONTNEED``), waiting first for the oldest write while
  ``units_in_memory`` are in flight.

Bits cannot change: every thread works on shared mappings of the same
files, so whatever a prefetched mapping holds when its unit steps *is* the
file (a load, a checkpoint's ``pwrite`` or an earlier step all go through
the page cache those mappings share). Memory stays bounded: the unit
stepping, the one read ahead, and ``units_in_memory`` being written back. A
background thread's error is raised on the stepping thread by the next
``views``, ``release`` or ``wait`` that needs its result, as the exception
it was (an ``OSError`` from the disk, ...), never dropped; the step engine
then refuses to step on a half-stepped state (step_engine.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import hashlib
import os
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ..agree import agree
from ..api import OptimizerOffloadPolicy
from ..claim_file import ClaimFile, Owner, OwnerStatus
from ..file_tensors import FileRegion, MappedFiles

__all__ = [
    "DiskStore", "HostStore", "LiveBytes", "MemoryTier", "Slot", "StateTier", "StoreError",
    "UnitLayout",
    "open_tier", "page_in", "release_free_heap",
]


class StoreError(RuntimeError):
    """The optimizer-state directory cannot be used (unwritable, full, claimed, foreign)."""


@dataclass(frozen=True)
class Slot:
    """One parameter-shaped state tensor inside its unit's region of ``dtype``."""

    param: int  # index of the parameter within its unit
    key: str
    dtype: torch.dtype
    offset: int  # in elements, into the unit's region of ``dtype``
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class UnitLayout:
    """The state tensors of one unit and how many elements each dtype's region holds."""

    slots: tuple[Slot, ...]
    numel: dict[torch.dtype, int]

    @staticmethod
    def of(entries: list[tuple[int, str, torch.dtype, tuple[int, ...]]]) -> UnitLayout:
        """Pack ``(param, key, dtype, shape)`` entries back to back, per dtype, in order."""
        numel: dict[torch.dtype, int] = {}
        slots = []
        for param, key, dtype, shape in entries:
            offset = numel.get(dtype, 0)
            slot = Slot(param, key, dtype, offset, shape)
            numel[dtype] = offset + slot.numel
            slots.append(slot)
        return UnitLayout(tuple(slots), numel)

    def nbytes(self) -> int:
        return sum(n * dtype.itemsize for dtype, n in self.numel.items())


def fingerprint(layouts: list[UnitLayout]) -> str:
    """A digest of every unit's slots: the same model and optimizer give the same one."""
    text = repr([[(s.param, s.key, str(s.dtype), s.shape) for s in u.slots] for u in layouts])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class LiveBytes:
    """Bytes of state tensors a store handed out for work and that are still alive, and their peak.

    The store's own instrument of [Note: Optimizer state tiers]: every tensor
    a unit works on (a unit's mapped views while it steps or loads, the state a
    first step creates before it moves into the store) is ``hold``-ed and
    counted until Python frees it, so a test can assert that host memory
    holds a few units at once, never the model's state.
    """

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self._lock = threading.Lock()

    def hold(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s bytes until it is freed."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._drop, nbytes)

    def _drop(self, nbytes: int) -> None:
        with self._lock:
            self.now -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.now


def _slot(layout: UnitLayout, param: int, key: str) -> Slot:
    return next(s for s in layout.slots if s.param == param and s.key == key)


# (unit, parameter index in the unit, key, value) -> whether value is that state tensor itself
InPlaceTest = Callable[[int, int, str, torch.Tensor], bool]


def _views(regions: dict[torch.dtype, torch.Tensor], layout: UnitLayout) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (s.param, s.key): regions[s.dtype].narrow(0, s.offset, s.numel).view(s.shape)
        for s in layout.slots
    }


class StateTier(Protocol):
    """Where the step engine keeps optimizer state (see [Note: Optimizer state tiers])."""

    # True: state lives in the tier's regions, stepped unit by unit on ``views``;
    # False: state stays where the optimizer made it, stepped in one call
    in_units: bool

    def views(self, unit: int) -> dict[tuple[int, str], torch.Tensor]:
        """``unit``'s state tensors, by (parameter index in the unit, key)."""

    def prefetch(self, unit: int) -> None:
        """``unit`` steps soon: start bringing its state in (any index; past the end is a no-op)."""

    def release(self, unit: int) -> dict[tuple[int, str], torch.Tensor]:
        """``unit`` stepped: let its state go; returns the views ``optimizer.state`` keeps."""

    def wait(self) -> None:
        """Block until every released unit is where it belongs."""

    def in_place_test(self) -> InPlaceTest:
        """Whether a value already is a unit's state tensor (in place, not a copy); valid until
        the next ``renew``."""

    def renew(self, unit: int) -> None:
        """Give ``unit`` fresh storage (a load of other values): views handed out keep the old."""

    def close(self) -> None:
        """Release the tier's resources (buffers, files' claim)."""


class MemoryTier:
    """State stays where the optimizer made it: flat run buffers or each local shard's tensors."""

    in_units = False

    def views(self, unit: int) -> dict[tuple[int, str], torch.Tensor]:
        raise AssertionError("MemoryTier holds no units: the engine steps it in one call")

    def prefetch(self, unit: int) -> None:
        """Nothing to read: the state is in memory."""

    def release(self, unit: int) -> dict[tuple[int, str], torch.Tensor]:
        raise AssertionError("MemoryTier holds no units: the engine steps it in one call")

    def wait(self) -> None:
        """Nothing is written behind."""

    def in_place_test(self) -> InPlaceTest:
        raise AssertionError("MemoryTier holds no units: the engine steps it in one call")

    def renew(self, unit: int) -> None:
        raise AssertionError("MemoryTier holds no units: the engine steps it in one call")

    def close(self) -> None:
        """Nothing to give back."""


def open_tier(policy: OptimizerOffloadPolicy | None, layouts: list[UnitLayout]) -> StateTier:
    """The tier ``policy`` asks for, holding units of ``layouts``; the same error on every rank."""
    if policy is None:
        return MemoryTier()

    def make() -> HostStore | DiskStore:
        if policy.tier == "host":
            return HostStore(layouts, policy.pin_memory)
        rank = dist.get_rank() if dist.is_initialized() else 0
        return DiskStore(policy.directory, rank, layouts, policy.units_in_memory)

    return agree("Cannot keep the optimizer state in its store", make, every_rank=True,
                 error_type=StoreError, undo=lambda store: store.close())


class HostStore:
    """Each unit's state in one host buffer per dtype, resident (see [Note: Optimizer state tiers])."""

    in_units = True

    def __init__(self, layouts: list[UnitLayout], pin_memory: bool) -> None:
        pin = pin_memory and torch.cuda.is_available()
        self._pin = pin
        self._layouts = layouts
        self._regions = [self._allocate(layout) for layout in layouts]
        self.live = LiveBytes()  # counts only what a first step creates: the regions are resident

    def _allocate(self, layout: UnitLayout) -> dict[torch.dtype, torch.Tensor]:
        return {dt: torch.empty(n, dtype=dt, pin_memory=self._pin) for dt, n in layout.numel.items()}

    def views(self, unit: int) -> dict[tuple[int, str], torch.Tensor]:
        return _views(self._regions[unit], self._layouts[unit])

    def in_place_test(self) -> InPlaceTest:
        def test(unit: int, param: int, key: str, value: torch.Tensor) -> bool:
            slot = _slot(self._layouts[unit], param, key)
            start = self._regions[unit][slot.dtype].data_ptr() + slot.offset * slot.dtype.itemsize
            return value.data_ptr() == start and value.dtype == slot.dtype and value.shape == slot.shape

        return test

    def renew(self, unit: int) -> None:
        self._regions[unit] = self._allocate(self._layouts[unit])

    def prefetch(self, unit: int) -> None:
        """Nothing to read: host state is always resident."""

    def release(self, unit: int) -> dict[tuple[int, str], torch.Tensor]:
        return self.views(unit)

    def wait(self) -> None:
        """Nothing is written behind."""

    def close(self) -> None:
        self._regions = []


class DiskStore:
    """Each unit's state in files under one folder per rank (see [Note: Optimizer state tiers])."""

    in_units = True

    def __init__(
        self, directory: str | os.PathLike, rank: int, layouts: list[UnitLayout], in_flight: int
    ) -> None:
        self._layouts = layouts
        self.folder = Path(directory) / f"rank{rank:05d}"
        self._token = uuid.uuid4().hex  # this store's: a second optimizer in this process is refused
        self._fingerprint = fingerprint(layouts)
        self._claim()
        self._renewals = 0
        self._paths = [self._new_paths(i) for i in range(len(layouts))]
        self._remove_leftovers()
        for i in range(len(layouts)):
            self._reserve(i)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="fsdp2-state-writeback")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="fsdp2-state-read")
        self._in_flight = in_flight
        self._pending: deque[Future] = deque()
        self._read_ahead: dict[int, Future] = {}  # unit -> its mapped, paged-in views
        self._lock = threading.Lock()
        self.live = LiveBytes()

    # ---- the claim: one job per folder ------------------------------------------

    @property
    def owner_file(self) -> Path:
        return self.folder / "OWNER"

    def _claim(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StoreError(
                f"Optimizer state directory {self.folder} is not writable ({e}); pass a "
                "directory this job can create files in"
            ) from e
        self._claim_file = ClaimFile(self.owner_file, self._token, fingerprint=self._fingerprint)
        try:
            self._claim_file.take(self._refuse)
        except RuntimeError as e:
            if isinstance(e, StoreError):
                raise
            raise StoreError(f"Could not claim {self.owner_file}: {e}") from e

    def _refuse(self, owner: Owner) -> StoreError | None:
        """A claim in place: a live job's, another host's, or another model's files are refused."""
        if owner.status is OwnerStatus.LIVE:
            return StoreError(
                f"Optimizer state directory {self.folder} is in use by a live process (pid "
                f"{owner.pid} on {owner.host}, {self.owner_file}); give each job (and each "
                "optimizer) a directory of its own"
            )
        if owner.status is OwnerStatus.ELSEWHERE:
            return StoreError(
                f"Optimizer state directory {self.folder} is claimed by host {owner.host} (pid "
                f"{owner.pid}); if that job is gone, delete {self.owner_file}, else use another "
                "directory"
            )
        if owner.record.get("fingerprint") not in (None, self._fingerprint):
            return StoreError(
                f"Optimizer state directory {self.folder} holds the state files of another model "
                f"or optimizer ({self.owner_file} records a different layout); pass an empty "
                "directory, or delete that folder if its state is no longer needed"
            )
        return None

    # ---- space ------------------------------------------------------------------

    def _new_paths(self, unit: int) -> dict[torch.dtype, Path]:
        """``unit``'s file names: the first of a run, or a renewal's (a ``-rN`` suffix)."""
        suffix = f"-r{self._renewals}" if self._renewals else ""
        return {
            dt: self.folder / f"unit{unit:05d}-{str(dt).removeprefix('torch.')}{suffix}.bin"
            for dt in self._layouts[unit].numel
        }

    def _remove_leftovers(self) -> None:
        """Unit files this run will not use (a killed run's renewals): never read, so deleted."""
        ours = {path.name for paths in self._paths for path in paths.values()}
        for path in self.folder.glob("unit*.bin"):
            if path.name not in ours:
                path.unlink(missing_ok=True)

    def _reserve(self, unit: int) -> None:
        layout = self._layouts[unit]
        for dt, path in self._paths[unit].items():
            nbytes = layout.numel[dt] * dt.itemsize
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    os.ftruncate(fd, nbytes)
                    if nbytes and hasattr(os, "posix_fallocate"):
                        os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
            except OSError as e:
                raise StoreError(
                    f"Cannot reserve {nbytes} bytes of optimizer state in {path} ({e}); "
                    f"the state needs {sum(u.nbytes() for u in self._layouts)} bytes per "
                    "rank: free space or point OptimizerOffloadPolicy.directory elsewhere"
                ) from e

    def renew(self, unit: int) -> None:
        """New files for ``unit``; the old ones are unlinked.

        A load of values that are not already the unit's files goes into new
        files, as a load in memory goes into new tensors: a state dict taken
        before the load keeps mappings of the old files, whose pages live on
        (unlinked) while it holds them, so it keeps the state it showed and
        does not follow the steps after the load (as with upstream).
        """
        self.wait()  # the writer fsyncs by path: none may be on the old files
        with self._lock:
            ahead = self._read_ahead.pop(unit, None)
        if ahead is not None and not ahead.cancel():
            ahead.exception()  # mappings of the old files, never used: let the read finish
        old = self._paths[unit]
        self._renewals += 1
        self._paths[unit] = self._new_paths(unit)
        self._reserve(unit)
        for path in old.values():
            path.unlink(missing_ok=True)

    # ---- stepping ---------------------------------------------------------------

    def views(self, unit: int) -> dict[tuple[int, str], torch.Tensor]:
        """Mappings of ``unit``'s files to work on (counted in ``live``): read ahead, or fresh.

        Raises here, on the calling thread, whatever the read ahead raised.
        """
        with self._lock:
            ahead = self._read_ahead.pop(unit, None)
        if ahead is not None:
            return ahead.result()
        views = self._map(unit)
        for v in views.values():
            self.live.hold(v)
        return views

    def _map(self, unit: int) -> dict[tuple[int, str], torch.Tensor]:
        """Fresh mappings of ``unit``'s files: no memory until touched."""
        return _views(self._regions(unit), self._layouts[unit])

    def _regions(self, unit: int) -> dict[torch.dtype, torch.Tensor]:
        return {
            dt: torch.from_file(str(path), shared=True, size=self._layouts[unit].numel[dt], dtype=dt)
            for dt, path in self._paths[unit].items()
        }

    def _read(self, unit: int) -> dict[tuple[int, str], torch.Tensor]:
        """On the reader thread: ``unit``'s files mapped, every page in (see the overlap note)."""
        self._advise(unit, os.POSIX_FADV_WILLNEED if hasattr(os, "posix_fadvise") else None)
        regions = self._regions(unit)
        for region in regions.values():
            page_in(region)
        views = _views(regions, self._layouts[unit])
        for v in views.values():
            self.live.hold(v)
        return views

    def _advise(self, unit: int, advice: int | None) -> None:
        if advice is None:
            return
        for path in self._paths[unit].values():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, advice)
            finally:
                os.close(fd)

    def in_place_test(self) -> InPlaceTest:
        maps = MappedFiles.now()  # a DCP load may have written the files through mappings
        return lambda unit, param, key, value: maps.region(value) == self.region(unit, param, key)

    def region(self, unit: int, param: int, key: str) -> FileRegion:
        """Where the state tensor ``key`` of ``unit``'s parameter ``param`` lies in its file."""
        slot = _slot(self._layouts[unit], param, key)
        size = slot.dtype.itemsize
        return FileRegion(str(self._paths[unit][slot.dtype]), slot.offset * size, slot.numel * size)

    def prefetch(self, unit: int) -> None:
        """Start reading ``unit``'s state on the reader thread (once; past the end: nothing)."""
        if not 0 <= unit < len(self._paths):
            return
        with self._lock:
            if unit not in self._read_ahead:
                self._read_ahead[unit] = self._reader.submit(self._read, unit)

    def release(self, unit: int) -> dict[tuple[int, str], torch.Tensor]:
        """``unit`` stepped: write its pages back behind us; returns fresh mappings to keep."""
        fresh = self._map(unit)
        with self._lock:
            while len(self._pending) >= self._in_flight:
                self._pending.popleft().result()
            self._pending.append(self._writer.submit(self._write_back, unit))
        return fresh

    def _write_back(self, unit: int) -> None:
        for path in self._paths[unit].values():
            fd = os.open(path, os.O_RDWR)
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def wait(self) -> None:
        with self._lock:
            while self._pending:
                self._pending.popleft().result()

    def close(self) -> None:
        with self._lock:
            ahead, self._read_ahead = list(self._read_ahead.values()), {}
        for future in ahead:  # reads only: nothing of the state is lost with them
            future.cancel()
        self._reader.shutdown(wait=True)
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            self._claim_file.release()


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, without touching the data


def page_in(region: torch.Tensor) -> None:
    """Fault every page of the mapped ``region`` in, writable, so that its step takes no fault.

    ``madvise(MADV_POPULATE_WRITE)`` through ``ctypes`` (the call lets go of
    the GIL); where the kernel or C library lacks it, one byte of each page
    is read instead (the step's first write to a page then still faults,
    but without waiting for the disk).
    """
    nbytes = region.numel() * region.element_size()
    if nbytes == 0:
        return
    madvise = getattr(_libc(), "madvise", None)
    if madvise is not None:
        if madvise(region.data_ptr(), nbytes, _MADV_POPULATE_WRITE) == 0:
            return
        if ctypes.get_errno() not in (0, errno.EINVAL):
            raise OSError(ctypes.get_errno(), f"paging in {nbytes} bytes of optimizer state failed")
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    region.view(torch.uint8)[::page].sum()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once (``find_library`` may start a process)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    if hasattr(libc, "madvise"):
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def release_free_heap() -> None:
    """Give memory the C allocator keeps after ``free`` back to the system (glibc only).

    torch's CPU tensors come from ``malloc``; glibc keeps freed blocks of up to
    its (adaptive) mmap threshold in the heap, resident. Not a torch API:
    ``malloc_trim(0)`` from the C library through ``ctypes``; a no-op where
    the library has no such function (musl, macOS).
    """
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
