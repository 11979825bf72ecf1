"""Int8-quantized all-gather for a frozen base model (an FSDP all-gather extension).

A frozen weight is stored as an ``Int8Weight``: int8 rows plus one fp32 scale
per row. Its ``fsdp_pre_all_gather`` hands FSDP the int8 data and the scales
(about a quarter of the fp32 bytes), and ``fsdp_post_all_gather`` dequantizes
the gathered rows into the fp32 weight the module computes with. Trainable
parameters (biases, the head) are gathered and reduced as usual.

Launch (from the repository root, after ``pip install -e .``):

    torchrun --nproc-per-node 2 examples/int8_all_gather.py   # 2 ranks, one machine (CPU: gloo)
    python examples/int8_all_gather.py                        # 1 rank, no torchrun needed
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-id int8 --rdzv-endpoint HOST:29500 examples/int8_all_gather.py  # on every node

``FSDP2_IMPL=torch`` runs it on upstream ``torch.distributed.fsdp`` (same
losses on 2 ranks; on 1 rank torch 2.13 hands the post hook only the int8 data,
not the scales, and the unpacking fails: see tests/test_extensions.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fsdp2

aten = torch.ops.aten


class Int8Weight(torch.Tensor):
    """A frozen weight held as int8 rows and per-row scales; its value is ``data * scale``.

    Only the ops FSDP applies to a sharded parameter are implemented natively
    (``new_zeros``/``new_empty``, dim-0 ``split`` (``torch.chunk``) and
    ``slice`` (``narrow``), ``copy_`` from an ``Int8Weight``,
    ``detach``/``alias``/``view``); other out-of-place ops run on the
    dequantized value. Any other write raises: applied to a dequantized
    temporary it would be lost without a trace.
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self._data = data  # int8, the weight's shape
        self._scale = scale  # fp32, (rows, 1)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        """Symmetric per-row int8 quantization of a 2-D weight."""
        w = weight.detach()
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12).float()
        data = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
        return cls(data, scale, w.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._data.to(dtype or self.dtype) * self._scale.to(dtype or self.dtype)

    def __repr__(self) -> str:
        return f"Int8Weight(shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return cls(func(self._data), func(self._scale), self.dtype)
        if func is aten.view.default:  # e.g. FSDP's flat view of the padded shard
            return cls(self._data.view(args[1]), self._scale.view(-1, 1), self.dtype)
        if func in (aten.new_zeros.default, aten.new_empty.default):
            # e.g. upstream's `new_empty(0)` for a rank past the last chunk
            size = args[1]
            data = torch.zeros(size, dtype=torch.int8, device=self.device)
            rows = size[0] if len(size) > 0 else 0
            return cls(data, torch.zeros(rows, 1, device=self.device), self.dtype)
        if func is aten.split.Tensor and _dim(args, kwargs, 2) == 0:  # torch.chunk
            datas = func(self._data, args[1], 0)
            scales = func(self._scale, args[1], 0)
            return [cls(d, s, self.dtype) for d, s in zip(datas, scales)]
        if func is aten.slice.Tensor and _dim(args, kwargs, 1) == 0:  # narrow, [a:b]
            rest = args[2:]
            return cls(func(self._data, 0, *rest), func(self._scale, 0, *rest), self.dtype)
        if func is aten.copy_.default and isinstance(args[1], Int8Weight):
            self._data.copy_(args[1]._data)
            self._scale.copy_(args[1]._scale)
            return self
        if func._schema.is_mutable:
            raise NotImplementedError(f"Int8Weight does not support the in-place op {func}")

        def plain(x: Any) -> Any:
            return x.dequantize() if isinstance(x, Int8Weight) else x

        args, kwargs = torch.utils._pytree.tree_map(plain, (args, kwargs))
        return func(*args, **kwargs)

    # ---- FSDP all-gather extension --------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Send int8 rows and fp32 scales, padded to the padded shard's rows."""
        rows = -(-outer_size[0] // mesh.size())
        data, scale = self._data, self._scale
        # FSDP requires inputs of the padded shard's shape from ranks holding
        # padding, which per-row scales are not: use dims 0 divisible by the mesh.
        if data.size(0) < rows:
            pad = rows - data.size(0)
            data = torch.cat([data, data.new_zeros(pad, *data.shape[1:])])
            scale = torch.cat([scale, scale.new_zeros(pad, 1)])
        return (data.contiguous(), scale.contiguous()), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """Dequantize the gathered rows (padded; FSDP keeps the first ``size(0)``)."""
        data, scale = all_gather_outputs
        if out is not None:  # later all-gathers: refill the existing unsharded weight
            rows = out.size(0)
            # Through .data: autograd saved `out` in forward, and writing it directly
            # would bump the version counter that backward checks.
            torch.mul(data[:rows].to(param_dtype), scale[:rows].to(param_dtype), out=out.data)
            return None
        weight = data.to(param_dtype) * scale.to(param_dtype)
        return weight, (weight,)


def _dim(args: tuple, kwargs: dict, index: int) -> int:
    """The ``dim`` argument of an aten view op (positional ``index``, default 0)."""
    return args[index] if len(args) > index else kwargs.get("dim", 0)


def quantize_frozen_(module: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` weight with a frozen ``Int8Weight`` (biases stay trainable)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(Int8Weight.from_float(m.weight), requires_grad=False)
    return module


class Net(nn.Module):
    """Frozen int8-quantized blocks (trainable biases) and a trainable fp32 head."""

    def __init__(self, dim: int = 64, num_blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(quantize_frozen_(nn.Linear(dim, dim)) for _ in range(num_blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def main() -> None:
    if os.environ.get("FSDP2_IMPL", "fsdp2").strip().lower() == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp2 import fully_shard

    if "RANK" not in os.environ:  # plain `python`: a one-rank group
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))

    torch.manual_seed(0)
    model = Net()
    blocks = model.blocks
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=1e-2)

    g = torch.Generator().manual_seed(rank)
    for step in range(20):
        x = torch.randn(16, 64, generator=g)
        y = x.sum(dim=1, keepdim=True) / 8
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:2d}  loss {loss.item():.4f}")
    rows = -(-64 // world_size)
    if rank == 0:  # what one block's all-gather sends per rank: int8 + scales + fp32 bias
        print(f"bytes per block all-gather: {rows * 64 + 4 * rows + 4 * rows} "
              f"(fp32 weights: {4 * rows * 64 + 4 * rows})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
