"""Caches keyed by identity: equal meshes over different process groups never share an entry.

See [Note: Caches keyed by identity] in fsdp2/identity_cache.py. Two
``init_device_mesh`` calls of one layout in one process compare equal but
hold different process groups; an equality-keyed cache (as these were,
``weakref.WeakKeyDictionary``) handed the first one's entry out for the
second while the first was alive, and after a garbage collection only on the
ranks where it had run.
"""

from __future__ import annotations

import gc

import torch
from _multiproc import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fsdp2._torch_compat import dtensor_state_like
from fsdp2.identity_cache import IdentityCache
from fsdp2.runtime.meshes.mesh import reordered_mesh


class _Key:
    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:  # every key equal, as meshes of one layout are
        return isinstance(other, _Key)

    def __hash__(self) -> int:
        return 0


def test_entries_by_identity_live_as_long_as_their_key() -> None:
    cache: IdentityCache[str] = IdentityCache()
    a, b = _Key("a"), _Key("b")
    cache.set(a, "of a")
    assert cache.get(a) == "of a" and cache.get(b) is None  # b == a, yet not a
    cache.set(b, "of b")
    assert (cache.get(a), cache.get(b), len(cache)) == ("of a", "of b", 2)
    del a
    gc.collect()
    assert len(cache) == 1 and cache.get(b) == "of b"


def _equal_meshes(rank: int, world_size: int) -> None:
    first = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    second = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    assert first == second and first.get_group(1) is not second.get_group(1)
    for mesh in (first, second):  # the same ranks' mesh, tp first, over *this* mesh's groups
        flipped = reordered_mesh(mesh, (1, 0))
        assert flipped.get_group(0) is mesh.get_group(1)
        assert flipped.get_group(1) is mesh.get_group(0)
    # optimizer state made like each parameter lives on that parameter's own mesh
    for mesh in (first, second):
        param = DTensor.from_local(torch.zeros(2, 3), mesh["dp"], [Shard(0)])
        state = dtensor_state_like(param, torch.ones(2, 3))
        assert state.device_mesh.get_group(0) is mesh["dp"].get_group(0)


def test_equal_meshes_over_other_groups_keep_their_own_entries() -> None:
    run_ranks(_equal_meshes, 2)
