"""DCP's file writer, recording each file's size and checksum as it writes the bytes.

[Note: Checksums while writing]
The manifest of [Note: Checkpoint integrity] needs every file's checksum. Read
back after the write, that is a second pass over every byte the save wrote,
inside the save's stall. Here the file system DCP's ``FileSystemWriter``
writes through wraps each stream it opens for writing: every ``write`` also
extends the file's checksum (``crc.DEFAULT``), so the sums are ready when the last byte is written
and no byte is read again. DCP writes each file front to back (``tell`` for
offsets, no ``seek``); a stream that seeks after all, or a file this writer
did not write, is summed from disk as before (``integrity.checksum``), so a
sum is never wrong, only sometimes not free. ``.metadata`` is written to a
temporary name and renamed: the sum follows the rename.

Beneath the sums, each file's write to the disk starts every few megabytes,
so DCP's closing ``fsync`` waits for the tail only (see [Note: Early
write-back] in writeback.py).

[Note: Committing inside DCP's last step]
A save's stall ends when DCP's last collective does: every rank's write
results reach the coordinator, which writes ``.metadata`` (``finish``), and
the outcome goes back to every rank. The manifest needs every rank's sums
and the commit (the rename) needs every rank's files written, which is
exactly what the coordinator knows at that point. So each rank's sums ride
with its write results (one extra ``WriteResult`` under a name no state dict
has, taken out again before DCP builds the metadata from them), and
``on_finish`` runs on the coordinator right after ``.metadata`` is written:
the manifest and the commit, inside DCP's own collective. An error there
reaches every rank as DCP's ``CheckpointException``, as a failed write does;
no collective of fsdp2's own follows the write.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from . import crc
from .writeback import WritebackFileSystem, WritebackWriter

__all__ = ["SummingWriter"]


class _SummingStream:
    """A writable stream that sums what passes through it; anything else goes to ``raw``."""

    def __init__(self, raw: Any, extend: Any) -> None:
        self._raw = raw
        self._extend = extend
        self.crc = self.size = 0
        self.in_order = True

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        view = memoryview(data).cast("B")
        if written is not None and written != len(view):
            view = view[:written]
        self.crc = self._extend(view, self.crc)
        self.size += len(view)
        return written

    def seek(self, *args: Any) -> int:
        self.in_order = False  # (the sum no longer describes the file)
        return self._raw.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _SummingFileSystem(WritebackFileSystem):
    """DCP's local file system, keeping ``{file name: (size, checksum)}`` of the files it wrote
    (and starting their disk writes early, as :class:`WritebackFileSystem` does)."""

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self._extend = crc.extender(algorithm)
        self.sums: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()  # (DCP may write files from several threads)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "r" in mode and "+" not in mode:
            with super().create_stream(path, mode) as raw:
                yield raw
            return
        with super().create_stream(path, mode) as raw:
            stream = _SummingStream(raw, self._extend)
            yield stream
        with self._lock:
            if stream.in_order and "a" not in mode:
                self.sums[Path(path).name] = (stream.size, stream.crc)
            else:
                self.sums.pop(Path(path).name, None)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.sums:
                self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        with self._lock:
            self.sums.pop(Path(path).name, None)


# The write result that carries a rank's sums to the coordinator (no state dict key is this).
_SUMS = "__fsdp2_file_sums__"

# What the coordinator's ``on_finish`` gets: each rank's ``(algorithm, {file: [size, sum]})``.
RankSums = list[tuple[str, dict[str, list[int]]]]


class SummingWriter(WritebackWriter):
    """``FileSystemWriter`` whose ``sums()`` are the size and checksum of each file it wrote.

    ``on_finish(sums)``: run on the coordinator once ``.metadata`` is written,
    with every rank's sums, its own ``.metadata`` included (see [Note:
    Committing inside DCP's last step]).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        on_finish: Callable[[RankSums], None] | None = None,
        **kwargs: Any,
    ) -> None:
        self.algorithm = crc.DEFAULT
        self._summing = _SummingFileSystem(self.algorithm)
        self._on_finish = on_finish
        super().__init__(path, file_system=self._summing, **kwargs)

    def sums(self) -> dict[str, list[int]]:
        """``{file name: [size, checksum]}``, as the checksum manifest keeps them."""
        with self._summing._lock:
            return {name: [size, crc] for name, (size, crc) in self._summing.sums.items()}

    def write_data(self, plan: Any, planner: Any) -> Any:
        def with_sums(written: Any) -> list[WriteResult]:
            carrier = WriteResult(index=MetadataIndex(_SUMS), size_in_bytes=0,
                                  storage_data=(self.algorithm, self.sums()))
            return [*written.value(), carrier]

        return super().write_data(plan, planner).then(with_sums)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        carried = [r.storage_data for rank in results for r in rank if r.index.fqn == _SUMS]
        super().finish(metadata, [[r for r in rank if r.index.fqn != _SUMS] for rank in results])
        if self._on_finish is not None:
            self._on_finish([*carried, (self.algorithm, self.sums())])
