"""Train the demo language model with Muon on its hidden matrices and AdamW on the rest.

Launch (from the repository root):

    torchrun --nproc-per-node 2 examples/muon.py             # 2 ranks (CPU: gloo)
    python examples/muon.py                                   # 1 rank, no torchrun needed
    torchrun --nproc-per-node 4 examples/muon.py --steps 200 --loss-file /tmp/muon.txt

The model, data and sharding are those of ``examples/train.py`` (one
``fully_shard`` per block, then the root). The Muon recipe
(https://kellerjordan.github.io/posts/muon/) steps the 2-D hidden matrices
(attention and MLP weights) with Muon and everything else (embedding, output
head, norms) with AdamW. ``fsdp2.Muon`` takes torch.optim.Muon's arguments and
gives its updates bit for bit, while each matrix is orthogonalized once, on one
owner rank, instead of gathered and orthogonalized on every rank. The
``match_rms_adamw`` learning-rate scaling (Moonshot's "Muon is Scalable for LLM
Training") lets both optimizers share one learning rate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parent
sys.path[:0] = [str(EXAMPLES), str(EXAMPLES.parent)]
from model import ModelArgs  # noqa: E402
from train import DATA, CharTokenizer, build_model, init_distributed, random_batch  # noqa: E402

import fsdp2  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="Muon and AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-file", type=Path, help="rank 0 writes each step's mean loss here")
    return p.parse_args(argv)


def split_params(model: torch.nn.Module) -> tuple[list, list]:
    """(named hidden matrices for Muon, the other parameters for AdamW)."""
    hidden, rest = [], []
    for name, p in model.named_parameters():
        is_hidden = p.ndim == 2 and name not in ("tok_embeddings.weight", "output.weight")
        (hidden if is_hidden else rest).append((name, p))
    return hidden, [p for _, p in rest]


def train(args: argparse.Namespace, device: torch.device) -> list[float]:
    """Train on an initialized process group; the mean loss of every step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    text = DATA.read_text(encoding="utf-8")
    tok = CharTokenizer(text)
    data = tok.encode(text)
    model_args = ModelArgs(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        vocab_size=tok.vocab_size,
        max_seq_len=args.seq_len,
    )
    torch.manual_seed(args.seed)
    model = build_model(model_args, world_size, device)
    hidden, rest = split_params(model)
    muon = fsdp2.Muon(
        hidden, lr=args.lr, weight_decay=args.weight_decay, adjust_lr_fn="match_rms_adamw"
    )
    adamw = torch.optim.AdamW(rest, lr=args.lr, weight_decay=args.weight_decay)
    if rank == 0:
        (load,) = muon.load_balance()
        print(
            f"{len(hidden)} matrices on Muon over {world_size} rank(s); Newton-Schulz work per "
            f"rank max/mean {load.max_over_mean:.3f}, {max(load.flops) / load.total:.2f} of the "
            "whole (the full_tensor() workaround: 1.00)"
        )
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    losses = []
    for step in range(args.steps):
        inputs, targets = random_batch(data, args.batch_size, args.seq_len, gen, device)
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    return losses


def main() -> None:
    args = parse_args()
    rank, _, device = init_distributed()
    losses = train(args, device)
    if rank == 0 and args.loss_file:
        args.loss_file.write_text("".join(f"{x}\n" for x in losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
