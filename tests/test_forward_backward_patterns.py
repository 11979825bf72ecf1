"""Forward/backward patterns beyond one forward + one backward, and extra forward methods.

Several forwards before one backward, a backward reaching only some outputs,
two backwards through one graph (``retain_graph=True``), and a registered
``generate`` method: gradients and outputs match an unsharded reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _impl import fsdp2_only, fully_shard, register_fsdp_forward_method
from _multiproc import run_ranks
from checks import ATOL, RTOL, assert_sharded, count_collectives, make_opts, train_steps
from models import (
    MLP,
    assert_grads_match,
    assert_params_match,
    build_chain,
    chain_batch,
    cpu_mesh,
    make_pair,
    mlp_batch,
    mlp_loss,
    rank_slice,
    shard_chain,
)

WORLD_SIZES = [2, 4]


def _several_forwards_body(rank, world_size):
    for raf in (True, False, None):
        ref, model = make_pair(build_chain)
        shard_chain(model, fully_shard, mesh=cpu_mesh(), reshard_after_forward=raf)
        micro = [chain_batch(i, 2 * world_size) for i in range(2)]
        sum(mlp_loss(model, rank_slice(b, rank, world_size)) for b in micro).backward()
        sum(mlp_loss(ref, b) for b in micro).backward()
        assert_grads_match(ref, model, RTOL, ATOL)
        assert_sharded(model, rank, world_size, f"raf={raf}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_several_forwards_then_one_backward(world_size):
    """Two micro-batches forwarded, their losses summed, one backward: reference grads (every raf)."""
    run_ranks(_several_forwards_body, world_size)


class _TwoHeads(nn.Module):
    """A trunk feeding a main head and an auxiliary head; returns both outputs."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(7, 6)
        self.main = nn.Linear(6, 1)
        self.aux = nn.Linear(6, 3)
        self.scale = nn.Linear(6, 6)  # root-owned, used by both heads' inputs

    def forward(self, x):
        h = torch.tanh(self.scale(torch.tanh(self.trunk(x))))
        return self.main(h), self.aux(h)


def _partial_body(rank, world_size):
    for raf in (True, False):
        torch.manual_seed(0)
        ref = _TwoHeads()
        model = copy.deepcopy(ref)
        for m in (model.trunk, model.main, model.aux, model):
            fully_shard(m, mesh=cpu_mesh(), reshard_after_forward=raf)
        opts = make_opts(ref, model)
        for step, use in enumerate(["main", "aux", "both"]):
            x, y = mlp_batch(step, 2 * world_size)

            def loss_fn(m, x, y, use=use):
                main, aux = m(x)
                parts = {"main": F.mse_loss(main, y), "aux": aux.pow(2).mean()}
                return sum(parts.values()) if use == "both" else parts[use]

            loss_fn(ref, x, y).backward()
            loss_fn(model, *rank_slice((x, y), rank, world_size)).backward()
            assert_grads_match(ref, model, RTOL, ATOL)  # the unused head: no grad on either
            assert_sharded(model, rank, world_size, f"raf={raf} step={step} ({use})")
            for o in opts:
                o.step()
                o.zero_grad()
        assert_params_match(ref, model, RTOL, ATOL)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_backward_through_part_of_the_outputs(world_size):
    """A loss on one of two outputs (an FSDP head unused): reference grads, unused head gets none."""
    run_ranks(_partial_body, world_size)


def _retain_graph_body(rank, world_size):
    ref, model = make_pair(build_chain)
    shard_chain(model, fully_shard, mesh=cpu_mesh())
    batch = chain_batch(0, 2 * world_size)
    loss = mlp_loss(model, rank_slice(batch, rank, world_size))
    counts = []
    for retain in (True, False):
        with count_collectives() as bwd:
            loss.backward(retain_graph=retain)
        counts.append(dict(bwd))
        assert_sharded(model, rank, world_size, f"after backward (retain_graph={retain})")
    ref_loss = mlp_loss(ref, batch)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    assert_grads_match(ref, model, RTOL, ATOL)
    return counts


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_two_backwards_with_retain_graph(world_size):
    """backward(retain_graph=True) then backward(): grads doubled like the reference; all regathered."""
    counts = run_ranks(_retain_graph_body, world_size)[0]
    # the root keeps its parameters after forward, but not after the first backward
    assert counts == [
        {"all_gather": 4, "reduce_scatter": 5},
        {"all_gather": 5, "reduce_scatter": 5},
    ], counts


class _Decoder(MLP):
    """``generate`` runs the layers outside ``forward``, using the root-owned ``out_proj``."""

    def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        outputs = []
        for _ in range(steps):
            h = torch.tanh(self.mid_proj(torch.tanh(self.in_proj(x))))
            y = self.out_proj(h)
            outputs.append(y)
            x = torch.cat([x[:, 1:], y], dim=1)
        return torch.cat(outputs, dim=1)


def _generate_body(rank, world_size):
    torch.manual_seed(0)
    ref = _Decoder()
    model = copy.deepcopy(ref)
    mesh = cpu_mesh()
    fully_shard(model.in_proj, mesh=mesh)
    fully_shard(model.mid_proj, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not an FSDP module: no-op
    with pytest.raises(ValueError, match="decode"):
        register_fsdp_forward_method(model, "decode")
    x, _ = rank_slice(mlp_batch(0, 2 * world_size), rank, world_size)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), count_collectives() as counts:
            out = model.generate(x, steps=3)
        # the root once, the two layers per step (they reshard after each use)
        assert counts["all_gather"] == 1 + 2 * 3, counts
        with torch.set_grad_enabled(grad):
            ref_out = ref.generate(x, steps=3)
        torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
        if grad:
            out.pow(2).mean().backward()
            ref_out.pow(2).mean().backward()  # on the same slice: local grads
            for p in ref.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world_size
            assert_grads_match(ref, model, RTOL, ATOL)
            assert_sharded(model, rank, world_size, "after generate's backward")
    # training through forward still works afterwards
    mlp_loss(model, (x, x[:, :1])).backward()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_register_fsdp_forward_method_generate(world_size):
    """A registered generate() (layers and root params outside forward) matches the reference, grads too."""
    run_ranks(_generate_body, world_size)


def _eval_then_train_body(rank, world_size, optimizer):
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[optimizer]
    ref, model = make_pair(build_chain)
    shard_chain(model, fully_shard, mesh=cpu_mesh())  # the root keeps its parameters (default)
    x, _ = chain_batch(100, 2 * world_size)
    with torch.no_grad():  # an evaluation pass before training, as most training loops do
        torch.testing.assert_close(model(rank_slice((x,), rank, world_size)[0]),
                                   ref(rank_slice((x,), rank, world_size)[0]))
    batches = [chain_batch(i, 2 * world_size) for i in range(3)]
    ref_losses, losses = train_steps(ref, model, batches, mlp_loss, rank, world_size,
                                     (make(ref.parameters()), make(model.parameters())))
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert_params_match(ref, model)


@fsdp2_only  # upstream's root keeps the parameters gathered under no_grad and trains on them stale
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_forward_under_no_grad_then_training(world_size, optimizer):
    """An evaluation forward under ``no_grad`` first: every step's loss and parameter is the
    unsharded model's (docs/differences.md, "Upstream bugs fsdp2 does not have")."""
    run_ranks(_eval_then_train_body, world_size, optimizer)


def _frozen_first_layer_reshard_to_two(rank, world_size):
    """Per-layer fully_shard with reshard_after_forward=2, the first layer frozen (no backward
    reaches it), a no_grad forward between steps, then the layer unfrozen: the parameters the
    optimizer holds are the module's again after each forward, so the unfrozen layer trains
    as in the plain model (upstream leaves it on its post-forward parameters: docs/differences.md)."""
    torch.manual_seed(42)
    layers = []
    for _ in range(3):
        layers += [nn.Linear(8, 8), nn.ReLU()]
    model = nn.Sequential(*layers)
    ref = copy.deepcopy(model)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=cpu_mesh(), reshard_after_forward=2)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, model)]
    for m in (ref, model):
        m[0].requires_grad_(False)
    inp = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank))
    for it in range(3):
        for m, opt in zip((ref, model), opts):
            if it == 2:
                m[0].requires_grad_(True)
            if it == 1:
                with torch.no_grad():
                    m(inp)
                continue
            m(inp).sum().backward()
            if m is ref:  # the reference: the gradients of the whole batch's mean
                for p in m.parameters():
                    if p.grad is not None:
                        torch.distributed.all_reduce(p.grad)
                        p.grad.div_(world_size)
            opt.step()
            opt.zero_grad()
    assert_params_match(ref, model, RTOL, ATOL)


@fsdp2_only
def test_a_frozen_layer_unfrozen_after_forwards_at_reshard_to_two():
    """reshard_after_forward=2 (W=4), a first layer no backward reaches, then unfrozen."""
    run_ranks(_frozen_first_layer_reshard_to_two, 4)
