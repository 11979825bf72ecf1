"""The step-time model: compute at a fraction of peak FLOP/s, collectives at stated bandwidths.

[Note: the step-time model]
Deliberately simple, and every input is printed with the estimate:

* compute of a phase (forward, backward) = its FLOPs on this rank (counted
  op by op from the simulated step, ``torch.utils.flop_counter`` formulas)
  / (``peak_tflops`` x ``mfu``);
* the optimizer step = the bytes its ops read and write / ``hbm_gbps``
  (AdamW is memory bound), or host bandwidth under CPU offload;
* a collective over ``n`` ranks of ``B`` logical bytes (all-gather output,
  reduce-scatter input, all-reduce tensor) takes ``latency +
  f * B * (n - 1) / n / bw`` with ``f = 2`` for all-reduce (ring
  reduce-scatter + all-gather) and 1 otherwise, where ``bw`` is the
  per-GPU intra-node bandwidth when the group's ranks share a node
  (``gpus_per_node`` consecutive ranks) and the inter-node bandwidth
  otherwise;
* without overlap, the step is the sum of everything; with overlap, each
  phase takes ``max(compute, communication)`` plus one exposed collective
  (the first all-gather of forward, the last reduce-scatter of backward),
  then the optimizer.

It ignores kernel launch overhead, attention's lower efficiency, stragglers
and network congestion; treat it as a ranking and an order of magnitude,
not a promise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from fsdp2.plan.tracker import Collective

GiB = 1024**3


@dataclass(frozen=True)
class Device:
    """One accelerator: memory, dense bf16 FLOP/s and bandwidths (GB/s per GPU, one direction)."""

    name: str
    memory_gib: float
    peak_tflops: float
    hbm_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    gpus_per_node: int = 8
    mfu: float = 0.4
    host_gbps: float = 25.0  # host <-> device (PCIe), for CPU offload
    latency_us: float = 20.0  # per collective

    def with_(self, **overrides: Any) -> Device:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Public data sheet numbers (dense bf16, no sparsity); network: one 400 Gb/s NIC
# per GPU (H100/H200/B200), 200 Gb/s (A100); intra-node: NVLink bus bandwidth a
# ring collective sees in practice (well below the sheet's bidirectional figure).
DEVICES = {
    "h100": Device("h100", 80, 989, 3350, 370, 45),
    "h200": Device("h200", 141, 989, 4800, 370, 45),
    "a100": Device("a100", 80, 312, 2039, 230, 23),
    "a100-40gb": Device("a100-40gb", 40, 312, 1555, 230, 23),
    "b200": Device("b200", 180, 2250, 8000, 720, 45),
    "mi300x": Device("mi300x", 192, 1307, 5300, 300, 45),
}


def get_device(name: str, **overrides: Any) -> Device:
    """A known device by name (see ``DEVICES``), with optional field overrides."""
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"--gpu {name!r}: unknown device; known: {sorted(DEVICES)}")
    return DEVICES[key].with_(**overrides)


def collective_seconds(c: Collective, device: Device) -> float:
    """Time of one collective under the model above."""
    n = len(c.ranks)
    if n <= 1:
        return 0.0
    nodes = {r // device.gpus_per_node for r in c.ranks}
    gbps = device.intra_node_gbps if len(nodes) == 1 else device.inter_node_gbps
    factor = 2.0 if c.kind == "all_reduce" else 1.0
    return device.latency_us * 1e-6 + factor * c.nbytes * (n - 1) / n / (gbps * 1e9)


def step_time(
    flops: dict[str, float],
    bytes_touched: dict[str, int],
    collectives: list[Collective],
    device: Device,
    cpu_offload: bool = False,
) -> dict[str, Any]:
    """Estimated seconds of one step, per phase, with and without overlap."""
    rate = device.peak_tflops * 1e12 * device.mfu
    out: dict[str, Any] = {"phases": {}}
    no_overlap = overlap = 0.0
    for phase in ("forward", "backward"):
        compute = flops.get(phase, 0.0) / rate
        comms = [collective_seconds(c, device) for c in collectives if c.phase == phase]
        comm = sum(comms)
        exposed = (comms[0] if phase == "forward" else comms[-1]) if comms else 0.0
        out["phases"][phase] = {"compute_s": compute, "comm_s": comm}
        no_overlap += compute + comm
        overlap += min(compute + comm, max(compute, comm) + exposed)
    optim_bw = device.host_gbps if cpu_offload else device.hbm_gbps
    optim = bytes_touched.get("optimizer", 0) / (optim_bw * 1e9)
    optim_comm = sum(collective_seconds(c, device) for c in collectives if c.phase == "optimizer")
    out["phases"]["optimizer"] = {"compute_s": optim, "comm_s": optim_comm}
    no_overlap += optim + optim_comm
    overlap += optim + optim_comm
    if cpu_offload:  # parameters up and gradients down once per step, over PCIe
        moved = 2 * sum(c.nbytes / max(1, len(c.ranks)) for c in collectives if c.phase == "forward")
        no_overlap += moved / (device.host_gbps * 1e9)
        overlap += moved / (device.host_gbps * 1e9) / 2
    out["step_s_no_overlap"] = no_overlap
    out["step_s_overlap"] = overlap
    out["compute_s"] = sum(p["compute_s"] for p in out["phases"].values())
    out["comm_s"] = sum(p["comm_s"] for p in out["phases"].values())
    return out
