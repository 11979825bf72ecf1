"""A small Llama-style decoder-only language model.

token embedding -> n_layers x TransformerBlock -> RMSNorm -> output head, where
each block is ``x + attention(norm(x))`` then ``x + mlp(norm(x))``: causal
self-attention with rotary position embeddings (RoPE, Su et al. 2021,
arXiv:2104.09864) and a SwiGLU MLP (Shazeer 2020, arXiv:2002.05202).

Built for meta-device init: ``__init__`` only allocates, and ``init_weights()``
fills every parameter and buffer, so a model made under ``torch.device("meta")``
can be sharded first and materialised after (``to_empty`` then ``init_weights``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 256
    max_seq_len: int = 128
    ffn_hidden_dim: int | None = None  # None: about 8/3 * dim (Llama), rounded up
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    tie_weights: bool = False  # output head shares the token embedding's weight
    # False: the RoPE tables are computed in each forward, not kept as buffers, so the
    # model holds parameters only and any state dict covers it (e.g. one loaded into a
    # model built on meta, which then needs no init_weights)
    rope_buffers: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each of shape ``(max_seq_len, head_dim // 2)``."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x1[i], x2[i]) pair of ``x`` (batch, heads, seq, head_dim) by its angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads:
            raise ValueError(f"dim={args.dim} is not a multiple of n_heads={args.n_heads}")
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (batch, seq, dim) -> (batch, heads, seq, head_dim); -1 heads: under tensor
        # parallelism wq/wk/wv hold a subset of the heads on each rank
        q, k, v = (
            w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_weights:
            self.output.weight = self.tok_embeddings.weight
        if args.rope_buffers:
            # Derived from args, so not saved in state_dict; init_weights fills them.
            self.register_buffer("rope_cos", torch.empty(0), persistent=False)
            self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every parameter and buffer: N(0, init_std) for weights, with the
        projections that write into the residual stream (``wo``, ``w2``) scaled
        by 1/sqrt(2 * n_layers) as in GPT-2; ones for the norms."""
        args = self.args
        residual_std = args.init_std / math.sqrt(2 * args.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.RMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Linear | nn.Embedding):
                std = residual_std if name.endswith((".wo", ".w2")) else args.init_std
                nn.init.normal_(module.weight, mean=0.0, std=std)
        if args.rope_buffers:
            device = self.tok_embeddings.weight.device
            self.rope_cos, self.rope_sin = rope_tables(
                args.head_dim, args.max_seq_len, args.rope_theta, device=device
            )

    def rope(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the first ``seq`` positions' angles, each ``(seq, head_dim // 2)``."""
        if self.args.rope_buffers:
            return self.rope_cos[:seq], self.rope_sin[:seq]
        args = self.args
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, device=device)
        return cos[:seq], sin[:seq]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (batch, seq) of ids -> logits (batch, seq, vocab_size)."""
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq} > max_seq_len={self.args.max_seq_len}")
        cos, sin = self.rope(seq, tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def demo_model() -> Transformer:
    """The demo's model at examples/train.py's defaults, initialized.

    For the planner: ``python -m fsdp2.plan --model examples/model.py:demo_model
    --world-size 2 --batch-size 8 --seq-len 128``.
    """
    model = Transformer(ModelArgs(dim=128, n_layers=4, n_heads=4, vocab_size=256, max_seq_len=128))
    model.init_weights()
    return model
