"""One job per checkpoint root: a claim file taken at the job's first save.

[Note: Checkpoint root claims]
Two jobs saving into one root undo each other: each removes the other's
``.step-N.partial`` as a leftover, prunes the other's steps, and commits
over the same names. So rank 0 claims the root at its job's first save,
before anything is written: it creates ``.fsdp2-owner.json`` (host, pid, the
process's start time, a random token) with ``O_EXCL``, which exactly one
creator wins. A root claimed by another live job is a
:class:`CheckpointLockedError` on every rank (the other ranks learn it in
the same :func:`~fsdp2.checkpoint.step_dirs.agree` as the rest of the
preparation). A claim is stale, and replaced, when its process is gone: same
host, and the pid no longer runs (or is a zombie, or is a newer process that
reused the pid: its start time differs). A claim from another host cannot be
checked from here: its error says to remove the file once that job is gone.
The owner removes its claim when it exits normally.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import uuid
from pathlib import Path

from .errors import CheckpointLockedError

CLAIM = ".fsdp2-owner.json"

_token = uuid.uuid4().hex
_claimed: set[Path] = set()


def claim(root: Path) -> None:
    """Rank 0, before its first write into ``root``: make this job the root's owner."""
    root = root.resolve()
    if root in _claimed:
        return
    path = root / CLAIM
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid()),
          "token": _token}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            owner = _read(path)
            if owner is not None and owner.get("token") == _token:
                break
            if owner is not None and not _stale(owner):
                raise CheckpointLockedError(
                    f"{root} belongs to another job that is still running (host "
                    f"{owner.get('host')}, pid {owner.get('pid')}; claim file {path}). Save "
                    "to another root; if that job is gone (e.g. it ran on another host), "
                    "delete the claim file"
                ) from None
            path.unlink(missing_ok=True)  # stale (or torn): the owner is gone
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        break
    else:
        raise CheckpointLockedError(f"{root}: could not take the claim file {path}")
    _claimed.add(root)


def _read(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {"token": None, "host": "?", "pid": None}  # released meanwhile: retry
    except ValueError:
        return None  # torn write of a killed owner
    return value if isinstance(value, dict) else None


def _stale(owner: dict) -> bool:
    if owner.get("pid") is None and owner.get("token") is None:
        return True
    if owner.get("host") != socket.gethostname():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    started = _start_time(pid)
    return started is None and _is_linux() or (
        owner.get("started") is not None and started != owner.get("started")
    )


def _start_time(pid: int) -> int | None:
    """The process's start time (Linux ``/proc``), ``None`` if gone, a zombie or unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # killed, not yet reaped: gone
        return None
    return int(fields[19])


def _is_linux() -> bool:
    return os.path.isdir("/proc/self")


def _forget_in_child() -> None:
    # A forked process is another job's rank (or a test's): its own token, no claims.
    global _token
    _token = uuid.uuid4().hex
    _claimed.clear()


@atexit.register
def _release() -> None:
    for root in _claimed:
        path = root / CLAIM
        owner = _read(path)
        if owner is not None and owner.get("token") == _token:
            path.unlink(missing_ok=True)


os.register_at_fork(after_in_child=_forget_in_child)
