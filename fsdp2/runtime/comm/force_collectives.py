"""A test switch: shard groups of one rank run the full collective path.

[Note: Forcing collectives on one rank]
A shard group of one rank has nothing to communicate, so fsdp2 takes
shortcuts there: the unsharded parameter aliases the shard (no all-gather, no
copy-out; ``FSDPParamGroup.unshard``), a staged all-gather (custom comm,
extensions) skips its collective (``staged_collectives.all_gather``), a custom
all-gather comm is not called at all, and the mean over one rank is taken to
be the gradient itself (no reduce-scatter input, no collective, no custom
reduce-scatter comm; ``GradientReduction.reduce_scatter``). HSDP's
all-reduce and the copy-in (mixed precision casts, CPU offload) have no
shortcut: they run at any size.

With ``FSDP2_FORCE_COLLECTIVES=1`` in the environment when ``fully_shard``
builds a group, that group takes none of these shortcuts: a one-rank group
(the whole world of a single-process run, or a one-rank shard dim) issues
every all-gather and reduce-scatter, with the same buffers, copies, streams
and events as a group of several ranks. Results are the same either way; the
switch exists so that one process (CPU tests, a single GPU with a one-rank
NCCL group) can exercise the code that otherwise runs only with two or more
ranks per shard group. It costs speed and memory, so leave it off in training.
"""

from __future__ import annotations

import os

ENV_VAR = "FSDP2_FORCE_COLLECTIVES"


def collectives_forced() -> bool:
    """Whether ``FSDP2_FORCE_COLLECTIVES`` asks one-rank shard groups to communicate.

    Read when a group is built (``fully_shard``); ``1``, ``true``, ``yes`` or
    ``on`` (any case) turn it on.
    """
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def skips_collectives(shard_size: int) -> bool:
    """Whether a shard group of ``shard_size`` ranks may skip its collectives (one rank, not forced)."""
    return shard_size == 1 and not collectives_forced()
