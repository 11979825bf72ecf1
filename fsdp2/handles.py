"""The handles of work started with ``async_op=True``: an all-gather, a gradient reduction.

Both are upstream's public classes (``UnshardHandle``, torch 2.15's
``GradientReductionHandle``); users only call ``wait()``. The subclasses that
do the waiting stay private, as upstream's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runtime.group.param_group import FSDPParamGroup
    from .runtime.hooks.state import FSDPState

__all__ = ["GradientReductionHandle", "UnshardHandle"]


class UnshardHandle:
    """A handle on an :meth:`FSDPModule.unshard` all-gather started with ``async_op=True``."""

    def wait(self) -> None:
        """Wait for the all-gather; afterwards the unsharded parameters are registered.

        Optional before the module's forward, which waits by itself.
        """


class _GroupUnshardHandle(UnshardHandle):
    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:  # in group order, as upstream
            group.wait_for_unshard()
        self._groups = []  # do not keep the groups alive


class GradientReductionHandle:
    """A handle on the gradient reduction :meth:`FSDPModule.finalize_backward` started with ``async_op=True``."""

    def wait(self) -> None:
        """Wait for the gradient reduction and end the backward iteration.

        Call it before reading the gradients, stepping the optimizer, or
        running the module again. Raises ``RuntimeError`` if
        :meth:`FSDPModule.reset_iter_state` ran since the handle was returned.
        """


class _RootReductionHandle(GradientReductionHandle):
    def __init__(self, state: FSDPState | None, token: object | None) -> None:
        self._state, self._token = state, token

    def wait(self) -> None:
        if self._state is not None:
            state, self._state = self._state, None
            token, self._token = self._token, None
            state.wait_for_reduction(token)


def group_unshard_handle(groups: list[FSDPParamGroup]) -> UnshardHandle:
    """The handle on the in-flight all-gathers of ``groups`` (empty: nothing to wait for)."""
    return _GroupUnshardHandle(list(groups))


def reduction_handle(state: FSDPState | None, token: object | None) -> GradientReductionHandle:
    """The handle on the reduction ``state.finalize_backward(wait=False)`` started."""
    return _RootReductionHandle(state, token)
