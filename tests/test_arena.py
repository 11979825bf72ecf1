"""Arenas: the groups of one mesh and dtype in one allocation, stepped as one run.

Every case compares with upstream's ``fully_shard`` (or, where upstream cannot
do the same, with fsdp2 without the event) to the bit, and checks the layout
itself: one arena, one flat run, gradients in one buffer that is freed at
``zero_grad`` and never written under a caller. See [Note: Arenas] in
fsdp2/runtime/storage/arena.py.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from _impl import IMPL
from checks import check_case
from models import build_transformer, cpu_mesh, full, rank_slice, shard_transformer
from models import transformer_batch as batch_of
from models import transformer_loss as loss_of
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.optim import flat_step_engine
from fsdp2.runtime.storage.arena import Arena
from fsdp2.runtime.storage.flat_shard import flat_slot_of

pytestmark = pytest.mark.skipif(IMPL == "torch", reason="fsdp2's own layout (not in upstream)")


def _homes(model) -> set:
    slots = [flat_slot_of(p) for p in model.parameters()]
    assert all(slot is not None for slot in slots), "a parameter outside its group's buffer"
    return {id(slot.home) for slot in slots}


def _arena_of(model) -> Arena:
    slot = flat_slot_of(next(model.parameters()))
    assert slot is not None, "the parameter is outside its group's buffer"
    home = slot.home
    assert isinstance(home, Arena), f"not in an arena: {type(home).__name__}"
    return home


def _grad_base(p) -> torch.Tensor:
    local = p.grad.to_local()
    return local if local._base is None else local._base


def _train(model, opt, rank, world_size, steps, first=0, to_none=True):
    for step in range(first, first + steps):
        loss_of(model, rank_slice(batch_of(step, 2 * world_size), rank, world_size)).backward()
        opt.step()
        opt.zero_grad(set_to_none=to_none)


def _assert_equal(model, ref, where):
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(full(p.detach()), full(r.detach())), f"{where}: {name} differs"


def _with_upstream():
    """The test model sharded by fsdp2 and by upstream's fully_shard, from equal values."""
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    ref = build_transformer(seed=5)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    shard_transformer(ours, fsdp2.fully_shard, mesh=cpu_mesh())
    shard_transformer(theirs, upstream_fully_shard, mesh=cpu_mesh())
    return ours, theirs


def _step_side_by_side(ours, theirs, rank, world_size, gradient_buffers: int):
    """Three AdamW steps of both, equal after each; ``ours``' gradients lie in
    ``gradient_buffers`` buffers (where there is a reduce-scatter). Returns our optimizer."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
    for step in range(3):
        batch = rank_slice(batch_of(step, 2 * world_size), rank, world_size)
        for m in (ours, theirs):
            loss_of(m, batch).backward()
        if world_size > 1:  # one rank keeps each gradient itself (no reduce-scatter)
            assert len({id(_grad_base(p)) for p in ours.parameters()}) == gradient_buffers
        for o in opts:
            o.step()
            o.zero_grad()
        _assert_equal(ours, theirs, f"step {step}")
    return opts[0]


def _one_arena_one_run(rank, world_size):
    """Blocks and root wrapped bottom-up share one arena; AdamW steps it as one run, bitwise
    to upstream's fully_shard, with its gradients views of one buffer."""
    ours, theirs = _with_upstream()
    assert len(_homes(ours)) == 1
    arena = _arena_of(ours)
    storage = arena.buffer.untyped_storage()
    for p in ours.parameters():  # a storage of its own over the arena's memory
        local = p.to_local()
        if local.numel():
            assert storage.data_ptr() <= local.data_ptr() < storage.data_ptr() + storage.nbytes()
    opt = _step_side_by_side(ours, theirs, rank, world_size, gradient_buffers=1)
    assert len(flat_step_engine(opt).runs()) == 1


def _gradients_freed_and_never_overwritten(rank, world_size):
    """zero_grad(set_to_none=True) frees the gradient buffer at once; a gradient a caller
    holds keeps its values through later backwards."""
    model = build_transformer(seed=5)
    shard_transformer(model, fsdp2.fully_shard, mesh=cpu_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, rank, world_size, 1)
    loss_of(model, rank_slice(batch_of(1, 2 * world_size), rank, world_size)).backward()
    p = next(model.parameters())
    held, values = p.grad, full(p.grad).clone()
    base = weakref.ref(_grad_base(p))
    opt.step()
    opt.zero_grad()
    assert base() is not None  # the held gradient keeps it
    _train(model, opt, rank, world_size, 2, first=2)  # new gradients, another buffer
    assert torch.equal(full(held), values)
    del held
    assert base() is None, "the gradient buffer outlived every gradient"
    loss_of(model, rank_slice(batch_of(4, 2 * world_size), rank, world_size)).backward()
    base = weakref.ref(_grad_base(p))
    opt.step()
    opt.zero_grad()
    assert base() is None, "zero_grad(set_to_none=True) left the gradient buffer alive"
    # gradients set to None by hand between backwards: a fresh buffer, the old one left alone
    loss_of(model, rank_slice(batch_of(5, 2 * world_size), rank, world_size)).backward()
    held = {n: (q.grad, full(q.grad).clone()) for n, q in model.named_parameters()}
    for q in model.parameters():
        q.grad = None
    loss_of(model, rank_slice(batch_of(6, 2 * world_size), rank, world_size)).backward()
    for name, (grad, value) in held.items():
        assert torch.equal(full(grad), value), f"{name}'s held gradient was overwritten"


def _state_dict_from_wrap_time_stays_live(rank, world_size):
    """A state dict taken right after fully_shard (torchtitan caches one) views the live
    parameters after training: the arena is made at wrap time, not under it."""
    model = build_transformer(seed=5)
    shard_transformer(model, fsdp2.fully_shard, mesh=cpu_mesh())
    held = model.state_dict()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, rank, world_size, 2)
    for name, p in model.named_parameters():
        assert torch.equal(held[name].to_local(), p.to_local()), f"{name} went stale"


def _leaving_the_arena(rank, world_size):
    """Groups that re-allocate their buffers (``model.to(torch.float64)`` after a step) leave
    the arena; the runs are cut again and training goes on bit for bit as the DTensor step
    (upstream's fully_shard refuses that conversion after a backward)."""
    ref = build_transformer(seed=5)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    models = (ours, theirs)
    for m in models:
        shard_transformer(m, fsdp2.fully_shard, mesh=cpu_mesh())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]  # no state to convert
    fsdp2.disable_flat_step(opts[1])
    for m, o in zip(models, opts):
        _train(m, o, rank, world_size, 1)
    arena = _arena_of(ours)
    before = arena.buffer
    for m in models:
        m.to(torch.float64)
    for m, o in zip(models, opts):
        _train(m, o, rank, world_size, 2, first=1)
    _assert_equal(ours, theirs, "in float64")
    assert arena.buffer is not before  # its layout changed: runs over it are cut again
    assert arena not in [flat_slot_of(p).home for p in ours.parameters()]  # every group left
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    assert len(flat_step_engine(opts[0]).runs()) > 1


def _to_empty_in_one_allocation(rank, world_size):
    """to_empty on a meta model places every group in one allocation (no copy at the first
    forward), and the model trains as the same model built on CPU."""
    cpu_model = build_transformer(seed=5)
    with torch.device("meta"):
        meta_model = build_transformer(seed=5)
    models = [cpu_model, meta_model]
    for m in models:
        shard_transformer(m, fsdp2.fully_shard, mesh=cpu_mesh())
    meta_model.to_empty(device="cpu")
    storage = next(meta_model.layers[0].parameters()).to_local().untyped_storage()
    with torch.no_grad():
        for p, q in zip(meta_model.parameters(), cpu_model.parameters()):
            p.to_local().copy_(q.to_local())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for m, o in zip(models, opts):
        _train(m, o, rank, world_size, 2)
    _assert_equal(meta_model, cpu_model, "to_empty then trained")
    assert len(_homes(meta_model)) == 1  # one arena, the one to_empty allocated: never moved
    local = next(meta_model.layers[0].parameters()).to_local()
    assert local.untyped_storage().data_ptr() == storage.data_ptr()
    assert all(isinstance(p, DTensor) for p in meta_model.parameters())


def _accelerator_layout(rank, world_size):
    """Where an arena keeps no shared gradient buffer (an accelerator's: its allocator would
    commit it whole at the first reduction), each group reduces into its own and steps as
    a run of its own, bitwise to upstream's fully_shard."""
    ours, theirs = _with_upstream()
    arena = _arena_of(ours)
    arena.shares_gradients = False  # as on an accelerator (see Arena.shares_gradients)
    groups = {id(flat_slot_of(p).group) for p in ours.parameters()}
    assert len(_homes(ours)) == len(groups) > 1  # each group its own layout for the step
    opt = _step_side_by_side(ours, theirs, rank, world_size, gradient_buffers=len(groups))
    assert len(flat_step_engine(opt).runs()) == len(groups)


def _parameter_major_groups(rank, world_size):
    """RaggedShard groups share one arena too: their old buffers are freed (a rank holding none
    of a parameter's rows holds no memory for it), and training is bitwise to the same groups
    each in a buffer of its own (arenas kept off while wrapping the reference)."""
    from fsdp2.runtime.storage.flat_shard import FlatShard

    moved = []
    ragged = {"shard_placement_fn": lambda p: fsdp2.RaggedShard()}
    ref, ours = build_transformer(seed=5), build_transformer(seed=5)
    can_join = FlatShard.can_join
    FlatShard.can_join = lambda self: False
    try:
        shard_transformer(ref, fsdp2.fully_shard, mesh=cpu_mesh(), **ragged)
    finally:
        FlatShard.can_join = can_join
    move_into = FlatShard.move_into

    def watched(self, arena, buffer):
        moved.append(weakref.ref(self.buffer.untyped_storage()))
        move_into(self, arena, buffer)

    FlatShard.move_into = watched
    try:
        shard_transformer(ours, fsdp2.fully_shard, mesh=cpu_mesh(), **ragged)
    finally:
        FlatShard.move_into = move_into
    assert len(_homes(ours)) == 1 and len(_homes(ref)) > 1
    assert moved and all(old() is None for old in moved), "an old buffer outlived the move"
    for p in ours.parameters():
        if p.to_local().numel() == 0:
            assert p.to_local().untyped_storage().nbytes() == 0
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, ref)]
    for m, o in zip((ours, ref), opts):
        _train(m, o, rank, world_size, 3)
    _assert_equal(ours, ref, "parameter-major groups in an arena")
    assert len(flat_step_engine(opts[0]).runs()) < len(flat_step_engine(opts[1]).runs())


CASES = {
    "one_arena_one_run": _one_arena_one_run,
    "gradients_freed": _gradients_freed_and_never_overwritten,
    "state_dict_live": _state_dict_from_wrap_time_stays_live,
    "leaving": _leaving_the_arena,
    "to_empty": _to_empty_in_one_allocation,
    "accelerator_layout": _accelerator_layout,
    "parameter_major": _parameter_major_groups,
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_arena(world_size, case, launch_cases):
    """Each case of CASES, all in one launch per world size (W = 4 has empty shards)."""
    check_case(launch_cases(world_size, CASES), case)
