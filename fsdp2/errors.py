"""Exceptions for user mistakes that upstream reports as AssertionError or NotImplementedError.

[Note: Exceptions compatible with upstream]
Code written for ``torch.distributed.fsdp.fully_shard`` catches its
exceptions by class and often matches their messages, so for each mistake
fsdp2 raises an instance of upstream's class whose message starts with
upstream's message; fsdp2's own guidance (the parameter's full name, the
fix) follows it. Upstream reports some user mistakes with ``AssertionError``
(a 2-D mesh without dim names, a shard dim the tensor lacks, ...) or
``NotImplementedError`` (a non-contiguous parameter, uneven sharding on a
dim other than 0, ...), where a ``ValueError`` is the natural class for bad
input. The classes below are both, so ``except AssertionError``, ``except
NotImplementedError`` and ``except ValueError`` all catch them. fsdp2's own
internal invariants still raise a plain ``AssertionError``.
"""

from __future__ import annotations

__all__ = ["FSDPAssertionError", "FSDPNotImplementedError"]


class FSDPAssertionError(AssertionError, ValueError):
    """A user mistake that upstream ``fully_shard`` reports with ``AssertionError``.

    Also a ``ValueError``, the class fsdp2 uses for bad input.
    """


class FSDPNotImplementedError(NotImplementedError, ValueError):
    """An input upstream ``fully_shard`` rejects with ``NotImplementedError``.

    Also a ``ValueError``, the class fsdp2 uses for bad input.
    """
