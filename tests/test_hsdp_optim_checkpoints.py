"""Checkpoints of HSDP with the optimizer state sharded across replicas, across layouts.

A checkpoint saved with ``shard_across_replicas=True`` (2x2 at W=4, through
``save_checkpoint`` with its checksums; each rank's slice, see [Note: Replica
slices in state dicts]) loads with ``load_latest`` into plain FSDP at W=4, into
the option with four replicas (4x1), into one process and into the option at
W=2 (a 2x1 mesh), and
checkpoints of plain FSDP and of one process load into the option. Each load
must give the saved parameters and optimizer state to the bit (compared as
full tensors), and training must go on as it would have. See [Note: Replica
slices] in fsdp2/runtime/group/replica_slices.py.
"""

from __future__ import annotations

import pytest
import torch
from _impl import fsdp2_only
from _multiproc import run_ranks
from checks import (
    ATOL,
    RTOL,
    assert_full_equal,
    full_snapshot,
    sharded_transformer,
    train_span,
)
from models import build_transformer, cpu_mesh, full
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

import fsdp2

pytestmark = fsdp2_only  # fsdp2's own option


def _hsdp(world_size: int):
    return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))


def _with_option(mesh, seed: int):
    model, optim = sharded_transformer(mesh, seed=seed)
    fsdp2.enable_local_shard_step(optim, shard_across_replicas=True)
    return model, optim


def _optim_snapshot(model, optim) -> dict:
    """The optimizer state by parameter name, every value a full tensor (a collective)."""
    state = get_optimizer_state_dict(model, optim)["state"]
    return {
        name: {k: full(v).clone() if torch.is_tensor(v) else torch.tensor(v) for k, v in s.items()}
        for name, s in state.items()
    }


def _assert_state_equal(got: dict, expected: dict, where: str) -> None:
    assert sorted(got) == sorted(expected), where
    for name, values in expected.items():
        assert sorted(got[name]) == sorted(values), (where, name)
        for key, value in values.items():
            assert torch.equal(got[name][key].to(value.dtype), value), f"{where}: {name}.{key}"


def _snapshot(model, optim) -> tuple[dict, dict]:
    return full_snapshot(model), _optim_snapshot(model, optim)


def _assert_loaded(model, optim, saved: tuple[dict, dict], where: str) -> None:
    assert_full_equal(model, saved[0], where)
    _assert_state_equal(_optim_snapshot(model, optim), saved[1], where)


def _w4_body(rank, world_size, roots):
    """Save with the option; load into plain FSDP; plain FSDP's checkpoint into the option."""
    model, optim = _with_option(_hsdp(world_size), seed=31)
    train_span(model, optim, 0, 2, rank, world_size)
    saved = _snapshot(model, optim)
    fsdp2.save_checkpoint(roots["option"], model, optim, step=2)
    uninterrupted = train_span(model, optim, 2, 4, rank, world_size, mean=True)
    # into plain FSDP (1-D, W=4): the same state; training goes on as with the option
    fsdp, f_optim = sharded_transformer(cpu_mesh(), seed=32)
    assert fsdp2.load_latest(roots["option"], fsdp, f_optim) == 2
    _assert_loaded(fsdp, f_optim, saved, "option -> FSDP")
    losses = train_span(fsdp, f_optim, 2, 4, rank, world_size, mean=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted),
                               rtol=RTOL, atol=ATOL)
    # into the option with four replicas of one shard (4x1): another replica count
    mesh41 = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    four, four_optim = _with_option(mesh41, seed=36)
    assert fsdp2.load_latest(roots["option"], four, four_optim) == 2
    _assert_loaded(four, four_optim, saved, "option 2x2 -> option 4x1")
    # and back: plain FSDP's checkpoint into the option
    fsdp2.save_checkpoint(roots["fsdp"], fsdp, f_optim, step=4)
    fsdp_saved = _snapshot(fsdp, f_optim)
    model, optim = _with_option(_hsdp(world_size), seed=33)
    assert fsdp2.load_latest(roots["fsdp"], model, optim) == 4
    _assert_loaded(model, optim, fsdp_saved, "FSDP -> option")
    after = train_span(model, optim, 4, 5, rank, world_size, mean=True)
    fsdp_after = train_span(fsdp, f_optim, 4, 5, rank, world_size, mean=True)
    torch.testing.assert_close(torch.tensor(after), torch.tensor(fsdp_after), rtol=RTOL, atol=ATOL)
    return saved


def _w2_body(rank, world_size, roots, saved, single_saved):
    """The option at W=2 (2x1): loads the W=4 option's and the single process's checkpoints."""
    for root, step, expected in (("option", 2, saved), ("single", 3, single_saved)):
        model, optim = _with_option(_hsdp(world_size), seed=34)
        assert fsdp2.load_latest(roots[root], model, optim) == step
        _assert_loaded(model, optim, expected, f"{root} -> option at W=2")
    return train_span(model, optim, 3, 4, rank, world_size, mean=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process part
def test_checkpoints_across_layouts(tmp_path):
    """option (2x2) <-> FSDP (W=4), -> option (4x1), -> one process -> option (2x1, W=2): exact
    state each way."""
    roots = {k: str(tmp_path / k) for k in ("option", "fsdp", "single")}
    saved = run_ranks(_w4_body, 4, roots)[0]
    for root in ("option", "fsdp"):
        report = fsdp2.verify_checkpoint(roots[root])
        assert report and not any(report.values()), report  # the checksums, unchanged
    # one process, no process group: the option's checkpoint as plain tensors
    model = build_transformer(seed=35)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert fsdp2.load_latest(roots["option"], model, optim) == 2
    _assert_loaded(model, optim, saved, "option -> one process")
    train_span(model, optim, 2, 3, None, 1)
    fsdp2.save_checkpoint(roots["single"], model, optim, step=3)
    single_saved = _snapshot(model, optim)
    expected = train_span(model, optim, 3, 4, None, 1)
    losses = run_ranks(_w2_body, 2, roots, saved, single_saved)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=ATOL)
