"""The suite's shared-memory backend gives what gloo gives, op by op, and refuses what gloo refuses.

Most multi-rank tests run on ``tests/_shm_backend.py`` (gloo's wake-ups cost
0.6-1.6 ms a collective on a small VM). Its results must be gloo's: the same
battery of every collective, point-to-point and object collective runs on
both, on the world and on a subgroup, and every output must be equal (the
values are integers, so any summation order gives the same bits).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _multiproc import RankError, run_ranks
from _shm_backend import NAME, available

pytestmark = pytest.mark.skipif(not available(), reason="the shared-memory backend needs x86")


def _ints(rank: int, n: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n) % 7 + 3 * rank + 1).to(dtype)


def _battery(rank: int, world_size: int, group=None) -> dict[str, object]:
    """Every op once on ``group`` (``None``: the world); what each produced on this rank."""
    out: dict[str, object] = {}
    w = dist.get_world_size(group)
    me = dist.get_rank(group)
    for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        t = _ints(me, 5)
        dist.all_reduce(t, getattr(dist.ReduceOp, op), group=group)
        out[f"all_reduce_{op}"] = t
    t = _ints(me, 6, torch.bfloat16)
    dist.all_reduce(t, group=group)
    out["all_reduce_bf16"] = t
    empty = torch.empty(0)
    dist.all_reduce(empty, group=group)
    nothing = torch.empty(0)
    dist.all_gather_into_tensor(nothing, torch.empty(0), group=group)
    out["empty"] = [empty, nothing]
    big = _ints(me, 40_000)  # past a slot's first size: the payload moves to a new file
    dist.all_reduce(big, group=group)
    out["all_reduce_big"] = big
    gathered = torch.empty(3 * w)
    work = dist.all_gather_into_tensor(gathered, _ints(me, 3), group=group, async_op=True)
    work.wait()
    out["all_gather_into_tensor"] = gathered
    parts = [torch.empty(2, 2, dtype=torch.int64) for _ in range(w)]
    dist.all_gather(parts, _ints(me, 4, torch.int64).view(2, 2), group=group)
    out["all_gather"] = parts
    shard = torch.empty(2)
    dist.reduce_scatter_tensor(shard, _ints(me, 2 * w), group=group)
    out["reduce_scatter_tensor"] = shard
    shard = torch.empty(3)
    dist.reduce_scatter(shard, [_ints(me + r, 3) for r in range(w)], group=group)
    out["reduce_scatter"] = shard
    src = dist.get_global_rank(group, w - 1) if group is not None else w - 1
    t = _ints(me, 4)
    dist.broadcast(t, src=src, group=group)
    out["broadcast"] = t
    dist.barrier(group=group)
    # uneven all-to-all: rank i sends i + j + 1 rows of 2 to rank j
    rows_in = [me + j + 1 for j in range(w)]
    rows_out = [i + me + 1 for i in range(w)]
    received = torch.empty(sum(rows_out), 2)
    dist.all_to_all_single(received, _ints(me, 2 * sum(rows_in)).view(-1, 2), rows_out, rows_in,
                           group=group)
    out["all_to_all_single"] = received
    lists = [torch.empty(2) for _ in range(w)]  # (gloo takes equal sizes only here)
    dist.all_to_all(lists, [_ints(me * 10 + j, 2) for j in range(w)], group=group)
    out["all_to_all"] = lists
    dst = src
    t = _ints(me, 3)
    dist.reduce(t, dst=dst, group=group)
    out["reduce"] = t if rank == dst else None
    gathered_list = [torch.empty(2) for _ in range(w)] if rank == dst else None
    dist.gather(_ints(me, 2), gathered_list, dst=dst, group=group)
    out["gather"] = gathered_list
    piece = torch.empty(2)
    dist.scatter(piece, [_ints(r, 2) for r in range(w)] if rank == dst else None, src=dst, group=group)
    out["scatter"] = piece
    objects = [None] * w
    dist.all_gather_object(objects, {"rank": me, "pad": "x" * me}, group=group)
    out["all_gather_object"] = objects
    box = [{"from": me}]
    dist.broadcast_object_list(box, src=src, group=group)
    out["broadcast_object_list"] = box
    if w > 1:  # a ring: each sends to the next, receives from the previous (isend first)
        to = dist.get_global_rank(group, (me + 1) % w) if group is not None else (me + 1) % w
        frm = dist.get_global_rank(group, (me - 1) % w) if group is not None else (me - 1) % w
        got = torch.empty(3)
        sent = dist.isend(_ints(me, 3), dst=to, group=group)
        dist.irecv(got, src=frm, group=group).wait()
        sent.wait()
        out["ring"] = got
    out["funcol_all_gather"] = funcol.all_gather_tensor(_ints(me, 2), 0, group or dist.group.WORLD)
    out["funcol_reduce_scatter"] = funcol.reduce_scatter_tensor(
        _ints(me, 2 * w), "sum", 0, group or dist.group.WORLD
    )
    return {k: v.wait() if isinstance(v, funcol.AsyncCollectiveTensor) else v
            for k, v in out.items()}


def _world_and_subgroup(rank: int, world_size: int) -> dict[str, object]:
    sub = dist.new_group(sorted({0, world_size - 1}))
    out = {f"world/{k}": v for k, v in _battery(rank, world_size).items()}
    if rank in (0, world_size - 1):
        out.update({f"sub/{k}": v for k, v in _battery(rank, world_size, sub).items()})
    out["backend"] = dist.get_backend()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_op_gives_what_gloo_gives(world_size):
    """The same battery on gloo and on the shared-memory backend: equal outputs on every rank."""
    theirs = run_ranks(_world_and_subgroup, world_size, backend="gloo")
    ours = run_ranks(_world_and_subgroup, world_size, backend=NAME)
    for rank, (mine, gloo) in enumerate(zip(ours, theirs)):
        assert mine.pop("backend") == NAME and gloo.pop("backend") == "gloo"
        assert mine.keys() == gloo.keys()
        for key in gloo:
            want, got = gloo[key], mine[key]
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want), (rank, key, got, want)
            elif isinstance(want, list) and want and isinstance(want[0], torch.Tensor):
                assert all(torch.equal(g, t) for g, t in zip(got, want, strict=True)), (rank, key)
            else:
                assert got == want, (rank, key, got, want)


def _mismatched_sizes(rank, world_size):
    dist.all_reduce(torch.ones(3 + rank))


def test_ranks_that_disagree_fail_on_every_rank():
    """Different sizes in one collective: a RuntimeError naming it on every rank, not a wrong read."""
    with pytest.raises(RankError) as info:
        run_ranks(_mismatched_sizes, 2, backend=NAME)
    text = str(info.value)
    assert "rank 0 raised" in text and "rank 1 raised" in text
    assert text.count("called different collectives or sizes") == 2


def _refusals(rank, world_size):
    """What this backend refused (gloo's refusals must be ours)."""
    refused = []
    for name, call in {
        "premul_sum": lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(0.5)),
        "float8": lambda: dist.all_reduce(torch.ones(2).to(torch.float8_e4m3fn)),
    }.items():
        try:
            call()
        except RuntimeError:
            refused.append(name)
    return refused


@pytest.mark.parametrize("backend", ["gloo", NAME])
def test_what_gloo_refuses_is_refused(backend):
    """PREMUL_SUM (NCCL's) and float8 (gloo has no float8): a RuntimeError on both backends."""
    assert run_ranks(_refusals, 2, backend=backend) == [["premul_sum", "float8"]] * 2
