"""FSDPModule's scheduling controls: manual unshard, prefetch lists, when to reshard.

Communication is checked through the public ``torch.distributed`` calls
(``checks.count_collectives``), in issue order and interleaved with the
layers' own forward/backward (``models.Chain`` logs both into one list), so
each test fails if the method under test is ignored. Numbers are checked
against an unsharded reference.
"""

from __future__ import annotations

import pytest
import torch
from _impl import IMPL, FSDPModule, UnshardHandle, fsdp2_only, fully_shard
from _multiproc import run_ranks
from checks import (
    ATOL,
    RTOL,
    assert_losses_match,
    assert_sharded,
    count_collectives,
    make_opts,
    train_steps,
)
from models import (
    assert_grads_match,
    assert_params_match,
    build_chain,
    build_transformer,
    chain_batch,
    chain_group_names,
    cpu_mesh,
    make_pair,
    mlp_loss,
    rank_slice,
    shard_chain,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.tensor import DTensor

WORLD_SIZES = [2, 4]


def _chain_pair(**kwargs):
    ref, model = make_pair(build_chain)
    shard_chain(model, fully_shard, mesh=cpu_mesh(), **kwargs)
    return ref, model


def _traced(model, world_size, fn):
    """Run ``fn()``; return its all-gathers and the layers' fwd/bwd marks, in order."""
    return _traced_call(model, world_size, fn)[0]


def _traced_call(model, world_size, fn):
    """(events as in ``_traced``, ``fn()``'s result)."""
    names = chain_group_names(model, world_size)
    model.log.clear()
    with count_collectives(model.log):
        result = fn()
    events = []
    for entry in model.log:
        if entry[0] == "all_gather":
            events.append(("AG", names[entry[1]]))
        elif entry[0] in ("fwd", "bwd"):
            events.append(entry)
        elif entry[0] == "wait":
            events.append(("wait", None))
    return events, result


# ---------------------------------------------------------------- unshard / reshard


def _unshard_body(rank, world_size):
    ref, model = _chain_pair()
    for step in range(2):
        batch = chain_batch(step, 2 * world_size)
        if step == 1:  # the first step runs as usual (and lazily initializes)
            fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
            handles = [m.unshard(async_op=True) for m in fsdp_modules[1:]]
            assert all(isinstance(h, UnshardHandle) for h in handles)
            assert model.unshard() is None  # the root, synchronously
            handles[0].wait()  # explicit wait; the others are left to the forward
            gathered = dict(model.layers[0].named_parameters())
            for name, p in ref.layers[0].named_parameters():
                assert not isinstance(gathered[name], DTensor), f"{name} sharded after wait()"
                torch.testing.assert_close(gathered[name].detach(), p.detach(), rtol=0, atol=0)
        with count_collectives() as fwd:
            loss = mlp_loss(model, rank_slice(batch, rank, world_size))
        with count_collectives() as bwd:
            loss.backward()
        expected_fwd = 0 if step == 1 else 5
        assert fwd["all_gather"] == expected_fwd, f"step {step}: forward all-gathers {fwd}"
        assert bwd["all_gather"] == 4, f"step {step}: the layers reshard after forward: {bwd}"
        assert_sharded(model, rank, world_size, f"after step {step}")
        mlp_loss(ref, batch).backward()
        assert_grads_match(ref, model, RTOL, ATOL)
    # reshard() frees what unshard() gathered: the next forward gathers everything again
    for m in fsdp_modules:
        m.unshard()
    assert not isinstance(model.head.weight, DTensor)
    for m in fsdp_modules:
        m.reshard()
    assert_sharded(model, rank, world_size, "after reshard()")
    with count_collectives() as fwd:
        mlp_loss(model, rank_slice(chain_batch(2, 2 * world_size), rank, world_size))
    assert fwd["all_gather"] == 5, f"forward after reshard(): {fwd}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unshard_before_forward_is_used_by_forward(world_size):
    """unshard() (sync and async) before forward: no all-gather in that forward; reshard() frees."""
    run_ranks(_unshard_body, world_size)


# ---------------------------------------------------------------- prefetch lists


def _forward_prefetch_body(rank, world_size):
    outcome = {}
    for explicit in (False, True):
        ref, model = _chain_pair()
        L = model.layers
        if explicit:
            L[0].set_modules_to_forward_prefetch([L[2], L[1]])
        batch = chain_batch(0, 2 * world_size)
        outcome[explicit], loss = _traced_call(
            model, world_size, lambda m=model, b=batch: mlp_loss(m, rank_slice(b, rank, world_size))
        )
        loss.backward()
        mlp_loss(ref, batch).backward()
        assert_grads_match(ref, model, RTOL, ATOL)
        assert_sharded(model, rank, world_size, f"explicit={explicit}")
    return outcome


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_forward_prefetch_order(world_size):
    """set_modules_to_forward_prefetch([L2, L1]) on L0 all-gathers L2, L1 right after L0, in order."""
    outcome = run_ranks(_forward_prefetch_body, world_size)[0]
    ag = lambda n: ("AG", n)  # noqa: E731
    fwd = lambda n: ("fwd", n)  # noqa: E731
    assert outcome[False] == [
        ag("root"), ag("L0"), fwd("L0"), ag("L1"), fwd("L1"), ag("L2"), fwd("L2"),
        ag("L3"), fwd("L3"),
    ], outcome[False]
    assert outcome[True] == [
        ag("root"), ag("L0"), ag("L2"), ag("L1"), fwd("L0"), fwd("L1"), fwd("L2"),
        ag("L3"), fwd("L3"),
    ], outcome[True]


def _backward_prefetch_body(rank, world_size):
    outcome = {}
    for explicit in (False, True):
        ref, model = _chain_pair()
        L = model.layers
        if explicit:
            model.set_modules_to_backward_prefetch([L[3], L[2]])
            L[3].set_modules_to_backward_prefetch([L[1]])
        batch = chain_batch(0, 2 * world_size)
        loss = mlp_loss(model, rank_slice(batch, rank, world_size))
        outcome[explicit] = _traced(model, world_size, loss.backward)
        mlp_loss(ref, batch).backward()
        assert_grads_match(ref, model, RTOL, ATOL)
        assert_sharded(model, rank, world_size, f"explicit={explicit}")
    return outcome


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_backward_prefetch_order(world_size):
    """Explicit backward prefetch lists replace the default reverse-forward order, in list order."""
    outcome = run_ranks(_backward_prefetch_body, world_size)[0]
    ag = lambda n: ("AG", n)  # noqa: E731
    bwd = lambda n: ("bwd", n)  # noqa: E731
    # default: each module prefetches the one that ran before it in forward
    assert outcome[False] == [
        ag("L3"), ag("L2"), bwd("L3"), ag("L1"), bwd("L2"), ag("L0"), bwd("L1"), bwd("L0"),
    ], outcome[False]
    # root -> [L3, L2], L3 -> [L1]; L2 and L1 keep the default (L1: already in flight)
    assert outcome[True] == [
        ag("L3"), ag("L2"), ag("L1"), bwd("L3"), bwd("L2"), ag("L0"), bwd("L1"), bwd("L0"),
    ], outcome[True]


def _last_backward_body(rank, world_size):
    """Two micro-batches forward, then two backwards (pipeline-style)."""
    ref, model = _chain_pair()
    batches = [chain_batch(s, 2 * world_size) for s in range(2)]
    losses = [mlp_loss(model, rank_slice(b, rank, world_size)) for b in batches]
    model.set_is_last_backward(False)
    losses[0].backward()
    model.set_is_last_backward(True)
    events = _traced(model, world_size, losses[1].backward)
    for b in batches:
        mlp_loss(ref, b).backward()
    assert_grads_match(ref, model, RTOL, ATOL)
    assert_sharded(model, rank, world_size, "after the last backward")
    # the last backward cleared the forward order: a further step has no stale prefetch
    loss = mlp_loss(model, rank_slice(batches[0], rank, world_size))
    later = _traced(model, world_size, loss.backward)
    return events, later


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_is_last_backward_keeps_prefetch_order_for_next_backward(world_size):
    """set_is_last_backward(False) keeps the forward order, so the following backward still prefetches."""
    events, later = run_ranks(_last_backward_body, world_size)[0]
    ag = lambda n: ("AG", n)  # noqa: E731
    bwd = lambda n: ("bwd", n)  # noqa: E731
    # with the order cleared after the first backward, each AG would follow the previous bwd
    assert events == [
        ag("root"), ag("L3"), ag("L2"), bwd("L3"), ag("L1"), bwd("L2"), ag("L0"), bwd("L1"),
        bwd("L0"),
    ], events
    assert later == [
        ag("L3"), ag("L2"), bwd("L3"), ag("L1"), bwd("L2"), ag("L0"), bwd("L1"), bwd("L0"),
    ], later


# ---------------------------------------------------------------- when to reshard


def _reshard_after_forward_body(rank, world_size):
    ref, model = _chain_pair()
    # before lazy init: the root's automatic False must not override it
    model.set_reshard_after_forward(True)
    counts = []
    settings = [
        None,  # set above: everything reshards
        lambda: model.set_reshard_after_forward(False),  # recursive: nothing reshards
        lambda: model.set_reshard_after_forward(True, recurse=False),  # root only
        lambda: model.layers[1].set_reshard_after_forward(True, recurse=False),
    ]
    for step, setting in enumerate(settings):
        if setting is not None:
            setting()
        batch = chain_batch(step, 2 * world_size)
        loss = mlp_loss(model, rank_slice(batch, rank, world_size))
        with count_collectives() as bwd:
            loss.backward()
        counts.append(bwd["all_gather"])
        mlp_loss(ref, batch).backward()
        assert_grads_match(ref, model, RTOL, ATOL)
        ref.zero_grad()
        model.zero_grad()
    return counts


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_set_reshard_after_forward(world_size):
    """set_reshard_after_forward (recursive or not, root included) sets which groups gather in backward."""
    counts = run_ranks(_reshard_after_forward_body, world_size)[0]
    assert counts == [5, 0, 1, 2], f"backward all-gathers per step: {counts}"


def _reshard_after_backward_body(rank, world_size):
    ref, model = _chain_pair()
    micro = [chain_batch(s, 2 * world_size) for s in range(3)]
    model.set_reshard_after_backward(False)
    counts = []
    for i, batch in enumerate(micro):
        if i == len(micro) - 1:
            model.set_reshard_after_backward(True)
        loss = None
        with count_collectives() as fwd:
            loss = mlp_loss(model, rank_slice(batch, rank, world_size))
        loss.backward()
        counts.append(fwd["all_gather"])
        if i < len(micro) - 1:
            kept = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
            assert len(kept) == len(list(model.parameters())), f"resharded: {kept}"
        mlp_loss(ref, batch).backward()
    assert_sharded(model, rank, world_size, "after the last micro-batch")
    assert_grads_match(ref, model, RTOL, ATOL)
    # recurse=False: only the root's group stays unsharded
    model.set_reshard_after_backward(False, recurse=False)
    mlp_loss(model, rank_slice(micro[0], rank, world_size)).backward()
    unsharded = {n.split(".")[0] for n, p in model.named_parameters() if not isinstance(p, DTensor)}
    model.set_reshard_after_backward(True, recurse=False)
    model.reshard()
    return counts, sorted(unsharded)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_set_reshard_after_backward(world_size):
    """set_reshard_after_backward(False) keeps parameters unsharded: the next forward gathers nothing."""
    counts, unsharded = run_ranks(_reshard_after_backward_body, world_size)[0]
    assert counts == [5, 0, 0], f"forward all-gathers per micro-batch: {counts}"
    assert unsharded == ["head"], unsharded


def _unshard_in_backward_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=11))
    mesh = cpu_mesh()
    fully_shard(model.tok_embeddings, mesh=mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # an embedding's backward needs only the indices, not the weight
    model.tok_embeddings.set_unshard_in_backward(False)
    opts = make_opts(ref, model)
    batches = [transformer_batch(s, 2 * world_size) for s in range(2)]
    loss = transformer_loss(model, rank_slice(batches[0], rank, world_size))
    with count_collectives() as bwd:
        loss.backward()
    transformer_loss(ref, batches[0]).backward()
    assert_grads_match(ref, model, RTOL, ATOL)
    for o in opts:
        o.step()
        o.zero_grad()
    r, m = train_steps(ref, model, batches[1:], transformer_loss, rank, world_size, opts)
    assert_losses_match(r, m)
    assert_params_match(ref, model, RTOL, ATOL)
    return dict(bwd)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_set_unshard_in_backward(world_size):
    """set_unshard_in_backward(False) on an embedding: one all-gather less, its gradient still reduced."""
    counts = run_ranks(_unshard_in_backward_body, world_size)[0]
    # groups: embedding, 2 blocks, root (kept unsharded after forward); the
    # embedding's all-gather (prefetched by the first block by default) is skipped
    assert counts == {"all_gather": 2, "reduce_scatter": 4}, counts


# ---------------------------------------------------------------- post-optimizer event


class _RecordingEvent:
    """Stands in for a torch.Event: records when something waits on it."""

    def __init__(self, log):
        self.log = log

    def wait(self, stream=None):
        self.log.append(("wait", None))

    def query(self):
        return True

    def synchronize(self):
        pass


def _post_optim_event_body(rank, world_size, recording):
    ref, model = _chain_pair()
    opts = make_opts(ref, model)
    forwards = []
    for step in range(3):
        batch = chain_batch(step, 2 * world_size)
        events, loss = _traced_call(
            model, world_size, lambda b=batch: mlp_loss(model, rank_slice(b, rank, world_size))
        )
        forwards.append(events[:2])
        loss.backward()
        mlp_loss(ref, batch).backward()
        assert_grads_match(ref, model, RTOL, ATOL)
        for o in opts:
            o.step()
            o.zero_grad()
        if step == 0:
            event = _RecordingEvent(model.log) if recording else torch.Event(device="cpu")
            model.set_post_optim_event(event)
    assert_params_match(ref, model, RTOL, ATOL)
    return forwards


def test_post_optim_event_accepted():
    """set_post_optim_event with a CPU torch.Event each step: training keeps parity."""
    run_ranks(_post_optim_event_body, 2, False)


@pytest.mark.skipif(IMPL == "torch", reason="upstream's CPU streams never touch the event")
def test_post_optim_event_waited_once_before_first_all_gather():
    """The root's next forward waits on the event before its first all-gather, then drops it."""
    forwards = run_ranks(_post_optim_event_body, 2, True)[0]
    assert forwards[0] == [("AG", "root"), ("AG", "L0")], forwards
    assert forwards[1] == [("wait", None), ("AG", "root")], forwards
    assert forwards[2] == [("AG", "root"), ("AG", "L0")], f"waited twice: {forwards}"


# ---------------------------------------------------------------- invalid calls


def _invalid_calls_body(rank, world_size):
    model = shard_chain(build_chain(), fully_shard, mesh=cpu_mesh())
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError):
        model.set_modules_to_forward_prefetch([model.layers[1], plain])
    with pytest.raises(ValueError):
        model.set_modules_to_backward_prefetch([plain])
    with pytest.raises(ValueError, match="bool"):
        model.set_reshard_after_forward("yes")
    # still trains after the rejected calls
    mlp_loss(model, rank_slice(chain_batch(0, 2 * world_size), rank, world_size)).backward()
    assert_sharded(model, rank, world_size)


def test_invalid_calls_raise_value_error():
    """Prefetch lists with a non-FSDP module and a non-bool reshard_after_forward raise ValueError."""
    run_ranks(_invalid_calls_body, 2)


def _invalid_calls_messages_body(rank, world_size):
    model = shard_chain(build_chain(), fully_shard, mesh=cpu_mesh())
    layer = model.layers[0]
    with pytest.raises(ValueError, match=r"item 1 \(Linear\) is not an FSDP module.*fully_shard"):
        model.set_modules_to_forward_prefetch([model.layers[1], torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"pass \[module\]"):
        model.set_modules_to_backward_prefetch(layer)
    with pytest.raises(ValueError, match="list of FSDP modules"):
        model.set_modules_to_backward_prefetch(3)
    bad_bools = [
        (model.set_requires_gradient_sync, 1),
        (model.set_reshard_after_backward, "no"),
        (layer.set_unshard_in_backward, None),
        (model.set_is_last_backward, 0),
        (layer.set_force_sum_reduction_for_comms, "x"),
        (model.unshard, "yes"),
    ]
    for method, value in bad_bools:
        with pytest.raises(ValueError, match=f"{method.__name__}.*must be a bool"):
            method(value)
    with pytest.raises(ValueError, match="recurse must be a bool"):
        model.set_requires_gradient_sync(True, recurse="all")
    for factor in (0, -2.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="positive finite number"):
            layer.set_gradient_divide_factor(factor)
    with pytest.raises(ValueError, match="callable"):
        layer.set_all_reduce_hook(3)
    with pytest.raises(ValueError, match="stream"):
        layer.set_all_reduce_hook(lambda t: None, stream=5)
    with pytest.raises(ValueError, match="wait"):
        model.set_post_optim_event(object())
    batch = rank_slice(chain_batch(0, 2 * world_size), rank, world_size)
    mlp_loss(model, batch).backward()
    with pytest.raises(RuntimeError, match=r"called on 'layers\.1', not on the root.*Chain"):
        model.layers[1].reset_iter_state()
    assert_sharded(model, rank, world_size)


@fsdp2_only
def test_invalid_calls_messages():
    """Wrong types and non-FSDP prefetch targets raise ValueError naming the method, item and fix."""
    run_ranks(_invalid_calls_messages_body, 2)


class _TwoOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(8, 6), torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.lin1(x), self.lin2(x)


def _unused_prefetch_phases(shard, rank, world_size):
    """A backward through ``lin2`` alone (not the last), then one through ``lin1``: each
    phase's collectives and the gradients."""
    from checks import log_collectives

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _TwoOutputs())
    for m in (model[0], model[1].lin1, model[1].lin2, model):
        shard(m, mesh=cpu_mesh())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    phases = []
    with log_collectives() as log:
        out1, out2 = model(x)
    phases.append(log)
    model.set_is_last_backward(False)
    with log_collectives() as log:
        out2.sum().backward(retain_graph=True)
    phases.append(log)
    model.set_is_last_backward(True)
    with log_collectives() as log:
        out1.sum().backward()
    phases.append(log)
    return phases, [p.grad.full_tensor() for p in model.parameters()]


def _unused_prefetch_body(rank, world_size):
    from torch.distributed.fsdp import fully_shard as upstream

    (ours, ours_grads), (theirs, theirs_grads) = (
        _unused_prefetch_phases(shard, rank, world_size) for shard in (fully_shard, upstream)
    )
    assert ours == theirs, (ours, theirs)
    for a, b in zip(ours_grads, theirs_grads):
        assert torch.equal(a, b)
    # the first backward prefetched lin1 (the previous group in forward order) for a use that
    # did not come; the second backward takes that all-gather instead of issuing another
    assert [k for k, *_ in theirs[2]].count("all_gather") == 1, theirs[2]


@fsdp2_only
def test_a_prefetch_no_use_took_serves_the_next_backward():
    """Upstream's collectives, phase by phase, when a backward prefetch targets a group the
    backward does not reach (set_is_last_backward(False), then a backward that does)."""
    run_ranks(_unused_prefetch_body, 2)
