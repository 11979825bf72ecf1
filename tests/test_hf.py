"""Hugging Face ``transformers`` models under fully_shard (optional dependency).

A tiny ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` are built from configs (no
downloads), sharded per decoder layer and then at the root, trained against
the unsharded model, and ``generate()`` runs through
``register_fsdp_forward_method`` with the reference's greedy tokens. Both
models run in one launch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _impl import fully_shard, register_fsdp_forward_method
from checks import assert_losses_match, check_case
from models import assert_grads_match, assert_params_match, cpu_mesh, global_mean
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 61, 8


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config)
    return model, model.model.layers


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config)  # ties lm_head to the token embedding
    return model, model.transformer.h


def _case(build):
    def case(rank, world_size):
        torch.manual_seed(0)
        ref, _ = build()
        model = copy.deepcopy(ref)
        layers = model.model.layers if hasattr(model, "model") else model.transformer.h
        mesh = cpu_mesh()
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        # SGD, not Adam: GPT-2's key bias has a mathematically zero gradient that
        # Adam would turn from rounding noise into full-size steps.
        ref_opt, opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model))
        g = torch.Generator().manual_seed(1)
        ref_losses, losses = [], []
        for _ in range(2):
            ids = torch.randint(0, VOCAB, (2 * world_size, SEQ), generator=g)
            ref_loss = ref(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            loss = model(input_ids=ids.chunk(world_size)[rank], labels=ids.chunk(world_size)[rank]).loss
            loss.backward()
            assert_grads_match(ref, model, rtol=1e-4, atol=1e-6)
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad()
            ref_losses.append(ref_loss.item())
            losses.append(global_mean(loss).item())
        assert_losses_match(ref_losses, losses)
        assert_params_match(ref, model, rtol=1e-4, atol=1e-6)

        register_fsdp_forward_method(model, "generate")
        prompt = torch.randint(0, VOCAB, (2, 3), generator=g)
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            expected = ref.generate(prompt, **kwargs)
            out = model.generate(prompt, **kwargs)
        assert torch.equal(out, expected), (out, expected)
        assert all(isinstance(p, DTensor) for p in model.parameters()), "not resharded"

    return case


CASES = {"llama": _case(_llama), "gpt2": _case(_gpt2)}


def test_hf_llama_parity_and_generate(launch_cases):
    """LlamaForCausalLM sharded per decoder layer: training parity, generate() matches."""
    check_case(launch_cases(2, CASES), "llama")


def test_hf_gpt2_parity_and_generate(launch_cases):
    """GPT2LMHeadModel (tied lm_head) sharded per block: training parity, generate() matches."""
    check_case(launch_cases(2, CASES), "gpt2")
