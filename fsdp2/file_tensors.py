"""Tensors that are views of a file: where one lives, and reading or writing it past the mapping.

[Note: File-backed tensors]
The NVMe tier of the optimizer (``optim/state_store.py``) keeps state in
files and hands out tensors that are views of a shared mapping of them
(``torch.from_file(shared=True)``). A mapping holds no memory until it is
touched, but every page touched through it stays resident while the mapping
lives. A checkpoint that reads the whole state through the mappings (DCP's
writer does, tensor by tensor) or writes a loaded state into them would so
bring the whole state into memory, the very thing the tier avoids.

So the checkpoint layer asks this module where such a tensor lives and goes
past the mapping: ``read`` copies its bytes from the file into a fresh
tensor (``pread``), ``write`` puts a tensor's bytes into the file
(``pwrite``), each one tensor at a time. The answer comes from the kernel
(``/proc/self/maps``), not from a registry that could go stale: a contiguous
CPU tensor whose memory lies in one ``MAP_SHARED`` mapping of a regular file
is at ``offset`` of that file, and a shared mapping and ``pread`` /
``pwrite`` of the same file see the same page cache, so the bytes are the
tensor's, dirty pages included. Anything else (heap tensors, private
mappings, another OS) has no region and is read as it is.
"""

from __future__ import annotations

import bisect
import mmap
import os
import sys
from dataclasses import dataclass

import torch

__all__ = ["FileRegion", "MappedFiles", "copy_region", "map_region", "read", "write"]


@dataclass(frozen=True)
class FileRegion:
    """``nbytes`` bytes at byte ``offset`` of the file ``path``."""

    path: str
    offset: int
    nbytes: int


class MappedFiles:
    """A snapshot of this process's shared file mappings (valid for tensors alive while it is used)."""

    def __init__(self, spans: list[tuple[int, int, int, str]]) -> None:
        self._spans = sorted(spans)  # (start, end, file offset, path)
        self._starts = [s[0] for s in self._spans]

    @staticmethod
    def now() -> MappedFiles:
        """The shared file mappings as the kernel lists them now (none off Linux)."""
        if not sys.platform.startswith("linux"):
            return MappedFiles([])
        spans = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[1][3] != "s":  # a MAP_SHARED mapping of a file
                    continue
                path = fields[5].rstrip("\n")
                if not path.startswith("/") or path.endswith(" (deleted)"):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end, int(fields[2], 16), path))
        return MappedFiles(spans)

    def region(self, tensor: torch.Tensor) -> FileRegion | None:
        """Where ``tensor``'s elements lie in a file, or ``None`` (not one shared file mapping)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            return None
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        start, end, offset, path = self._spans[i]
        if ptr + nbytes > end:
            return None
        return FileRegion(path, offset + ptr - start, nbytes)


def read(region: FileRegion, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A fresh tensor holding ``region``'s bytes (read from the file, not through a mapping)."""
    out = torch.empty(shape, dtype=dtype)
    view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
    fd = os.open(region.path, os.O_RDONLY)
    try:
        done = 0
        while done < region.nbytes:
            n = os.preadv(fd, [view[done:]], region.offset + done)
            if n <= 0:
                raise OSError(f"{region.path}: {region.nbytes} bytes expected at {region.offset}, "
                              f"the file ends after {done}")
            done += n
    finally:
        os.close(fd)
    return out


def write(region: FileRegion, tensor: torch.Tensor) -> None:
    """Put ``tensor``'s bytes (``region.nbytes`` of them) into ``region`` of its file."""
    data = tensor.detach().contiguous()
    if data.numel() * data.element_size() != region.nbytes:
        raise AssertionError(f"{region}: writing {data.numel() * data.element_size()} bytes")
    view = memoryview(data.view(torch.uint8).reshape(-1).numpy())
    fd = os.open(region.path, os.O_WRONLY)
    try:
        done = 0
        while done < region.nbytes:
            done += os.pwritev(fd, [view[done:]], region.offset + done)
    finally:
        os.close(fd)


def copy_region(region: FileRegion, dst_fd: int, dst_offset: int) -> None:
    """Copy ``region`` into the open file ``dst_fd`` at ``dst_offset``, in the kernel where it can."""
    src = os.open(region.path, os.O_RDONLY)
    try:
        done = 0
        while done < region.nbytes:
            count = region.nbytes - done
            if hasattr(os, "copy_file_range"):
                n = os.copy_file_range(src, dst_fd, count, region.offset + done, dst_offset + done)
            else:  # pragma: no cover - a chunk through user memory
                chunk = os.pread(src, min(count, 1 << 24), region.offset + done)
                n = os.pwrite(dst_fd, chunk, dst_offset + done)
            if n <= 0:
                raise OSError(f"{region.path}: copy stopped {region.nbytes - done} bytes short")
            done += n
    finally:
        os.close(src)


def map_region(region: FileRegion, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> tuple[torch.Tensor, mmap.mmap]:
    """A tensor over a shared mapping of just ``region`` (its storage exactly the tensor's bytes).

    Returns the tensor and its mapping: ``mapping.madvise(mmap.MADV_DONTNEED)``
    lets the pages the tensor was read through go (the file keeps the bytes),
    while the tensor stays valid (it is paged in again if read).
    """
    start = region.offset - region.offset % mmap.PAGESIZE
    fd = os.open(region.path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, region.offset + region.nbytes - start, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    finally:
        os.close(fd)
    numel = region.nbytes // dtype.itemsize
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=region.offset - start)
    return tensor.view(shape), mapping
