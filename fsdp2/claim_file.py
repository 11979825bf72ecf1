"""One live owner per folder: a claim file created with ``O_EXCL``, taken over when its owner is gone.

[Note: Claim files]
Two jobs writing into one folder undo each other's work (a checkpoint root,
an optimizer-state directory). So the first to write *claims* the folder: it
creates a small JSON file with ``O_EXCL`` (exactly one creator wins) holding
who it is (host, pid, the process's start time, a token unique to the
claimer) and whatever else its user wants checked later (``fields``).

A claim found in place is judged by one rule, :func:`owner_status`:

- ``MINE``: our own token (a second save of the same job);
- ``GONE``: same host, and the pid no longer runs, is a zombie, or is a newer
  process that reused the pid (its start time differs); or the file is torn
  (a writer killed mid-``write``). A gone owner's claim is replaced;
- ``LIVE``: same host and that very process still runs;
- ``ELSEWHERE``: another host: it cannot be checked from here, so it counts
  as held and the user's error says to delete the file once that job is gone.

The caller decides what a held claim (or a gone one with the wrong
``fields``) means through ``refuse``, so each user raises its own error class
with its own advice; the rule for life and death is this module's alone.
"""

from __future__ import annotations

import enum
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ClaimFile", "Owner", "OwnerStatus", "owner_status", "start_time"]


class OwnerStatus(enum.Enum):
    MINE = "mine"
    LIVE = "live"
    GONE = "gone"
    ELSEWHERE = "elsewhere"


@dataclass(frozen=True)
class Owner:
    """A claim file's record and how :func:`owner_status` judged it."""

    record: dict[str, Any]
    status: OwnerStatus

    @property
    def host(self) -> Any:
        return self.record.get("host")

    @property
    def pid(self) -> Any:
        return self.record.get("pid")


class ClaimFile:
    """``path`` as this claimer's, while it holds it; ``fields`` are kept in the record."""

    def __init__(self, path: Path, token: str, **fields: Any) -> None:
        self.path = path
        self.token = token
        self._fields = fields
        self.held = False

    def take(self, refuse: Callable[[Owner], Exception | None], attempts: int = 3) -> None:
        """Create the claim; an owner found in place goes to ``refuse`` first.

        ``refuse(owner)`` returns the error to raise, or ``None`` to replace the
        claim, which is allowed only when the owner is ``GONE``: a live or
        unverifiable owner with no error from ``refuse`` is still refused.
        """
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": start_time(os.getpid()), "token": self.token, **self._fields}
        for _ in range(attempts):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                fd = None
            if fd is not None:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
                    f.flush()
                    os.fsync(f.fileno())
                self.held = True
                return
            owner = self.read()
            if owner is None:  # released meanwhile: try again
                continue
            if owner.status is OwnerStatus.MINE:
                self.held = True
                return
            error = refuse(owner)
            if error is not None:
                raise error
            if owner.status is not OwnerStatus.GONE:
                raise RuntimeError(f"{self.path} is held by host {owner.host}, pid {owner.pid}")
            self.path.unlink(missing_ok=True)
        raise RuntimeError(f"could not take the claim file {self.path}: another process "
                           "keeps claiming it")

    def read(self) -> Owner | None:
        """The claim in place, judged; ``None`` if there is none."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            return Owner({}, OwnerStatus.GONE)  # torn write of a killed owner
        return Owner(record, owner_status(record, self.token))

    def release(self) -> None:
        """Remove the claim if it is still this claimer's."""
        if not self.held:
            return
        self.held = False
        try:
            owner = self.read()
        except OSError:
            return
        if owner is not None and owner.status is OwnerStatus.MINE:
            self.path.unlink(missing_ok=True)


def owner_status(record: dict[str, Any], token: str | None = None) -> OwnerStatus:
    """The one rule: whose claim ``record`` is, and whether its process still runs."""
    if token is not None and record.get("token") == token:
        return OwnerStatus.MINE
    if record.get("host") != socket.gethostname():
        return OwnerStatus.ELSEWHERE if record.get("host") else OwnerStatus.GONE
    pid = record.get("pid")
    if not isinstance(pid, int):
        return OwnerStatus.GONE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return OwnerStatus.GONE
    except PermissionError:
        pass  # alive, another user's
    started = start_time(pid)
    if started is None and os.path.isdir("/proc/self"):
        return OwnerStatus.GONE  # a zombie (or gone since the kill above)
    if record.get("started") is not None and started is not None and started != record["started"]:
        return OwnerStatus.GONE  # the pid was reused by a newer process
    return OwnerStatus.LIVE


def start_time(pid: int) -> int | None:
    """The process's start time (Linux ``/proc``); ``None`` if gone, a zombie or unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # killed, not yet reaped: gone
        return None
    return int(fields[19])
