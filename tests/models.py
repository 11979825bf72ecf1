"""Tiny deterministic models and helpers shared by the tests.

Sizes are deliberately odd (7, 13, 5, 3, 1, 17 ...) so that dim 0 of most
parameters does not divide evenly over 2, 3 or 4 ranks, and some ranks own
zero rows of some parameters. The transformer is the demo's small Llama
(examples/model.py) at a toy size; the sharding recipes are ``shard_groups``
and its model-specific wrappers.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

# The one small Llama: examples/model.py, imported as the examples import it.
_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
import model as _demo  # noqa: E402
import moe as _moe  # noqa: E402  (examples/moe.py: the mixture-of-experts model)

ModelArgs, Transformer = _demo.ModelArgs, _demo.Transformer
# its module classes, by the names the guide pages and the tests' wrap policies use
Block, Attention, FeedForward = _demo.TransformerBlock, _demo.Attention, _demo.FeedForward
RMSNorm = nn.RMSNorm

# ---------------------------------------------------------------- MLP


class MLP(nn.Module):
    """7 -> 13 -> 5 -> 1; weight dim 0 sizes 13, 5, 1 and bias sizes 13, 5, 1."""

    def __init__(self, in_dim: int = 7, hidden: int = 13, mid: int = 5, out_dim: int = 1):
        super().__init__()
        self.in_proj = nn.Linear(in_dim, hidden)
        self.mid_proj = nn.Linear(hidden, mid)
        self.out_proj = nn.Linear(mid, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.in_proj(x))
        x = torch.tanh(self.mid_proj(x))
        return self.out_proj(x)


def build_mlp(seed: int = 0) -> MLP:
    """An MLP whose initial values depend only on ``seed``."""
    torch.manual_seed(seed)
    return MLP()


def mlp_batch(step: int, batch: int, in_dim: int = 7, out_dim: int = 1, seed: int = 1234):
    """A deterministic (inputs, targets) regression batch for ``step``."""
    g = torch.Generator().manual_seed(seed + step)
    x = torch.randn(batch, in_dim, generator=g)
    y = torch.randn(batch, out_dim, generator=g)
    return x, y


def mlp_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


# ---------------------------------------------------------------- traced chain


class _Trace(torch.autograd.Function):
    """Identity that appends ("fwd", name) to ``log`` when run, ("bwd", name) in backward."""

    @staticmethod
    def forward(ctx, x, log, name):
        ctx.log, ctx.name = log, name
        log.append(("fwd", name))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("bwd", ctx.name))
        return grad, None, None


class TracedLinear(nn.Linear):
    """tanh(Linear) whose output records in ``log`` when forward ran and when backward reached it."""

    def __init__(self, in_dim: int, out_dim: int, name: str, log: list):
        super().__init__(in_dim, out_dim)
        self.name = name
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Trace.apply(torch.tanh(super().forward(x)), self.log, self.name)


class Chain(nn.Module):
    """5 -> 6 -> 7 -> 8 -> 9 traced layers ``L0..L3`` and a 9 -> 1 ``head``.

    Every layer has a different size, so each FSDP group's collectives have a
    distinct numel at any world size up to 4 (see ``group_numel``): a log of
    collectives says which group each one served. ``log`` (shared by the
    layers) records the layers' forward and backward in order.
    """

    DIMS = (5, 6, 7, 8, 9)

    def __init__(self):
        super().__init__()
        self.log: list = []
        dims = self.DIMS
        self.layers = nn.ModuleList(
            TracedLinear(dims[i], dims[i + 1], f"L{i}", self.log) for i in range(len(dims) - 1)
        )
        self.head = nn.Linear(dims[-1], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_chain(seed: int = 0) -> Chain:
    """A Chain whose initial values depend only on ``seed``."""
    torch.manual_seed(seed)
    return Chain()


def chain_batch(step: int, batch: int, seed: int = 99):
    """A deterministic (inputs, targets) regression batch for a Chain."""
    return mlp_batch(step, batch, in_dim=Chain.DIMS[0], out_dim=1, seed=seed)


def shard_chain(model: Chain, fully_shard, **kwargs) -> Chain:
    """fully_shard each layer, then the root (which holds ``head``)."""
    return shard_groups(model, fully_shard, model.layers, **kwargs)


def group_numel(module: nn.Module, world_size: int, exclude=()) -> int:
    """Elements of one group's all-gather output / reduce-scatter input (dim 0 padded to W)."""
    skip = {id(p) for m in exclude for p in m.parameters()}
    total = 0
    for p in module.parameters():
        if id(p) not in skip:
            rows = -(-p.shape[0] // world_size)
            total += rows * world_size * (p.numel() // p.shape[0])
    return total


def chain_group_names(model: Chain, world_size: int) -> dict[int, str]:
    """numel -> group name ("L0".."L3", "root") for a Chain sharded by ``shard_chain``."""
    names = {group_numel(layer, world_size): layer.name for layer in model.layers}
    names[group_numel(model, world_size, exclude=model.layers)] = "root"
    assert len(names) == len(model.layers) + 1, f"group sizes collide at W={world_size}"
    return names


# ---------------------------------------------------------------- transformer
# The demo's Llama (examples/model.py: RoPE attention, SwiGLU, nn.RMSNorm), at a
# toy size: vocab 17, dim 8, 2 heads, 2 blocks, feed-forward hidden 11.


def toy_args(
    vocab: int = 17,
    dim: int = 8,
    n_heads: int = 2,
    n_layers: int = 2,
    hidden: int = 11,
    tie_weights: bool = False,
) -> ModelArgs:
    """The toy Transformer's ``ModelArgs`` (``hidden`` is the feed-forward's width).

    RoPE tables computed in forward (``rope_buffers=False``): the model holds
    parameters only, so every state dict covers it (e.g. one loaded into a model
    built on meta), as the guide pages' flows need.
    """
    return ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab, max_seq_len=16,
        ffn_hidden_dim=hidden, tie_weights=tie_weights, rope_buffers=False,
    )


def build_transformer(seed: int = 0, **kwargs) -> Transformer:
    """A toy Transformer (``toy_args(**kwargs)``) whose values depend only on ``seed``.

    The values are the modules' own default init, drawn in the constructor (the
    scale the tests' tolerances were set for), not the demo's ``init_weights()``.
    """
    torch.manual_seed(seed)
    return Transformer(toy_args(**kwargs))


def transformer_batch(step: int, batch: int, seq: int = 6, vocab: int = 17, seed: int = 4321):
    """A deterministic (tokens, targets) batch for ``step``."""
    g = torch.Generator().manual_seed(seed + step)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    return tokens, targets


def transformer_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------- mixture of experts
# examples/moe.py's model at a toy size: vocab 13, dim 8, expert hidden 12,
# top-1 routing, experts split over an expert-parallel mesh by all-to-all.

build_moe, moe_meshes, expert_parallel, shard_moe, expert_placement = (
    _moe.build_moe, _moe.moe_meshes, _moe.expert_parallel, _moe.shard_moe, _moe.expert_placement
)


def toy_moe(seed: int = 0, num_experts: int = 4, n_layers: int = 2) -> nn.Module:
    return _moe.build_moe(seed, vocab=13, dim=8, hidden=12, num_experts=num_experts,
                          n_layers=n_layers)


def moe_batch(step: int, batch: int, vocab: int = 13, seed: int = 77):
    """A deterministic (tokens, targets) batch of ``batch`` single tokens."""
    g = torch.Generator().manual_seed(seed + step)
    tokens = torch.randint(0, vocab, (batch,), generator=g)
    return tokens, (tokens * 5 + 2) % vocab


def moe_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens), targets)


# ---------------------------------------------------------------- helpers


def make_pair(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """(reference, to_shard): two models with identical initial values."""
    ref = build()
    return ref, copy.deepcopy(ref)


def cpu_mesh(world_size: int | None = None):
    """A 1-D CPU device mesh over the default process group."""
    if world_size is None:
        world_size = dist.get_world_size()
    return init_device_mesh("cpu", (world_size,))


def rank_slice(batch, rank: int, world_size: int):
    """Rank ``rank``'s equal share (dim 0) of every tensor in ``batch``."""
    return tuple(t.chunk(world_size)[rank] for t in batch)


def global_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean of a scalar over all ranks (for comparing per-rank losses)."""
    t = value.detach().clone().reshape(1)
    dist.all_reduce(t)
    return t[0] / dist.get_world_size()


def full(t: torch.Tensor) -> torch.Tensor:
    """The full value of a tensor that may be a DTensor.

    Shards (``Shard``, and ``RaggedShard`` with its rows set) are gathered with
    one process-group collective per sharded mesh dim, not through
    ``full_tensor()``: DTensor's redistribute costs about 0.9 ms of Python a
    call on these machines, and the optimizer matrices call this for every
    parameter after every step (a third of their time). Anything else
    (partial or strided placements, tensors that need grad, other backends)
    takes ``full_tensor()``; ``tests/test_multiproc.py`` holds the two equal.
    """
    if not isinstance(t, DTensor):
        return t
    gathered = _gather_shards(t)
    return t.full_tensor() if gathered is None else gathered


_GATHER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32)


def _shard_sizes(placement, size: int, world: int) -> list[int] | None:
    """Each rank's rows of a ``size``-row dim under ``placement`` (None: not a plain shard)."""
    from fsdp2 import RaggedShard

    if isinstance(placement, RaggedShard) and placement.row_bounds:
        bounds = placement.row_bounds
        return [b - a for a, b in zip(bounds, bounds[1:])]
    if type(placement) is Shard:  # torch.chunk's: full chunks, what is left, then empty ones
        chunk = -(-size // world) if size else 0
        return [max(0, min(chunk, size - r * chunk)) for r in range(world)]
    return None


def _shard_plan(t: DTensor) -> list[tuple[Any, int, list[int]]] | None:
    """(process group, tensor dim, each rank's rows) per sharded mesh dim of ``t``, or None
    where all-gathers of padded shards are not ``t.full_tensor()``."""
    mesh, placements = t.device_mesh, t.placements
    sharded = [
        (i, p.dim, _shard_sizes(p, t.shape[p.dim], mesh.size(i))) if isinstance(p, Shard)
        else (i, None, None)  # partial sums and the like
        for i, p in enumerate(placements) if not p.is_replicate()
    ]
    if (
        t.requires_grad
        or t.dtype not in _GATHER_DTYPES
        or not sharded
        or any(sizes is None for *_, sizes in sharded)
        or len({d for _, d, _ in sharded}) != len(sharded)  # one mesh dim per tensor dim
        or t.to_local().device.type != "cpu"
    ):
        return None
    groups = [mesh.get_group(i) for i, _, _ in sharded]
    if any(dist.get_backend(g) not in ("fsdp2_shm", "gloo") for g in groups):
        return None
    return [(group, dim, sizes) for group, (_, dim, sizes) in zip(groups, sharded)]


def _padded_rows(value: torch.Tensor, dim: int, most: int) -> torch.Tensor:
    rows = value.movedim(dim, 0)
    padded = rows.new_zeros((most, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    return padded


def _unpad(blocks: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
    """``blocks`` (ranks, most, ...): each rank's first ``sizes[r]`` rows, joined on ``dim``."""
    return torch.cat([b[:n] for b, n in zip(blocks, sizes)]).movedim(0, dim)


def _gather_shards(t: DTensor) -> torch.Tensor | None:
    """``t.full_tensor()`` by all-gathers of padded shards, or None where that is not it."""
    plan = _shard_plan(t)
    if plan is None:
        return None
    value = t.to_local()
    for group, dim, sizes in plan:
        padded = _padded_rows(value, dim, max(sizes))
        out = padded.new_empty((len(sizes) * padded.shape[0], *padded.shape[1:]))  # gloo's shape
        dist.all_gather_into_tensor(out, padded, group=group)
        value = _unpad(out.view(len(sizes), *padded.shape), sizes, dim)
    return value.contiguous()


def full_all(tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``[full(t) for t in tensors]`` (None stays None) in one all-gather per process group
    and dtype for the tensors sharded on one mesh dim: the parity checks gather every
    parameter after every step, and one collective a tensor was most of their cost.

    A collective: every rank passes the same tensors in the same order.
    """
    tensors = list(tensors)
    fulls: list[torch.Tensor | None] = list(tensors)
    batches: dict[tuple[int, torch.dtype], list[tuple[int, Any, int, list[int]]]] = {}
    others = []
    for i, t in enumerate(tensors):
        if not isinstance(t, DTensor):
            continue
        plan = _shard_plan(t)
        if plan is None or len(plan) != 1:
            others.append(i)
            continue
        ((group, dim, sizes),) = plan
        batches.setdefault((id(group), t.dtype), []).append((i, group, dim, sizes))
    for batch in batches.values():
        pieces = [_padded_rows(tensors[i].to_local(), dim, max(sizes)) for i, _, dim, sizes in batch]
        flat = torch.cat([p.reshape(-1) for p in pieces])
        group, ranks = batch[0][1], len(batch[0][3])
        out = flat.new_empty(ranks * flat.numel())  # gloo's shape: the inputs end to end
        dist.all_gather_into_tensor(out, flat, group=group)
        out = out.view(ranks, flat.numel())
        start = 0
        for (i, _, dim, sizes), piece in zip(batch, pieces):
            blocks = out[:, start : start + piece.numel()].reshape(ranks, *piece.shape)
            fulls[i] = _unpad(blocks, sizes, dim).contiguous()
            start += piece.numel()
    for i in others:
        fulls[i] = full(tensors[i])
    return fulls


def assert_params_match(ref: nn.Module, model: nn.Module, rtol: float = 1e-5, atol: float = 1e-6):
    """Every parameter of ``model`` (by name) equals ``ref``'s, as a full tensor.

    All full tensors are gathered (a collective) before anything is compared,
    so a mismatch seen on only some ranks cannot desynchronize collectives.
    """
    ref_params = dict(ref.named_parameters())
    names, params = zip(*model.named_parameters())
    fulls = dict(zip(names, full_all(p.detach() for p in params)))
    assert sorted(ref_params) == sorted(fulls), (sorted(ref_params), sorted(fulls))
    for name, ref_p in ref_params.items():
        p = fulls[name]
        assert p.shape == ref_p.shape, (name, p.shape, ref_p.shape)
        torch.testing.assert_close(
            p, ref_p.detach(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def assert_grads_match(ref: nn.Module, model: nn.Module, rtol: float = 1e-5, atol: float = 1e-6):
    """Every parameter's ``.grad`` of ``model`` (by name) equals ``ref``'s (or both None)."""
    ref_params = dict(ref.named_parameters())
    names, params = zip(*model.named_parameters())
    grads = dict(zip(names, full_all(p.grad for p in params)))
    assert sorted(ref_params) == sorted(grads), (sorted(ref_params), sorted(grads))
    for name, g in grads.items():
        ref_g = ref_params[name].grad
        if ref_g is None:
            assert g is None, f"{name}: expected no grad, got one"
            continue
        assert g is not None, f"{name}: missing grad"
        assert g.shape == ref_g.shape, (name, g.shape, ref_g.shape)
        torch.testing.assert_close(
            g, ref_g, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def sharded_state_dict_from(ref: nn.Module, mesh) -> dict[str, torch.Tensor]:
    """``ref``'s state dict with every tensor as a Shard(0) DTensor on ``mesh``."""
    return {
        k: distribute_tensor(v.detach().clone(), mesh, [Shard(0)])
        for k, v in ref.state_dict().items()
    }


def shard_groups(model: nn.Module, fully_shard, groups, **kwargs) -> nn.Module:
    """The bottom-up recipe: ``fully_shard`` each of ``groups``, then the root ``model``.

    A group is a module or a list of modules sharded together (``fully_shard([a, b])``);
    every call gets the same ``kwargs``. ``fully_shard`` is fsdp2's, upstream's, or
    anything called like them.
    """
    for group in groups:
        fully_shard(group, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_transformer(model: Transformer, fully_shard, **kwargs) -> Transformer:
    """fully_shard each block, then the root (the usual bottom-up recipe)."""
    return shard_groups(model, fully_shard, model.layers, **kwargs)


def shard_mlp(model: MLP, fully_shard, per_layer: bool = True, **kwargs) -> MLP:
    """fully_shard the first two layers separately, then the root (holds out_proj).

    ``per_layer=False``: the root alone, one group for all three layers.
    """
    groups = [model.in_proj, model.mid_proj] if per_layer else []
    return shard_groups(model, fully_shard, groups, **kwargs)
