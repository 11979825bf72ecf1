"""Run the Python blocks of a user-guide page (``docs/*.md``) on real gloo ranks.

A guide page's ```` ```python ```` blocks are examples users copy, so each one
runs in a test. :func:`blocks` reads a page's fenced blocks; the fence's info
string decides what happens to each:

- ```` ```python ````: runs, in a fresh namespace of the page's fixtures
  (:func:`fixtures`: ``rank``, ``world_size``, ``device`` ..., a sharded
  ``model`` and its ``optim``, this rank's ``batches``);
- ```` ```python no-run: REASON ````: shown only, for code that cannot run on
  CPU ranks by nature (a GPU, a library we do not install); the reason is
  required and must say so;
- any other language (``bash``, ``text``): not Python, not run.

:func:`run_page` runs every runnable block of one page in one launch of
``world_size`` processes, in order, so a page costs one launch. A failing block
fails the launch with its traceback, whose file name is ``docs/PAGE.md:LINE``.
After each block, a ``model`` left in its namespace must be an
``FSDPModule``: a block that claims to shard a model has sharded it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
_NO_RUN = re.compile(r"^python\s+no-run:\s*(\S.{9,})$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: str  # file name under docs/
    line: int  # line of the opening fence
    info: str  # the fence's info string ("python", "python no-run: ...", "bash")
    code: str

    @property
    def runs(self) -> bool:
        return self.info == "python"

    @property
    def no_run_reason(self) -> str | None:
        match = _NO_RUN.match(self.info)
        return match.group(1) if match else None

    @property
    def name(self) -> str:
        return f"docs/{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """Every fenced block of ``docs/<page>``, in order."""
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        text = f.read()
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match.group(1).strip(), match.group(2)))
    return found


def python_blocks(page: str) -> list[Block]:
    """The page's Python blocks, runnable or not."""
    return [b for b in blocks(page) if b.info.split()[:1] == ["python"]]


def check_fences(page: str) -> list[str]:
    """Problems with the page's Python fences: a ``python`` block that is
    neither plain (runs) nor ``no-run`` with a reason."""
    return [
        f"{b.name}: fence {b.info!r} neither runs nor gives a reason (```python no-run: REASON)"
        for b in python_blocks(page)
        if not b.runs and b.no_run_reason is None
    ]


def fixtures(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """The names every guide block may use, as the guide's index page lists them."""
    import torch
    import torch.nn as nn
    from models import Block as ToyBlock
    from models import build_transformer, rank_slice, transformer_batch, transformer_loss
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2

    def build_model() -> nn.Module:
        return build_transformer(seed=0)

    def init_weights(model: nn.Module) -> None:
        model.init_weights()  # the demo model's own: every parameter and the RoPE tables

    mesh = init_device_mesh("cpu", (world_size,))
    model = build_model()
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    batches = [rank_slice(transformer_batch(step, 2 * world_size), rank, world_size)
               for step in range(3)]
    full_model = build_model()
    return {
        "torch": torch,
        "nn": nn,
        "rank": rank,
        "world_size": world_size,
        "device_type": "cpu",
        "device": torch.device("cpu"),
        "mesh": mesh,
        "build_model": build_model,
        "init_weights": init_weights,
        "Block": ToyBlock,
        "model": model,
        "optim": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "batches": batches,
        "batch": batches[0],
        "tokens": batches[0][0],
        "loss_fn": transformer_loss,
        # rank 0's full weights of build_model(); {} elsewhere (as a loader gives them)
        "full_sd": full_model.state_dict() if rank == 0 else {},
        "ckpt_dir": os.path.join(workdir, "ckpt"),
    }


def run_page(
    rank: int,
    world_size: int,
    page: str,
    workdir: str,
    extra: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> list[str]:
    """Body for ``run_ranks``: run the page's runnable blocks in order; return their names.

    ``extra(namespace)`` returns page-specific fixtures, built for each block
    from its fresh namespace (e.g. a scheduler over its ``optim``).
    """
    import fsdp2

    os.chdir(workdir)  # blocks that write relative paths write into the test's folder
    ran = []
    for block in python_blocks(page):
        if not block.runs:
            continue
        namespace = fixtures(rank, world_size, workdir)
        if extra is not None:
            namespace.update(extra(namespace))
        exec(compile(block.code, block.name, "exec"), namespace)  # noqa: S102
        model = namespace.get("model")
        if model is not None and not isinstance(model, fsdp2.FSDPModule):
            raise AssertionError(f"{block.name}: `model` is not an FSDPModule: {type(model)}")
        ran.append(block.name)
    return ran
