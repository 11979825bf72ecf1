"""``--search``: try the sensible configurations under a memory limit, rank by step time.

Candidates: FSDP over all ranks and HSDP with one node (``gpus_per_node``)
or two per shard group; ``reshard_after_forward`` True, False and the node
size (1-D meshes larger than a node); activation checkpointing off and on;
CPU offload off and on. Offload changes where the state lives, not the ops,
so one simulation prices both.

[Note: layer extrapolation in the search]
A Hugging Face config with more than ``2 * FEW`` layers is simulated with
``FEW`` and ``2 * FEW`` layers and every number extrapolated linearly to the
real depth: the blocks are identical, so memory, bytes, FLOPs and times are
affine in the number of blocks (checked against full simulations in
tests/test_plan.py). The best configuration that fits is then simulated at
full depth, and that plan is what the search returns first.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fsdp2.plan.cost import Device
from fsdp2.plan.planner import Plan, price
from fsdp2.plan.simulate import PlanConfig, simulate
from fsdp2.plan.workload import load_hf_config

FEW = 2
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def candidates(base: PlanConfig, gpus_per_node: int) -> list[PlanConfig]:
    """The configurations the search tries (offload is priced from the same simulation)."""
    w = base.world_size
    meshes: list[tuple[int, ...]] = [(w,)]
    for shard in (gpus_per_node, 2 * gpus_per_node):
        if 1 < shard < w and w % shard == 0:
            meshes.append((w // shard, shard))
    out = []
    for mesh in meshes:
        shard = mesh[-1]
        rafs: list[bool | int] = [True, False]
        if len(mesh) == 1 and 1 < gpus_per_node < shard and shard % gpus_per_node == 0:
            rafs.append(gpus_per_node)
        for raf in rafs:
            for ac in (False, True):
                out.append(
                    base.with_(
                        mesh=mesh,
                        reshard_after_forward=raf,
                        activation_checkpointing=ac,
                        cpu_offload=False,
                    )
                )
    return out


def _layers(cfg: PlanConfig) -> tuple[str, int, dict] | None:
    if cfg.hf_config is None:
        return None
    config = load_hf_config(cfg.hf_config)
    for key in _LAYER_KEYS:
        if isinstance(config.get(key), int):
            return key, config[key], config
    return None


def _affine(a: Any, b: Any, t: float) -> Any:
    """``a + t * (b - a)`` through dicts; numbers rounded back to int where they were."""
    if isinstance(a, dict):
        return {k: _affine(a[k], b[k], t) for k in a if k in b}
    if isinstance(a, bool) or not isinstance(a, (int, float)):
        return b
    value = a + t * (b - a)
    return round(value) if isinstance(a, int) else value


def _extrapolated(few: Plan, more: Plan, layers: int, cfg: PlanConfig) -> Plan:
    t = (layers - FEW) / FEW
    return replace(
        more,
        config=cfg,
        peak_bytes_per_rank=_affine(few.peak_bytes_per_rank, more.peak_bytes_per_rank, t),
        peak_breakdown=_affine(few.peak_breakdown, more.peak_breakdown, t),
        host_bytes_per_rank=_affine(few.host_bytes_per_rank, more.host_bytes_per_rank, t),
        comm_bytes_per_step=_affine(few.comm_bytes_per_step, more.comm_bytes_per_step, t),
        comm_calls_per_step=_affine(few.comm_calls_per_step, more.comm_calls_per_step, t),
        flops_per_step=_affine(few.flops_per_step, more.flops_per_step, t),
        time=_affine(few.time, more.time, t),
        num_params=_affine(few.num_params, more.num_params, t),
    )


def _priced(cfg: PlanConfig, device: Device, extrapolate: bool) -> list[Plan]:
    """Plans of ``cfg`` without and with CPU offload."""
    layers = _layers(cfg) if extrapolate else None
    if layers is None or layers[1] <= 2 * FEW:
        sim = simulate(cfg)
        return [price(sim, device), price(replace(sim, config=cfg.with_(cpu_offload=True)), device)]
    key, n, config = layers
    sims = [simulate(cfg.with_(hf_config={**config, key: k})) for k in (FEW, 2 * FEW)]
    out = []
    for offload in (False, True):
        target = cfg.with_(cpu_offload=offload)
        few, more = (price(replace(s, config=s.config.with_(cpu_offload=offload)), device) for s in sims)
        out.append(_extrapolated(few, more, n, target))
    return out


def search(
    base: PlanConfig,
    device: Device,
    memory_limit: int | None = None,
    extrapolate: bool = True,
    progress: Any = None,
) -> list[Plan]:
    """Every candidate priced; those under ``memory_limit`` first, fastest first.

    ``memory_limit`` defaults to the device's memory. The first plan (the
    best that fits) is a full-depth simulation; the rest may be extrapolated
    (see [Note: layer extrapolation in the search]).
    """
    limit = memory_limit if memory_limit is not None else int(device.memory_gib * 1024**3)
    plans: list[Plan] = []
    cands = candidates(base, device.gpus_per_node)
    for i, cfg in enumerate(cands):
        if progress:
            progress(f"[{i + 1}/{len(cands)}] mesh {cfg.mesh_shape()}, raf={cfg.reshard_after_forward}, "
                     f"AC={'on' if cfg.activation_checkpointing else 'off'}")
        plans += _priced(cfg, device, extrapolate)
    plans.sort(key=lambda p: (p.peak_bytes_per_rank > limit, p.step_seconds))
    layers = _layers(base) if extrapolate else None
    if plans and plans[0].peak_bytes_per_rank <= limit and layers and layers[1] > 2 * FEW:
        best = plans[0].config
        full = price(simulate(best.with_(cpu_offload=False)), device)
        if best.cpu_offload:
            full = price(replace(full.simulation, config=best), device)
        plans[0] = full
    return plans
