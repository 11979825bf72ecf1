"""Core behaviours of fully_shard, each checked against an unsharded reference.

Every test launches real gloo ranks (see ``_multiproc.run_ranks``); the body
functions below run inside each rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _impl import FSDPModule, UnshardHandle, fsdp2_only, fully_shard, register_fsdp_forward_method
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
    MLP,
    Transformer,
    assert_grads_match,
    assert_params_match,
    build_mlp,
    build_transformer,
    cpu_mesh,
    full,
    make_pair,
    mlp_batch,
    mlp_loss,
    rank_slice,
    shard_mlp,
    shard_transformer,
    sharded_state_dict_from,
    toy_args,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.tensor import DTensor

# ---------------------------------------------------------------- sharding layout


def _layout_body(rank, world_size):
    ref, model = make_pair(build_mlp)
    mesh = cpu_mesh()
    shard_mlp(model, fully_shard, mesh=mesh)
    assert_sharded(model, rank, world_size, "after fully_shard")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.device_mesh == mesh, name
        assert p.shape == ref_params[name].shape, (name, p.shape)
        chunks = ref_params[name].detach().chunk(world_size)
        if rank < len(chunks):
            torch.testing.assert_close(p.to_local(), chunks[rank], rtol=0, atol=0)
        else:
            assert p.to_local().numel() == 0, name
    # the odd sizes must really produce empty shards somewhere
    if world_size == 4 and rank == 3:
        assert model.mid_proj.weight.to_local().shape == (0, 13)
        assert model.out_proj.bias.to_local().shape == (0,)
    if world_size == 2 and rank == 1:
        assert model.out_proj.weight.to_local().shape == (0, 5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_params_are_shard0_dtensors_with_chunk_shapes(world_size):
    """Sharded params are Shard(0) DTensor Parameters holding torch.chunk slices (empty past the end)."""
    run_ranks(_layout_body, world_size)


def _default_mesh_body(rank, world_size):
    model = build_mlp()
    fully_shard(model)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        assert p.device_mesh.size() == world_size, name
        assert p.device_mesh.device_type == "cpu", name
    assert_sharded(model, rank, world_size)
    loss = mlp_loss(model, mlp_batch(0, 2))
    loss.backward()


def test_default_mesh_is_world_on_cpu():
    """mesh=None shards over all ranks of the default group on a CPU mesh."""
    run_ranks(_default_mesh_body, 2)


def _class_body(rank, world_size):
    model = build_mlp()
    untouched = build_mlp()
    out = fully_shard(model.in_proj, mesh=cpu_mesh())
    assert out is model.in_proj, "fully_shard must return the module itself"
    fully_shard(model, mesh=cpu_mesh())
    for m in (model, model.in_proj):
        assert isinstance(m, FSDPModule)
    assert isinstance(model, MLP) and issubclass(type(model), MLP)
    assert issubclass(type(model), FSDPModule)
    assert isinstance(model.in_proj, nn.Linear) and issubclass(type(model.in_proj), nn.Linear)
    assert not isinstance(model.mid_proj, FSDPModule), (
        "only modules passed to fully_shard change class"
    )
    assert type(model.mid_proj) is nn.Linear
    assert type(untouched) is MLP and not isinstance(untouched, FSDPModule), (
        "the original class is unchanged"
    )
    assert type(untouched.in_proj) is nn.Linear


def test_fsdp_module_class_swap():
    """fully_shard makes the module an FSDPModule whose class subclasses the original class."""
    run_ranks(_class_body, 2)


# ---------------------------------------------------------------- grouping


def _list_group_body(rank, world_size):
    ref, model = make_pair(build_mlp)
    mesh = cpu_mesh()
    fully_shard([model.in_proj, model.mid_proj], mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    assert isinstance(model.in_proj, FSDPModule) and isinstance(model.mid_proj, FSDPModule)
    batch = mlp_batch(0, 2 * world_size)
    mlp_loss(model, rank_slice(batch, rank, world_size)).backward()  # warm-up / lazy init
    model.zero_grad()
    with count_collectives() as fwd:
        loss = mlp_loss(model, rank_slice(batch, rank, world_size))
    with count_collectives() as bwd:
        loss.backward()
    # one group for [in_proj, mid_proj] + one for the root (out_proj)
    assert fwd["all_gather"] == 2, f"forward all-gathers: {fwd}"
    # the list group was resharded after forward: one more all-gather in backward
    assert bwd["all_gather"] == 1, f"backward all-gathers: {bwd}"
    assert bwd["reduce_scatter"] == 2, f"backward reduce-scatters: {bwd}"
    mlp_loss(ref, batch).backward()
    assert_grads_match(ref, model, RTOL, ATOL)


def test_list_of_modules_is_one_group():
    """fully_shard([a, b]) all-gathers and reduce-scatters a and b in one collective each."""
    run_ranks(_list_group_body, 2)


def _nested_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=1, n_layers=3))
    shard_transformer(model, fully_shard, mesh=cpu_mesh(), reshard_after_forward=True)
    assert all(isinstance(layer, FSDPModule) for layer in model.layers)
    assert isinstance(model, FSDPModule)
    assert not isinstance(model.norm, FSDPModule)
    batches = [transformer_batch(s, 2 * world_size) for s in range(3)]
    opts = make_opts(ref, model)
    ref_losses, losses = train_steps(
        ref, model, batches[:1], transformer_loss, rank, world_size, opts
    )
    with count_collectives() as fwd:
        loss = transformer_loss(model, rank_slice(batches[1], rank, world_size))
    with count_collectives() as bwd:
        loss.backward()
    model.zero_grad()
    # 3 blocks + root = 4 groups; all resharded after forward (explicit True)
    assert fwd["all_gather"] == 4, fwd
    assert bwd["all_gather"] == 4, bwd
    assert bwd["reduce_scatter"] == 4, bwd
    r2, l2 = train_steps(ref, model, batches[1:], transformer_loss, rank, world_size, opts)
    assert_losses_match(ref_losses + r2, losses + l2)
    assert_params_match(ref, model, RTOL, ATOL)


def test_nested_fully_shard_blocks_and_root():
    """Blocks then root: one all-gather/reduce-scatter per group and training parity."""
    run_ranks(_nested_body, 2)


# ---------------------------------------------------------------- special parameters


def _tied_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=2, tie_weights=True))
    assert ref.output.weight is ref.tok_embeddings.weight
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    assert model.output.weight is model.tok_embeddings.weight, "tied weight must stay one parameter"
    assert isinstance(model.output.weight, DTensor)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]
    batches = [transformer_batch(s, 2 * world_size) for s in range(4)]
    ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size)
    assert model.output.weight is model.tok_embeddings.weight
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model, RTOL, ATOL)


def test_tied_embedding_and_output_weights():
    """A weight shared by embedding and output head stays tied and trains with parity."""
    run_ranks(_tied_body, 2)


def _frozen_body(rank, world_size):
    ref, model = make_pair(build_mlp)
    for m in (ref, model):
        m.in_proj.weight.requires_grad_(False)  # frozen param in a mixed group
        m.mid_proj.requires_grad_(False)  # fully frozen group
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    shard_mlp(model, fully_shard, mesh=cpu_mesh())
    for name, p in model.named_parameters():
        assert p.requires_grad == dict(ref.named_parameters())[name].requires_grad, name
    batches = [mlp_batch(s, 2 * world_size) for s in range(3)]
    ref_losses, losses = train_steps(ref, model, batches, mlp_loss, rank, world_size)
    # one more backward to inspect grads
    mlp_loss(model, rank_slice(batches[0], rank, world_size)).backward()
    for name in ("in_proj.weight", "mid_proj.weight", "mid_proj.bias"):
        p = dict(model.named_parameters())[name]
        assert p.grad is None, f"frozen {name} got a grad"
        assert not p.requires_grad, name
        assert isinstance(p, DTensor)
    for name in ("in_proj.bias", "out_proj.weight"):
        assert dict(model.named_parameters())[name].grad is not None, name
    fulls = {n: full(p.detach()) for n, p in model.named_parameters()}
    for name in ("in_proj.weight", "mid_proj.weight", "mid_proj.bias"):
        torch.testing.assert_close(fulls[name], initial[name], rtol=0, atol=0)
    assert not torch.equal(fulls["in_proj.bias"], initial["in_proj.bias"]), (
        "trainable param did not train"
    )
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model, RTOL, ATOL)


def test_frozen_parameters():
    """requires_grad=False params (alone or mixed in a group) get no grad and never change."""
    run_ranks(_frozen_body, 2)


def _freeze_later_body(rank, world_size):
    ref, model = make_pair(lambda: build_mlp(seed=4))
    shard_mlp(model, fully_shard, mesh=cpu_mesh())
    batches = [mlp_batch(s, 2 * world_size) for s in range(4)]
    ref_losses, losses = train_steps(ref, model, batches[:2], mlp_loss, rank, world_size)
    # Freeze after fully_shard and after training started (e.g. a fine-tuning phase).
    for m in (ref, model):
        m.in_proj.weight.requires_grad_(False)
    frozen = full(model.in_proj.weight.detach())
    r2, l2 = train_steps(ref, model, batches[2:], mlp_loss, rank, world_size)
    assert model.in_proj.weight.grad is None, "a parameter frozen after fully_shard got a grad"
    torch.testing.assert_close(full(model.in_proj.weight.detach()), frozen, rtol=0, atol=0)
    assert_losses_match(ref_losses + r2, losses + l2)
    assert_params_match(ref, model, RTOL, ATOL)


def test_requires_grad_changed_after_fully_shard():
    """Freezing a parameter after fully_shard and training: it gets no grad, the rest keeps parity."""
    run_ranks(_freeze_later_body, 2)


def _ignored_body(rank, world_size):
    ref, model = make_pair(build_mlp)
    ignored = model.in_proj.bias
    before = ignored.detach().clone()
    fully_shard(model.in_proj, mesh=cpu_mesh(), ignored_params={ignored})
    fully_shard(model, mesh=cpu_mesh(), ignored_params={ignored})
    assert model.in_proj.bias is ignored, "ignored param must stay the same object"
    assert not isinstance(model.in_proj.bias, DTensor)
    assert model.in_proj.bias.shape == (13,)
    torch.testing.assert_close(model.in_proj.bias.detach(), before, rtol=0, atol=0)
    for name, p in model.named_parameters():
        if name != "in_proj.bias":
            assert isinstance(p, DTensor), name
    batch = rank_slice(mlp_batch(0, 2 * world_size), rank, world_size)
    mlp_loss(model, batch).backward()
    assert not isinstance(model.in_proj.bias, DTensor), "ignored param was sharded during training"
    assert model.in_proj.bias is ignored
    # not managed by FSDP: its grad is the plain, unreduced local gradient
    g = model.in_proj.bias.grad
    assert g is not None and not isinstance(g, DTensor)
    mlp_loss(ref, batch).backward()  # same values, local data
    torch.testing.assert_close(g, ref.in_proj.bias.grad, rtol=RTOL, atol=ATOL)
    # managed params still get the reduced (global-mean) grads
    full_ref = copy.deepcopy(ref)
    full_ref.zero_grad()
    mlp_loss(full_ref, mlp_batch(0, 2 * world_size)).backward()
    torch.testing.assert_close(
        full(model.out_proj.weight.grad), full_ref.out_proj.weight.grad, rtol=RTOL, atol=ATOL
    )


def test_ignored_params_stay_plain_tensors():
    """ignored_params stay the same plain (non-DTensor) parameters with local, unreduced grads."""
    run_ranks(_ignored_body, 2)


# ---------------------------------------------------------------- meta-device init


def _meta_body(rank, world_size, assign):
    ref = build_transformer(seed=7)
    with torch.device("meta"):
        model = Transformer(toy_args())
    mesh = cpu_mesh()
    shard_transformer(model, fully_shard, mesh=mesh)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == "meta", name
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == "cpu", name
        assert p.to_local().device.type == "cpu", name
    model.load_state_dict(sharded_state_dict_from(ref, mesh), assign=assign)
    assert_sharded(model, rank, world_size, "after load")
    assert_params_match(ref, model, 0, 0)
    batches = [transformer_batch(s, 2 * world_size) for s in range(3)]
    ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size)
    assert_losses_match(ref_losses, losses)
    assert_params_match(ref, model, RTOL, ATOL)


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_meta_device_init_then_to_empty(assign):
    """Model built on meta, sharded, to_empty(cpu) and loaded from a state dict trains with parity."""
    run_ranks(_meta_body, 2, assign)


# ---------------------------------------------------------------- control flow


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.shared = nn.Linear(5, 5)
        self.out = nn.Linear(5, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.out(h)


def _twice_body(rank, world_size):
    for raf in (True, False):
        torch.manual_seed(0)
        ref = _Twice()
        model = copy.deepcopy(ref)
        fully_shard(model.shared, mesh=cpu_mesh(), reshard_after_forward=raf)
        fully_shard(model, mesh=cpu_mesh(), reshard_after_forward=raf)
        batches = [mlp_batch(s, 2 * world_size) for s in range(3)]
        ref_losses, losses = train_steps(ref, model, batches, mlp_loss, rank, world_size)
        assert_sharded(model, rank, world_size, f"raf={raf}")
        assert_losses_match(ref_losses, losses)
        assert_params_match(ref, model, RTOL, ATOL)


def test_module_run_twice_in_one_forward():
    """A sharded module applied twice per forward gets the summed gradient (parity)."""
    run_ranks(_twice_body, 2)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 5)
        self.out = nn.Linear(5, 1)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.out(h)


def _branchy_body(rank, world_size):
    for raf in (True, False, None):
        torch.manual_seed(0)
        ref = _Branchy()
        model = copy.deepcopy(ref)
        mesh = cpu_mesh()
        fully_shard(model.a, mesh=mesh, reshard_after_forward=raf)
        fully_shard(model.b, mesh=mesh, reshard_after_forward=raf)
        fully_shard(model, mesh=mesh, reshard_after_forward=raf)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step, use_b in enumerate([False, True, False, True]):
            x, y = mlp_batch(step, 2 * world_size)
            F.mse_loss(ref(x, use_b), y).backward()
            xs, ys = rank_slice((x, y), rank, world_size)
            F.mse_loss(model(xs, use_b), ys).backward()
            assert_sharded(model, rank, world_size, f"raf={raf} step={step}")
            assert_grads_match(ref, model, RTOL, ATOL)
            if not use_b:
                assert model.b.weight.grad is None and model.b.bias.grad is None
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad()
        assert_params_match(ref, model, RTOL, ATOL)


def test_module_skipped_in_some_steps():
    """A sharded module that does not run in some steps (incl. the first) gets no grad then, right grads later."""
    run_ranks(_branchy_body, 2)


def _no_grad_body(rank, world_size, reshard_after_forward, strict):
    """strict: require every FSDP module sharded after no_grad forward, then build the optimizer."""
    ref, model = make_pair(lambda: build_transformer(seed=3))
    shard_transformer(
        model, fully_shard, mesh=cpu_mesh(), reshard_after_forward=reshard_after_forward
    )
    batches = [transformer_batch(s, 2 * world_size) for s in range(3)]
    opts = make_opts(ref, model)
    ref_losses, losses = train_steps(
        ref, model, batches[:1], transformer_loss, rank, world_size, opts
    )
    tokens, _ = transformer_batch(10, 3)
    for _ in range(2):
        with torch.no_grad():
            out = model(tokens)
        if strict:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    assert_sharded(
                        m, rank, world_size, f"after no_grad forward ({type(m).__name__})"
                    )
        elif reshard_after_forward is not False:
            for layer in model.layers:  # non-root modules reshard after forward
                assert_sharded(layer, rank, world_size, "block after no_grad forward")
        assert not out.requires_grad
        with torch.no_grad():
            torch.testing.assert_close(out, ref(tokens), rtol=RTOL, atol=ATOL)
    if strict:
        # the model is sharded, so an optimizer built now sees the sharded params
        opts = make_opts(ref, model)
    r2, l2 = train_steps(ref, model, batches[1:], transformer_loss, rank, world_size, opts)
    assert_sharded(model, rank, world_size, "after training")
    assert_losses_match(ref_losses + r2, losses + l2)
    assert_params_match(ref, model, RTOL, ATOL)


def test_no_grad_forward_reshards_and_matches():
    """Under no_grad with raf=True, outputs match and every FSDP module is sharded afterwards."""
    run_ranks(_no_grad_body, 2, True, True)


@pytest.mark.parametrize("reshard_after_forward", [None, False], ids=lambda r: f"raf={r}")
def test_no_grad_forward_then_training(reshard_after_forward):
    """no_grad forward with raf None/False matches the reference and later training keeps parity."""
    run_ranks(_no_grad_body, 2, reshard_after_forward, False)


@fsdp2_only
@pytest.mark.parametrize("reshard_after_forward", [None, False], ids=lambda r: f"raf={r}")
def test_no_grad_forward_leaves_root_sharded(reshard_after_forward):
    """fsdp2 reshards even raf=False/root modules after a no_grad forward (upstream keeps them unsharded)."""
    run_ranks(_no_grad_body, 2, reshard_after_forward, True)


# ---------------------------------------------------------------- gradients


def _grad_accum_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=4))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    micro = [transformer_batch(s, 2 * world_size) for s in range(2)]
    for batch in micro:
        transformer_loss(ref, batch).backward()
        transformer_loss(model, rank_slice(batch, rank, world_size)).backward()
    assert_sharded(model, rank, world_size, "after accumulation")
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), name
        assert p.grad.placements == p.placements, name
    assert_grads_match(ref, model, RTOL, ATOL)
    # the accumulated grads are the ones the optimizer uses
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert_params_match(ref, model, RTOL, ATOL)


def test_gradient_accumulation():
    """Two backward passes without a step accumulate the same grads as the reference."""
    run_ranks(_grad_accum_body, 2)


def _grad_layout_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=6))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    batch = transformer_batch(0, 2 * world_size)
    transformer_loss(ref, batch).backward()
    transformer_loss(model, rank_slice(batch, rank, world_size)).backward()
    for name, p in model.named_parameters():
        g = p.grad
        assert isinstance(g, DTensor), f"{name}.grad is {type(g).__name__}"
        assert g.placements == p.placements, (name, g.placements)
        assert g.device_mesh == p.device_mesh, name
        assert g.shape == p.shape, (name, g.shape)
        assert g.to_local().shape == p.to_local().shape, (
            name,
            g.to_local().shape,
            p.to_local().shape,
        )
    assert_grads_match(ref, model, RTOL, ATOL)


def test_sharded_grads_are_dtensors_equal_to_reference():
    """.grad of a sharded param is a DTensor like the param whose full_tensor is the reference grad."""
    run_ranks(_grad_layout_body, 3)


def _all_sharded_body(rank, world_size):
    for raf in (True, False, None):
        ref, model = make_pair(lambda: build_transformer(seed=8))
        shard_transformer(model, fully_shard, mesh=cpu_mesh(), reshard_after_forward=raf)
        for step in range(2):
            batch = transformer_batch(step, 2 * world_size)
            transformer_loss(model, rank_slice(batch, rank, world_size)).backward()
            assert_sharded(model, rank, world_size, f"raf={raf} step={step}")
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    assert_sharded(m, rank, world_size, f"raf={raf} step={step} {type(m).__name__}")
            model.zero_grad()


def test_params_sharded_after_forward_backward():
    """After forward+backward every param is a sharded DTensor again, for every reshard_after_forward."""
    run_ranks(_all_sharded_body, 2)


# ---------------------------------------------------------------- manual unshard / reshard


def _unshard_body(rank, world_size):
    ref, model = make_pair(lambda: build_transformer(seed=3))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    batches = [transformer_batch(s, 2 * world_size) for s in range(2)]
    opts = make_opts(ref, model)
    ref_losses, losses = train_steps(
        ref, model, batches[:1], transformer_loss, rank, world_size, opts
    )
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(fsdp_modules) == 3
    handles = [m.unshard(async_op=True) for m in fsdp_modules[1:]]
    assert fsdp_modules[0].unshard() is None  # the root, synchronously
    for h in handles:
        assert isinstance(h, UnshardHandle)
        h.wait()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert not isinstance(p, DTensor), f"{name} still sharded after unshard()"
        assert p.shape == ref_params[name].shape, name
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        torch.testing.assert_close(
            model(batches[1][0][:2]), ref(batches[1][0][:2]), rtol=RTOL, atol=ATOL
        )
    for m in fsdp_modules:
        m.reshard()
    assert_sharded(model, rank, world_size, "after reshard()")
    r2, l2 = train_steps(ref, model, batches[1:], transformer_loss, rank, world_size, opts)
    assert_losses_match(ref_losses + r2, losses + l2)
    assert_params_match(ref, model, RTOL, ATOL)


def test_manual_unshard_reshard():
    """unshard() (sync and async handle) exposes full params; reshard() restores shards; training continues."""
    run_ranks(_unshard_body, 2)


# ---------------------------------------------------------------- extra forward methods


class _Encoder(MLP):
    def encode(self, x):
        return torch.tanh(self.mid_proj(torch.tanh(self.in_proj(x))))


def _forward_method_body(rank, world_size):
    torch.manual_seed(0)
    ref = _Encoder()
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=cpu_mesh())
    register_fsdp_forward_method(model, "encode")
    x, _ = mlp_batch(0, 2 * world_size)
    xs = x.chunk(world_size)[rank]
    out = model.encode(xs)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, ref.encode(x).chunk(world_size)[rank], rtol=RTOL, atol=ATOL)
    out.pow(2).mean().backward()
    ref.encode(x).pow(2).mean().backward()
    assert_sharded(model, rank, world_size, "after encode backward")
    assert_grads_match(ref, model, RTOL, ATOL)


def test_register_fsdp_forward_method():
    """A registered non-forward method unshards params and produces reference outputs and grads."""
    run_ranks(_forward_method_body, 2)
