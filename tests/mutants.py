"""Known bugs, put back on purpose: the differential test must find each (test-only switches).

Each entry is a context manager that reintroduces one bug fsdp2 once had, by
patching the one line that fixed it; ``test_call_sequences.py`` checks that
random call sequences expose every one of them within a few seeds.
"""

from __future__ import annotations

import contextlib
import types
from unittest import mock

import torch

from fsdp2.optim import default_step, flat_run, state_views, step_engine, step_plan


@contextlib.contextmanager
def new_state_objects():
    """A run publishes new state objects after a load instead of adopting the held ones."""

    def publish(state, param, values):
        state.pop(param, None)
        return state_views.publish(state, param, values)

    with mock.patch.object(flat_run, "publish", publish):
        yield


@contextlib.contextmanager
def nesterov_writes_grads():
    """The C++ loop taken for SGD with nesterov momentum, which adds into ``p.grad``."""
    with mock.patch.object(step_plan, "_foreach_writes_grads", lambda *a: False):
        yield


@contextlib.contextmanager
def fused_tail_across_parameters():
    """Fused kernels handed whole runs: their scalar tail falls on other elements."""
    attach = flat_run.FlatRun.attach

    def whole(self, state, grad, *, per_parameter=False):
        return attach(self, state, grad, per_parameter=False)

    with mock.patch.object(flat_run.FlatRun, "attach", whole):
        yield


@contextlib.contextmanager
def offloaded_closure():
    """``step(closure)`` with the state offloaded stepped before the closure ran (no gradients yet)."""
    with mock.patch.object(step_engine, "has_closure", lambda *a: False):
        yield


class _NeverCompiling:
    """``torch`` as the engine's modules see it, but ``torch.compiler.is_compiling()`` is False."""

    compiler = types.SimpleNamespace(is_compiling=lambda: False, disable=torch.compiler.disable)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def compiled_step_swapped():
    """The engine swaps parameters while Dynamo traces ``step()`` (it no longer steps aside)."""
    with mock.patch.object(step_engine, "torch", _NeverCompiling()), \
            mock.patch.object(default_step, "torch", _NeverCompiling()):
        yield


MUTANTS = {
    "new-state-objects": new_state_objects,
    "nesterov-writes-grads": nesterov_writes_grads,
    "fused-tail": fused_tail_across_parameters,
    "offloaded-closure": offloaded_closure,
    "compiled-step-swapped": compiled_step_swapped,
}
