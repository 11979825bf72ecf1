"""Where checkpoints live on disk, and the commit that makes one visible.

[Note: Atomic checkpoints]
DCP writes a checkpoint as one file per rank plus ``.metadata``, which rank 0
writes last, after every rank has reported its writes. A job killed during a
save leaves some of those files behind, and if the save went into the
directory of the previous checkpoint, that one is gone too. So nothing is
written under its final name:

1. rank 0 creates the root and removes ``.NAME.partial``, the leftover of an
   earlier killed save of the same name, if any;
2. every rank writes into ``.NAME.partial`` (DCP returns on rank 0 only after
   every rank's files and the metadata are written);
3. rank 0 renames it to ``NAME`` (one ``rename``: atomic on POSIX
   filesystems) and fsyncs the root; with ``keep``, it then deletes the
   oldest complete steps beyond ``keep`` and the leftovers of older steps.

A directory named ``step-N`` is therefore complete, and loaders never look at
``.partial`` ones. Re-saving a name that exists moves the old one aside
(``.NAME.old``) just before the rename and deletes it after; pruning renames a
step to ``.NAME.deleting`` before deleting its files, so no step is ever
seen half-deleted under its name. A second job in the same root would still
undo all this (it removes the first's ``.partial`` as a leftover), so the
first save also claims the root (see [Note: Checkpoint root claims] in
``claim.py``).

Rank 0 makes every change to the directory tree (the root is shared by all
ranks, as DCP needs anyway to load at another world size). The other ranks
learn the outcome in the same collective (:func:`agree`): a failure is one
error, raised on every rank, never a hang.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from .claim import claim
from .errors import CheckpointError
from .integrity import METADATA

_STEP = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^\.step-(\d+)\.(partial|old|deleting)$")

_T = TypeVar("_T")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The directory of step ``step`` under ``root``."""
    return Path(root) / f"step-{step}"


def partial_dir(final: Path) -> Path:
    """Where the checkpoint that becomes ``final`` is written."""
    return final.parent / f".{final.name}.partial"


def complete_steps(root: str | os.PathLike) -> list[int]:
    """The steps under ``root`` with a complete checkpoint, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        match = _STEP.match(name)
        if match and os.path.isfile(os.path.join(root, name, METADATA)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def agree(
    what: str, key: Any, action: Callable[[], _T], group: Any = None, hint: str = ""
) -> _T:
    """Run ``action`` on rank 0 of ``group``; every rank returns its result or raises its error.

    Collective: every rank also contributes ``key`` (the arguments that must
    match, e.g. the step), and a mismatch is a ``ValueError`` on every rank.
    An error of ``action`` is a :class:`CheckpointError` (a ``RuntimeError``;
    its own class if it was one) on every rank: ``what``, the error, then
    ``hint`` (how to fix it).
    """
    outcome: tuple[str, Any] | None = None
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank(group) == 0:
        try:
            outcome = ("ok", action())
        except Exception as exc:  # noqa: BLE001 - sent to every rank below
            cls = type(exc) if isinstance(exc, CheckpointError) else CheckpointError
            outcome = ("error", (cls, f"{type(exc).__name__}: {exc}"))
    if not distributed:
        gathered = [(key, outcome)]
    else:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (key, outcome), group=group)
    keys = [k for k, _ in gathered]
    if any(k != keys[0] for k in keys):
        listed = ", ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
        raise ValueError(f"{what}: the ranks passed different arguments ({listed}); "
                         "every rank must make the same call")
    status, value = gathered[0][1]
    if status == "error":
        cls, text = value
        raise cls(f"{what}: {text}{hint}")
    return value


def prepare(final: Path, owned_root: bool = False) -> None:
    """Rank 0, before the write: the root exists (claimed if ``owned_root``), no leftover remains."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if owned_root:
        claim(final.parent)
    for leftover in (partial_dir(final), _old_dir(final)):
        if leftover.exists():
            shutil.rmtree(leftover)
    if not os.access(final.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{final.parent} is not writable")


def commit(final: Path, keep: int | None) -> None:
    """Rank 0, after the write: ``final`` appears whole; older steps beyond ``keep`` go."""
    partial, old = partial_dir(final), _old_dir(final)
    if not (partial / METADATA).is_file():
        raise FileNotFoundError(f"{partial / METADATA} is missing after the write")
    if final.exists():
        os.replace(final, old)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
    if keep is not None:
        _prune(final.parent, keep)


def discard(final: Path) -> None:
    """Rank 0, after a failed write: free what the partial folder holds (a full disk needs it)."""
    shutil.rmtree(partial_dir(final), ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    steps = complete_steps(root)
    for step in steps[:-keep]:
        doomed = root / f".step-{step}.deleting"
        shutil.rmtree(doomed, ignore_errors=True)  # a killed prune's leftover
        try:
            os.replace(step_dir(root, step), doomed)  # gone from view at once, then deleted
        except FileNotFoundError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
    # Leftovers of saves killed before the newest complete step: no save of
    # theirs is in flight (one at a time), and none would ever be loaded.
    newest = steps[-1] if steps else -1
    for name in os.listdir(root):
        match = _LEFTOVER.match(name)
        if match and int(match.group(1)) < newest:
            shutil.rmtree(root / name, ignore_errors=True)


def _old_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.old"


def _fsync_dir(path: Path) -> None:
    # The rename itself must reach the disk, not only the files it names.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
