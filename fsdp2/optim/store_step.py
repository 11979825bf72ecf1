"""The store strategy of the step engine: units stepped one by one on a host or disk tier.

``StoreStep`` owns what the unit-by-unit step needs between steps: the
units (cut once, from the same flat runs the in-memory step uses:
``plan_units`` in step_plan.py), the tier that holds their state
(state_store.py), which state tensors each unit last published, and whether
a failed step left the state half stepped. ``step`` runs the units (see
[Note: Stepping in units] in unit_step.py), ``load`` copies a loaded state
into the tier, ``close`` brings it back into ordinary memory. The engine
(step_engine.py) tells it the optimizer at each call; it reaches back to
nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import unit_step
from .state_store import DiskStore, StateTier, release_free_heap
from .state_views import publish, same_objects, unwrap
from .step_plan import Unit


class StoreStep:
    """The units of ``optimizer``'s param groups, stepped on ``tier``'s state views.

    ``copies``: the host tier steps host copies of parameters that live on
    an accelerator (``unit_step.params_on_accelerator``).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, units: list[Unit], tier: StateTier, copies: bool
    ) -> None:
        self.units = units
        self.tier = tier
        self.copies = copies
        # the units hold the state of the parameters planned here, no others
        self._planned = _param_ids(optimizer)
        self._half_stepped: int | None = None  # the unit a failed step stopped at
        self._failure = ""
        # each unit's state tensors as last published (``unit_step.held``), by identity
        self._published: list[list | None] = [None] * len(units)
        self._in_place: Any = None  # the tier's in-place test during a step, made on demand

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step every unit (the optimizer's own step then gets empty groups)."""
        if self._half_stepped is not None:
            raise RuntimeError(
                f"The optimizer state is half stepped: an earlier step failed at unit "
                f"{self._half_stepped} of {len(self.units)} ({self._failure}), so some units "
                "stepped and others did not; load a checkpoint (model and optimizer) before "
                "stepping again"
            )
        if self._planned != _param_ids(optimizer):
            raise ValueError(
                f"{type(optimizer).__name__}'s parameters changed after "
                "enable_local_shard_step(offload=...) planned where their state lives (a param "
                "group added, or a group's parameter list edited): call remove() on its handle "
                "and enable_local_shard_step again, or add the param groups before enabling it"
            )
        state, tier = optimizer.state, self.tier
        disk = isinstance(tier, DiskStore)
        i, begun, clean = 0, False, False
        self._in_place = None
        try:  # See [Note: Overlapping the disk with the step] in state_store.py
            tier.prefetch(0)  # read during backward by the last step's end, or now
            for i, unit in enumerate(self.units):
                tier.prefetch(i + 1)  # read while this unit steps
                self._load_replaced(i, unit, state)
                views = tier.views(i)
                begun = True
                try:
                    unit_step.step_unit(
                        optimizer, unit, views, state, self.copies, tier.live.hold
                    )
                except Exception:
                    # The optimizer raised in its group's first unit: torch checks a group
                    # before it changes anything (Adam with amsgrad turned on mid-training
                    # has no 'max_exp_avg_sq'), so whole groups stepped and the rest did not,
                    # as the optimizer's own loop over its groups leaves them.
                    clean = i == 0 or self.units[i - 1].group != unit.group
                    raise
                del views  # the mapping it stepped on goes (the store keeps a fresh one)
                if disk:
                    # What the unit's kernels allocated (and the state a first step created
                    # before it moved to disk) is freed, but glibc keeps such blocks in its
                    # heap, resident, and they pile up unit after unit: hand them back now.
                    release_free_heap()
                unit_step.keep(unit, tier.release(i), state)
                self._published[i] = unit_step.held(unit, state)
            tier.prefetch(0)  # the next step's first unit, read during forward and backward
        except BaseException as e:
            if begun and not clean:  # some units may have stepped: no later step builds on it
                self._half_stepped, self._failure = i, f"{type(e).__name__}: {e}"
            raise

    def load(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``load_state_dict``: the loaded state copied into the tier, unit by unit."""
        state, tier = optimizer.state, self.tier
        in_place = tier.in_place_test()
        for i, unit in enumerate(self.units):
            test = functools.partial(in_place, i)
            if not self._reusable(i, unit, state, test):
                tier.renew(i)  # a state dict taken before the load keeps what it showed
                test = None
            unit_step.load_unit(unit, tier.views(i), state, self.copies, test)
            unit_step.keep(unit, tier.release(i), state)
            self._published[i] = unit_step.held(unit, state)
        tier.wait()
        self._half_stepped = None  # every unit holds the loaded state now

    def close(self, optimizer: torch.optim.Optimizer) -> None:
        """State in files comes back into ordinary memory; the tier is released."""
        if isinstance(self.tier, DiskStore):
            state = optimizer.state
            for unit in self.units:
                for i, p in enumerate(unit.params):
                    if p in state:
                        publish(state, p, {
                            k: v.clone() if k in unit.keys[i] else v
                            for k, v in unwrap(state[p]).items()
                        })
        self.tier.close()

    def _load_replaced(self, i: int, unit: Unit, state: dict) -> None:
        """A state tensor of the unit replaced by a caller's own (``state[p][k] = t``): the
        unit gets fresh storage, loaded from ``state``.

        As in torch, the replacing tensor is stepped from now on and the replaced
        one, wherever it is held, keeps its values: it stays on the old storage,
        and the tensors ``state`` holds adopt the new (``publish``).
        Every step asks; the answer is one identity check per state tensor, and
        only where an object changed is its memory looked at (a disk tier reads
        the process's mappings for that).
        """
        published = self._published[i]
        if published is not None and same_objects(published, unit_step.held(unit, state)):
            return
        if self._in_place is None:  # one per step, until a renewal
            self._in_place = self.tier.in_place_test()
        if self._reusable(i, unit, state, functools.partial(self._in_place, i)):
            return
        self.tier.renew(i)
        self._in_place = None
        unit_step.load_unit(unit, self.tier.views(i), state, self.copies)

    def _reusable(self, i: int, unit: Unit, state: dict, in_place: Any) -> bool:
        """Whether unit ``i`` may go on in the tier's memory it has: ``state`` holds only
        values already there, and every tensor it published last still holds one.

        A published tensor ``state`` no longer holds (a load or a caller dropped its
        parameter's state, or the key) is the caller's now: in torch it keeps its
        values, while the unit's memory would be written by the parameter's next
        first step. So the unit then moves to fresh memory and the dropped tensor
        stays on the old.
        """
        published = self._published[i]
        if published is not None:
            now = {id(t) for t in unit_step.held(unit, state) if t is not None}
            if any(t is not None and id(t) not in now for t in published):
                return False
        return unit_step.loaded_in_place(unit, state, in_place)


def _param_ids(optimizer: torch.optim.Optimizer) -> list[tuple[int, ...]]:
    return [tuple(map(id, g["params"])) for g in optimizer.param_groups]
