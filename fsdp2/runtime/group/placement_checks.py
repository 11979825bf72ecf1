"""Where a group's sharded parameters must be before it trains: off ``meta``, on the host
with CPU offload. Checked at lazy init and before an unshard, with the fix in the error."""

from __future__ import annotations

import torch

from ..storage.param import FSDPParam


def check_materialized(names_on_meta: list[str], module_fqn: str) -> None:
    """Fail clearly, naming them, if any of a group's parameters is still on ``meta``."""
    if not names_on_meta:
        return
    where = f" of '{module_fqn}'" if module_fqn else ""
    raise RuntimeError(
        "FSDP parameters should be materialized from meta device before training, "
        f"but the following were still on meta device: {names_on_meta}\n"
        "For example, call module.to_empty(device) to materialize to device and "
        "call module.reset_parameters() on each module to initialize values.\n"
        f"These parameters{where} were never materialized: call "
        "model.to_empty(device=...) and then initialize them (e.g. "
        "reset_parameters() on each module), or load them with "
        "load_state_dict(..., assign=True) / set_full_state_dict before the "
        "first forward."
    )


def check_on_host(fsdp_params: list[FSDPParam], device: torch.device) -> None:
    """CPU offload: fail clearly if any sharded parameter is not on the CPU.

    ``device``: where the group computes (each all-gather copies the shards there).
    """
    misplaced = [
        (p.fqn, p.sharded_param.device)
        for p in fsdp_params
        if p.sharded_param.device.type != "cpu"
    ]
    if misplaced:
        raise RuntimeError(
            "FSDP parameters should be materialized on CPU when enabling CPU offloading. "
            'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
            f"Found following parameters on non-CPU device: {misplaced}\n"
            "CPUOffloadPolicy keeps sharded parameters on the CPU, but "
            f"{'this one is' if len(misplaced) == 1 else 'these are'} not. "
            'Materialize the model on the CPU (e.g. model.to_empty(device="cpu") and '
            "initialize it, or load a CPU state dict); FSDP copies the shards to "
            f"{device} for each all-gather."
        )
