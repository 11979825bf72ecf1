"""The NVMe tier's peak is its steady state: first step, load and checkpoint saves hold a few units.

Counted in bytes through the store (``DiskStore.live``: every tensor a unit
works on, and the state a first step creates, until Python frees it), with
the garbage collector off so that nothing is freed by luck. Checkpoints of
file-backed state go past the store's mappings (a tensor at a time): the
save and the load leave the mappings' pages untouched (``mincore``-free:
the process's resident shared-file pages of the state folder, from
``/proc/self/smaps``). Values are checked bit for bit against the in-memory step.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from _multiproc import run_ranks
from checks import sharded_linear_stack, square_loss_backward
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2 import OptimizerOffloadPolicy

pytestmark = pytest.mark.skipif(
    os.environ.get("FSDP2_TEST_IMPL") == "torch", reason="fsdp2's own feature"
)

NUM_LAYERS, DIM = 8, 64  # 8 units of one Linear's three AdamW(amsgrad) moments each


def _model(seed: int) -> torch.nn.Module:
    return sharded_linear_stack(NUM_LAYERS, DIM, seed)


def _train(model, opt, steps, first=0):
    for i in range(first, first + steps):
        square_loss_backward(model, DIM, i)
        opt.step()
        opt.zero_grad()


def _mapped_kb(folder: str) -> int:
    """Resident kB of this process's mappings of files under ``folder``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                inside = len(head) >= 6 and head[5].startswith(folder)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def _state_of(opt):
    return {
        (i, k): (v.to_local() if isinstance(v, DTensor) else v).clone()
        for i, s in enumerate(opt.state.values()) for k, v in s.items()
    }


def _peaks_body(rank, world_size, tmp):
    gc.disable()  # a reference cycle must not hide behind a lucky collection
    try:
        ref = _model(3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, amsgrad=True, foreach=True)
        fsdp2.enable_local_shard_step(ref_opt)
        _train(ref, ref_opt, 3)

        model = _model(3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True, foreach=True)
        folder = os.path.join(tmp, "state")
        policy = OptimizerOffloadPolicy("nvme", folder, unit_bytes=3 * DIM * DIM * 4 // world_size)
        handle = fsdp2.enable_local_shard_step(opt, offload=policy)
        store, units = handle.engine.tier, handle.engine.units
        unit_bytes = max(u.layout.nbytes() for u in units)
        total = sum(u.layout.nbytes() for u in units)
        assert len(units) == NUM_LAYERS and total >= 8 * unit_bytes
        bound = 2 * unit_bytes  # a unit loading or stepping: its views, and the state a first step made
        # stepping, the next unit is read ahead (see [Note: Overlapping the disk with the step])
        step_bound = bound + unit_bytes

        _train(model, opt, 1)
        assert 0 < store.live.peak <= step_bound, ("first step", store.live.peak, step_bound, total)
        store.live.reset_peak()
        _train(model, opt, 2, first=1)
        assert store.live.peak <= 2 * unit_bytes, ("steady steps", store.live.peak, unit_bytes)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), n
        assert all(torch.equal(a, b) for a, b in zip(_state_of(opt).values(), _state_of(ref_opt).values()))

        # saves: neither streams the store's mapped pages into this process
        store.wait()
        before = _mapped_kb(folder)
        fsdp2.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
        fsdp2.save_checkpoint(os.path.join(tmp, "async"), model, opt, async_save=True).result()
        after_save = _mapped_kb(folder)
        assert after_save - before <= unit_bytes // 1024 + 8, ("save", before, after_save)
        assert not [n for n in os.listdir(os.path.join(folder, f"rank{rank:05d}")) if n.startswith(".staged")]

        # load into a fresh NVMe optimizer: written into the files unit by unit, bits unchanged
        fresh = _model(11)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, amsgrad=True, foreach=True)
        fresh_folder = os.path.join(tmp, "fresh")
        fresh_handle = fsdp2.enable_local_shard_step(
            fresh_opt, offload=OptimizerOffloadPolicy("nvme", fresh_folder, unit_bytes=policy.unit_bytes))
        fresh_store = fresh_handle.engine.tier
        for name in ("ckpt", "async"):
            fresh_store.live.reset_peak()
            fsdp2.load_checkpoint(os.path.join(tmp, name), fresh, fresh_opt)
            # DCP first creates the state of an optimizer without any by a step (lr=0)
            assert fresh_store.live.peak <= step_bound, (name, fresh_store.live.peak, step_bound)
            fresh_store.wait()
            assert _mapped_kb(fresh_folder) <= unit_bytes // 1024 + 8, name
            got, want = _state_of(fresh_opt), _state_of(opt)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
        _train(fresh, fresh_opt, 1, first=3)
        _train(ref, ref_opt, 1, first=3)
        for p, q in zip(fresh.parameters(), ref.parameters()):
            assert torch.equal(p.to_local(), q.to_local())
        fresh_handle.remove()
        handle.remove()
    finally:
        gc.enable()


@pytest.mark.parametrize("world_size", [1, 2])
def test_nvme_peaks_are_a_few_units(world_size, tmp_path):
    run_ranks(_peaks_body, world_size, str(tmp_path))
