"""Tensor parallelism for ``--mesh replicate,shard,tp``: a plan by module name.

Megatron-style: the projections into attention heads and into the MLP's
hidden dim are split column-wise, the projections back row-wise, so each
block runs one all-reduce in forward and one in backward per half. Names
follow Hugging Face Llama-style models (``q_proj`` ... ``down_proj``); the
embedding, norms and output head stay replicated over ``tp``. Attention must
view heads as ``(batch, seq, -1, head_dim)`` so each rank takes its heads.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def apply_tensor_parallel(model: nn.Module, blocks: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """``parallelize_module`` every block's projections on ``tp_mesh`` (see the module doc)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for block in blocks:
        plan = {}
        for name, module in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear) and leaf in COLWISE:
                plan[name] = ColwiseParallel()
            elif isinstance(module, nn.Linear) and leaf in ROWWISE:
                plan[name] = RowwiseParallel()
        if not plan:
            raise ValueError(
                f"--mesh with a tp dim: block {type(block).__name__} has no nn.Linear named "
                f"{COLWISE + ROWWISE}; tensor parallelism is planned by these names only "
                "(use a 1-D or 2-D --mesh, or shard the model yourself in --model)"
            )
        parallelize_module(block, tp_mesh, plan)
