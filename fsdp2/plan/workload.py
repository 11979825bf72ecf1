"""Building the model to plan: a Hugging Face config or a ``module:function``.

Whatever builds the model runs inside the planner's ``FakeTensorMode``, so
its parameters are fake tensors (shapes, no memory) and a 70B model is built
in seconds. This file also picks the modules that become ``fully_shard``
groups and makes the inputs and the loss of one step.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def shipped_configs() -> list[str]:
    """Names of the Hugging Face configs shipped with fsdp2 (``--hf-config NAME``)."""
    return sorted(f[: -len(".json")] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def load_hf_config(spec: str | dict) -> dict:
    """A config dict from a dict, a shipped name (``llama-3-8b``) or a ``config.json`` path."""
    if isinstance(spec, dict):
        return dict(spec)
    path = spec
    if not os.path.exists(path):
        shipped = os.path.join(CONFIG_DIR, f"{spec}.json")
        if os.path.exists(shipped):
            path = shipped
        elif os.path.isdir(spec) is False and not spec.endswith(".json"):
            raise ValueError(
                f"--hf-config {spec!r}: no such file and no shipped config of that name; "
                f"pass a config.json path or one of {shipped_configs()}"
            )
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--hf-config {spec!r}: cannot read a JSON config there ({exc})") from exc


def build_hf_model(config: dict, dtype: torch.dtype) -> nn.Module:
    """A ``transformers`` causal LM (random values) from a config dict."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "--hf-config needs the `transformers` package: pip install 'fsdp2[hf]'"
        ) from exc
    config = dict(config)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise ValueError("--hf-config: the config has no 'model_type' (e.g. \"llama\", \"gpt2\")")
    for key in ("architectures", "torch_dtype", "dtype", "transformers_version"):
        config.pop(key, None)
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    hf_config.use_cache = False  # training: no key/value cache
    try:  # transformers >= 4.56 calls it `dtype`
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config, dtype=dtype, attn_implementation="sdpa"
        )
    except TypeError:
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config, torch_dtype=dtype, attn_implementation="sdpa"
        )
    return model.train()


def load_callable(spec: str | Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``pkg.module:function`` or ``path/to/file.py:function`` -> the function."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(
            f"--model {spec!r}: expected 'module:function' or 'file.py:function' "
            "naming a function that returns an nn.Module"
        )
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        if not os.path.exists(where):
            raise ValueError(f"--model {spec!r}: file {where!r} does not exist")
        mod_name = "_fsdp2_plan_" + os.path.splitext(os.path.basename(where))[0]
        module_spec = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(module_spec)
        import sys

        sys.modules[mod_name] = module  # dataclasses look their module up there
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {where!r} has no function {name!r}")
    return fn


def build_model(
    hf_config: str | dict | None,
    model_fn: str | Callable[[], nn.Module] | None,
    dtype: torch.dtype,
) -> nn.Module:
    """The model to plan, from exactly one of ``hf_config`` and ``model_fn``."""
    if (hf_config is None) == (model_fn is None):
        raise ValueError("give exactly one of --hf-config and --model")
    if hf_config is not None:
        return build_hf_model(load_hf_config(hf_config), dtype)
    model = load_callable(model_fn)()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {model_fn!r} returned {type(model).__name__}, not an nn.Module")
    return model.to(dtype) if dtype != torch.float32 else model


def default_groups(model: nn.Module) -> list[str]:
    """Names of the transformer blocks: the elements of the ``ModuleList`` with most parameters."""
    best, best_numel = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = name, numel
    if best is None:
        return []
    return [f"{best}.{i}" for i in range(len(model.get_submodule(best)))]


def select_groups(model: nn.Module, patterns: list[str] | None) -> list[nn.Module]:
    """The modules that get their own ``fully_shard`` (the root is added by the caller).

    ``patterns`` are ``fnmatch`` patterns over module names (``model.layers.*``);
    ``None`` picks the transformer blocks. Returned deepest first, as
    ``fully_shard`` is applied bottom-up.
    """
    names = dict(model.named_modules())
    if patterns is None:
        chosen = default_groups(model)
    else:
        chosen = []
        for pattern in patterns:
            hits = [n for n in names if n and fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise ValueError(
                    f"--groups {pattern!r} matches no module; module names look like "
                    f"{[n for n in names if n][:5]}"
                )
            chosen += [h for h in hits if h not in chosen]
    chosen.sort(key=lambda n: -n.count("."))
    return [names[n] for n in chosen]


def vocab_size(model: nn.Module) -> int:
    """The number of token ids: the first ``nn.Embedding``'s rows."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    raise ValueError(
        "the model has no nn.Embedding, so the planner cannot make token inputs; "
        "pass make_inputs= and loss_fn= to fsdp2.plan.PlanConfig"
    )


def token_inputs(model: nn.Module, batch_size: int, seq_len: int) -> tuple[Any, Any]:
    """Default inputs: ``(tokens,)`` of shape (batch, seq) and next-token targets."""
    vocab = vocab_size(model)
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


def lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a causal LM's logits (a tensor, or ``.logits``)."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
