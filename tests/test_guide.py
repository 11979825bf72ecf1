"""docs/: every Python block of the user guide runs, one launch per page, on gloo ranks.

The guide's blocks import ``fsdp2`` themselves (it is fsdp2's guide), so the
file is fsdp2-only. ``tests/guide_blocks.py`` reads the blocks and gives each
one a fresh namespace of the fixtures docs/README.md lists; pages with names
of their own (the checkpoint loop's ``train_step``, the pipeline's stage) add
them here. docs/migrating-from-fsdp1.md and docs/torch-versions.md have test
files of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from _impl import fsdp2_only
from _multiproc import run_ranks
from guide_blocks import DOCS, ROOT, check_fences, python_blocks, run_page

# the guide's snippets import fsdp2 itself; examples of the API, run once per CI run
pytestmark = [fsdp2_only, pytest.mark.torch_independent]

# page -> world size of its launch
PAGES = {
    "usage.md": 2,
    "meshes.md": 4,
    "meta-device.md": 2,
    "mixed-precision.md": 2,
    "checkpoints.md": 2,
    "api.md": 2,
    "optimizers.md": 2,
    "pipelining.md": 4,
    "multi-node.md": 2,
    "debugging.md": 2,
    "clients.md": 2,
    "composing.md": 2,
    "moe.md": 4,
    "layouts.md": 3,
}
# pages with their own test file
# the planner runs its own fake process group: its page runs in a fresh process
# without one, from the repository root (it names examples/model.py)
SUBPROCESS = {"plan.md"}
OWN_TESTS = {"migrating-from-fsdp1.md": "test_migration_guide.py",
             "torch-versions.md": "test_torch_versions_guide.py"}
# pages without Python: the index, prose and tables, contributor pages
NO_PYTHON = {"README.md", "differences.md", "performance.md", "design.md", "style.md"}


def _checkpoint_extra(rank, world_size):
    """A scheduler over the fixture's optimizer and one training step per call."""
    from models import rank_slice, transformer_batch, transformer_loss

    def extra_for(namespace):
        model, optim = namespace["model"], namespace["optim"]
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda i: 1.0 / (1 + i))

        def train_step(step):
            batch = rank_slice(transformer_batch(step, 2 * world_size), rank, world_size)
            transformer_loss(model, batch).backward()
            optim.step()
            optim.zero_grad()
            sched.step()

        return {"sched": sched, "train_step": train_step, "num_steps": 4, "save_every": 2,
                "step": 4}

    return extra_for


class _Stage(nn.Module):
    """One pipeline stage: two linear blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _pipeline_extra(rank, world_size):
    def extra_for(namespace):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        return {"pp": 2, "dp": world_size // 2, "stage_module": _Stage(),
                "x": torch.randn(8, 16, generator=g), "y": torch.randn(8, 16, generator=g),
                "loss_fn": lambda out, target: (out - target).pow(2).mean()}

    return extra_for


def _meshes_extra(rank, world_size):
    from models import build_transformer

    # tensor parallelism splits the feed-forward's hidden dim: make it even
    return lambda namespace: {"build_model": lambda: build_transformer(seed=0, hidden=12)}


def _multinode_extra(rank, world_size):
    return lambda namespace: {"local_world_size": world_size}


EXTRA = {"checkpoints.md": _checkpoint_extra, "meshes.md": _meshes_extra, "pipelining.md": _pipeline_extra,
         "multi-node.md": _multinode_extra}


def _body(rank, world_size, page, workdir):
    make = EXTRA.get(page)
    return run_page(rank, world_size, page, workdir,
                    None if make is None else make(rank, world_size))


def test_every_guide_page_is_tested():
    """Each page of docs/ is run here, has a test file of its own, or has no Python block."""
    pages = {f for f in os.listdir(DOCS) if f.endswith(".md")}
    assert pages == set(PAGES) | SUBPROCESS | set(OWN_TESTS) | NO_PYTHON, sorted(pages)
    for test_file in OWN_TESTS.values():
        assert os.path.exists(os.path.join(ROOT, "tests", test_file)), test_file
    for page in NO_PYTHON:
        assert not python_blocks(page), page


@pytest.mark.parametrize("page", sorted(PAGES) + sorted(SUBPROCESS) + sorted(OWN_TESTS))
def test_python_fences_run_or_say_why(page):
    """Every ```python block runs, or is ```python no-run: REASON; few are no-run."""
    assert not check_fences(page)
    blocks = python_blocks(page)
    no_run = [b for b in blocks if not b.runs]
    assert len(no_run) <= 2, [b.name for b in no_run]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_guide_page_runs(page, tmp_path):
    """Every runnable Python block of ``page`` runs, in order, on the page's ranks."""
    runnable = [b.name for b in python_blocks(page) if b.runs]
    assert runnable, f"{page} has no runnable Python block"
    results = run_ranks(_body, PAGES[page], page, str(tmp_path))
    assert all(ran == runnable for ran in results), results


@pytest.mark.parametrize("page", sorted(SUBPROCESS))
def test_guide_page_runs_in_a_fresh_process(page):
    """Every runnable Python block of ``page`` runs, in order, in a process without a process group."""
    runnable = [b for b in python_blocks(page) if b.runs]
    assert runnable, f"{page} has no runnable Python block"
    for block in runnable:
        code = f"exec(compile({block.code!r}, {block.name!r}, 'exec'), {{}})"
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, f"{block.name}:\n{done.stderr[-3000:]}"
