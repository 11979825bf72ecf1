"""fsdp2.Muon: torch.optim.Muon on sharded matrices, equal to single-device Muon to the bit.

Each training case shards the toy Transformer, steps its hidden matrices with
``fsdp2.Muon`` and the rest with AdamW, and steps an unsharded copy with
``torch.optim.Muon`` / AdamW on the *same* gradients (the sharded model's,
gathered): every parameter and momentum buffer must stay bit-equal, step after
step. The checkpoint cases feed synthetic full gradients, which do not depend
on the world size, so a run resumed at W=2 or W=3 from a W=4 checkpoint can be
compared bit for bit with the uninterrupted W=4 run.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _impl import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from _multiproc import run_ranks
from checks import check_case
from models import (
    build_transformer,
    full,
    global_mean,
    rank_slice,
    shard_transformer,
    transformer_batch,
)
from models import transformer_loss as loss_of
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

import fsdp2

HYPER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
STEPS = 3


def _split(model: torch.nn.Module) -> tuple[list, list]:
    """(named hidden matrices for Muon, the rest for AdamW), as the Muon recipe splits them."""
    hidden, rest = [], []
    for name, p in model.named_parameters():
        is_hidden = p.ndim == 2 and "tok_embeddings" not in name and "output" not in name
        (hidden if is_hidden else rest).append((name, p))
    return hidden, rest


def _optimizers(model: torch.nn.Module, muon_cls, hyper: dict) -> tuple:
    hidden, rest = _split(model)
    params = hidden if muon_cls is fsdp2.Muon else [p for _, p in hidden]
    return muon_cls(params, **hyper), torch.optim.AdamW([p for _, p in rest], lr=1e-2)


def _assert_equal(ref, model, ref_muon, muon, where: str) -> None:
    """Every parameter and Muon momentum buffer of ``model`` equals ``ref``'s, bit for bit."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(full(p.detach()), q.detach()), f"{where}: {name} differs"
    for (_, p), (_, q) in zip(_split(model)[0], _split(ref)[0]):
        got, want = full(muon.state[p]["momentum_buffer"]), ref_muon.state[q]["momentum_buffer"]
        assert torch.equal(got, want), f"{where}: momentum differs"


def _train_ref_on_gathered_grads(rank, world_size, *, mesh=None, hyper=HYPER, accum=1,
                                 wrap_ac=False, **shard_kwargs):
    """Train the sharded model and the single-device reference on its gathered gradients."""
    ref = build_transformer(seed=3)
    model = copy.deepcopy(ref)
    if wrap_ac:
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (world_size,))
    shard_transformer(model, fully_shard, mesh=mesh, **shard_kwargs)
    muon, adamw = _optimizers(model, fsdp2.Muon, hyper)
    ref_muon, ref_adamw = _optimizers(ref, torch.optim.Muon, hyper)
    losses = []
    for step in range(STEPS):
        for micro in range(accum):
            batch = transformer_batch(step * accum + micro, 2 * world_size)
            loss = loss_of(model, rank_slice(batch, rank, world_size))
            loss.backward()
        with torch.no_grad():
            ref_loss = loss_of(ref, batch)
        losses.append((global_mean(loss).item(), ref_loss.item()))
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = full(p.grad).clone()
        for opt in (muon, adamw, ref_muon, ref_adamw):
            opt.step()
            opt.zero_grad()
        _assert_equal(ref, model, ref_muon, muon, f"step {step}")
    return losses, muon


def _case_plain(rank, world_size):
    """1-D mesh: bit-equal to single-device Muon every step (uneven shards for W=3, 4)."""
    _train_ref_on_gathered_grads(rank, world_size)


def _case_hyper(rank, world_size):
    """No Nesterov, match_rms_adamw learning-rate scaling, two NS coefficient sets: bit-equal."""
    _train_ref_on_gathered_grads(
        rank,
        world_size,
        hyper={**HYPER, "nesterov": False, "adjust_lr_fn": "match_rms_adamw", "ns_steps": 4},
    )


def _case_tensor_lr(rank, world_size):
    """A tensor lr (kept a float32 0-d tensor, as torch.optim.Muon keeps it), ratio != 1: bit-equal."""
    hyper = {**HYPER, "lr": torch.tensor(0.015), "adjust_lr_fn": "match_rms_adamw"}
    _train_ref_on_gathered_grads(rank, world_size, hyper=hyper)


def _case_grad_accumulation(rank, world_size):
    """Two microbatches per step (gradients accumulated in the sharded .grad): bit-equal."""
    _train_ref_on_gathered_grads(rank, world_size, accum=2)


def _case_offload(rank, world_size):
    """CPUOffloadPolicy (unpinned: no accelerator here): bit-equal."""
    _train_ref_on_gathered_grads(
        rank, world_size, offload_policy=CPUOffloadPolicy(pin_memory=False)
    )


def _case_activation_checkpointing(rank, world_size):
    """checkpoint_wrapper on each block, then fully_shard: bit-equal."""
    _train_ref_on_gathered_grads(rank, world_size, wrap_ac=True)


def _case_mixed_precision(rank, world_size):
    """bf16 compute: the update is bit-equal on the same gradients; loss within bf16 of fp32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    losses, _ = _train_ref_on_gathered_grads(rank, world_size, mp_policy=policy)
    for got, want in losses:
        assert abs(got - want) <= 2e-2 * abs(want), losses


def _case_hsdp(rank, world_size):
    """HSDP on a 2x2 (replicate, shard) mesh: bit-equal."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _train_ref_on_gathered_grads(rank, world_size, mesh=mesh)


def _case_two_all_to_alls(rank, world_size):
    """A step issues two all-to-alls over the shard group and no other collective."""
    model = build_transformer(seed=3)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    muon, _ = _optimizers(model, fsdp2.Muon, HYPER)
    loss_of(model, transformer_batch(0, 2)).backward()
    calls = []
    originals = {}
    for name in ("all_to_all_single", "all_gather_into_tensor", "all_reduce", "broadcast"):
        originals[name] = getattr(dist, name)

        def seen(*args, _name=name, **kwargs):
            calls.append(_name)
            return originals[_name](*args, **kwargs)

        setattr(dist, name, seen)
    try:
        muon.step()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    assert calls == ["all_to_all_single"] * 2, calls


def _experts_body(rank, world_size, placement) -> None:
    """Synthetic gradients for 2-D and 3-D (expert) parameters against per-matrix torch Muon."""
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(0)
    shapes = [(11, 8), (8, 11), (8, 8), (8, 8), (5, 7), (3, 6, 10), (5, 9, 4)]
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    placements = [[Shard(0)]] * 5 + [[placement]] * 2
    params = [
        torch.nn.Parameter(distribute_tensor(f.clone(), mesh, pl))
        for f, pl in zip(fulls, placements)
    ]
    refs = [torch.nn.Parameter(f.clone()) for f in fulls[:5]]
    refs += [torch.nn.Parameter(f[e].clone()) for f in fulls[5:] for e in range(f.shape[0])]
    muon = fsdp2.Muon([(f"p{i}", p) for i, p in enumerate(params)], **HYPER)
    ref_muon = torch.optim.Muon(refs, **HYPER)
    for step in range(STEPS):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g, pl in zip(params, grads, placements):
            p.grad = distribute_tensor(g, mesh, pl)
        per_matrix = grads[:5] + [g[e] for g in grads[5:] for e in range(g.shape[0])]
        for q, g in zip(refs, per_matrix):
            q.grad = g.clone()
        muon.step()
        ref_muon.step()
        got = [full(p.detach()) for p in params]
        got = got[:5] + [g[e] for g in got[5:] for e in range(g.shape[0])]
        for i, (a, b) in enumerate(zip(got, refs)):
            assert torch.equal(a, b.detach()), f"step {step}: matrix {i} differs"


def _case_experts_split(rank, world_size):
    """3-D stacks sharded inside each matrix (Shard(1)): one matrix per expert, bit-equal."""
    _experts_body(rank, world_size, Shard(1))


def _case_experts_whole(rank, world_size):
    """3-D stacks sharded over experts (Shard(0)): each rank's experts stepped in place, bit-equal."""
    _experts_body(rank, world_size, Shard(0))


def _case_load_balance(rank, world_size):
    """Owners split Newton-Schulz work evenly: max/mean <= 1.25 and the work adds up."""
    model = build_transformer(seed=3, n_layers=4)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    muon, _ = _optimizers(model, fsdp2.Muon, HYPER)
    (report,) = muon.load_balance()
    assert report.group_ranks == list(range(world_size)), report
    assert report.max_over_mean <= 1.25, report
    assert abs(sum(report.flops) - report.total) <= 1e-6 * report.total, report


def _expect_error(exc_type, needle: str, build) -> None:
    with pytest.raises(exc_type) as info:
        build()
    assert needle in str(info.value), str(info.value)


def _case_bad_input(rank, world_size):
    """Non-matrix, tensor-parallel, partial and two-mesh-dim parameters raise on every rank."""
    model = build_transformer(seed=3)
    fully_shard(model)
    _expect_error(
        ValueError,
        "layers.0.attention_norm.weight",
        lambda: fsdp2.Muon(list(model.named_parameters())),
    )
    _expect_error(ValueError, "AdamW", lambda: fsdp2.Muon(list(model.named_parameters())))
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = distribute_tensor(torch.randn(8, 8), mesh2d, [Shard(0), Shard(1)])
    _expect_error(NotImplementedError, "w_tp", lambda: fsdp2.Muon([("w_tp", tp)]))
    _expect_error(NotImplementedError, "tensor parallel", lambda: fsdp2.Muon([("w_tp", tp)]))
    partial = DTensor.from_local(torch.randn(8, 8), init_device_mesh("cpu", (4,)), [Partial()])
    _expect_error(ValueError, "w_partial", lambda: fsdp2.Muon([("w_partial", partial)]))
    twice = distribute_tensor(torch.randn(8, 8), mesh2d, [Shard(0), Shard(0)])
    _expect_error(ValueError, "1-D mesh", lambda: fsdp2.Muon([("w_twice", twice)]))
    # unnamed parameters are named by their place in the param groups
    _expect_error(ValueError, "param_groups[0]['params'][1]", lambda: fsdp2.Muon(
        [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    ))


# ---------------------------------------------------------------- checkpoints

SAVED_AT = 2


def _synthetic_grads(model: torch.nn.Module, step: int) -> None:
    """Set every gradient from a seeded full tensor, the same at any world size."""
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        g = torch.randn(p.shape, generator=gen)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g


def _sharded_run(world_size):
    model = build_transformer(seed=5)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return (model, *_optimizers(model, fsdp2.Muon, HYPER))


def _steps(model, optims, steps) -> None:
    for step in steps:
        _synthetic_grads(model, step)
        for opt in optims:
            opt.step()
            opt.zero_grad()


def _case_save(ckpt_dir, rank, world_size):
    """W=4: step, save model + both optimizers with DCP, then run on (the uninterrupted run)."""
    model, muon, adamw = _sharded_run(world_size)
    _steps(model, (muon, adamw), range(SAVED_AT))
    msd, osd = get_state_dict(model, (muon, adamw))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    _steps(model, (muon, adamw), range(SAVED_AT, SAVED_AT + 2))
    after = {name: full(p.detach()) for name, p in model.named_parameters()}
    if rank == 0:
        torch.save(after, os.path.join(ckpt_dir, "uninterrupted.pt"))
    dist.barrier()


def _case_resume(ckpt_dir, rank, world_size):
    """Load the W=4 checkpoint at this world size; the next steps equal the uninterrupted run."""
    model, muon, adamw = _sharded_run(world_size)
    msd, osd = get_state_dict(model, (muon, adamw))
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, (muon, adamw), model_state_dict=state["model"], optim_state_dict=state["optim"])
    _steps(model, (muon, adamw), range(SAVED_AT, SAVED_AT + 2))
    want = torch.load(os.path.join(ckpt_dir, "uninterrupted.pt"))
    for name, p in model.named_parameters():
        assert torch.equal(full(p.detach()), want[name]), f"{name} differs after resuming"


# ---------------------------------------------------------------- launches

CASES = {
    1: {"plain": _case_plain, "experts_split": _case_experts_split},
    2: {
        "plain": _case_plain,
        "grad_accumulation": _case_grad_accumulation,
        "offload": _case_offload,
        "activation_checkpointing": _case_activation_checkpointing,
        "mixed_precision": _case_mixed_precision,
        "two_all_to_alls": _case_two_all_to_alls,
        "tensor_lr": _case_tensor_lr,
        "experts_whole": _case_experts_whole,
    },
    3: {
        "plain": _case_plain,
        "hyper": _case_hyper,
        "tensor_lr": _case_tensor_lr,
        "experts_split": _case_experts_split,
    },
    4: {
        "plain": _case_plain,
        "hsdp": _case_hsdp,
        "tensor_lr": _case_tensor_lr,
        "experts_split": _case_experts_split,
        "experts_whole": _case_experts_whole,
        "load_balance": _case_load_balance,
        "bad_input": _case_bad_input,
    },
}


def _cases(world_size: int, ckpt: str) -> dict:
    """``CASES[world_size]``; W=4 also saves the checkpoint in ``ckpt``, W=2 and 3 resume it."""
    cases = dict(CASES[world_size])
    if world_size == 4:
        cases["save"] = functools.partial(_case_save, ckpt)
    elif world_size in (2, 3):
        cases["resume"] = functools.partial(_case_resume, ckpt)
    return cases


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, launch_cases) -> str:
    """The W=4 launch's checkpoint, saved before any other launch of this module reads it."""
    path = str(tmp_path_factory.mktemp("muon_ckpt"))
    check_case(launch_cases(4, _cases(4, path)), "save")
    return path


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bit_equal_to_single_device_muon(world_size, ckpt_dir, launch_cases):
    """1-D mesh at W = 1..4 (uneven shards at 3 and 4): every step bit-equal to torch.optim.Muon."""
    check_case(launch_cases(world_size, _cases(world_size, ckpt_dir)), "plain")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_tensor_lr_bit_equal(world_size, ckpt_dir, launch_cases):
    """lr=torch.tensor(0.015), match_rms_adamw (a ratio that rounds) at W = 2..4: bit-equal."""
    check_case(launch_cases(world_size, _cases(world_size, ckpt_dir)), "tensor_lr")


def test_hyperparameters_bit_equal(ckpt_dir, launch_cases):
    """nesterov=False, adjust_lr_fn='match_rms_adamw', ns_steps=4 at W=3: bit-equal."""
    check_case(launch_cases(3, _cases(3, ckpt_dir)), "hyper")


@pytest.mark.parametrize(
    "case", ["grad_accumulation", "offload", "activation_checkpointing", "mixed_precision"]
)
def test_composition_bit_equal(case, ckpt_dir, launch_cases):
    """Gradient accumulation, CPU offload, activation checkpointing, bf16 compute at W=2."""
    check_case(launch_cases(2, _cases(2, ckpt_dir)), case)


def test_hsdp_bit_equal(ckpt_dir, launch_cases):
    """HSDP 2x2: bit-equal to torch.optim.Muon."""
    check_case(launch_cases(4, _cases(4, ckpt_dir)), "hsdp")


@pytest.mark.parametrize(
    "world_size,case",
    [(1, "experts_split"), (3, "experts_split"), (4, "experts_split"),
     (2, "experts_whole"), (4, "experts_whole")],
)
def test_stacked_experts_bit_equal(world_size, case, ckpt_dir, launch_cases):
    """3-D expert stacks, sharded within or across matrices: each expert bit-equal to 2-D Muon."""
    check_case(launch_cases(world_size, _cases(world_size, ckpt_dir)), case)


def test_step_is_two_all_to_alls(ckpt_dir, launch_cases):
    """optimizer.step() communicates with exactly two all-to-alls."""
    check_case(launch_cases(2, _cases(2, ckpt_dir)), "two_all_to_alls")


def test_load_balance(ckpt_dir, launch_cases):
    """The owners' Newton-Schulz work is within 1.25x of an even split at W=4."""
    check_case(launch_cases(4, _cases(4, ckpt_dir)), "load_balance")


def test_bad_input_raises_on_every_rank(ckpt_dir, launch_cases):
    """Clear errors naming the parameter and the fix, at construction, on all 4 ranks."""
    check_case(launch_cases(4, _cases(4, ckpt_dir)), "bad_input")


@pytest.mark.parametrize("world_size", [2, 3])
def test_checkpoint_reshards(world_size, ckpt_dir, launch_cases):
    """DCP save at W=4, load at W=2 / W=3: the next steps equal the uninterrupted W=4 run."""
    check_case(launch_cases(world_size, _cases(world_size, ckpt_dir)), "resume")


def test_signature_matches_torch_muon():
    """fsdp2.Muon takes torch.optim.Muon's parameters: names, kinds and defaults, in order."""
    def params(cls):
        return [
            (p.name, p.kind, p.default)
            for p in inspect.signature(cls.__init__).parameters.values()
        ]

    assert params(fsdp2.Muon) == params(torch.optim.Muon)


def test_adjust_lr_fn_validated():
    """An unknown adjust_lr_fn raises as torch.optim.Muon does."""
    with pytest.raises(ValueError, match="not supported"):
        fsdp2.Muon([torch.nn.Parameter(torch.randn(4, 4))], adjust_lr_fn="nope")


def _example_body(rank, world_size):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    import muon as example

    args = example.parse_args(["--steps", "15", "--batch-size", "4", "--dim", "64"])
    return example.train(args, torch.device("cpu"))


def test_example_loss_falls():
    """examples/muon.py trains the demo model with Muon + AdamW on 2 ranks and its loss falls."""
    pytest.importorskip("tqdm")  # the example's progress bar (examples/train.py)
    losses = run_ranks(_example_body, 2)[0]
    assert min(losses[-5:]) < 0.75 * losses[0], losses
