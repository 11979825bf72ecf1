"""Which groups share an arena: those of one set of process groups (see [Note: Arenas]).

The storage layer (runtime/storage/arena.py) lays buffers out; this module
picks the buffers, since only a group knows its meshes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..storage import arena
from .param_group import FSDPParamGroup


def join_arenas(groups: list[FSDPParamGroup], fresh_only: bool = False) -> None:
    """Move ``groups``' buffers into arenas, one per set of process groups and kind.

    ``fresh_only``: only buffers an adoption re-allocated that nobody has seen
    yet (lazy init); see [Note: Arenas] for why only then.
    """
    for members in _by_meshes(groups).values():
        flats = [g.flat_shard for g in members if not fresh_only or g.flat_shard.fresh]
        arena.join(flats)
    for g in groups:
        g.flat_shard.fresh = False


def materialize_in_arenas(groups: list[FSDPParamGroup], device: torch.device) -> set[nn.Parameter]:
    """``to_empty`` for ``groups``: one uninitialized allocation per set of process groups
    and kind; returns the parameters placed (the others take ``nn.Module.to_empty``'s path)."""
    placed: set[nn.Parameter] = set()
    for members in _by_meshes(groups).values():
        for g in members:
            g.reshard()
        placed |= arena.materialize([g.flat_shard for g in members], torch.device(device))
        for g in members:
            g.layout_changed()
    return placed


def _by_meshes(groups: list[FSDPParamGroup]) -> dict[tuple, list[FSDPParamGroup]]:
    by_meshes: dict[tuple, list[FSDPParamGroup]] = {}
    for g in groups:
        info = g.mesh_info
        key = (id(info.shard_process_group), id(info.replicate_process_group), g.device)
        by_meshes.setdefault(key, []).append(g)
    return by_meshes
