"""The benchmark model: ``examples/model.py`` when it exists, else a small Llama here.

Both expose ``ModelArgs`` (a dataclass) and ``Transformer(args)`` with
``.layers`` (the blocks that get one ``fully_shard`` each). ``build_model``
returns a model whose initial values depend only on the seed, and
``model_loss`` turns its output (a tensor of logits, or an object with
``.logits``) into a next-token cross-entropy loss.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# About 30M parameters: 8 blocks of 3.2M, embedding and head 2.1M each.
BENCH_SHAPE = {"vocab_size": 4096, "dim": 512, "n_layers": 8, "n_heads": 8, "ffn_dim": 1408}
# Field names other people use for the same thing (examples/model.py may differ).
_SYNONYMS = {
    "vocab_size": ("vocab_size", "vocab", "n_vocab"),
    "dim": ("dim", "d_model", "hidden_size", "n_embd"),
    "n_layers": ("n_layers", "num_layers", "n_layer", "depth"),
    "n_heads": ("n_heads", "num_heads", "n_head"),
    "ffn_dim": ("ffn_dim", "ffn_hidden_dim", "hidden_dim", "ffn_hidden", "intermediate_size"),
    "max_seq_len": ("max_seq_len", "seq_len", "block_size", "max_seq_length"),
}


@dataclass
class ModelArgs:
    vocab_size: int = 4096
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    ffn_dim: int = 1408
    max_seq_len: int = 256
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the two halves of the head dim (GPT-NeoX layout)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class Block(nn.Module):
    """Pre-norm attention (RoPE, causal) and SwiGLU feed-forward, no biases."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.w13 = nn.Linear(args.dim, 2 * args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.wqkv(self.attention_norm(x)).view(b, s, 3, self.n_heads, d // self.n_heads)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        out = F.scaled_dot_product_attention(
            _rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True
        )
        x = x + self.wo(out.transpose(1, 2).reshape(b, s, d))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        half = self.args.dim // self.args.n_heads // 2
        freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
        cos, sin = angles.cos(), angles.sin()
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def _examples_module():
    path = os.path.join(REPO, "examples", "model.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("_fsdp2_examples_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    if not hasattr(module, "ModelArgs") or not hasattr(module, "Transformer"):
        return None
    return module


def _args_for(args_cls, shape: dict[str, int]):
    names = {f.name for f in dataclasses.fields(args_cls)}
    kwargs = {}
    for key, value in shape.items():
        for name in _SYNONYMS.get(key, (key,)):
            if name in names:
                kwargs[name] = value
                break
    return args_cls(**kwargs)


_SOURCE: list[str] = []


def model_source() -> str:
    """Which Transformer ``build_model`` uses: examples/model.py or benchmarks/model.py."""
    if not _SOURCE:
        try:
            module = _examples_module()
            if module is not None:
                _build(module, BENCH_SHAPE, 0)
                _SOURCE.append("examples/model.py")
        except Exception as exc:  # noqa: BLE001 - fall back, but say why
            _SOURCE.append(f"benchmarks/model.py (examples/model.py unusable: {exc!r:.80})")
        if not _SOURCE:
            _SOURCE.append("benchmarks/model.py")
    return _SOURCE[0]


def _build(module, shape: dict[str, int], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = module.Transformer(_args_for(module.ModelArgs, {**shape, "max_seq_len": 256}))
    if not hasattr(model, "layers"):
        raise ValueError("Transformer has no .layers")
    if hasattr(model, "init_weights"):  # examples/model.py only allocates in __init__
        model.init_weights()
    return model


def build_model(seed: int = 0, shape: dict[str, int] | None = None) -> nn.Module:
    """A Transformer with values that depend only on ``seed`` (fp32, CPU)."""
    shape = shape or BENCH_SHAPE
    if model_source() == "examples/model.py":
        return _build(_examples_module(), shape, seed)
    torch.manual_seed(seed)
    model = Transformer(_args_for(ModelArgs, shape))
    for p in model.parameters():
        if p.dim() == 2:  # scaled init keeps the loss finite over many steps
            nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[1]))
    return model


def model_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def batch(step: int, rank: int, batch_size: int, seq: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """This rank's deterministic (tokens, targets) for ``step``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
