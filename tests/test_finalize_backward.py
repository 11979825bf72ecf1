"""torch 2.15's FSDP2 API: manual/async backward finalization, kept unsharded storage.

fsdp2 offers these on every torch; under ``FSDP2_TEST_IMPL=torch`` the same
cases validate upstream where the installed torch has them (2.15 on), else they
are skipped (``needs_upstream``).

- ``set_manual_backward_finalization`` + ``finalize_backward()``: gradients
  accumulated over micro-batches without sync are reduced once per group, at
  finalization, and equal the single-process reference; a group whose inputs
  need no grad (autograd never reaches its post-backward) is reduced there too.
  W = 1, 2, 4.
- ``finalize_backward(async_op=True)``: a ``GradientReductionHandle``; forward
  or finalizing again before ``wait()`` raise; ``reset_iter_state`` invalidates it.
- Errors: off the root, without manual mode, mode changes after backward started.
- ``set_keep_unsharded_storage``: the unsharded parameter's storage survives
  reshard and the next unshard writes the same memory; by default it is freed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _impl import (
    GradientReductionHandle,
    fully_shard,
    needs_upstream,
)
from checks import _PATCHED, check_case, on_collectives
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

D = 9  # odd: shards are uneven at W = 2 and 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _build(world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    ref, model = Net(), Net()
    model.load_state_dict(ref.state_dict())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return ref, model


def _batches(rank, step, n=2):
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(4, D, generator=g) for _ in range(n)]


def _check_grads(model, ref, world_size, step, n):
    ref.zero_grad()
    for r in range(world_size):  # the mean over ranks of each rank's summed micro-batch grads
        for x in _batches(r, step, n):
            (ref(x).sum() / world_size).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, DTensor), f"{name} not resharded"
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def _count_reduce_scatters():
    counts = {"reduce_scatter": 0}

    def count(kind, args, kwargs):
        if kind == "reduce_scatter":
            counts["reduce_scatter"] += 1

    return counts, lambda: on_collectives(count, _PATCHED)


def _accumulate_then_finalize(rank, world_size):
    """Two micro-batches without sync, then finalize: one reduce-scatter per group, right grads."""
    ref, model = _build(world_size)
    model.set_manual_backward_finalization(True)
    groups = 4  # three blocks and the root's head
    counts, counting = _count_reduce_scatters()
    with counting():
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        for x in _batches(rank, 0):
            model(x).sum().backward()
        assert counts["reduce_scatter"] == 0, counts
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        assert model.finalize_backward() is None
    if world_size > 1:
        assert counts["reduce_scatter"] == groups, counts
    _check_grads(model, ref, world_size, 0, 2)
    # Next step, same mode: a syncing backward reduces as it goes; the root's and the
    # first block's inputs need no grad, so autograd never reaches their post-backward:
    # finalize runs it.
    model.zero_grad()
    counts["reduce_scatter"] = 0
    with counting():
        model(_batches(rank, 1, 1)[0]).sum().backward()
        during_backward = counts["reduce_scatter"]
        model.finalize_backward()
    if world_size > 1:
        assert during_backward == groups - 2, counts  # the root and blocks[0] wait
        assert counts["reduce_scatter"] == groups, counts
    _check_grads(model, ref, world_size, 1, 1)


def _async_handle(rank, world_size):
    """finalize_backward(async_op=True): a handle; forward/finalize refused until wait()."""
    ref, model = _build(world_size)
    model.set_manual_backward_finalization(True)
    model(_batches(rank, 0, 1)[0]).sum().backward()
    handle = model.finalize_backward(async_op=True)
    assert isinstance(handle, GradientReductionHandle), type(handle)
    with pytest.raises(RuntimeError, match="must be waited on before forward"):
        model(_batches(rank, 0, 1)[0])
    with pytest.raises(RuntimeError, match="must be waited on before finalizing backward again"):
        model.finalize_backward()
    handle.wait()
    handle.wait()  # a second wait does nothing
    _check_grads(model, ref, world_size, 0, 1)
    # reset_iter_state invalidates an outstanding handle
    model(_batches(rank, 1, 1)[0]).sum().backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    with pytest.raises(RuntimeError, match="invalidated"):
        handle.wait()
    model.set_manual_backward_finalization(False)  # allowed again after the reset
    model(_batches(rank, 2, 1)[0]).sum().backward()  # automatic mode: no finalize needed
    assert all(isinstance(p, DTensor) and p.grad is not None for p in model.parameters())


def _errors(rank, world_size):
    """Off the root, without manual mode, mode changes mid-iteration: RuntimeError, as upstream."""
    _, model = _build(world_size)
    model.blocks[0].set_manual_backward_finalization(True)  # not known yet to be a non-root
    with pytest.raises(RuntimeError, match="must be called on the root"):
        model(_batches(rank, 0, 1)[0])  # found at lazy init (upstream's model is unusable after)
    _, model = _build(world_size)
    assert model.finalize_backward() is None  # before the first forward: nothing to do
    model.finalize_backward(async_op=True).wait()
    model(_batches(rank, 0, 1)[0]).sum().backward()  # lazy init done: roots are known
    with pytest.raises(RuntimeError, match="must be called on the root"):
        model.blocks[1].set_manual_backward_finalization(True)
    with pytest.raises(RuntimeError, match="must be called on the root"):
        model.blocks[1].finalize_backward()
    with pytest.raises(RuntimeError, match="requires manual backward finalization"):
        model.finalize_backward()
    model.set_manual_backward_finalization(True)
    model(_batches(rank, 1, 1)[0]).sum().backward()
    with pytest.raises(RuntimeError, match="cannot change mode after backward starts"):
        model.set_manual_backward_finalization(False)
    model.finalize_backward()
    model.set_manual_backward_finalization(False)  # finalized: free to change


def _keep_unsharded_storage(rank, world_size):
    """Kept storage: same data pointer after reshard + unshard; freed by default."""
    _, model = _build(world_size)
    block = model.blocks[0]
    for keep in (False, True):
        block.set_keep_unsharded_storage(keep)
        block.unshard()
        unsharded = block.weight
        assert not isinstance(unsharded, DTensor)
        ptr = unsharded.data_ptr()
        block.reshard()
        assert isinstance(block.weight, DTensor)
        kept = unsharded.untyped_storage().size() > 0
        assert kept == keep, (keep, unsharded.untyped_storage().size())
        if keep:
            block.unshard()
            assert block.weight.data_ptr() == ptr
            torch.testing.assert_close(block.weight.detach(), model.blocks[0].weight.detach())
            block.reshard()


CASES = {
    "accumulate": _accumulate_then_finalize,
    "async": _async_handle,
    "errors": _errors,
    "keep_storage": _keep_unsharded_storage,
}


def _cases(world_size):
    return CASES if world_size == 2 else {"accumulate": _accumulate_then_finalize}


@needs_upstream("FSDPModule.finalize_backward")
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_accumulate_then_finalize(world_size, launch_cases):
    """Manual finalization: one reduce-scatter per group at finalize; gradients equal the reference."""
    check_case(launch_cases(world_size, _cases(world_size)), "accumulate")


@needs_upstream("FSDPModule.finalize_backward")
def test_async_finalize_handle(launch_cases):
    """async_op=True returns a GradientReductionHandle; misuse before wait() raises; reset invalidates."""
    check_case(launch_cases(2, _cases(2)), "async")


@needs_upstream("FSDPModule.finalize_backward")
def test_manual_finalization_errors(launch_cases):
    """Non-root, missing manual mode, and mode changes after backward started raise RuntimeError."""
    check_case(launch_cases(2, _cases(2)), "errors")


@needs_upstream("FSDPModule.set_keep_unsharded_storage")
def test_keep_unsharded_storage(launch_cases):
    """set_keep_unsharded_storage keeps data pointers across reshard/unshard; default frees."""
    check_case(launch_cases(2, _cases(2)), "keep_storage")
