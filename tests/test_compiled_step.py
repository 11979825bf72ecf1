"""``torch.compile`` around ``optimizer.step()`` with the flat step on by default: upstream's bits.

A compiled step is traced as torch's own step on the DTensors (the engine
steps aside while Dynamo traces, see [Note: Calls the engine steps aside for]
in fsdp2/optim/step_engine.py); the eager steps around it stay flat and
rebuild their runs from the state the compiled step wrote (see [Note: State
the run did not write] in flat_run.py). Each case runs fsdp2 and upstream's
``fully_shard`` side by side and compares every parameter after every step.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from _impl import IMPL
from checks import assert_same_optimizer_state, assert_same_params, check_case, persistent_cache_dir
from models import build_mlp, cpu_mesh, mlp_batch, mlp_loss, rank_slice, shard_mlp

import fsdp2
from fsdp2.optim import flat_step_engine

pytestmark = pytest.mark.skipif(IMPL == "torch", reason="fsdp2's own default (not in upstream)")


def _pair(ragged: bool = False):
    """fsdp2 and upstream; ``ragged``: fsdp2 on the parameter-major layout (the same
    elementwise step on other rows: still upstream's bits)."""
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    ref = build_mlp(seed=4)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    layout = {"shard_placement_fn": lambda p: fsdp2.RaggedShard()} if ragged else {}
    shard_mlp(ours, fsdp2.fully_shard, mesh=cpu_mesh(), **layout)
    shard_mlp(theirs, upstream_fully_shard, mesh=cpu_mesh())
    return ours, theirs


def _batch(step, rank, world_size):
    return rank_slice(mlp_batch(step, 2 * world_size), rank, world_size)


def _compiled_steps_between_eager_ones(backend: str, ragged: bool = False):
    def case(rank, world_size):
        torch._dynamo.reset()
        # torch's compile caches key a DTensor step by global shapes: ranks whose local
        # shards differ (13 rows on 2 ranks) must not share one (upstream's step fails too).
        # So each (case, W, rank) has a cache of its own, kept across runs where the user's
        # cache folder is writable (an inductor step compiles in 15 s cold, 8 s warm).
        before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        name = f"inductor-{backend}-{'ragged' if ragged else 'dim0'}-w{world_size}-rank{rank}"
        with persistent_cache_dir(name) as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            try:
                _compiled_steps(backend, rank, world_size, ragged)
            finally:
                if before is None:
                    del os.environ["TORCHINDUCTOR_CACHE_DIR"]
                else:
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = before

    return case


def _compiled_steps(backend: str, rank: int, world_size: int, ragged: bool = False) -> None:
    """Eager (the engine attaches, runs hold state), compiled, then eager steps again."""
    ours, theirs = _pair(ragged)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
    compiled = [torch.compile(o.step, backend=backend) for o in opts]
    for step, use_compiled in enumerate([False, True, True, False, False]):
        for m, o, c in zip((ours, theirs), opts, compiled):
            mlp_loss(m, _batch(step, rank, world_size)).backward()
            (c if use_compiled else o.step)()
            o.zero_grad()
        assert_same_params(ours, theirs, f"step {step} ({'compiled' if use_compiled else 'eager'})")
    assert_same_optimizer_state(opts[0], opts[1], layouts_differ=ragged)
    engine = flat_step_engine(opts[0])
    assert engine is not None and engine.runs()
    # three eager steps, the first torch's own (See [Note: The flat step by default])
    assert all(r.flat_steps == 2 for r in engine.runs()), [r.flat_steps for r in engine.runs()]


def _step_inside_compiled_function(rank, world_size, ragged=False):
    torch._dynamo.reset()
    ours, theirs = _pair(ragged)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, theirs)]

    def train_step(model, opt, batch):
        mlp_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()

    compiled = torch.compile(train_step, backend="eager")
    for step in range(3):
        for m, o in zip((ours, theirs), opts):
            compiled(m, o, _batch(step, rank, world_size))
        assert_same_params(ours, theirs, f"step {step}")
    assert_same_optimizer_state(opts[0], opts[1], layouts_differ=ragged)


def _compiled_model_keeps_the_flat_step(rank, world_size):
    torch._dynamo.reset()
    ours, theirs = _pair()
    models = [torch.compile(m, backend="aot_eager") for m in (ours, theirs)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(3):
        for m, o in zip(models, opts):
            mlp_loss(m, _batch(step, rank, world_size)).backward()
            o.step()
            o.zero_grad()
        assert_same_params(ours, theirs, f"step {step}")
    engine = flat_step_engine(opts[0])
    assert engine is not None and all(r.flat_steps == 2 for r in engine.runs())  # after the first


CASES = {
    "compiled-step-eager-backend": _compiled_steps_between_eager_ones("eager"),
    "compiled-step-inside-a-function": _step_inside_compiled_function,
    "compiled-model-eager-step": _compiled_model_keeps_the_flat_step,
}
# The parameter-major layout (RaggedShard): the compiled step is torch's own on its DTensors
RAGGED = {
    "compiled-step": _compiled_steps_between_eager_ones("eager", ragged=True),
    "step-inside-a-function": lambda rank, ws: _step_inside_compiled_function(rank, ws, True),
}
INDUCTOR = {"compiled-step-default-backend": _compiled_steps_between_eager_ones("inductor")}
# Every W=2 case in one launch: each launch's first compile warms Dynamo up again.
AT_TWO = {**CASES, **{f"ragged-{name}": case for name, case in RAGGED.items()}, **INDUCTOR}


def _launch(world_size: int, launch_cases):
    return launch_cases(world_size, AT_TWO if world_size == 2 else CASES, timeout=600)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_matches_upstream(world_size, case, launch_cases):
    """torch.compile(optimizer.step), a step in a compiled function, a compiled model: upstream's bits."""
    check_case(_launch(world_size, launch_cases), case)


@pytest.mark.parametrize("case", list(RAGGED))
def test_compiled_step_on_the_parameter_major_layout(case, launch_cases):
    """The same on RaggedShard groups (W=2, where its rows differ from torch.chunk's)."""
    check_case(_launch(2, launch_cases), f"ragged-{case}")


def test_compiled_step_default_backend(launch_cases):
    """torch.compile(optimizer.step) with inductor, between eager flat steps: upstream's bits."""
    check_case(_launch(2, launch_cases), "compiled-step-default-backend")
