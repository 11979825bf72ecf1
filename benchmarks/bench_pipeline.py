"""Pipeline parallelism x FSDP: collectives and bytes per step, per torch schedule.

W = 4 gloo ranks as a (pp=2, dp=2) mesh. Each stage module holds two linear
blocks (``dim`` x ``dim``), each block and the stage root sharded on ``dp``;
GPipe and 1F1B run one stage per rank, the multi-stage schedules two. The same
seeded stages train for two steps of 8 micro-batches with:

* ``fsdp2``: fsdp2's ``fully_shard`` and ``fsdp2.pipelining.PipelineStage``;
* ``torch``: upstream's ``fully_shard`` and torch's ``PipelineStage``;
* ``fsdp2, torch's stage`` (the reference column): fsdp2's modules under
  torch's own ``PipelineStage``, which does not recognize them (what users got
  before ``fsdp2.pipelining``).

Counted on the second step (the first also runs torch's metadata inference),
on every rank, by wrapping the ``torch.distributed`` collectives: the number
of all-gathers + reduce-scatters (+ all-reduces) and the bytes each rank
sends in them; the rows report the busiest rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")
MICROBATCHES = 8
_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                "reduce_scatter_tensor", "all_reduce")


class _Stage(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


class _Counter:
    """Count the public torch.distributed collectives and the bytes this rank sends."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self._saved: dict = {}

    def __enter__(self) -> _Counter:
        for name in _COLLECTIVES:
            orig = self._saved[name] = getattr(dist, name)

            def wrapper(*args, _orig=orig, _name=name, **kwargs):
                self.calls += 1
                t = kwargs.get("input_tensor", kwargs.get("input", kwargs.get("tensor")))
                if t is None:
                    t = args[0] if _name == "all_reduce" else args[1]
                self.bytes += t.numel() * t.element_size()
                return _orig(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._saved.items():
            setattr(dist, name, orig)


def _run(schedule: str, impl: str, dim: int, mesh) -> tuple[int, int]:
    import torch.distributed.fsdp as upstream
    import torch.distributed.pipelining as pipelining

    import fsdp2
    import fsdp2.pipelining

    shard = upstream.fully_shard if impl == "torch" else fsdp2.fully_shard
    stage_cls = fsdp2.pipelining.PipelineStage if impl == "fsdp2" else pipelining.PipelineStage
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    single = schedule in ("GPipe", "1F1B")
    num_stages = 2 if single else 4
    if single:
        indices = [pp_rank]
    elif schedule in ("ZBVZeroBubble", "DualPipeV"):
        indices = [pp_rank, 3 - pp_rank]
    else:
        indices = [pp_rank, pp_rank + 2]
    torch.manual_seed(0)
    modules = [_Stage(dim) for _ in range(num_stages)]
    stages, params = [], []
    for i in indices:
        for block in modules[i].blocks:
            shard(block, mesh=mesh["dp"])
        shard(modules[i], mesh=mesh["dp"])
        params += list(modules[i].parameters())
        stages.append(stage_cls(modules[i], i, num_stages, torch.device("cpu"),
                                group=mesh["pp"].get_group()))
    cls = getattr(pipelining, "Schedule" + schedule)
    pipe = cls(stages[0] if single else stages, n_microbatches=MICROBATCHES,
               loss_fn=lambda y, t: ((y - t) ** 2).mean())
    optim = torch.optim.SGD(params, lr=0.01)
    first, last = 0 in indices, num_stages - 1 in indices
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(4 * MICROBATCHES, dim, generator=g).chunk(2)[dp_rank] for _ in "xy")
        with _Counter() as counter:
            pipe.step(*([x] if first else []), **({"target": y} if last else {}))
        optim.step()
        optim.zero_grad()
    return counter.calls, counter.bytes


def pipeline_body(rank: int, world_size: int, cfg: dict) -> dict:
    """Per schedule and implementation: (collectives, bytes sent) of this rank's second step."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dim = cfg["shape"]["dim"]
    return {
        schedule: {impl: _run(schedule, impl, dim, mesh) for impl in ("fsdp2", "torch", "plain")}
        for schedule in SCHEDULES
    }
