"""Tiny deterministic models and helpers shared by the tests.

Sizes are deliberately odd (7, 13, 5, 3, 1, 17 ...) so that dim 0 of most
parameters does not divide evenly over 2, 3 or 4 ranks, and some ranks own
zero rows of some parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

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
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return norm * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            # -1 heads: under tensor parallelism each rank holds a subset of heads
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Llama-style: embedding, ``n_layers`` blocks, final RMSNorm, output head."""

    def __init__(
        self,
        vocab: int = 17,
        dim: int = 8,
        n_heads: int = 2,
        n_layers: int = 2,
        hidden: int = 11,
        tie_weights: bool = False,
    ):
        super().__init__()
        self.vocab = vocab
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie_weights:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build_transformer(seed: int = 0, **kwargs) -> Transformer:
    """A Transformer whose initial values depend only on ``seed``."""
    torch.manual_seed(seed)
    return Transformer(**kwargs)


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
    """The full value of a tensor that may be a DTensor."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def assert_params_match(ref: nn.Module, model: nn.Module, rtol: float = 1e-5, atol: float = 1e-6):
    """Every parameter of ``model`` (by name) equals ``ref``'s, as a full tensor.

    All full tensors are gathered (a collective) before anything is compared,
    so a mismatch seen on only some ranks cannot desynchronize collectives.
    """
    ref_params = dict(ref.named_parameters())
    fulls = {name: full(p.detach()) for name, p in model.named_parameters()}
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
    grads = {name: None if p.grad is None else full(p.grad) for name, p in model.named_parameters()}
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


def shard_transformer(model: Transformer, fully_shard, **kwargs) -> Transformer:
    """fully_shard each block, then the root (the usual bottom-up recipe)."""
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_mlp(model: MLP, fully_shard, **kwargs) -> MLP:
    """fully_shard the first two layers separately, then the root (holds out_proj)."""
    fully_shard(model.in_proj, **kwargs)
    fully_shard(model.mid_proj, **kwargs)
    fully_shard(model, **kwargs)
    return model
