"""The same outcome on every rank: one rank's error is every rank's error, never a hang.

[Note: Agreeing on an outcome]
Work that one rank may fail at (a directory to create, files to reserve, a
checkpoint to commit) is followed by collectives on every rank. If the rank
that failed simply raised, the others would wait for it in the next
collective forever. So such work runs through :func:`agree`: the action runs
(on rank 0 only, or on every rank), each rank's outcome is all-gathered
(one small object collective), and then every rank returns, or every rank
raises the first failing rank's error, in the same words. Ranks whose own
action succeeded give back what it made (``undo``) before raising.

Every rank also contributes ``key``, the arguments that must match (a
checkpoint's step, say): ranks that disagree get a ``ValueError`` each
instead of work on different arguments.

The lazy-init check that every rank shards the same model
(``runtime/hooks/divergence.py``) agrees through the process group's store instead,
since it runs before any collective may be trusted; it raises by the same
rule (the first failing rank's error, named, on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["agree"]

_T = TypeVar("_T")


def agree(
    what: str,
    action: Callable[[], _T],
    *,
    every_rank: bool = False,
    key: Any = None,
    group: Any = None,
    error_type: type[Exception] = RuntimeError,
    hint: str = "",
    undo: Callable[[_T], None] | None = None,
) -> _T:
    """Run ``action`` (rank 0 of ``group``, or ``every_rank``); return, or raise on every rank.

    Collective over ``group`` when a process group is initialized. An error
    keeps its class where it is an ``error_type`` and becomes one otherwise;
    its message is ``what``, the failing rank (when several ran), the error,
    then ``hint``. The value returned is rank 0's, or each rank's own with
    ``every_rank``.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    outcome: tuple[bool, Any] | None = None
    if every_rank or rank == 0:
        try:
            outcome = (True, action())
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            cls = type(exc) if isinstance(exc, error_type) else error_type
            outcome = (False, (cls, f"{type(exc).__name__}: {exc}"))
    if distributed:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        # Only rank 0's value travels when it alone ran; each rank keeps its own otherwise.
        shared = outcome if not every_rank or not outcome[0] else (True, None)
        dist.all_gather_object(gathered, (key, shared), group=group)
    else:
        gathered = [(key, outcome)]
    keys = [k for k, _ in gathered]
    failed = [(r, o[1]) for r, (_, o) in enumerate(gathered) if o is not None and not o[0]]
    if failed and undo is not None and outcome is not None and outcome[0]:
        undo(outcome[1])
    if any(k != keys[0] for k in keys):
        listed = ", ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
        raise ValueError(f"{what}: the ranks passed different arguments ({listed}); "
                         "every rank must make the same call")
    if failed:
        first, (cls, text) = failed[0]
        where = f"rank {first}: " if every_rank and len(gathered) > 1 else ""
        raise cls(f"{what}: {where}{text}{hint}")
    return outcome[1] if every_rank else gathered[0][1][1]
