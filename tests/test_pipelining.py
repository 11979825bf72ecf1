"""Pipeline parallelism: torch's schedules over FSDP-sharded stages, against upstream.

Each case trains the same seeded stages for 2 steps (4 micro-batches; the
first step includes torch 2.13's metadata inference) twice in one launch:
upstream's ``fully_shard`` with torch's ``PipelineStage`` (the baseline), and
the implementation under test with ``fsdp2.pipelining.PipelineStage``. The
losses and the final full parameters must be identical, and every step must
issue no more all-gathers, reduce-scatters and all-reduces (nor bytes) than
the baseline's step. One reduce-scatter per group per step is also checked
directly, so a regression to one per micro-batch fails under either
implementation.

- W = 4: a (pp=2, dp=2) mesh, for every schedule that runs on CPU: GPipe and
  1F1B (one stage per rank), Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
  ZBVZeroBubble and DualPipeV (two stages per rank); mixed precision and
  ``reshard_after_forward=False`` for a single-stage and a multi-stage
  schedule each; torch's own ``PipelineStage`` over fsdp2 modules (as before:
  same losses and parameters, more collectives).
- W = 8: (pp=2, dp=2, tp=2), blocks tensor-parallel on ``tp``, 1F1B.
- torch's own ``PipelineStage`` over fsdp2 modules under
  ``fsdp2.patch_torch()``, held to the same bar: GPipe, 1F1B,
  Interleaved1F1B, ZBVZeroBubble, DualPipeV, and 1F1B in mixed precision
  (torch 2.15: its manual, async backward finalization; before: upstream's
  private state names, read through ``fully_shard.state(module)``).
- ``FSDPModule.finish_backward`` on its own (fsdp2 only).

Collectives are counted by wrapping the ``torch.distributed`` functions
(``CommDebugMode`` does not see them under pipelining's ``autograd.grad``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as upstream
import torch.distributed.pipelining as pipelining
import torch.nn as nn
from _impl import IMPL, MixedPrecisionPolicy, fsdp2_only, fully_shard
from checks import _PATCHED, check_case, on_collectives
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import fsdp2.pipelining

D = 9  # odd: dp shards are uneven
MICROBATCHES = 4
STEPS = 2

SINGLE = {"GPipe": pipelining.ScheduleGPipe, "1F1B": pipelining.Schedule1F1B}
MULTI = {
    "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
    "LoopedBFS": pipelining.ScheduleLoopedBFS,
    "InterleavedZeroBubble": pipelining.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": pipelining.ScheduleZBVZeroBubble,
    "DualPipeV": pipelining.ScheduleDualPipeV,
}
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


class StageModule(nn.Module):
    """Two blocks; with ``tp`` each block is a column- then row-parallel pair."""

    def __init__(self, tp: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, D)) if tp else nn.Linear(D, D)
            for _ in range(2)
        )

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _stage_indices(schedule: str, pp_rank: int, pp: int = 2) -> tuple[list[int], int]:
    if schedule in SINGLE:
        return [pp_rank], pp
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank], 2 * pp
    return [pp_rank, pp_rank + pp], 2 * pp


def _train_pipeline(schedule, shard, stage_cls, mesh, mp=False, reshard_after_forward=None):
    """Train the stages this rank holds; per-step collective counts, losses, final full params.

    The schedule runs forward and backward over the stages, so not ``checks.train_steps``.
    """
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    tp = "tp" in mesh.mesh_dim_names
    indices, num_stages = _stage_indices(schedule, pp_rank)
    torch.manual_seed(0)
    modules = [StageModule(tp) for _ in range(num_stages)]  # same values on every rank
    kwargs = {}
    if mp:
        policy = MixedPrecisionPolicy if shard is fully_shard else upstream.MixedPrecisionPolicy
        kwargs["mp_policy"] = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    stages, mine = [], []
    for i in indices:
        module = modules[i]
        for block in module.blocks:
            if tp:
                parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            shard(block, mesh=mesh["dp"], **kwargs)
        shard(module, mesh=mesh["dp"], **kwargs)
        mine.append(module)
        stages.append(stage_cls(module, i, num_stages, torch.device("cpu"),
                                group=mesh["pp"].get_group()))
    cls = SINGLE.get(schedule) or MULTI[schedule]
    pipe = cls(stages if schedule in MULTI else stages[0], n_microbatches=MICROBATCHES,
               loss_fn=lambda y, t: ((y - t) ** 2).mean())
    optim = torch.optim.SGD([p for m in mine for p in m.parameters()], lr=0.1)
    first, last = 0 in indices, num_stages - 1 in indices
    counts, losses = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(16, D, generator=g).chunk(2)[dp_rank] for _ in range(2))
        step_counts = dict.fromkeys(KINDS, 0) | {"bytes": 0}

        def count(kind, args, kwargs, step_counts=step_counts):
            step_counts[kind] += 1
            t = kwargs.get("input_tensor", kwargs.get("input", kwargs.get("tensor")))
            t = t if t is not None else (args[0] if kind == "all_reduce" else args[1])
            step_counts["bytes"] += t.numel() * t.element_size() if torch.is_tensor(t) else 0

        step_losses = []
        with on_collectives(count, _PATCHED):
            pipe.step(*([x] if first else []), **({"target": y, "losses": step_losses} if last else {}))
        optim.step()
        optim.zero_grad()
        counts.append(step_counts)
        losses.append([loss.detach().float() for loss in step_losses])
    params = {f"{i}.{n}": (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
              for i, m in zip(indices, mine) for n, p in m.named_parameters()}
    groups = sum(len(m.blocks) for m in mine)  # the roots hold no parameters of their own
    return counts, losses, params, groups


def _parity_case(schedule, mp=False, reshard_after_forward=None, ours_stage=None, patched=False):
    """Ours (or, with ``ours_stage``, that stage class over ours) against upstream's run.

    ``patched``: torch's own stage over ours under ``fsdp2.patch_torch()``,
    held to the same bar as ``fsdp2.pipelining``.
    """

    def case(rank, world_size):
        dims = ("pp", "dp", "tp")[: 3 if world_size == 8 else 2]
        mesh = init_device_mesh("cpu", (2,) * len(dims), mesh_dim_names=dims)
        settings = {"mp": mp, "reshard_after_forward": reshard_after_forward}
        base = _train_pipeline(schedule, upstream.fully_shard, pipelining.PipelineStage, mesh,
                               **settings)
        if patched:
            with fsdp2.patch_torch():
                ours = _train_pipeline(schedule, fully_shard, pipelining.PipelineStage, mesh,
                                       **settings)
        else:
            stage_cls = ours_stage or fsdp2.pipelining.PipelineStage
            ours = _train_pipeline(schedule, fully_shard, stage_cls, mesh, **settings)
        (base_counts, base_losses, base_params, groups), (counts, losses, params, _) = base, ours
        # Bitwise; torch's own stage reduces per micro-batch, which rounds differently.
        tol = {"rtol": 1e-5, "atol": 1e-6} if ours_stage else {"rtol": 0, "atol": 0}
        for got, want in zip(losses, base_losses):
            torch.testing.assert_close(got, want, **tol)
        for name, value in base_params.items():
            torch.testing.assert_close(params[name], value, **tol, msg=name)
        if ours_stage is not None:
            return  # torch's own stage: right results, but no claim on its collectives
        for step, (got, want) in enumerate(zip(counts, base_counts)):  # lazy init's step too
            for kind in (*KINDS, "bytes"):
                assert got[kind] <= want[kind], (schedule, step, kind, got, want)
        # One reduce-scatter per group and step, never one per micro-batch.
        for step_counts in counts:
            assert step_counts["reduce_scatter"] <= groups, (schedule, counts, groups)

    return case


def _finish_backward_case(rank, world_size):
    """Two backwards without sync, then finish_backward: one reduce-scatter per group, right grads."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    ref, model = StageModule(), StageModule()
    model.load_state_dict(ref.state_dict())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    def batches(r):  # rank r's two micro-batches
        g = torch.Generator().manual_seed(r)
        return [torch.randn(4, D, generator=g) for _ in range(2)]

    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    model.set_is_last_backward(False)
    counts = dict.fromkeys(KINDS, 0)

    def count(kind, args, kwargs):
        counts[kind] += 1

    with on_collectives(count, _PATCHED):
        for x in batches(rank):
            model(x).sum().backward()
        assert counts["reduce_scatter"] == 0, counts
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        model.set_is_last_backward(True)
        model.finish_backward()
    assert counts["reduce_scatter"] == 2, counts  # the two blocks; the root has no parameters
    assert all(isinstance(p, DTensor) for p in model.parameters()), "resharded after reduce"
    for r in range(world_size):  # reference: the mean over ranks of each rank's summed gradients
        for x in batches(r):
            (ref(x).sum() / world_size).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
    try:
        model.blocks[0].finish_backward()
    except RuntimeError as e:
        assert "must be called on the root FSDP module" in str(e), e
    else:
        raise AssertionError("finish_backward on a non-root module did not raise")


CASES_4 = {name: _parity_case(name) for name in (*SINGLE, *MULTI)}
CASES_4 |= {
    "1F1B/mp": _parity_case("1F1B", mp=True),
    "Interleaved1F1B/mp": _parity_case("Interleaved1F1B", mp=True),
    "GPipe/no_reshard": _parity_case("GPipe", reshard_after_forward=False),
    "ZBVZeroBubble/no_reshard": _parity_case("ZBVZeroBubble", reshard_after_forward=False),
    "1F1B/torch_stage": _parity_case("1F1B", ours_stage=pipelining.PipelineStage),
    "Interleaved1F1B/torch_stage": _parity_case(
        "Interleaved1F1B", ours_stage=pipelining.PipelineStage
    ),
}
if IMPL == "fsdp2":
    CASES_4["finish_backward"] = _finish_backward_case
PATCHED = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
if IMPL == "fsdp2":
    CASES_4 |= {f"{name}/patched": _parity_case(name, patched=True) for name in PATCHED}
    CASES_4["1F1B/patched/mp"] = _parity_case("1F1B", mp=True, patched=True)
CASES_8 = {"1F1B": _parity_case("1F1B")}


@pytest.mark.parametrize("schedule", [*SINGLE, *MULTI])
def test_schedule_matches_upstream_with_no_more_collectives(schedule, launch_cases):
    """pp=2 x dp=2: identical losses and parameters; per step no more collectives than upstream."""
    check_case(launch_cases(4, CASES_4), schedule)


@pytest.mark.parametrize("case", ["1F1B/mp", "Interleaved1F1B/mp"])
def test_mixed_precision(case, launch_cases):
    """bf16 parameters, fp32 reduction: identical to upstream, no more collectives."""
    check_case(launch_cases(4, CASES_4), case)


@pytest.mark.parametrize("case", ["GPipe/no_reshard", "ZBVZeroBubble/no_reshard"])
def test_reshard_after_forward_false(case, launch_cases):
    """reshard_after_forward=False (torchtitan's PP default): identical, no more collectives."""
    check_case(launch_cases(4, CASES_4), case)


@pytest.mark.parametrize("case", ["1F1B/torch_stage", "Interleaved1F1B/torch_stage"])
def test_torchs_own_stage_still_trains_the_same(case, launch_cases):
    """torch's plain PipelineStage over these modules: upstream's losses and parameters."""
    check_case(launch_cases(4, CASES_4), case)


def test_with_tensor_parallel(launch_cases):
    """pp=2 x dp=2 x tp=2 (W = 8), 1F1B: identical to upstream, no more collectives."""
    check_case(launch_cases(8, CASES_8), "1F1B")


@fsdp2_only
@pytest.mark.parametrize("case", [*(f"{n}/patched" for n in PATCHED), "1F1B/patched/mp"])
def test_torchs_own_stage_under_patch_torch(case, launch_cases):
    """torch's PipelineStage over fsdp2 under patch_torch(): bitwise, no more collectives."""
    check_case(launch_cases(4, CASES_4), case)


@fsdp2_only
def test_finish_backward(launch_cases):
    """FSDPModule.finish_backward reduces accumulated grads once per group; refused off the root."""
    check_case(launch_cases(4, CASES_4), "finish_backward")
