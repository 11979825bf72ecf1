"""``plan()``: simulate a step, then price it on a device. The ``Plan`` it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdp2.plan.cost import Device, get_device, step_time
from fsdp2.plan.simulate import PlanConfig, Simulation, simulate
from fsdp2.plan.tracker import CATEGORIES

HOST_CATEGORIES = ("parameters", "gradients", "optimizer")
STEP_PHASES = ("forward", "backward", "optimizer")


@dataclass
class Plan:
    """Per-rank memory, traffic and time of one training step (rank 0's view).

    ``peak_bytes_per_rank`` is device memory: with CPU offload the sharded
    parameters, gradients and optimizer state are in host memory instead
    (``host_bytes_per_rank``), and two shard-sized staging buffers of the
    largest group are added for the copies. ``peak_breakdown`` splits the
    peak by category (see ``fsdp2.plan.tracker.CATEGORIES``);
    ``comm_bytes_per_step`` has the logical bytes per collective kind (as
    ``benchmarks/instruments.CommCounter`` counts them) and their ``total``.
    """

    config: PlanConfig
    device: Device
    peak_bytes_per_rank: int
    peak_breakdown: dict[str, int]
    peak_phase: str
    host_bytes_per_rank: int
    comm_bytes_per_step: dict[str, int]
    comm_calls_per_step: dict[str, int]
    flops_per_step: float
    time: dict[str, Any]
    num_params: int
    simulation: Simulation = field(repr=False)

    @property
    def fits(self) -> bool:
        """Whether the peak fits in the device's memory."""
        return self.peak_bytes_per_rank <= self.device.memory_gib * 1024**3

    @property
    def step_seconds(self) -> float:
        """Estimated step time with communication overlapped."""
        return self.time["step_s_overlap"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready numbers (what ``--json`` writes)."""
        from fsdp2.plan.report import plan_dict

        return plan_dict(self)

    def table(self) -> str:
        """The human-readable report (what the CLI prints)."""
        from fsdp2.plan.report import plan_table

        return plan_table(self)

    def plot(self, path: str) -> str:
        """Draw live memory across the step by phase, peak marked, to ``path`` (needs matplotlib)."""
        from fsdp2.plan.report import plot_timeline

        return plot_timeline(self, path)


def price(sim: Simulation, device: Device) -> Plan:
    """Turn a simulated step into a ``Plan`` on ``device``."""
    cfg = sim.config
    tl = sim.timeline
    breakdown = dict(tl.peak_breakdown)
    peak, host, phase = tl.peak, 0, tl.peak_phase
    if cfg.cpu_offload:
        # Device memory = everything but the host-resident state, plus staging copies.
        device_live = [
            total - sum(tl.by_category[c][i] for c in HOST_CATEGORIES)
            for i, total in enumerate(tl.totals)
        ]
        index = max(range(len(device_live)), key=device_live.__getitem__) if device_live else 0
        staging = 2 * sim.largest_group_shard
        peak = (device_live[index] if device_live else 0) + staging
        host = max((sum(tl.by_category[c][i] for c in HOST_CATEGORIES) for i in range(len(tl.totals))), default=0)
        breakdown = {c: (0 if c in HOST_CATEGORIES else tl.by_category[c][index]) for c in CATEGORIES}
        breakdown["comm"] += staging
        phase = _phase_at(tl.phases, index)
    comm: dict[str, int] = {}
    calls: dict[str, int] = {}
    for c in sim.collectives:
        if c.phase in STEP_PHASES:
            comm[c.kind] = comm.get(c.kind, 0) + c.nbytes
            calls[c.kind] = calls.get(c.kind, 0) + 1
    comm["total"] = sum(comm.values())
    return Plan(
        config=cfg,
        device=device,
        peak_bytes_per_rank=peak,
        peak_breakdown=breakdown,
        peak_phase=phase,
        host_bytes_per_rank=host,
        comm_bytes_per_step=comm,
        comm_calls_per_step=calls,
        flops_per_step=sum(sim.flops.get(p, 0.0) for p in STEP_PHASES),
        time=step_time(sim.flops, sim.bytes_touched, sim.collectives, device, cfg.cpu_offload),
        num_params=sim.num_params,
        simulation=sim,
    )


def _phase_at(phases: list[tuple[int, str]], index: int) -> str:
    current = phases[0][1] if phases else "forward"
    for start, name in phases:
        if start <= index:
            current = name
    return current


def plan(config: PlanConfig | None = None, device: str | Device = "h100", **kwargs: Any) -> Plan:
    """Simulate one fsdp2 training step of ``config`` and price it on ``device``.

    ``kwargs`` are ``PlanConfig`` fields (when ``config`` is ``None``, or to
    override it) and ``Device`` fields (``mfu=0.5``, ``inter_node_gbps=...``).
    Example::

        from fsdp2.plan import plan
        p = plan(hf_config="llama-3-8b", world_size=64, seq_len=4096, param_dtype="bf16")
        print(p.table()); p.peak_bytes_per_rank; p.comm_bytes_per_step["total"]
    """
    device_fields = set(Device.__dataclass_fields__) - {"name"}
    dev_overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in device_fields}
    config = (config or PlanConfig()).with_(**kwargs) if kwargs or config is None else config
    dev = device if isinstance(device, Device) else get_device(device)
    return price(simulate(config), dev.with_(**dev_overrides))
