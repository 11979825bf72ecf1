"""docs/torch-versions.md: every Python block of the page runs, on 2 ranks, with fsdp2.

Each block runs in a fresh namespace with ``torch``, fsdp2's ``fully_shard``
and ``MixedPrecisionPolicy``, ``build_model`` (two blocks, each with an RMS
``norm`` and a linear ``proj``, and a head), ``micro_batches`` (this rank's)
and ``loss_fn``. The finalization block must leave every parameter sharded with
the reference gradient of the last micro-batch added to the accumulated ones.
"""

from __future__ import annotations

import os
import re

import torch
from _impl import fsdp2_only
from _multiproc import run_ranks
from test_mixed_precision_policy import D, Net

import fsdp2

pytestmark = fsdp2_only  # the page's snippets are fsdp2's

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "docs", "torch-versions.md")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[str]:
    with open(PAGE, encoding="utf-8") as f:
        return _BLOCK.findall(f.read())


def _run(rank, world_size):
    def micro_batches_of(r):
        g = torch.Generator().manual_seed(r)
        return [torch.randn(4, D, generator=g) for _ in range(3)]

    def loss_fn(out):
        return out.float().pow(2).mean()

    blocks = _blocks()
    assert len(blocks) == 2, len(blocks)
    namespaces = []
    for code in blocks:
        namespace = {
            "torch": torch,
            "fully_shard": fsdp2.fully_shard,
            "MixedPrecisionPolicy": fsdp2.MixedPrecisionPolicy,
            "build_model": lambda: (torch.manual_seed(0), Net())[1],
            "micro_batches": micro_batches_of(rank),
            "loss_fn": loss_fn,
        }
        exec(compile(code, PAGE, "exec"), namespace)
        namespaces.append(namespace)
    # The finalization block's model against one process holding every rank's batches.
    torch.manual_seed(0)
    ref = Net()
    for r in range(world_size):
        for x in micro_batches_of(r):
            (loss_fn(ref(x)) / world_size).backward()
    torch.optim.AdamW(ref.parameters(), lr=1e-3).step()
    model = namespaces[0]["model"]
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), msg=name)


def test_every_block_of_the_page_runs():
    """The torch-versions page's examples run; its finalization example trains as one process would."""
    run_ranks(_run, 2)
