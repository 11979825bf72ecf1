"""set_custom_all_gather / set_custom_reduce_scatter: user comm objects run every collective.

The comms allocate the buffers FSDP gathers and reduces into and run the
collectives themselves (here through ``torch.distributed``). Training must
match the unsharded reference, every all-gather and reduce-scatter must go
through the comm, on buffers the comm allocated, as upstream lays them out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _impl import FSDPModule, fully_shard
from _multiproc import run_ranks
from checks import assert_losses_match, count_collectives, make_opts, train_steps
from models import (
    assert_params_match,
    build_transformer,
    cpu_mesh,
    make_pair,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)


class _Comm:
    """Allocates with torch.empty and remembers what it handed out and was called with."""

    def __init__(self) -> None:
        self.allocated: list[torch.Tensor] = []
        self.calls: list[dict] = []

    def allocate(self, size, *, dtype, device):
        t = torch.empty(*size, dtype=dtype, device=device)
        self.allocated.append(t)
        return t

    def owns(self, t: torch.Tensor) -> bool:
        return any(t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
                   for a in self.allocated)


class CountingAllGather(_Comm):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append({"out": output_tensor, "in": input_tensor})
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


class CountingReduceScatter(_Comm):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append({"out": output_tensor, "in": input_tensor, "op": op})
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


def _custom_comms_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=13))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    ag, rs = CountingAllGather(), CountingReduceScatter()
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
    batches = [transformer_batch(s, 2 * world_size) for s in range(3)]
    opts = make_opts(ref, model)
    with count_collectives() as counts:
        ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size, opts)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)
    # 3 steps x (3 forward + 2 backward all-gathers, 3 reduce-scatters): all through the comms
    assert len(ag.calls) == 15 and len(rs.calls) == 9, (len(ag.calls), len(rs.calls))
    assert counts["all_gather"] >= 15 and counts["reduce_scatter"] == 9, counts
    for call in ag.calls:
        out, inp = call["out"], call["in"]
        assert ag.owns(out), "all-gather output not from allocate()"
        assert out.numel() == world_size * inp.numel()
        # the input is this rank's block of the allocated output
        assert inp.data_ptr() == out.data_ptr() + rank * inp.numel() * inp.element_size()
    for call in rs.calls:
        assert rs.owns(call["out"]) and rs.owns(call["in"]), "reduce-scatter buffers not allocated"
        assert call["in"].numel() == world_size * call["out"].numel()


def test_custom_all_gather_and_reduce_scatter():
    """Custom comms run every collective on their own buffers; training matches the reference."""
    run_ranks(_custom_comms_body, 2)
