"""set_custom_all_gather / set_custom_reduce_scatter: user comm objects run every collective.

The comms allocate the buffers FSDP gathers and reduces into and run the
collectives themselves (here through ``torch.distributed``). Training must
match the unsharded reference, every all-gather and reduce-scatter must go
through the comm, on buffers the comm allocated, as upstream lays them out.
"""

from __future__ import annotations

import os

import pytest
import torch
from _impl import FSDPModule, fully_shard
from _multiproc import run_ranks
from checks import (
    TorchAllGather,
    TorchReduceScatter,
    assert_losses_match,
    count_collectives,
    full_params,
    make_opts,
    train_alone,
    train_steps,
)
from models import (
    assert_params_match,
    build_transformer,
    cpu_mesh,
    make_pair,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)


class _Counting:
    """Remembers the buffers it allocated and the calls it ran (mixed into a torch comm)."""

    def __init__(self) -> None:
        self.allocated: list[torch.Tensor] = []
        self.calls: list[dict] = []

    def allocate(self, size, *, dtype, device):
        t = super().allocate(size, dtype=dtype, device=device)
        self.allocated.append(t)
        return t

    def owns(self, t: torch.Tensor) -> bool:
        return any(t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
                   for a in self.allocated)


class CountingAllGather(_Counting, TorchAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append({"out": output_tensor, "in": input_tensor})
        return super().__call__(output_tensor, input_tensor, group, async_op)


class CountingReduceScatter(_Counting, TorchReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append({"out": output_tensor, "in": input_tensor, "op": op})
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _set_comms(model) -> tuple[CountingAllGather, CountingReduceScatter]:
    """Counting comms on every fsdp2 module of ``model``."""
    ag, rs = CountingAllGather(), CountingReduceScatter()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(ag)
            m.set_custom_reduce_scatter(rs)
    return ag, rs


def _assert_through_the_comms(ag, rs, rank, world_size) -> None:
    """3 steps x (3 forward + 2 backward all-gathers, 3 reduce-scatters), all on the comms'
    buffers; each all-gather input is this rank's block of the allocated output."""
    assert len(ag.calls) == 15 and len(rs.calls) == 9, (len(ag.calls), len(rs.calls))
    for call in ag.calls:
        out, inp = call["out"], call["in"]
        assert ag.owns(out), "all-gather output not from allocate()"
        assert out.numel() == world_size * inp.numel()
        assert inp.data_ptr() == out.data_ptr() + rank * inp.numel() * inp.element_size()
    for call in rs.calls:
        assert rs.owns(call["out"]) and rs.owns(call["in"]), "reduce-scatter buffers not allocated"
        assert call["in"].numel() == world_size * call["out"].numel()


def _custom_comms_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=13))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    ag, rs = _set_comms(model)
    batches = [transformer_batch(s, 2 * world_size) for s in range(3)]
    opts = make_opts(ref, model)
    with count_collectives() as counts:
        ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size, opts)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)
    _assert_through_the_comms(ag, rs, rank, world_size)
    assert counts["all_gather"] >= 15 and counts["reduce_scatter"] == 9, counts


def test_custom_all_gather_and_reduce_scatter():
    """Custom comms run every collective on their own buffers; training matches the reference."""
    run_ranks(_custom_comms_body, 2)


def _ragged_custom_comms_body(rank, world_size):
    from fsdp2 import RaggedShard

    ragged = {"shard_placement_fn": lambda p: RaggedShard()}
    ref, model = make_pair(lambda: build_transformer(seed=13))
    default = build_transformer(seed=13)  # the same values, through the default collectives
    shard_transformer(model, fully_shard, mesh=cpu_mesh(), **ragged)
    shard_transformer(default, fully_shard, mesh=cpu_mesh(), **ragged)
    bounds = {p.placements[-1].row_bounds for p in model.parameters() if p.dim() == 2}
    ag, rs = _set_comms(model)
    batches = [transformer_batch(s, 2 * world_size) for s in range(3)]
    ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size,
                                     make_opts(ref, model))
    default_losses = train_alone(default, batches, transformer_loss, rank, world_size,
                                 torch.optim.AdamW(default.parameters(), lr=1e-2))
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)
    # the comms move the same bytes as the default collectives: bit for bit their training
    assert losses == default_losses, (losses, default_losses)
    got, want = full_params(model), full_params(default)
    assert all(torch.equal(got[n], want[n]) for n in want), "differs from the default gather"
    _assert_through_the_comms(ag, rs, rank, world_size)
    return bounds


@pytest.mark.skipif(os.environ.get("FSDP2_TEST_IMPL") == "torch", reason="fsdp2's RaggedShard")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_custom_comms_on_the_parameter_major_layout(world_size):
    """Custom comms on RaggedShard groups: their own buffers, the default collectives' bits."""
    bounds = run_ranks(_ragged_custom_comms_body, world_size)[0]
    if world_size == 3:  # the plan's rows, not torch.chunk's (ceil(rows / 3) on each rank)
        assert any(b[1] - b[0] != b[2] - b[1] for b in bounds), bounds
