"""Train a small Llama-style character-level language model with fsdp2.

Launch (from the repository root, after ``pip install -e ".[demo]"``):

    torchrun --nproc-per-node 2 examples/train.py       # 2 ranks, one machine (CPU: gloo)
    torchrun --nproc-per-node 2 examples/train.py --bf16   # bf16 compute, fp32 master weights
    python examples/train.py                            # 1 rank, no torchrun needed
    torchrun --nproc-per-node 4 examples/train.py --steps 100 --ckpt-dir /tmp/ckpt --ckpt-every 50
    torchrun --nproc-per-node 2 examples/train.py --steps 200 --ckpt-dir /tmp/ckpt --resume
    torchrun --nproc-per-node 2 examples/train.py --ckpt-dir /tmp/ckpt --ckpt-every 10 --ckpt-async
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-id demo --rdzv-endpoint HOST:29500 examples/train.py   # on every node

With CUDA each rank takes the GPU of its LOCAL_RANK and NCCL; without, gloo on CPU.
``--ckpt-dir`` saves a sharded checkpoint (torch.distributed.checkpoint) every
``--ckpt-every`` steps and at the end, as ``DIR/step-N`` (the ``--ckpt-keep``
newest are kept; ``--ckpt-async`` writes in the background while training goes
on); ``--resume`` continues from the newest complete one, at any world size
(the second command above resumes on 2 ranks). A run killed mid-save resumes
from the step before.
``FSDP2_IMPL=torch`` runs the same script on upstream ``torch.distributed.fsdp``,
for side-by-side comparisons (same seed: the loss curves should match).

The corpus is ``examples/data/python_docs.txt`` (see NOTICE.md there); the
tokenizer is one id per character. Every rank starts from the same weights and
draws its own random windows of the text (seeded by ``--seed`` and its rank).
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

EXAMPLES = Path(__file__).resolve().parent
# model.py beside this file, and fsdp2 from the checkout this script is in (even
# if another one is pip-installed), so two checkouts can be compared side by side.
sys.path[:0] = [str(EXAMPLES), str(EXAMPLES.parent)]
from model import ModelArgs, Transformer  # noqa: E402

FSDP2_IMPL = os.environ.get("FSDP2_IMPL", "fsdp2").strip().lower()
GRAD_PAYLOADS = {
    "bf16": torch.bfloat16, "fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
if FSDP2_IMPL == "torch":
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    IMPL_INFO = f"torch {torch.__version__}"
elif FSDP2_IMPL == "fsdp2":
    import fsdp2
    from fsdp2 import MixedPrecisionPolicy, fully_shard

    IMPL_INFO = f"fsdp2 {fsdp2.__version__} from {Path(fsdp2.__file__).parent}"
else:
    raise SystemExit(f"FSDP2_IMPL must be 'fsdp2' or 'torch', got {FSDP2_IMPL!r}")
# Checkpoints go through torch's public DCP API, so fsdp2's helpers serve either implementation.
from fsdp2 import load_latest, save_checkpoint  # noqa: E402

# nn.init on a sharded (DTensor) parameter of a CPU mesh: each rank fills its own
# shard from its own generator, which is all this script needs (same seed everywhere).
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")

DATA = EXAMPLES / "data" / "python_docs.txt"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=DATA, help="UTF-8 text file to train on")
    p.add_argument(
        "--sample-chars", type=int, default=200, help="text to generate after training (0: none)"
    )
    p.add_argument(
        "--loss-file", type=Path, help="rank 0 writes each step's mean loss here, one a line"
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="mixed precision: bf16 all-gather and compute, fp32 gradient reduction and weights",
    )
    p.add_argument(
        "--grad-comm",
        choices=sorted(GRAD_PAYLOADS),
        help="fsdp2: exchange gradients in this payload, summed in fp32 (GradientCommPolicy)",
    )
    p.add_argument(
        "--error-feedback", action="store_true", help="with --grad-comm: carry each encoding's error"
    )
    p.add_argument("--ckpt-dir", type=Path, help="save sharded checkpoints here (DCP)")
    p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--ckpt-keep", type=int, default=3, help="newest checkpoints kept")
    p.add_argument(
        "--ckpt-async", action="store_true", help="write checkpoints while training goes on"
    )
    p.add_argument("--resume", action="store_true", help="continue from --ckpt-dir's latest")
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.grad_comm and FSDP2_IMPL != "fsdp2":
        p.error("--grad-comm is fsdp2's (GradientCommPolicy); upstream has no such policy")
    if args.error_feedback and not args.grad_comm:
        p.error("--error-feedback needs --grad-comm")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if args.ckpt_every < 1:
        p.error("--ckpt-every must be at least 1")
    if args.ckpt_keep < 1:
        p.error("--ckpt-keep must be at least 1")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group; without torchrun, be a group of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        # Share the cores among this machine's ranks instead of oversubscribing them.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


class CharTokenizer:
    """One id per distinct character of the corpus, in sorted order."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.ids[c] for c in text], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def random_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``seq_len + 1`` tokens: inputs and next-token targets."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    windows = windows.to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def build_model(
    args: ModelArgs, world_size: int, device: torch.device, bf16: bool = False,
    grad_comm: object = None,
) -> Transformer:
    """Make the model on ``meta``, shard it (one group per block, then the root), then
    allocate this rank's shards on ``device`` and initialise them. ``grad_comm``: an
    fsdp2 ``GradientCommPolicy`` for every group's gradient exchange."""
    with torch.device("meta"):
        model = Transformer(args)
    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy()
    if bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if grad_comm is not None:
        for module in [*model.layers, model]:
            module.set_gradient_comm_policy(grad_comm)
    model.to_empty(device=device)
    model.init_weights()
    return model


@torch.no_grad()
def generate(
    model: Transformer, tokenizer: CharTokenizer, prompt: str, n_chars: int, seed: int
) -> str:
    """Sample ``n_chars`` characters after ``prompt`` (temperature 0.8, no KV cache).

    Every rank must call this: each forward all-gathers the sharded parameters.
    """
    device = model.tok_embeddings.weight.device
    gen = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode(prompt).tolist()
    for _ in range(n_chars):
        context = torch.tensor([ids[-model.args.max_seq_len :]], device=device)
        probs = torch.softmax(model(context)[0, -1].float().cpu() / 0.8, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return tokenizer.decode(ids)


def resume(ckpt_dir: Path, model: Transformer, optim, sched, gen: torch.Generator,
           data_len: int, opts: argparse.Namespace) -> int:
    """Load the newest complete checkpoint (any world size); return the step to continue from."""
    step = load_latest(ckpt_dir, model, optim, extra={"sched": sched})
    if step is None:
        raise SystemExit(f"--resume: no complete step-N checkpoint in {ckpt_dir}")
    if step >= opts.steps:
        raise SystemExit(f"{ckpt_dir}/step-{step} is the latest: pass --steps beyond {step}")
    for _ in range(step):  # replay this rank's data draws: same batches as unbroken
        torch.randint(0, data_len - opts.seq_len - 1, (opts.batch_size,), generator=gen)
    if dist.get_rank() == 0:
        print(f"resumed from {ckpt_dir}/step-{step}", flush=True)
    return step


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1, then cosine decay to 0.1 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def main() -> None:
    opts = parse_args()
    rank, world_size, device = init_distributed()

    text = opts.data.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)

    torch.manual_seed(opts.seed)  # same weights on every rank
    model_args = ModelArgs(
        dim=opts.dim,
        n_layers=opts.n_layers,
        n_heads=opts.n_heads,
        vocab_size=tokenizer.vocab_size,
        max_seq_len=opts.seq_len,
    )
    grad_comm = None
    if opts.grad_comm:
        grad_comm = fsdp2.GradientCommPolicy(
            GRAD_PAYLOADS[opts.grad_comm], error_feedback=opts.error_feedback
        )
    model = build_model(model_args, world_size, device, bf16=opts.bf16, grad_comm=grad_comm)
    optim = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda step: lr_factor(step, opts.warmup_steps, opts.steps)
    )
    gen = torch.Generator().manual_seed(opts.seed * 100_003 + rank)  # different data per rank

    n_params = sum(p.numel() for p in model.parameters())  # global sizes (DTensors)
    tokens_per_step = world_size * opts.batch_size * opts.seq_len
    if rank == 0:
        print(
            f"impl={IMPL_INFO} world_size={world_size} device={device.type} "
            f"backend={dist.get_backend()} params={n_params / 1e6:.2f}M "
            f"vocab={tokenizer.vocab_size} corpus={len(data):,} chars "
            f"tokens/step={tokens_per_step:,}",
            flush=True,
        )

    first = resume(opts.ckpt_dir, model, optim, sched, gen, len(data), opts) if opts.resume else 0
    progress = tqdm(range(first, opts.steps), desc="train", dynamic_ncols=True, disable=rank != 0)
    losses: list[float] = []
    pending = None  # the checkpoint being written in the background (--ckpt-async)
    start = time.perf_counter()
    timed_from = start  # tokens/s excludes the first step (warm-up, lazy init)
    for step in progress:
        inputs, targets = random_batch(data, opts.batch_size, opts.seq_len, gen, device)
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        sched.step()

        # Mean over ranks, for the log; one scalar all-reduce per step.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world_size)
        if opts.ckpt_dir and ((step + 1) % opts.ckpt_every == 0 or step + 1 == opts.steps):
            pending = save_checkpoint(opts.ckpt_dir, model, optim, step=step + 1,
                                      keep=opts.ckpt_keep, extra={"sched": sched},
                                      async_save=opts.ckpt_async)
        if step == first:
            timed_from = time.perf_counter()
        if rank == 0:
            elapsed = time.perf_counter() - timed_from
            tok_s = tokens_per_step * (step - first) / elapsed if step > first else 0.0
            progress.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tok_s:,.0f}")
    progress.close()
    if pending is not None:
        pending.result()  # the last checkpoint is written (or its error raised)

    total = time.perf_counter() - start
    if rank == 0:
        tok_s = tokens_per_step * (len(losses) - 1) / max(1e-9, time.perf_counter() - timed_from)
        tail = losses[-10:]
        print(
            f"done: impl={FSDP2_IMPL} world_size={world_size} steps={opts.steps} "
            f"time={total:.1f}s tokens/s={tok_s:,.0f} "
            f"first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} "
            f"mean_last_{len(tail)}={sum(tail) / len(tail):.4f}",
            flush=True,
        )
        if opts.loss_file:
            opts.loss_file.write_text("".join(f"{x!r}\n" for x in losses))
    if opts.sample_chars > 0:
        model.eval()
        sample = generate(model, tokenizer, "The ", opts.sample_chars, opts.seed)
        if rank == 0:
            print(f"sample:\n{sample}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
