"""torch 2.13's communication settings on FSDPModule, and share_comm_ctx, against upstream.

- ``set_reduce_scatter_unused_params(True)``: a parameter used on rank 0 only
  gets zeros reduced on the other ranks, so every rank reduce-scatters the same
  parameters; gradients equal upstream's and the reference's. (Without the
  flag the ranks would issue reduce-scatters of different sizes, which a real
  backend reports as a mismatch or hangs on: not run here.) A parameter unused
  everywhere gets a zero gradient with the flag, none without.
- ``set_separate_reduce_scatter_group``: reduce-scatters run on a group of
  their own over the shard group's ranks (FSDP and HSDP), back on the shard
  group after ``False``; same numerics.
- ``set_reduce_scatter_max_input_buffers``, ``set_allocate_memory_from_process_group_for_comm``:
  upstream's argument checks; on gloo neither changes a result.
- ``set_symm_mem_for_comm``: the same outcome as upstream at call time (on a
  CPU-only build both raise "SymmetricMemory does not find allocation
  backend"); with a custom comm both raise upstream's AssertionError.
- ``share_comm_ctx``: two model chunks (each an FSDP root) run back to back
  issue the very collectives upstream issues from the second step on, shared
  or not; shared, the second chunk's backward prefetches the first chunk's
  root (upstream's first step is off: see ``_share_comm_ctx``).

W = 2 and 4; every case also trains against a single-process reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as upstream
import torch.nn as nn
from _impl import FSDPModule, fully_shard, share_comm_ctx
from checks import (
    TorchAllGather,
    TorchReduceScatter,
    check_case,
    count_collectives,
    on_collectives,
    train_alone,
)
from models import (
    assert_grads_match,
    build_mlp,
    cpu_mesh,
    global_mean,
    mlp_batch,
    mlp_loss,
    rank_slice,
    shard_mlp,
)
from torch.distributed.device_mesh import init_device_mesh

IMPLS = {"ours": fully_shard, "upstream": upstream.fully_shard}


class _Cond(nn.Module):
    """``extra`` runs only when asked: conditional computation (MoE, multi-modal)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(7, 6)
        self.extra = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x, use_extra: bool):
        h = torch.tanh(self.shared(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def _full_grads(model):
    return {
        n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()
    }


def _unused_params_case(users):
    """``extra`` used on the ranks in ``users`` (a set); the flag on for both implementations."""

    def case(rank, world_size):
        torch.manual_seed(0)
        ref = _Cond()
        results = []
        for shard in IMPLS.values():
            model = copy.deepcopy(ref)
            shard(model.shared, mesh=cpu_mesh())
            shard(model, mesh=cpu_mesh())
            model.set_reduce_scatter_unused_params(True)
            results.append(model)
        ours, theirs = results
        x, y = mlp_batch(0, 2 * world_size)
        ref_loss = sum(
            nn.functional.mse_loss(ref(*(rank_slice((x,), r, world_size)), r in users),
                                   rank_slice((y,), r, world_size)[0])
            for r in range(world_size)
        ) / world_size
        ref_loss.backward()
        xs, ys = rank_slice((x, y), rank, world_size)
        for model in (ours, theirs):
            nn.functional.mse_loss(model(xs, rank in users), ys).backward()
        grads, up_grads = _full_grads(ours), _full_grads(theirs)
        for name, grad in grads.items():
            assert grad is not None, f"{name}: no gradient (flag on)"
            assert torch.equal(grad, up_grads[name]), name
        if users:
            assert_grads_match(ref, ours)
        else:  # unused everywhere: zeros, where the reference has none
            assert not grads["extra.weight"].any() and not grads["extra.bias"].any()

    return case


def _unused_flag_off(rank, world_size):
    """Without the flag a parameter unused on every rank has no gradient (both implementations)."""
    for shard in IMPLS.values():
        torch.manual_seed(0)
        model = _Cond()
        shard(model, mesh=cpu_mesh())
        model.set_reduce_scatter_unused_params(True)
        model.set_reduce_scatter_unused_params(False)
        x, y = rank_slice(mlp_batch(0, 2 * world_size), rank, world_size)
        nn.functional.mse_loss(model(x, False), y).backward()
        assert model.extra.weight.grad is None and model.head.weight.grad is not None


# ---- which group reduce-scatters -------------------------------------------------------


def _groups_of(kind_wanted):
    seen = []

    def record(kind, args, kwargs):
        if kind == kind_wanted:
            seen.append(kwargs.get("group"))

    return seen, on_collectives(record)


def _separate_group_case(hsdp):
    def case(rank, world_size):
        mesh = (init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
                if hsdp else cpu_mesh())
        shard_group = mesh.get_group(mesh.ndim - 1)
        for name, shard in IMPLS.items():
            ref, model = build_mlp(seed=3), build_mlp(seed=3)
            shard_mlp(model, shard, mesh=mesh)
            model.set_separate_reduce_scatter_group()
            batch = mlp_batch(0, 2 * world_size)
            mlp_loss(ref, batch).backward()
            rs_groups, recording = _groups_of("reduce_scatter")
            ag_groups, recording_ag = _groups_of("all_gather")
            with recording, recording_ag:
                mlp_loss(model, rank_slice(batch, rank, world_size)).backward()
            assert_grads_match(ref, model)
            assert len(rs_groups) == 3 and len({id(g) for g in rs_groups}) == 1, (name, rs_groups)
            rs_group = rs_groups[0]
            assert rs_group is not shard_group and all(g is shard_group for g in ag_groups), name
            assert dist.get_process_group_ranks(rs_group) == dist.get_process_group_ranks(
                shard_group), name
            model.set_separate_reduce_scatter_group(False)
            rs_groups, recording = _groups_of("reduce_scatter")
            with recording:
                mlp_loss(model, rank_slice(batch, rank, world_size)).backward()
            assert all(g is shard_group for g in rs_groups), name

    return case


# ---- settings that change no result on gloo ---------------------------------------------


def _raises(exc_type, match, fn):
    try:
        fn()
    except exc_type as e:
        assert match in str(e), (match, str(e))
        return
    raise AssertionError(f"expected {exc_type.__name__} containing {match!r}")


def _no_result_change(rank, world_size):
    """Max input buffers and process-group memory: checked arguments, the default's numerics."""
    baseline, base_counts = None, {}
    for name, shard in IMPLS.items():
        for setting in ("default", "buffers", "pg_memory"):
            model = shard_mlp(build_mlp(seed=5), shard, mesh=cpu_mesh())
            if setting == "buffers":
                model.set_reduce_scatter_max_input_buffers(3)
                model.set_reduce_scatter_max_input_buffers(2, recurse=False)
            elif setting == "pg_memory":
                for m in model.modules():
                    if isinstance(m, (FSDPModule, upstream.FSDPModule)):
                        m.set_allocate_memory_from_process_group_for_comm(True)
            with count_collectives() as counts:
                batches = [mlp_batch(step, 2 * world_size) for step in range(3)]
                losses = train_alone(model, batches, mlp_loss, rank, world_size)
            assert counts == base_counts.setdefault(name, counts), (name, setting, counts)
            baseline = losses if baseline is None else baseline
            assert losses == baseline, (name, setting, losses, baseline)
        model = shard_mlp(build_mlp(), shard, mesh=cpu_mesh())
        _raises(TypeError, "max_input_buffers must be an int, got bool",
                lambda m=model: m.set_reduce_scatter_max_input_buffers(True))
        _raises(TypeError, "max_input_buffers must be an int, got float",
                lambda m=model: m.set_reduce_scatter_max_input_buffers(1.5))
        _raises(ValueError, "max_input_buffers must be a positive int, got 0",
                lambda m=model: m.set_reduce_scatter_max_input_buffers(0))
        model.set_custom_all_gather(TorchAllGather())
        _raises(AssertionError, "cannot call set_allocate_memory_from_process_group() when all "
                "gather comm is custom: TorchAllGather",
                lambda m=model: m.set_allocate_memory_from_process_group_for_comm(True))
        model = shard_mlp(build_mlp(), shard, mesh=cpu_mesh())
        model.set_custom_reduce_scatter(TorchReduceScatter())
        _raises(AssertionError, "cannot call set_allocate_memory_from_process_group() when "
                "reduce scatter comm is custom: TorchReduceScatter",
                lambda m=model: m.set_allocate_memory_from_process_group_for_comm(True))


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what we compare
        return type(e).__name__, str(e).split(". fsdp2:")[0]
    return "ok", ""


def _symm_mem(rank, world_size):
    """set_symm_mem_for_comm: upstream's outcome at call time; custom comms refused alike."""
    outcomes = []
    for shard in IMPLS.values():
        model = shard_mlp(build_mlp(), shard, mesh=cpu_mesh())
        outcomes.append(_outcome(model.set_symm_mem_for_comm))
        model = shard_mlp(build_mlp(), shard, mesh=cpu_mesh())
        model.set_custom_all_gather(TorchAllGather())
        _raises(AssertionError, "cannot call set_symm_mem() when all gather comm is custom: "
                "TorchAllGather", model.set_symm_mem_for_comm)
    assert outcomes[0] == outcomes[1], outcomes
    if not torch.cuda.is_available():
        assert outcomes[0][0] in ("RuntimeError", "ok"), outcomes


# ---- share_comm_ctx ------------------------------------------------------------------------


def _chunks(shard):
    """Two pipeline-style chunks, each its own FSDP root (resharding after forward) over per-layer groups."""
    chunks = []
    for seed in (11, 12):
        torch.manual_seed(seed)
        chunk = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 5), nn.Tanh(),
                              nn.Linear(5, 7))
        for layer in (chunk[0], chunk[2]):
            shard(layer, mesh=cpu_mesh())
        shard(chunk, mesh=cpu_mesh(), reshard_after_forward=True)
        chunks.append(chunk)
    return chunks


def _run_chunks(shard, sharer, rank, world_size):
    """Two steps through both chunks; the second step's collectives, losses, last grads."""
    first, second = _chunks(shard)
    if sharer is not None:
        sharer([first, second])
    log, losses = [], []
    for step in range(2):
        for p in (*first.parameters(), *second.parameters()):
            p.grad = None
        x, y = rank_slice(mlp_batch(step, 2 * world_size, out_dim=7), rank, world_size)
        log.clear()
        with count_collectives(log):
            loss = nn.functional.mse_loss(second(first(x.requires_grad_())), y)
            loss.backward()
        losses.append(global_mean(loss))
    ref = _chunks(lambda m, **kw: m)
    full_x, full_y = mlp_batch(1, 2 * world_size, out_dim=7)
    nn.functional.mse_loss(ref[1](ref[0](full_x)), full_y).backward()
    for chunk, ref_chunk in zip((first, second), ref):
        assert_grads_match(ref_chunk, chunk)
    return list(log), torch.stack(losses)


def _share_comm_ctx(rank, world_size):
    """Shared or not, step 2 issues upstream's collectives; sharing lets chunk 2 prefetch chunk 1.

    (Upstream's first step differs: the second root's lazy init empties the
    shared forward order that the first root's groups already index into, so
    that backward prefetches the wrong groups, an all-gather each, wasted.)
    """
    runs = {}
    for share in (False, True):
        for name, shard in IMPLS.items():
            sharer = None
            if share:
                sharer = share_comm_ctx if name == "ours" else upstream.share_comm_ctx
            runs[name, share] = _run_chunks(shard, sharer, rank, world_size)
        (log, losses), (up_log, up_losses) = runs["ours", share], runs["upstream", share]
        assert log == up_log, (share, "\n".join(f"{a} {b}" for a, b in zip(log, up_log)))
        assert torch.equal(losses, up_losses), (share, losses, up_losses)
    # the first chunk's root is gathered during the second chunk's backward only when shared
    assert runs["ours", True][0] != runs["ours", False][0]
    _raises(ValueError, "Expects list of FSDPModules but got",
            lambda: share_comm_ctx([nn.Linear(2, 2)]))
    share_comm_ctx([])


CASES_2 = {
    "unused_on_rank0_only": _unused_params_case({0}),
    "unused_everywhere": _unused_params_case(set()),
    "unused_flag_off": _unused_flag_off,
    "separate_group": _separate_group_case(hsdp=False),
    "no_result_change": _no_result_change,
    "symm_mem": _symm_mem,
    "share_comm_ctx": _share_comm_ctx,
}
CASES_4 = {
    "unused_on_rank0_only": _unused_params_case({0}),
    "separate_group": _separate_group_case(hsdp=False),
    "separate_group_hsdp": _separate_group_case(hsdp=True),
    "share_comm_ctx": _share_comm_ctx,
}


CASES = {2: CASES_2, 4: CASES_4}


@pytest.mark.parametrize("world_size", [2, 4])
def test_unused_params_on_some_ranks_reduce_zeros(world_size, launch_cases):
    """set_reduce_scatter_unused_params: a param used on rank 0 only; grads equal upstream and reference."""
    check_case(launch_cases(world_size, CASES[world_size]), "unused_on_rank0_only")


def test_unused_everywhere_gets_zeros_with_the_flag_none_without(launch_cases):
    """A parameter no rank uses: zero gradient with the flag, None without (as upstream)."""
    check_case(launch_cases(2, CASES_2), "unused_everywhere")
    check_case(launch_cases(2, CASES_2), "unused_flag_off")


@pytest.mark.parametrize("world_size,case", [(2, "separate_group"), (4, "separate_group"),
                                             (4, "separate_group_hsdp")])
def test_separate_reduce_scatter_group(world_size, case, launch_cases):
    """Reduce-scatters on their own group over the shard ranks, then back; reference gradients."""
    check_case(launch_cases(world_size, CASES[world_size]), case)


def test_buffer_cap_and_process_group_memory_change_no_result(launch_cases):
    """set_reduce_scatter_max_input_buffers / _allocate_memory_from_process_group: checks, same losses."""
    check_case(launch_cases(2, CASES_2), "no_result_change")


def test_symm_mem_outcome_matches_upstream(launch_cases):
    """set_symm_mem_for_comm raises (or not) as upstream on this build; custom comms are refused."""
    check_case(launch_cases(2, CASES_2), "symm_mem")


@pytest.mark.parametrize("world_size", [2, 4])
def test_share_comm_ctx_issues_upstreams_collectives(world_size, launch_cases):
    """Two chunk roots, shared or not: the same collective sequence and losses as upstream."""
    check_case(launch_cases(world_size, CASES[world_size]), "share_comm_ctx")
