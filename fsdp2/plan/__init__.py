"""Plan before you launch: per-rank memory, traffic and step time of fsdp2 at any scale.

``plan(...)`` runs one real fsdp2 training step on fake tensors (no data)
with torch's fake process group at the target world size, as rank 0, and
reports peak memory per rank with a breakdown, the bytes each collective
kind moves per step, and an estimated step time; ``search(...)`` ranks the
sensible configurations under a memory limit. ``python -m fsdp2.plan
--help`` is the same from the command line. docs/plan.md describes the
model and its limits.

    from fsdp2.plan import plan
    p = plan(hf_config="llama-3-8b", world_size=64, param_dtype="bf16", seq_len=4096)
    print(p.table())
"""

from fsdp2.plan.cost import DEVICES, Device, get_device
from fsdp2.plan.planner import Plan, plan, price
from fsdp2.plan.search import search
from fsdp2.plan.simulate import PlanConfig, Simulation, simulate
from fsdp2.plan.workload import shipped_configs

__all__ = [
    "DEVICES",
    "Device",
    "Plan",
    "PlanConfig",
    "Simulation",
    "get_device",
    "plan",
    "price",
    "search",
    "shipped_configs",
    "simulate",
]
