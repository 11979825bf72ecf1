"""Upstream's private API that torch's own code, its tests and libraries use.

``FSDPModule._set_unshard_async_op`` (Unsloth's FSDP2 recipes, upstream's
training tests): the hooks' all-gathers as async collectives on the current
stream, with the same values. Upstream's ``fully_shard`` carries
``state(module)`` (and ``FSDPModule._get_fsdp_state()``), and torch 2.13's
pipelining reduces a stage through what it returns (``_state_ctx.all_states``,
each state's ``_fsdp_param_groups`` and their ``post_backward()``, the root's
``_root_post_backward_final_callback()``); upstream's own tests read
``_is_root``, ``_lazy_init()``, ``_fsdp_param_group._module_fqn`` and each
parameter's ``_param_fqn``. fsdp2's state answers the same names with the
same values, and lazy init's misuse errors match upstream's. Run on torch's
threaded process group, as upstream's tests run (and ``_set_unshard_async_op``
on process ranks), against whichever implementation ``FSDP2_TEST_IMPL``
selects (CI runs it on both).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _impl import fully_shard
from _multiproc import run_ranks
from _threaded import run_threads_spawned
from checks import on_collectives
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as upstream_fully_shard


def _mlp(seed: int) -> nn.Sequential:
    gen = torch.Generator().manual_seed(seed)  # thread ranks share the default RNG
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _model() -> nn.Sequential:
    """Upstream's layout: FSDP(model(0: MLP(FSDP(in), FSDP(out)), 1: MLP(in, out)))."""
    model = nn.Sequential(_mlp(0), _mlp(1))
    fully_shard(model[0][0])
    fully_shard(model[0][2])
    fully_shard(model)  # the root gets model[1]
    return model


def _names(rank, world_size):
    model = _model()
    assert fully_shard.state(nn.Linear(2, 2)) is None  # not sharded: no state
    root = fully_shard.state(model)
    assert model._get_fsdp_state() is root  # FSDPModule's private accessor: the same object
    first, second = fully_shard.state(model[0][0]), fully_shard.state(model[0][2])
    root._lazy_init()
    assert root._is_root and not first._is_root and not second._is_root
    assert root._state_ctx.all_states == [root, first, second]
    out = {}
    for state in (root, first, second):
        group = state._fsdp_param_group
        assert state._fsdp_param_groups == [group]
        out[group._module_fqn] = sorted(p._param_fqn for p in group.fsdp_params)
    # which parameters the modules hold, as upstream's group says it (torchtitan's
    # chunked-loss test of upstream reads is_unsharded around a toggled reshard)
    group = first._fsdp_param_group
    assert group.is_sharded and not group.is_unsharded and not group.is_sharded_post_forward
    model[0][0].set_reshard_after_forward(False)
    model(torch.zeros(2, 8))
    assert group.is_unsharded and not group.is_sharded
    model[0][0].reshard()
    assert group.is_sharded and not group.is_unsharded
    return out


def _misuse(rank, world_size):
    errors = []
    model = _model()
    fully_shard.state(model[0][0])._lazy_init()  # a sub-module first: the root then refuses
    with pytest.raises(RuntimeError) as info:
        fully_shard.state(model)._lazy_init()
    errors.append(str(info.value).splitlines()[:2])
    pair = nn.Sequential(_mlp(0), _mlp(1))
    fully_shard([pair[0], pair[1]])
    with pytest.raises(RuntimeError) as info:
        fully_shard.state(pair[0])._lazy_init()
    errors.append(str(info.value).split(" but got ")[0])
    return errors


def _two_blocks(shard, mesh) -> nn.Sequential:
    """Two MLP blocks and the root, each sharded by ``shard`` (fsdp2's or upstream's)."""
    model = nn.Sequential(_mlp(0), _mlp(1))
    for block in model:
        shard(block, mesh=mesh)
    return shard(model, mesh=mesh)


def _reduce_through_private_names(rank, world_size):
    """What torch 2.13's PipelineStage.perform_reduce_grad does after no-sync backwards,
    on the implementation under test and on upstream's; and an ordinary synced run."""
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for name, shard, manual in (("synced", fully_shard, False), ("manual", fully_shard, True),
                                ("upstream", upstream_fully_shard, True)):
        model = _two_blocks(shard, mesh)
        gen = torch.Generator().manual_seed(rank)
        batches = [torch.randn(4, 8, generator=gen) for _ in range(2)]
        if manual:
            model.set_is_last_backward(False)
            model.set_reshard_after_backward(False)
            model.set_requires_gradient_sync(False)
        for x in batches:
            model(x).sum().backward()
        if manual:
            model.set_is_last_backward(True)
            model.set_reshard_after_backward(True)
            model.set_requires_gradient_sync(True)
            state = shard.state(model)
            for each in state._state_ctx.all_states:
                for group in each._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
        results[name] = [p.grad.full_tensor() for p in model.parameters()]
    return results


def _thread_cases(rank, world_size):
    cases = {"names": _names, "misuse": _misuse, "reduce": _reduce_through_private_names}
    return {name: case(rank, world_size) for name, case in cases.items()}


@pytest.fixture(scope="module")
def on_threads():
    """Each thread case's results on one 2-rank threaded world (``run_threads_spawned``: a
    fresh interpreter, since this suite forks ranks after it)."""
    results = run_threads_spawned(_thread_cases, 2)
    return lambda name: [per_rank[name] for per_rank in results]


def test_state_names_match_upstream(on_threads):
    """fully_shard.state, _lazy_init, _is_root, _state_ctx.all_states, FQNs: upstream's values."""
    for names in on_threads("names"):
        assert names == {
            "": ["1.0.bias", "1.0.weight", "1.2.bias", "1.2.weight"],
            "0.0": ["0.0.bias", "0.0.weight"],
            "0.2": ["0.2.bias", "0.2.weight"],
        }


def test_lazy_init_misuse_raises_upstreams_errors(on_threads):
    """A sub-module's lazy init before the root's, and a root of several modules: upstream's text."""
    for errors in on_threads("misuse"):
        assert errors == [
            ["FSDP state has already been lazily initialized for 0.0",
             "FSDP requires running forward through the root module first"],
            "FSDP requires a single root module",
        ]


def test_reducing_through_the_private_names_as_torch_pipelining_does(on_threads):
    """Backwards without sync, then each group's post_backward and the root's final callback:
    upstream's gradients bit for bit (a synced step's up to the order of the sums)."""
    for grads in on_threads("reduce"):
        for ours, theirs, synced in zip(grads["manual"], grads["upstream"], grads["synced"]):
            assert torch.equal(ours, theirs)
            torch.testing.assert_close(ours, synced)


def _async_unshard(rank, world_size):
    """Two blocks and a root, Adam, 3 steps: with the switch and without, on the
    implementation under test and on upstream's; and how the hooks' all-gathers ran."""
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, shard, switch in (("plain", fully_shard, False), ("async", fully_shard, True),
                                ("upstream", upstream_fully_shard, True)):
        model = _two_blocks(shard, mesh)  # blocks reshard after forward (the default)
        if switch:
            model._set_unshard_async_op(True)  # recursive, as upstream
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(rank)
        calls = []
        with on_collectives(lambda kind, args, kwargs, log=calls: log.append(
                (kind, kwargs.get("async_op", False)))):
            for _ in range(3):
                model(torch.randn(4, 8, generator=gen)).sum().backward()
                optim.step()
                optim.zero_grad()
        out[name] = ([p.full_tensor() for p in model.parameters()],
                     sorted({a for kind, a in calls if kind == "all_gather"}))
    return out


def test_unshard_async_op_gathers_async_with_the_same_values():
    """_set_unshard_async_op(True): every hook all-gather async, parameters unchanged bit for bit
    (and upstream's with the same switch)."""
    for out in run_ranks(_async_unshard, 2):
        (plain, plain_modes), (ours, modes), (theirs, _) = out["plain"], out["async"], out["upstream"]
        assert False in plain_modes and modes == [True], (plain_modes, modes)  # no sync gather
        for a, b, c in zip(plain, ours, theirs):
            assert torch.equal(a, b) and torch.equal(b, c)
