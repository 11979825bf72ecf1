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
   filesystems) and fsyncs the root; with ``keep``, it then renames the
   oldest complete steps beyond ``keep`` out of view and deletes them, and
   the leftovers of older steps, on a background thread (training does not
   wait for a filesystem to free gigabytes; the next commit waits for it).

A directory named ``step-N`` is therefore complete, and loaders never look at
``.partial`` ones. Re-saving a name that exists moves the old one aside
(``.NAME.old``) just before the rename and deletes it after; pruning renames a
step to ``.NAME.deleting`` before deleting its files, so no step is ever
seen half-deleted under its name. A second job in the same root would still
undo all this (it removes the first's ``.partial`` as a leftover), so the
first save also claims the root (see [Note: Checkpoint root claims]).

Rank 0 makes every change to the directory tree (the root is shared by all
ranks, as DCP needs anyway to load at another world size). The other ranks
learn the outcome in the same collective (``fsdp2.agree``): a failure is one
error, raised on every rank, never a hang.

[Note: Checkpoint root claims]
Rank 0 claims the root at its job's first save, before anything is written:
``.fsdp2-owner.json``, a claim file (see [Note: Claim files] in
``fsdp2/claim_file.py``, which also decides when an old claim's job is
gone). A root claimed by another live job is a :class:`CheckpointLockedError`
on every rank (the other ranks learn it in the same agreement (``fsdp2.agree``) as the rest
of the preparation); a gone job's claim is replaced. The token is the
process's: every save of one job is the same owner, and a forked process is
another job. The owner removes its claims when it exits normally.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import threading
import uuid
from pathlib import Path

from ..claim_file import ClaimFile, Owner, OwnerStatus
from .errors import CheckpointLockedError
from .integrity import METADATA

CLAIM = ".fsdp2-owner.json"
_STEP = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^\.step-(\d+)\.(partial|old|deleting)$")



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


def claim_root(root: Path) -> None:
    """Rank 0, before its first write into ``root``: make this job the root's owner."""
    root = root.resolve()
    if root in _claims:
        return
    claim = ClaimFile(root / CLAIM, _token)
    claim.take(lambda owner: _locked(root, claim.path, owner))
    _claims[root] = claim


def _locked(root: Path, path: Path, owner: Owner) -> CheckpointLockedError | None:
    if owner.status is OwnerStatus.GONE:
        return None
    return CheckpointLockedError(
        f"{root} belongs to another job that is still running (host {owner.host}, pid "
        f"{owner.pid}; claim file {path}). Save to another root; if that job is gone (e.g. it "
        "ran on another host), delete the claim file"
    )


# One token per process: every save of a job is the same owner (see [Note: Checkpoint root claims]).
_token = uuid.uuid4().hex
_claims: dict[Path, ClaimFile] = {}


def _forget_in_child() -> None:
    # A forked process is another job's rank (or a test's): its own token, no claims.
    global _token
    _token = uuid.uuid4().hex
    _claims.clear()


@atexit.register
def _release_claims() -> None:
    for claim in _claims.values():
        claim.release()


os.register_at_fork(after_in_child=_forget_in_child)


def prepare(final: Path, owned_root: bool = False) -> None:
    """Rank 0, before the write: the root exists (claimed if ``owned_root``), no leftover remains."""
    _wait_for_deletions()  # (the space the last pruning frees is there for this write)
    final.parent.mkdir(parents=True, exist_ok=True)
    if owned_root:
        claim_root(final.parent)
    for leftover in (partial_dir(final), _old_dir(final)):
        if leftover.exists():
            shutil.rmtree(leftover)
    if not os.access(final.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{final.parent} is not writable")


def commit(final: Path, keep: int | None) -> None:
    """Rank 0, after the write: ``final`` appears whole; older steps beyond ``keep`` go."""
    _wait_for_deletions()
    partial, old = partial_dir(final), _old_dir(final)
    if not (partial / METADATA).is_file():
        raise FileNotFoundError(f"{partial / METADATA} is missing after the write")
    if final.exists():
        os.replace(final, old)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    doomed = [old] if old.exists() else []
    if keep is not None:
        doomed += _prune(final.parent, keep)
    if doomed:
        _delete_later(doomed)


def discard(final: Path) -> None:
    """Rank 0, after a failed write: free what the partial folder holds (a full disk needs it)."""
    _wait_for_deletions()
    shutil.rmtree(partial_dir(final), ignore_errors=True)


def _prune(root: Path, keep: int) -> list[Path]:
    """Steps beyond ``keep``, renamed out of view, and older leftovers: what to delete."""
    steps = complete_steps(root)
    doomed = []
    for step in steps[:-keep]:
        gone = root / f".step-{step}.deleting"
        shutil.rmtree(gone, ignore_errors=True)  # a killed prune's leftover
        try:
            os.replace(step_dir(root, step), gone)  # gone from view at once, then deleted
        except FileNotFoundError:
            continue
        doomed.append(gone)
    # Leftovers of saves killed before the newest complete step: no save of
    # theirs is in flight (one at a time), and none would ever be loaded.
    newest = steps[-1] if steps else -1
    for name in os.listdir(root):
        match = _LEFTOVER.match(name)
        if match and int(match.group(1)) < newest and root / name not in doomed:
            doomed.append(root / name)
    return doomed


_deleting: threading.Thread | None = None


def _delete_later(paths: list[Path]) -> None:
    """Delete ``paths`` (out of view under leftover names) on a background thread.

    Deleting a step can take longer than writing one took to commit (139 ms
    for 360 MB here). A normal exit waits for it; a killed process leaves the
    rest to the next save's pruning, which deletes leftovers of older steps.
    """
    global _deleting

    def delete() -> None:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)

    _deleting = threading.Thread(target=delete, name="fsdp2-checkpoint-prune", daemon=True)
    _deleting.start()


def _wait_for_deletions() -> None:
    """The previous commit's deletions are done (their space is free again)."""
    if _deleting is not None:
        _deleting.join()


atexit.register(_wait_for_deletions)


def _old_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.old"


def _fsync_dir(path: Path) -> None:
    # The rename itself must reach the disk, not only the files it names.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
