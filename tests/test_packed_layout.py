"""The packed plan in ``fully_shard``: whole blocks at any W, the same training as the other layouts.

Where the contiguous parameter-major plan would pad much (a tile band larger
than a rank's share), ``RaggedShard`` groups deal their bands to the ranks
instead ([Note: Packed blocks] in fsdp2/runtime/storage/block_packing.py) and
copy the gathered runs into the parameters ([Note: The packed order] in
fsdp2/runtime/storage/packed_rows.py). The small test models would seldom
pack by themselves, so most cases here force the packed plan on every group
and rerun the parameter-major layout's own cases (tests/test_ragged_layout.py)
and the fp8 tile all-gather's (tests/test_fp8_tiles.py) on it at W = 2 and 3
(HSDP 2 x 2 at W = 4): training as the reference, bit for bit the dim-0
layout at W = 2, DCP across layouts, state dicts, offload, HSDP (with the
optimizer state sliced across replicas too), resharding to a smaller group,
accumulation, Muon, and the gathered fp8 weight equal to
quantize-after-gather's. One case shows the choice made by itself, with its
padding.
"""

from __future__ import annotations

import contextlib

import pytest
import test_extensions
import test_fp8_tiles
import test_ragged_layout
import torch
import torch.nn as nn
from _impl import fsdp2_only
from checks import assert_losses_match, check_case, packed_everywhere, train_steps
from models import assert_params_match, cpu_mesh, full
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2 import RaggedShard, fully_shard
from fsdp2.runtime.storage.block_packing import pack_blocks
from fsdp2.runtime.storage.block_plan import plan_blocks
from fsdp2.runtime.storage.packed_rows import PackedRows

pytestmark = fsdp2_only  # fsdp2's own layout


def _orders(model: nn.Module) -> set[type]:
    return {type(g.order) for m in model.modules() if isinstance(m, fsdp2.FSDPModule)
            for g in m._get_fsdp_state()._fsdp_param_groups}


def _forced(case):
    def run(rank, world_size):
        with packed_everywhere() as made:
            case(rank, world_size)
        assert made, "no group was planned"

    return run


RAGGED = ("parity", "mixed_precision", "accumulation_and_resharding", "meta_init_and_checkpointing",
          "offload_and_hsdp", "state_dict", "dcp", "muon", "dtensor_step")
# at W = 4 only what needs four ranks (HSDP 2 x 2; the rest runs at 2 and 3, uneven at 3)
FP8 = {"fp8_" + name: case for name, case in test_fp8_tiles.PARAM_MAJOR.items()}


def _is_packed(rank, world_size):
    """The forced plan is built: the groups order their buffers as packed runs, the unsharded
    parameters view one buffer of their own, and the gathered runs land in it by one cat."""
    with packed_everywhere():
        model = test_ragged_layout.build_transformer(seed=24)
        test_ragged_layout.shard_transformer(model, fully_shard, mesh=cpu_mesh(),
                                             shard_placement_fn=lambda p: RaggedShard((2, 2)))
    assert _orders(model) == {PackedRows}
    block = model.layers[0]
    block.unshard()
    params = list(block.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    for p in params:
        assert p.is_contiguous()
    block.reshard()
    with test_ragged_layout._Ops() as ops:
        block.unshard()
        block.reshard()
    names = {n.split(".")[0] for n in ops.names}
    if world_size > 1:
        assert "cat" in names and "split_with_sizes_copy" not in names, names


def _chooses_by_itself(rank, world_size):
    """Matrices whose 16-row bands are larger than a rank's share of the contiguous plan: the
    contiguous plan would pad more than 3% of the group, so fully_shard packs, with every
    band whole on one rank, and trains as the reference."""
    torch.manual_seed(7)
    ref = nn.Sequential(nn.Linear(16, 48, bias=False), nn.Tanh(), nn.Linear(48, 40, bias=False),
                        nn.Tanh(), nn.Linear(40, 16))
    model = test_ragged_layout.copy.deepcopy(ref)
    tiles = lambda p: RaggedShard((16, 16)) if p.dim() == 2 else RaggedShard()  # noqa: E731
    fully_shard(model, mesh=cpu_mesh(), shard_placement_fn=tiles)
    shapes = [tuple(p.shape) for p in ref.parameters()]
    granularities = [(16, 16) if len(s) == 2 else "rows" for s in shapes]
    contiguous = plan_blocks(shapes, granularities, world_size)
    packed = pack_blocks(shapes, granularities, world_size)
    numel = sum(p.numel() for p in ref.parameters())
    # W = 2, 3, 4: the contiguous plan pads 38-84% of the group, the packed 3-7%
    assert contiguous.padding > 0.35 * numel and packed.padding < 0.08 * numel
    assert _orders(model) == {PackedRows}
    for p in model.parameters():
        if p.dim() == 2:
            bounds = p.placements[0].row_bounds
            assert all(b % 16 == 0 or b == p.shape[0] for b in bounds), bounds
    batches = [(torch.randn(2 * world_size, 16), torch.randn(2 * world_size, 16))
               for _ in range(3)]

    def loss(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    ref_losses, losses = train_steps(ref, model, batches, loss, rank, world_size)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model)


def _replica_slices(rank, world_size):
    """HSDP 2 x 2 with the optimizer state sliced across replicas, on packed groups: the
    steps of plain HSDP on the same layout, bit for bit."""
    results = []
    for across in (False, True):
        with packed_everywhere():
            ref, model = test_ragged_layout.make_pair(
                lambda: test_ragged_layout.build_transformer(seed=34))
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            test_ragged_layout.shard_transformer(model, fully_shard, mesh=mesh,
                                                 shard_placement_fn=lambda p: RaggedShard())
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if across:
            fsdp2.enable_local_shard_step(optim, shard_across_replicas=True)
        batches = [test_ragged_layout.transformer_batch(s, 2 * world_size) for s in range(3)]
        test_ragged_layout.train_alone(model, batches, test_ragged_layout.transformer_loss,
                                       rank, world_size, optim)
        results.append([full(p.detach()) for p in model.parameters()])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def _state_order_after_a_raising_step(rank, world_size):
    """A step that raises part-way (``capturable`` on CPU) leaves ``optimizer.state`` in the
    parameters' order, as torch's own step makes it, not in the order of the runs' slots
    (largest bands first here); in memory and on the host tier."""
    import tempfile

    for tier in (None, "host"):
        with packed_everywhere():
            model = test_ragged_layout.build_transformer(seed=36)
            test_ragged_layout.shard_transformer(model, fully_shard, mesh=cpu_mesh(),
                                                 shard_placement_fn=lambda p: RaggedShard())
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        folder = tempfile.TemporaryDirectory()
        if tier is not None:
            fsdp2.enable_local_shard_step(optim, offload=fsdp2.OptimizerOffloadPolicy(
                tier=tier, directory=folder.name, unit_bytes=1024))
        test_ragged_layout.transformer_loss(
            model, test_ragged_layout.transformer_batch(0, 2 * world_size)).backward()
        optim.param_groups[0]["capturable"] = True
        with pytest.raises(AssertionError, match="capturable=True"):  # torch's own refusal
            optim.step()
        optim.param_groups[0]["capturable"] = False
        params = [id(p) for g in optim.param_groups for p in g["params"]]
        have = [id(p) for p in optim.state]
        assert have == [p for p in params if p in set(have)], tier
        optim.step()
        assert [id(p) for p in optim.state] == params, tier
        folder.cleanup()


def _edges(lay) -> set[int]:
    """Where each rank's rows of a parameter begin and end in the ``W * S`` gathered buffer."""
    share, row = lay.shard_numel, lay.row_numel
    edges = set()
    for r in range(lay.world_size):
        rows = lay.row_bounds[r + 1] - lay.row_bounds[r]
        if rows:
            at = r * share + (lay.rank_offsets[r] if lay.packed
                              else lay.start + lay.row_bounds[r] * row - r * share)
            edges |= {at, at + rows * row}
    return edges


def _segments_follow_the_rows(rank, world_size):
    """The quantized gradient exchange's segments (``slice_segments``) cut each rank's block at
    exactly its parameters' edges, on the contiguous plan and the packed one."""
    for packed in (False, True):
        with packed_everywhere() if packed else contextlib.nullcontext():
            model = test_ragged_layout.build_transformer(seed=24)
            test_ragged_layout.shard_transformer(model, fully_shard, mesh=cpu_mesh(),
                                                 shard_placement_fn=lambda p: RaggedShard((2, 2)))
        for m in model.modules():
            if not isinstance(m, fsdp2.FSDPModule):
                continue
            for group in m._get_fsdp_state()._fsdp_param_groups:
                params = group.fsdp_params
                share = params[0].layout.shard_numel
                want = set().union(*(_edges(p.layout) for p in params))
                want = {e for e in want if 0 < e < world_size * share and e % share}
                segments = group.order.slice_segments(params)
                assert [sum(seg) for seg in segments] == [share] * world_size, segments
                got = set()
                for r, seg in enumerate(segments):
                    at = r * share
                    for n in seg[:-1]:
                        at += n
                        got.add(at)
                assert got == want, (packed, sorted(got ^ want))


CASES = {name: _forced(test_ragged_layout.CASES[name]) for name in RAGGED}
CASES.update({name: _forced(case) for name, case in FP8.items()})
CASES.update({"is_packed": _is_packed, "chooses_by_itself": _chooses_by_itself,
              "state_order": _state_order_after_a_raising_step,
              "segments": _segments_follow_the_rows,
              "subclass_hooks": _forced(test_extensions._ragged_body)})
W4 = {"replica_slices": _replica_slices,
      "offload_and_hsdp": _forced(test_ragged_layout.CASES["offload_and_hsdp"])}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_layout(case, world_size, launch_cases):
    check_case(launch_cases(world_size, CASES), case)


@pytest.mark.parametrize("case", list(W4))
def test_packed_layout_at_four_ranks(case, launch_cases):
    check_case(launch_cases(4, W4), case)
