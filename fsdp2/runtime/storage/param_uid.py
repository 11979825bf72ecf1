"""``original_uid``: the number that names a parameter for good, across ``fully_shard`` calls.

The lazy-init check of shared parameters reads it ([Note: A parameter belongs
to one group] in ``hooks/shared_params.py``); ``FSDPParam`` sets it.
"""

from __future__ import annotations

import itertools

import torch.nn as nn

ORIG_UID_ATTR = "_fsdp2_orig_uid"
_uids = itertools.count()


def original_uid(param: nn.Parameter) -> int:
    """A number naming ``param`` for good, set on it the first time FSDP manages it.

    Sharding replaces the parameter on its modules, so the object itself
    cannot tell later calls that they shard the same parameter again (see
    [Note: A parameter belongs to one group] in ``hooks/shared_params.py``).
    """
    uid = param.__dict__.get(ORIG_UID_ATTR)
    if uid is None:
        uid = next(_uids)
        setattr(param, ORIG_UID_ATTR, uid)
    return uid
