"""torch.compile of each block, then fully_shard: training parity with eager FSDP hooks.

The common recipe compiles every transformer block and shards it afterwards;
FSDP's hooks stay eager (dynamo skips them) while the block's own compute is
compiled. CPU compile is slow, so one tiny model runs a few steps with the
``aot_eager`` backend (dynamo graph capture + AOT autograd, no codegen): it
exercises tracing through sharded/unsharded parameter swaps without paying
for inductor's C++ compilation on every CI run.
"""

from __future__ import annotations

import torch
from _impl import fully_shard
from _multiproc import run_ranks
from checks import train_steps
from models import (
    assert_params_match,
    build_transformer,
    cpu_mesh,
    make_pair,
    transformer_batch,
    transformer_loss,
)

BACKEND = "aot_eager"


def _compile_body(rank, world_size):
    torch._dynamo.reset()
    ref, model = make_pair(lambda: build_transformer(seed=9))
    mesh = cpu_mesh()
    for layer in model.layers:
        layer.compile(backend=BACKEND)  # nn.Module.compile: names and class stay the same
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batches = [transformer_batch(s, 2 * world_size) for s in range(3)]
    ref_losses, losses = train_steps(ref, model, batches, transformer_loss, rank, world_size)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert_params_match(ref, model)
    return torch._dynamo.utils.counters["stats"]["unique_graphs"], sum(
        torch._dynamo.utils.counters["graph_break"].values()
    )


def test_compiled_blocks_then_fully_shard():
    """Compiled then sharded blocks train with parity; hooks stay eager: one graph, no breaks."""
    results = run_ranks(_compile_body, 2)
    # the same block code compiles once; tracing into FSDP hooks would break the graph
    assert all(r == (1, 0) for r in results), results
