"""FSDP's streams proven race-free on CPU with the stream-order checker (tests/stream_checker.py).

Each planted missing wait must be caught; the training matrix must run with no
race and match the unsharded reference. See [Note: Streams] in
fsdp2/runtime/comm/comm_context.py.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from checks import (
    TorchAllGather,
    bind_row_hooks,
    check_case,
    packed_everywhere,
    train_alone,
    train_steps,
)
from models import (
    assert_params_match,
    build_chain,
    build_transformer,
    chain_batch,
    expert_parallel,
    make_pair,
    mlp_loss,
    moe_batch,
    moe_loss,
    moe_meshes,
    rank_slice,
    shard_chain,
    shard_moe,
    shard_transformer,
    toy_moe,
    transformer_batch,
    transformer_loss,
)
from stream_checker import StreamChecker
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from fsdp2 import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    Muon,
    RaggedShard,
    enable_local_shard_step,
    fully_shard,
)
from fsdp2.runtime.comm import comm_context
from fsdp2.versions import ACCUMULATE_PROFILER_RANGE

STEPS = 3


def _checked_run(rank, world_size, edge=None, *, check_ref=True, accumulate=False, prefetch=False,
           post_optim_event=False, mesh=None, hook_stream=False, finalize_async=False,
           checkpointed=False, muon=False, compiled=False, custom_all_gather=False,
           keep_storage=False, max_input_buffers=1, replica_slices=False, row_hooks=False,
           unshard_async_op=False, **kwargs):
    """Train a Chain under the checker; returns its errors (and checks parity with no edge skipped)."""
    ref, model = make_pair(build_chain)
    if compiled:  # one block compiled, as tests/test_compile.py does
        model.layers[1].compile(backend="aot_eager")
    shard_chain(model, fully_shard, mesh=mesh, **kwargs)
    if checkpointed:  # every block recomputed in backward (its all-gather again)
        layers, head = list(model.layers), model.head

        def forward(x):
            for layer in layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return head(x)

        model.forward = forward
    if row_hooks:  # the parameter-major layout's staged all-gather: hooks beside plain rows
        hooked = []
        bind_row_hooks(model, lambda name, p: p.dim() == 2, hooked)
    if custom_all_gather:  # the staged all-gather path (a user comm with its own buffers)
        for m in [*model.layers, model]:
            m.set_custom_all_gather(TorchAllGather())
    if finalize_async:
        model.set_manual_backward_finalization(True)
    if max_input_buffers != 1:  # reductions in flight at once (read at lazy init)
        model.set_reduce_scatter_max_input_buffers(max_input_buffers)
    if unshard_async_op:  # upstream's private switch: gathers on the compute stream, async
        model._set_unshard_async_op(True)
    if keep_storage:  # every unshard writes the memory the last step's compute read
        model.set_keep_unsharded_storage(True)
    if prefetch:
        layers = list(model.layers)
        for a, b in zip(layers, layers[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    if muon:  # fsdp2.Muon on the matrices (its own collectives), SGD on the rest
        opts = ([torch.optim.Muon([p for p in ref.parameters() if p.ndim == 2], lr=0.02),
                 torch.optim.SGD([p for p in ref.parameters() if p.ndim != 2], lr=0.1)],
                [Muon([(n, p) for n, p in model.named_parameters() if p.ndim == 2], lr=0.02),
                 torch.optim.SGD([p for p in model.parameters() if p.ndim != 2], lr=0.1)])
    else:
        opts = (torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1))
    handle = None
    if replica_slices:  # HSDP, state sharded across replicas, its all-gather left in flight
        handle = enable_local_shard_step(opts[1], shard_across_replicas=True,
                                         overlap_replica_gather=True)
    if compiled:  # compile outside the checker; under it the compiled block runs
        mlp_loss(model, rank_slice(chain_batch(0, 8), rank, world_size)).backward()
        model.zero_grad()
    checker = StreamChecker(skip=edge)
    seen = []

    def record_post_optim_event():
        event = checker.new_event()
        event.record()
        model.set_post_optim_event(event)

    compare = check_ref and not edge
    batches = [chain_batch(step, 8) for step in range(STEPS)]
    if compare and replica_slices:  # gradients hold only this replica's slice: compare the end
        train_alone(ref, batches, mlp_loss, opt=opts[0])
    with checker:
        if hook_stream:
            # HSDP: the hook follows FSDP's all-reduce on its stream (a stream of its own is refused)
            stream = None if mesh is not None else checker.new_stream("hook")
            model.set_all_reduce_hook(lambda t: seen.append(t.sum()), stream=stream)
        with_ref = compare and not replica_slices
        train_steps(
            ref if with_ref else None, model, batches,
            mlp_loss, rank, world_size, opts if with_ref else (None, opts[1]), mean=False,
            micro_batches=2 if accumulate else 1,
            after_backward=(lambda: model.finalize_backward(async_op=True).wait())
            if finalize_async else None,
            after_step=record_post_optim_event if post_optim_event else None,
        )
    if hook_stream and not edge:
        assert len(seen) > 0
    if row_hooks:  # every tiled weight's pre hook ran: the staged path, not the plain one
        assert set(hooked) == {n for n, p in model.named_parameters() if p.dim() == 2}, hooked
    if handle is not None:
        handle.wait_for_parameters()
    if compare:  # the parameters after the last step too
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.full_tensor(), a.detach(), rtol=1e-5, atol=1e-6, msg=name)
    return checker.errors


def _planted(rank, world_size):
    out = {}
    for buffers in (1, 2):  # one reduction in flight, or two (set_reduce_scatter_max_input_buffers)
        for edge in CAUGHT:
            kwargs = {"offload_policy": CPUOffloadPolicy()} if edge == "offload->optimizer" else {}
            errors = _checked_run(rank, world_size, edge, post_optim_event=edge == "post_optim->all_gather",
                            max_input_buffers=buffers, **kwargs)
            out[buffers, edge] = errors[:2]
        out[buffers, "none"] = _checked_run(rank, world_size, max_input_buffers=buffers)
    return out


def test_each_planted_missing_wait_is_caught(launch_cases):
    """Every named wait left out is a race the checker reports, with 1 or 2 reductions in flight."""
    ok, per_rank = launch_cases.run(_planted, 2)
    assert ok, per_rank
    for buffers in (1, 2):
        for rank, result in enumerate(per_rank):
            none = result[buffers, "none"]
            assert none == [], f"rank {rank}, {buffers}: a race with every wait in place: {none}"
        for edge in CAUGHT:
            # Memory is tracked by bytes, and a rank whose racing access reads only padding
            # no one wrote (rank 1's first group, for one edge) has no race to report.
            found = [result[buffers, edge] for result in per_rank if result[buffers, edge]]
            assert found, f"{buffers}: skipping '{edge}' went unnoticed on every rank"
            for errors in found:
                assert SIGNATURE[edge] in errors[0], (buffers, edge, errors[0])


# The race each skipped wait leaves, as the checker names it (first error).
SIGNATURE = {
    "all_gather->copy_out": "on stream 0 (compute) reads memory that 'all_gather_single' wrote",
    "copy_out->compute": "is reused by stream 1 (copy_in) while 'all_gather_single'",
    "compute->reduce_scatter": "'_chunk_cat' on stream 3 (reduce_scatter) reads memory",
    "reduce_scatter->optimizer": "on stream 0 (compute) reads memory that 'reduce_scatter_single'",
    "offload->optimizer": "on stream 0 (compute) reads memory that 'reduce_scatter_single'",
    "post_optim->all_gather": "'all_gather_single' on stream 5 (process group 0) reads memory",
    "replica_gather->copy_in": "'slice' on stream 1 (copy_in) reads memory that "
                               "'all_gather_single' wrote on stream 6 (process group 1)",
}


# At W=2; the post-forward shard's edge needs a smaller post-forward group, the replica
# gather's an HSDP mesh (both W=4 below), the kept output's the parameter-major layout.
CAUGHT = [e for e in comm_context.EDGES
          if e not in ("post_forward_shard->all_gather", "replica_gather->copy_in",
                       "compute->kept_output")]


def _case(packed: bool = False, **kwargs):
    def case(rank, world_size):
        with packed_everywhere() if packed else contextlib.nullcontext():
            errors = _checked_run(rank, world_size, **kwargs)
        assert errors == [], "\n".join(errors[:5])
    return case


def _hsdp(rank, world_size):
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    errors = _checked_run(rank, world_size, mesh=mesh, hook_stream=True)
    assert errors == [], "\n".join(errors[:5])


def _replica_slices(rank, world_size):
    """HSDP with the state sharded across replicas, the post-step all-gather in flight:
    no race (with and without set_post_optim_event), same parameters as the reference;
    without the named wait, the copy-in stream's copy of the gathered slices is a race."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    for post_optim_event in (False, True):
        errors = _checked_run(rank, world_size, mesh=mesh, replica_slices=True,
                              post_optim_event=post_optim_event)
        assert errors == [], "\n".join(errors[:5])
    planted = _checked_run(rank, world_size, "replica_gather->copy_in", mesh=mesh,
                           replica_slices=True)
    assert planted and SIGNATURE["replica_gather->copy_in"] in planted[0], planted[:2]


def _packed(rank, world_size):
    """The packed plan's copies: no race with every wait in place; the copy-out's and the
    reduce-scatter input's waits, each left out, are races the checker reports."""
    kwargs = {"shard_placement_fn": lambda p: RaggedShard(), "prefetch": True}
    with packed_everywhere():
        errors = _checked_run(rank, world_size, **kwargs)
        assert errors == [], "\n".join(errors[:5])
        for edge in ("all_gather->copy_out", "compute->reduce_scatter"):
            assert _checked_run(rank, world_size, edge, **kwargs), f"skipping '{edge}' went unnoticed"


MATRIX = {
    "default": _case(),
    "no_reshard": _case(reshard_after_forward=False),
    "explicit_prefetch": _case(prefetch=True, post_optim_event=True),
    "mixed_precision": _case(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64)),
    "offload": _case(offload_policy=CPUOffloadPolicy()),
    "accumulate": _case(accumulate=True),
    "hook_on_stream": _case(hook_stream=True),
    "finalize_async": _case(finalize_async=True),
    "checkpointed": _case(checkpointed=True),
    "muon": _case(muon=True),
    "compiled_block": _case(compiled=True),
    "custom_all_gather": _case(custom_all_gather=True),
    "keep_storage": _case(keep_storage=True),
    "unshard_async_op": _case(unshard_async_op=True, prefetch=True),
    "max_input_buffers_2": _case(max_input_buffers=2),
    "max_input_buffers_3_offload": _case(max_input_buffers=3, offload_policy=CPUOffloadPolicy()),
    # the parameter-major layout (docs/layouts.md): gathered into the parameters, no copy-out
    "ragged": _case(shard_placement_fn=lambda p: RaggedShard()),
    "ragged_mixed_precision": _case(shard_placement_fn=lambda p: RaggedShard(4),
                                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64)),
    "ragged_prefetch_no_reshard": _case(shard_placement_fn=lambda p: RaggedShard(), prefetch=True,
                                        reshard_after_forward=False, max_input_buffers=2),
    "ragged_extensions": _case(shard_placement_fn=lambda p: RaggedShard(), row_hooks=True,
                               prefetch=True),
    "ragged_custom_all_gather": _case(shard_placement_fn=lambda p: RaggedShard(),
                                      custom_all_gather=True),
    # the packed plan (RaggedShard where bands outgrow a rank's share): a copy-out again
    "packed": _packed,
    "packed_extensions": _case(packed=True, shard_placement_fn=lambda p: RaggedShard(),
                               row_hooks=True),
}


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_matrix_w2(launch_cases, name):
    check_case(launch_cases(2, MATRIX), name)


def _reshard_int(rank, world_size):
    errors = _checked_run(rank, world_size, reshard_after_forward=2)
    assert errors == [], "\n".join(errors[:5])
    planted = _checked_run(rank, world_size, "post_forward_shard->all_gather", reshard_after_forward=2)
    assert planted and "'cat' wrote on stream 0 (compute)" in planted[0], planted[:2]
    # The parameter-major layout: its gather already waits for the compute stream (the
    # kept output's wait), which orders the kept shard's 'clone' too; that wait is the race
    ragged = {"shard_placement_fn": lambda p: RaggedShard(), "reshard_after_forward": 2}
    for edge in (None, "post_forward_shard->all_gather"):
        errors = _checked_run(rank, world_size, edge, **ragged)
        assert errors == [], (edge, errors[:5])
    planted = _checked_run(rank, world_size, "compute->kept_output", **ragged)
    assert planted, "skipping 'compute->kept_output' went unnoticed"


def _ragged_planted(rank, world_size):
    """The parameter-major layout's own wait, left out, is a race the checker reports."""
    kwargs = {"shard_placement_fn": lambda p: RaggedShard()}
    return _checked_run(rank, world_size, "compute->kept_output", **kwargs)[:2]


def test_the_kept_output_wait_is_caught(launch_cases):
    ok, per_rank = launch_cases.run(_ragged_planted, 2)
    assert ok, per_rank
    for rank, errors in enumerate(per_rank):
        assert errors, f"rank {rank}: skipping 'compute->kept_output' went unnoticed"


def _pipeline(rank, world_size):
    """1F1B over (pp=2, dp=2) with fsdp2's PipelineStage: no race, same losses and parameters."""
    from test_pipelining import _train_pipeline

    import fsdp2.pipelining

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    run = lambda: _train_pipeline("1F1B", fully_shard, fsdp2.pipelining.PipelineStage, mesh)  # noqa: E731
    _, want_losses, want_params, _ = run()
    checker = StreamChecker()
    with checker:
        _, losses, params, _ = run()
    assert checker.errors == [], "\n".join(checker.errors[:5])
    torch.testing.assert_close(losses, want_losses, rtol=0, atol=0)
    torch.testing.assert_close(params, want_params, rtol=0, atol=0)


def _hook_stream_on_cpu(rank, world_size):
    """As upstream's test: a stream is refused on a 2x2 HSDP mesh; on a 1-D mesh the hook
    runs with its stream as the current one (CPU included, without FSDP streams)."""
    device_module = torch.get_device_module("cpu")
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model = build_chain()
    shard_chain(model, fully_shard, mesh=mesh)
    with pytest.raises(ValueError, match="stream cannot be set when using native HSDP"):
        model.set_all_reduce_hook(lambda t: None, stream=device_module.Stream())
    stream, seen = device_module.Stream(), []
    model = build_chain()
    shard_chain(model, fully_shard)
    model.set_all_reduce_hook(lambda t: seen.append(device_module.current_stream()),
                              stream=stream)
    mlp_loss(model, rank_slice(chain_batch(0, 8), rank, world_size)).backward()
    assert seen and all(s is stream for s in seen), seen
    assert device_module.current_stream() is not stream  # restored after the hook


def _two_meshes_one_call(rank, world_size):
    """MoE blocks: a group on dp and one on efsdp per fully_shard call; no race, same results."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    from fsdp2 import ShardPlacementResult

    dp, sparse = moe_meshes("cpu", 2)
    batches = [moe_batch(step, 4 * world_size) for step in range(3)]

    def run():
        model = toy_moe()
        expert_parallel(model, sparse["ep"])
        shard_moe(model, fully_shard, ShardPlacementResult, FSDPMeshInfo, dp, sparse)
        losses = train_alone(model, batches, moe_loss, rank, world_size)
        return losses, {n: p.detach().to_local().clone() for n, p in model.named_parameters()}

    want_losses, want_params = run()
    checker = StreamChecker()
    with checker:
        losses, params = run()
    assert checker.errors == [], "\n".join(checker.errors[:5])
    assert losses == want_losses
    torch.testing.assert_close(params, want_params, rtol=0, atol=0)


def _tensor_parallel(rank, world_size):
    """FSDP x TP (2 x 2, ColwiseParallel and RowwiseParallel) on both layouts: no race, the
    reference's training; each layout's own wait left out is a race the checker reports."""
    import test_tensor_parallel as tp_cases
    from torch.distributed.tensor.parallel import parallelize_module

    mesh, dp_mesh = tp_cases._meshes(("dp",))
    dp_rank, dp_size = tp_cases._dp_rank(dp_mesh), dp_mesh.size()
    batches = [transformer_batch(step, 2 * dp_size) for step in range(STEPS)]
    layouts = {"all_gather->copy_out": {},
               "compute->kept_output": {"shard_placement_fn": lambda p: RaggedShard()}}
    for own_wait, layout in layouts.items():
        for edge in (None, own_wait):
            ref, model = make_pair(lambda: build_transformer(seed=21, hidden=12))
            for layer in model.layers:
                parallelize_module(layer, mesh["tp"], tp_cases.TP_PLAN)
            shard_transformer(model, fully_shard, mesh=dp_mesh, **layout)
            checker = StreamChecker(skip=edge)
            with checker:
                # one step shows a left-out wait
                train_steps(None if edge else ref, model, batches[:1] if edge else batches,
                            transformer_loss, dp_rank, dp_size)
            if edge is None:
                assert checker.errors == [], (layout, checker.errors[:5])
                assert_params_match(ref, model)
            else:
                assert checker.errors, f"skipping {edge!r} went unnoticed ({layout})"


MATRIX_W4 = {"default": _case(), "reshard_int": _reshard_int, "hsdp": _hsdp, "pipeline": _pipeline,
             "ragged": _case(shard_placement_fn=lambda p: RaggedShard()),
             "tensor_parallel": _tensor_parallel,
             "replica_slices": _replica_slices,
             "hook_stream_cpu": _hook_stream_on_cpu, "two_meshes_one_call": _two_meshes_one_call}


@pytest.mark.parametrize("name", sorted(MATRIX_W4))
def test_matrix_w4(launch_cases, name):
    check_case(launch_cases(4, MATRIX_W4), name)


def _forced(rank, world_size):
    os.environ["FSDP2_FORCE_COLLECTIVES"] = "1"
    return {"default": _checked_run(rank, world_size)}


def test_one_rank_forced_collectives(launch_cases):
    ok, per_rank = launch_cases.run(_forced, 1)
    assert ok, per_rank
    assert per_rank[0]["default"] == []


def _profile(rank, world_size):
    """The ``FSDP::`` ranges of one training step in a CPU profile, ours and upstream's."""
    import torch.distributed.fsdp as upstream

    out = {}
    for name, shard in (("ours", fully_shard), ("upstream", upstream.fully_shard)):
        _, model = make_pair(build_chain)
        shard_chain(model, shard)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            mlp_loss(model, rank_slice(chain_batch(0, 8), rank, world_size)).backward()
        out[name] = sorted({e.key for e in prof.key_averages() if e.key.startswith("FSDP::")})
    return out


# The ranges of one CPU training step, by upstream's names (with the group's FQN, as upstream).
RANGES = (
    "FSDP::root_pre_forward", "FSDP::root_post_backward_callback", "FSDP::all_gather",
    "FSDP::all_gather_copy_out", "FSDP::pre_forward", "FSDP::post_forward",
    "FSDP::pre_backward", "FSDP::post_backward_reshard", "FSDP::post_backward_reduce",
    "FSDP::post_backward_rs_wait", "FSDP::backward_prefetch",
) + (("FSDP::post_backward_accumulate",) if ACCUMULATE_PROFILER_RANGE else ())


def test_profiler_ranges_have_upstreams_names(launch_cases):
    """A CPU step opens exactly upstream's range kinds, each with upstream's group labels."""
    ok, per_rank = launch_cases.run(_profile, 2)
    assert ok, per_rank
    ours, theirs = per_rank[0]["ours"], per_rank[0]["upstream"]
    base = lambda k: k.split(" (")[0].split(" for ")[0]  # noqa: E731
    assert {base(k) for k in theirs} == set(RANGES), theirs  # the list is upstream's own
    assert {base(k) for k in ours} == set(RANGES), ours
    assert set(ours) == set(theirs), (sorted(set(ours) ^ set(theirs)), ours, theirs)


def test_cpu_has_no_streams():
    """On CPU the comm context makes no streams, and holds no gradients of reductions."""
    ctx = comm_context.CommContext()
    ctx.init_streams(torch.device("cpu"))
    assert not ctx.active and ctx.copy_in is None
    ctx.hold_reduction([torch.ones(2)], None, offload=False)
    assert [s.grads for s in ctx.reduce_scatter_states] == [[]]


def _bounded(rank, world_size):
    """Peaks while the CPU runs ahead (nothing blocks in checker mode), per prefetch mode.

    Counted from what fsdp2 holds at each allocation (the new buffer included):
    the backend may keep a finished collective's tensors a little longer (gloo's
    worker thread), which no stream ordering of ours governs.
    """
    return {
        (prefetch, buffers): _peaks(rank, world_size, prefetch, buffers)
        for prefetch in (False, True) for buffers in (1, 2)
    }


def _peaks(rank, world_size, prefetch, max_input_buffers):
    from fsdp2.runtime.storage.rank_major import RankMajor

    peak = {"ag": 0, "rs": 0, "groups": 0}
    originals = RankMajor.all_gather_output, RankMajor.reduce_scatter_input

    def tracked(kind, fn):
        def wrapper(*args, **kwargs):
            ctx = groups[0].comm_ctx
            if kind == "ag":
                in_flight = [g for g in groups if g.step.pending_unshard is not None
                             or g.step.pending_staged is not None]
                alive = 1 + len(in_flight) + (ctx.all_gather_state is not None)
                busy = [g for g in groups if g.step.is_unsharded or g in in_flight]
                peak["groups"] = max(peak["groups"], len(busy) + 1)
            else:
                alive = 1 + len(ctx.reduce_scatter_states)
            peak[kind] = max(peak[kind], alive)
            return fn(*args, **kwargs)
        return wrapper

    ref, model = make_pair(build_chain)
    shard_chain(model, fully_shard)
    groups = [m._fsdp_state().param_group for m in [*model.layers, model]]
    model.set_reduce_scatter_max_input_buffers(max_input_buffers)
    if prefetch:
        layers = list(model.layers)
        for a, b in zip(layers, layers[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    RankMajor.all_gather_output = tracked("ag", originals[0])
    RankMajor.reduce_scatter_input = tracked("rs", originals[1])
    checker = StreamChecker()
    try:
        with checker:
            for step in range(2):
                mlp_loss(model, rank_slice(chain_batch(step, 8), rank, world_size)).backward()
    finally:
        RankMajor.all_gather_output, RankMajor.reduce_scatter_input = originals
    assert checker.errors == [], checker.errors[:3]
    assert groups[0].comm_ctx.active
    return peak


def test_memory_bounded_as_upstream(launch_cases):
    """Upstream's bound: the previous all-gather output is released (after the copy-in
    stream waited for its copy-out) before the next is allocated, so one output is
    alive at a time; ``n`` reductions' buffers (``set_reduce_scatter_max_input_buffers(n)``,
    n = 1 and 2: the (n+1)-th waits for the oldest), never more and, over the Chain's
    five groups, reached; and at an all-gather's issue at most the root, the group being
    consumed and the one in flight hold unsharded parameters (the root holds its head)."""
    ok, per_rank = launch_cases.run(_bounded, 2)
    assert ok, per_rank
    for peaks in per_rank:
        for prefetch in (False, True):
            for buffers in (1, 2):
                want = {"ag": 1, "rs": buffers, "groups": 3}
                assert peaks[prefetch, buffers] == want, (prefetch, buffers, peaks)


def test_checker_tracks_memory_not_storage_objects():
    """A DLPack alias (a sharded parameter over its flat buffer) shares the buffer's history."""
    from fsdp2.runtime.storage.shard_storage import own_storage

    for ordered in (False, True):
        buf = torch.zeros(8)
        alias = own_storage(buf[2:6])
        assert alias.untyped_storage()._cdata != buf.untyped_storage()._cdata
        checker = StreamChecker()
        with checker:
            side = checker.new_stream("side")
            with checker.use(side):
                buf.add_(1)
            if ordered:
                checker.current.wait_stream(side)
            alias.mul_(2)
        if ordered:
            assert checker.errors == []
        else:
            assert len(checker.errors) == 1, checker.errors
            assert "'mul_' on stream 0 (compute) writes memory that 'add_' wrote on stream" in (
                checker.errors[0]
            )


def test_checker_puts_a_grown_storage_in_the_pool_it_grew_on():
    """A storage grown by ``resize_`` on one stream and first written on another (a kept
    all-gather output) goes back to the first stream's pool when freed, as the caching
    allocator returns it: a new allocation on the other stream does not reuse it, one on
    the stream it grew on does, and must be ordered after the other stream's use."""
    for alloc_on in ("compute", "side"):
        kept = torch.empty(16)
        kept.untyped_storage().resize_(0)
        checker = StreamChecker()
        with checker:
            side = checker.new_stream("side")
            grow_on = checker.current if alloc_on == "compute" else side
            with checker.use(grow_on):
                kept.untyped_storage().resize_(16 * kept.element_size())
            side.wait_stream(checker.current)
            with checker.use(side):
                kept.fill_(1)  # first written on the side stream
            checker.current.wait_stream(side)
            kept.mul_(2)  # used on compute
            kept.untyped_storage().resize_(0)
            with checker.use(side):
                torch.empty(16).fill_(0)  # a new allocation on the side stream
        if alloc_on == "compute":  # it went back to compute's pool: nothing to reuse
            assert checker.errors == [], checker.errors
        else:
            assert len(checker.errors) == 1, checker.errors
            assert "is reused by stream 1 (side) while 'mul_' on stream 0 (compute)" in (
                checker.errors[0]
            )
