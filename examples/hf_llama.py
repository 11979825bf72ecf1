"""Fine-tune a tiny Hugging Face ``LlamaForCausalLM`` with fsdp2, then generate.

The model is built from a small ``LlamaConfig`` (random weights, nothing is
downloaded), sharded per decoder layer and then at the root (the usual
bottom-up recipe), trained for a few steps to count (token t is followed by t + 1), and
``generate()`` runs on the sharded model through
``register_fsdp_forward_method``.

Launch (from the repository root, after ``pip install -e ".[hf]"``):

    torchrun --nproc-per-node 2 examples/hf_llama.py      # 2 ranks, one machine (CPU: gloo)
    python examples/hf_llama.py                           # 1 rank, no torchrun needed
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-id hf --rdzv-endpoint HOST:29500 examples/hf_llama.py   # on every node

With CUDA each rank takes the GPU of its LOCAL_RANK and NCCL; without, gloo on
CPU. ``FSDP2_IMPL=torch`` runs the same script on upstream
``torch.distributed.fsdp`` (same seed: the losses should match).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fsdp2

if os.environ.get("FSDP2_IMPL", "fsdp2").strip().lower() == "torch":
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
else:
    from fsdp2 import fully_shard, register_fsdp_forward_method


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()

    if "RANK" not in os.environ:  # plain `python`: a one-rank group
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,))

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    torch.manual_seed(0)  # same initial weights on every rank
    model = LlamaForCausalLM(config).to(device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "generate")
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for step in range(args.steps):
        # counting sequences (start, start+1, ...): learnable, so the loss falls
        start = torch.randint(0, config.vocab_size, (args.batch, 1), generator=g)
        ids = ((start + torch.arange(args.seq)) % config.vocab_size).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        if rank == 0:
            print(f"step {step:3d}  loss {mean.item() / world_size:.4f}")

    prompt = torch.arange(5, device=device).unsqueeze(0)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    if rank == 0:
        print("generated (should count on from 4):", out[0].tolist())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
