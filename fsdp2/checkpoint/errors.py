"""The exceptions of ``save_checkpoint``, ``load_checkpoint`` and ``load_latest``.

All are ``Exception`` subclasses: DCP's own ``CheckpointException`` is a
``BaseException`` (``except Exception`` misses it), so it is wrapped, kept as
the ``__cause__``.
"""

from __future__ import annotations

__all__ = ["CheckpointDamagedError", "CheckpointError", "CheckpointLockedError"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (I/O, DCP); raised on every rank."""


class CheckpointDamagedError(CheckpointError, ValueError):
    """A checkpoint's files are missing, truncated or changed since the save; nothing was loaded.

    Also a ``ValueError``, the class an incomplete checkpoint raised before.
    """


class CheckpointLockedError(CheckpointError):
    """Another live job owns the checkpoint root (see ``docs/checkpoints.md``)."""
