"""One real fsdp2 training step on fake tensors, at the target world size.

[Note: how the planner simulates a step]
The planner joins torch's fake process group as rank 0 of W ranks (its
collectives return at once and move nothing) and runs, under
``FakeTensorMode`` (tensors with shapes and no data), exactly what a training
script runs: build the model, ``fully_shard`` each group and the root, make
the optimizer, then forward, loss, backward, ``optimizer.step()`` and
``zero_grad()``. fsdp2's own code runs unchanged, so the storages it
allocates and frees, and the collectives it issues with their sizes, are
those of a real rank 0; ``StepTracker`` (tracker.py) records them.

What a real step would find already there is made first, outside the
measured step: the optimizer state (one optimizer step on zero gradients).
fsdp2's lazy init runs in the measured step's first forward, as in a
training job's first step; it allocates nothing that outlives the step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.checkpoint import checkpoint

from fsdp2._torch_compat import fake_tensor_mode, init_fake_process_group
from fsdp2.plan import workload
from fsdp2.plan.tracker import Collective, StepTracker, Timeline

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclass
class PlanConfig:
    """What to plan: the model, the mesh and the training settings of one step.

    Give exactly one of ``hf_config`` (a shipped name such as ``"llama-3-8b"``,
    a ``config.json`` path or a dict) and ``model`` (``"module:function"``,
    ``"file.py:function"`` or a callable returning an ``nn.Module``).
    ``mesh`` is the data-parallel mesh shape: ``(W,)`` (FSDP, the default),
    ``(replicate, shard)`` (HSDP) or ``(replicate, shard, tp)``; its product
    is the world size. ``batch_size`` is per data-parallel rank.
    ``shard_optim_across_replicas``: HSDP with the optimizer state sharded
    across replicas too (``enable_local_shard_step(...,
    shard_across_replicas=True)``; a ``(replicate, shard)`` mesh, fsdp2 only).
    """

    hf_config: str | dict | None = None
    model: str | Callable[[], nn.Module] | None = None
    world_size: int = 8
    mesh: tuple[int, ...] | None = None
    groups: list[str] | None = None
    dtype: str = "float32"
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool | int = True
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    optimizer: str = "adamw"
    batch_size: int = 1
    seq_len: int = 2048
    implementation: str = "fsdp2"
    shard_optim_across_replicas: bool = False
    make_inputs: Callable[[nn.Module, int, int], tuple[Any, Any]] | None = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None

    def mesh_shape(self) -> tuple[int, ...]:
        shape = tuple(self.mesh) if self.mesh else (self.world_size,)
        if not 1 <= len(shape) <= 3 or any(int(s) < 1 for s in shape):
            raise ValueError(
                f"mesh={shape}: expected shard, replicate,shard or replicate,shard,tp "
                "with positive sizes (e.g. --mesh 8,128)"
            )
        total = 1
        for s in shape:
            total *= int(s)
        if total != self.world_size:
            raise ValueError(
                f"mesh={shape} has {total} ranks but world_size={self.world_size}; "
                "make the product of --mesh equal --world-size"
            )
        return tuple(int(s) for s in shape)

    def with_(self, **changes: Any) -> PlanConfig:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


@dataclass
class Simulation:
    """What the tracker saw in the measured step (rank 0's view)."""

    config: PlanConfig
    timeline: Timeline
    collectives: list[Collective]
    flops: dict[str, float]
    bytes_touched: dict[str, int]
    state_bytes: dict[str, int]  # sharded parameters, optimizer state at the start of the step
    largest_group_shard: int
    num_params: int
    seconds: float
    cpu_seconds: float = 0.0


def _dtype(name: str | None, what: str) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"{what}={name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def _check(cfg: PlanConfig) -> tuple[int, ...]:
    shape = cfg.mesh_shape()
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={cfg.optimizer!r}: expected one of {OPTIMIZERS}")
    if cfg.implementation not in ("fsdp2", "torch"):
        raise ValueError(f"implementation={cfg.implementation!r}: expected 'fsdp2' or 'torch'")
    if cfg.batch_size < 1 or cfg.seq_len < 1:
        raise ValueError("batch_size and seq_len must be positive")
    raf = cfg.reshard_after_forward
    shard = shape[-2] if len(shape) == 3 else shape[-1]
    if not isinstance(raf, bool):
        if not isinstance(raf, int) or raf < 1 or shard % raf:
            raise ValueError(
                f"reshard_after_forward={raf!r}: expected True, False or an int dividing "
                f"the shard dim's size {shard}"
            )
    for what in ("dtype", "param_dtype", "reduce_dtype"):
        _dtype(getattr(cfg, what), what)
    if cfg.shard_optim_across_replicas and (len(shape) != 2 or cfg.implementation != "fsdp2"):
        raise ValueError(
            f"shard_optim_across_replicas=True with mesh={shape} and implementation="
            f"{cfg.implementation!r}: it shards fsdp2's HSDP optimizer state over the replicate "
            "dim; give a replicate,shard mesh (e.g. --mesh 8,128) and implementation fsdp2"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "fsdp2.plan runs its own (fake) process group, but one is already initialized "
            "in this process; plan in a process without one (e.g. before "
            "init_process_group, or in a subprocess)"
        )
    return shape


def _make_mesh(shape: tuple[int, ...]) -> tuple[DeviceMesh, DeviceMesh | None]:
    if len(shape) == 1:
        return init_device_mesh("cpu", shape), None
    if len(shape) == 2:
        return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")), None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    return mesh["replicate", "shard"], mesh["tp"]


def _fully_shard_fn(implementation: str):
    if implementation == "fsdp2":
        from fsdp2.api import CPUOffloadPolicy, MixedPrecisionPolicy
        from fsdp2.fully_shard import fully_shard
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy


def _checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Non-reentrant activation checkpointing of each block's forward."""
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _make_optimizer(
    cfg: PlanConfig, model: nn.Module, handles: list[Any] | None = None
) -> torch.optim.Optimizer:
    """The configured optimizer (fsdp2: its flat step); its step handle appended to ``handles``."""
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach=True: the default on GPUs, which the plan is for (CPU tensors default to a loop).
    if cfg.optimizer == "sgd":
        optim = torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    elif cfg.optimizer == "adam":
        optim = torch.optim.Adam(params, lr=1e-3, foreach=True)
    else:
        optim = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if cfg.implementation == "fsdp2":
        from fsdp2.optim.local_shard_step import enable_local_shard_step

        # same state and updates; much faster to simulate
        handle = enable_local_shard_step(
            optim, shard_across_replicas=cfg.shard_optim_across_replicas
        )
        if handles is not None:
            handles.append(handle)
    return optim


def _group_shard_bytes(group: nn.Module, owned: set[int]) -> int:
    from fsdp2._torch_compat import local_tensor

    total = 0
    for p in group.parameters():
        if id(p) in owned:
            continue
        owned.add(id(p))
        local = local_tensor(p) if hasattr(p, "placements") else p
        total += local.numel() * local.element_size()
    return total


def shard_model(
    cfg: PlanConfig, model: nn.Module, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh | None
) -> tuple[list[nn.Module], int]:
    """Apply activation checkpointing, tensor parallelism and ``fully_shard`` as configured.

    Returns the groups (blocks first, then the root) and the largest group's
    sharded bytes.
    """
    fully_shard, mp_cls, offload_cls = _fully_shard_fn(cfg.implementation)
    blocks = workload.select_groups(model, cfg.groups)
    if tp_mesh is not None:
        from fsdp2.plan.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, blocks, tp_mesh)
    if cfg.activation_checkpointing:
        _checkpoint_blocks(blocks)
    kwargs: dict[str, Any] = {"mesh": dp_mesh}
    if cfg.param_dtype or cfg.reduce_dtype:
        kwargs["mp_policy"] = mp_cls(
            param_dtype=_dtype(cfg.param_dtype, "param_dtype"),
            reduce_dtype=_dtype(cfg.reduce_dtype, "reduce_dtype"),
        )
    if cfg.cpu_offload:
        kwargs["offload_policy"] = offload_cls()
    for block in blocks:
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    owned: set[int] = set()
    largest = max(_group_shard_bytes(g, owned) for g in [*blocks, model])
    return [*blocks, model], largest


def simulate(cfg: PlanConfig) -> Simulation:
    """Run one training step of ``cfg`` on fake tensors at its world size; what it used."""
    shape = _check(cfg)
    started, cpu_started = time.perf_counter(), time.process_time()
    tracker = StepTracker()
    fake = fake_tensor_mode()
    init_fake_process_group(cfg.world_size)
    try:
        dp_mesh, tp_mesh = _make_mesh(shape)
        with fake:
            sim = _run_step(cfg, tracker, dp_mesh, tp_mesh)
    finally:
        dist.destroy_process_group()
    sim.seconds = time.perf_counter() - started
    sim.cpu_seconds = time.process_time() - cpu_started
    return sim


def _run_step(
    cfg: PlanConfig, tracker: StepTracker, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh | None
) -> Simulation:
    model = workload.build_model(cfg.hf_config, cfg.model, _dtype(cfg.dtype, "dtype"))
    num_params = sum(p.numel() for p in model.parameters())
    groups, largest = shard_model(cfg, model, dp_mesh, tp_mesh)
    handles: list[Any] = []
    optim = _make_optimizer(cfg, model, handles)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # optimizer state as after the first step
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    state = [t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    for handle in handles:  # state sharded across replicas lives in the step engine's slices
        state += handle.state_tensors()
    with tracker:
        return _measured_step(cfg, tracker, model, groups, optim, params, largest, num_params,
                              state)


def _measured_step(
    cfg: PlanConfig,
    tracker: StepTracker,
    model: nn.Module,
    groups: list[nn.Module],
    optim: torch.optim.Optimizer,
    params: list[nn.Parameter],
    largest: int,
    num_params: int,
    optim_state: list[torch.Tensor],
) -> Simulation:
    for t in (*model.parameters(), *model.buffers()):
        tracker.tag(t, "parameters")
    for t in optim_state:
        tracker.tag(t, "optimizer")
    state_bytes = {"parameters": 0, "optimizer": 0}
    for t in (*model.parameters(), *model.buffers()):
        state_bytes["parameters"] += _local_bytes(t)
    state_bytes["optimizer"] = sum(_local_bytes(t) for t in optim_state)

    def tag_unsharded(module: nn.Module, *_: Any) -> None:
        for p in module.parameters():
            tracker.tag(p, "unsharded")

    for group in groups:  # runs after the FSDP pre-forward hook: parameters are unsharded
        group.register_forward_pre_hook(tag_unsharded)
    make_inputs = cfg.make_inputs or workload.token_inputs
    loss_fn = cfg.loss_fn or workload.lm_loss
    inputs, targets = make_inputs(model, cfg.batch_size, cfg.seq_len)
    tracker.set_phase("forward")
    loss = loss_fn(model(*inputs), targets)
    tracker.set_phase("backward")
    loss.backward()
    del loss
    for p in params:
        tracker.tag(p.grad, "gradients")
    tracker.set_phase("optimizer")
    optim.step()
    optim.zero_grad(set_to_none=True)
    tracker.set_phase("end")
    return Simulation(
        config=cfg,
        timeline=tracker.timeline(),
        collectives=tracker.collectives,
        flops=dict(tracker.flops),
        bytes_touched=dict(tracker.bytes_touched),
        state_bytes=state_bytes,
        largest_group_shard=largest,
        num_params=num_params,
        seconds=0.0,
    )


def _local_bytes(t: torch.Tensor) -> int:
    from fsdp2._torch_compat import local_tensor

    local = local_tensor(t) if hasattr(t, "placements") else t
    return local.numel() * local.element_size()
