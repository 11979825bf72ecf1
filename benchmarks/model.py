"""The benchmark model: examples/model.py's small Llama (the demo's), at the benchmark's shape.

``ModelArgs`` (a dataclass) and ``Transformer(args)`` are examples/model.py's,
loaded by path (this module is itself ``model`` on the benchmarks' path);
``.layers`` are the blocks that get one ``fully_shard`` each, and a shape is a
dict of ``ModelArgs`` fields. ``build_model`` returns a model whose initial
values depend only on the seed, and ``model_loss`` turns its output (a tensor
of logits, or an object with ``.logits``) into a next-token cross-entropy loss.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_SOURCE = "examples/model.py"  # recorded with the results

# About 30M parameters: 8 blocks of 3.2M, embedding and head 2.1M each.
BENCH_SHAPE = {"vocab_size": 4096, "dim": 512, "n_layers": 8, "n_heads": 8, "ffn_hidden_dim": 1408}


def _load_examples_model():
    spec = importlib.util.spec_from_file_location(
        "_fsdp2_examples_model", os.path.join(REPO, *MODEL_SOURCE.split("/"))
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_EXAMPLES = _load_examples_model()
ModelArgs, Transformer = _EXAMPLES.ModelArgs, _EXAMPLES.Transformer


def build_model(seed: int = 0, shape: dict[str, int] | None = None) -> nn.Module:
    """A Transformer with values that depend only on ``seed`` (fp32, CPU)."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**{**(shape or BENCH_SHAPE), "max_seq_len": 256}))
    model.init_weights()
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
