"""A cache keyed by an object's identity, which forgets an entry when its object goes.

[Note: Caches keyed by identity]
``weakref.WeakKeyDictionary`` finds keys by ``==``. Two ``DeviceMesh``
objects of one layout are equal even over different process groups (a
second ``init_device_mesh`` in one process: tests, a re-initialized job),
and so are two ``DTensorSpec`` objects on them: an equality-keyed cache hands
one mesh's entry out for the other, and which entry a rank gets back depends
on whether the garbage collector has freed the older object there yet, which
differs between ranks. DTensors made from such an entry then name different
process groups on different ranks, and their next collective mismatches (a
hang on NCCL). ``IdentityCache`` hands out only what was stored for the very
object asked about.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class IdentityCache(Generic[V]):
    """``key -> value`` by ``key``'s identity; an entry lives as long as its key."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, key: Any) -> V | None:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else None

    def set(self, key: Any, value: V) -> V:
        at = id(key)

        def forget(ref: weakref.ref, at: int = at) -> None:
            entry = self._entries.get(at)
            if entry is not None and entry[0] is ref:
                del self._entries[at]

        self._entries[at] = (weakref.ref(key, forget), value)
        return value

    def __len__(self) -> int:
        return len(self._entries)
