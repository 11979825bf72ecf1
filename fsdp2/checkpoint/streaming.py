"""Checkpoints of file-backed state, a tensor at a time: DCP planners and the async save's snapshot.

[Note: Streaming file-backed state]
State that lives in files (the optimizer's NVMe tier; see [Note: File-backed
tensors] in ``fsdp2/file_tensors.py``) must not come into memory whole when
a checkpoint is saved or loaded. DCP's own path would bring it in, twice
over: ``FileSystemWriter`` clones every tensor whose storage is larger than
the tensor (each state tensor is a view of its unit's region), and keeps
every tensor it wrote in a dict until the file is written. So:

- ``StreamingSavePlanner.resolve_data`` hands DCP, for a file-backed tensor,
  a tensor over a mapping of exactly its bytes (no clone), and tells the
  kernel to drop the pages of the one it handed before (DCP asks for the next
  tensor once the previous one is written): host memory holds about one
  state tensor of the save, whatever DCP keeps.
- ``StreamingLoadPlanner`` gives DCP a fresh tensor to read each file-backed
  target's bytes into and writes it into the file (``pwrite``) when DCP
  commits it: one tensor at a time, the store's mappings never touched.
- ``snapshot`` (the async save's stage): a file-backed tensor is copied into a
  staging file next to its own (``copy_file_range``, in the kernel: no host
  memory), and the staged value is a mapping of that copy, which the
  background write streams like any other; the staging file is deleted when
  the save ends. Training may step the state meanwhile: the copy is taken
  before ``save_checkpoint`` returns.

Tensors that are not file-backed go through DCP's default path unchanged
(save for a rank's ragged rows, written in pieces: see [Note: Ragged rows in
checkpoints] in ragged_pieces.py).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from .. import file_tensors
from . import ragged_pieces


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner; file-backed tensors are read a tensor at a time, and a
    rank's ragged rows are written in pieces (see [Note: Ragged rows in checkpoints] in
    ragged_pieces.py). Made without plan caching (DCP's ``enable_plan_caching``), as
    ``save_checkpoint`` makes it."""

    def set_up_planner(
        self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._maps = file_tensors.MappedFiles.now()  # the state dict holds what it lists
        self._handed: mmap.mmap | None = None
        self._pieces: dict[Any, ragged_pieces.Piece] = {}  # a piece's index -> its rows

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            for piece_item, piece in ragged_pieces.split(item, self.state_dict.get(item.index.fqn)):
                items.append(piece_item)
                if piece is not None:
                    self._pieces[piece_item.index] = piece
        if self._pieces:
            plan = self.plan = dataclasses.replace(plan, items=items)
        return plan

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)  # a DTensor's whole local chunk, for a piece
        piece = self._pieces.get(write_item.index)
        if piece is not None:
            data = piece.of(data)
        if isinstance(data, torch.Tensor):
            region = self._maps.region(data)
            if region is not None:
                self._drop_previous()
                data, self._handed = file_tensors.map_region(region, data.dtype, data.shape)
        return data

    def _drop_previous(self) -> None:
        if self._handed is not None:
            self._handed.madvise(mmap.MADV_DONTNEED)  # the bytes stay in the file
            self._handed = None


class StreamingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; file-backed targets are written into their files."""

    def set_up_planner(
        self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._maps = file_tensors.MappedFiles.now()
        # data_ptr of a tensor handed out (alive until committed; DCP hands back a detached
        # alias of it, another Python object) -> the target's region
        self._regions: dict[int, file_tensors.FileRegion] = {}

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        target = super().resolve_tensor(read_item)
        region = self._maps.region(target)
        if region is None:
            return target
        fresh = torch.empty(target.shape, dtype=target.dtype)
        self._regions[fresh.data_ptr()] = region
        return fresh

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        region = self._regions.pop(tensor.data_ptr(), None)
        if region is not None:
            file_tensors.write(region, tensor)
        super().commit_tensor(read_item, tensor)


class Snapshot:
    """The async save's staged copies of file-backed tensors, in staging files until ``close``."""

    def __init__(self) -> None:
        self._maps = file_tensors.MappedFiles.now()  # the state being staged holds what it lists
        self._files: dict[str, tuple[int, Path, int]] = {}  # folder -> (fd, path, bytes used)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A staged copy of ``tensor`` if it is file-backed (over a mapping of the copy), else ``None``."""
        region = self._maps.region(tensor)
        if region is None:
            return None
        folder = os.path.dirname(region.path)
        if folder not in self._files:
            path = Path(folder) / f".staged-{uuid.uuid4().hex}.bin"
            self._files[folder] = (os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), path, 0)
        fd, path, used = self._files[folder]
        offset = -(-used // 64) * 64
        file_tensors.copy_region(region, fd, offset)
        self._files[folder] = (fd, path, offset + region.nbytes)
        staged = file_tensors.FileRegion(str(path), offset, region.nbytes)
        return file_tensors.map_region(staged, tensor.dtype, tensor.shape)[0]

    def close(self) -> None:
        """Delete the staging files (mappings still alive keep their pages until freed)."""
        for fd, path, _ in self._files.values():
            os.close(fd)
            path.unlink(missing_ok=True)
        self._files = {}
