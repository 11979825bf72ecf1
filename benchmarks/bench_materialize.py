"""Sharding and materializing a model built on ``meta``, at W = 1024 (torch's fake process group).

The model is ``examples/model.py``'s Llama shaped like Llama-3 70B (dim 8192,
80 layers, 64 heads, FFN 28672, vocab 128256: 70.6B parameters), built on
``meta``; one ``fully_shard`` per block, then the root, on a 1-D mesh of 1024
ranks. Three timings per implementation, interleaved over repetitions:

* ``fully_shard``: the 81 calls;
* ``to_empty(device="cpu")``: this rank's shards become real (uninitialized) memory;
* ``to_empty`` + ``reset_parameters()``: then every ``nn.Linear``, ``nn.Embedding``
  and ``nn.RMSNorm`` draws its values, as a training script initializing
  weights after ``to_empty`` does (torchtitan's ``init_weights``);
* the root's lazy init (what the first forward does before its first
  all-gather), called directly; fsdp2's includes the check that every rank
  shards the same model (fsdp2/runtime/hooks/divergence.py), timed on its own too.

The fake process group's collectives do nothing, so this is Python, dispatch
and memory work only; the shards are real: ~276 MB per rank, fp32.

Each run is a fresh process forked from the same parent, as a training
script materializes once: run in one process one after the other, the
implementations met the allocator in the state the other left. glibc
serves an allocation from memory freed earlier (no page faults) or from a
fresh mapping (a fault per page) by a threshold it raises as it frees, so
whichever allocated in pieces below it reused the other's pages: upstream's
per-parameter tensors or fsdp2's per-group buffers won by up to 1.8x from
one run to the next (measured 2026-12-06, issue 60).
"""

from __future__ import annotations

import gc
import os
import pickle
import time

import torch
import torch.nn as nn
from common import FSDP_IMPLS, cpu_mesh, fully_shard_of, rotated
from model import ModelArgs, Transformer

LLAMA_70B = {
    "dim": 8192,
    "n_layers": 80,
    "n_heads": 64,
    "vocab_size": 128256,
    "ffn_hidden_dim": 28672,
    "max_seq_len": 16,
}


def _reset_parameters(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.RMSNorm)):
            module.reset_parameters()


def _one_run(impl: str, args, transformer, mesh, lazy_init: bool) -> dict[str, float]:
    fully_shard = fully_shard_of(impl)
    with torch.device("meta"):
        model = transformer(args)
    t0 = time.perf_counter()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    t1 = time.perf_counter()
    model.to_empty(device="cpu")
    t2 = time.perf_counter()
    _reset_parameters(model)
    t3 = time.perf_counter()
    # After lazy init neither implementation's model is freed by `del` (torch keeps a
    # reference; seen on 2.13), so those runs come last: leaked memory would slow the
    # allocations of the runs after them.
    lazy, check = _lazy_init_seconds(impl, model) if lazy_init else (0.0, 0.0)
    numel = sum(p.to_local().numel() for p in model.parameters())
    del model
    gc.collect()
    return {
        "fully_shard": t1 - t0, "to_empty": t2 - t1, "init": t3 - t2, "local_numel": numel,
        "lazy_init": lazy, "divergence_check": check,
    }


def _fresh(*args, **kwargs) -> dict[str, float]:
    """``_one_run(*args, **kwargs)`` in a process forked for it (see the module docstring).

    ``os.fork``: the benchmark's ranks are daemonic, which ``multiprocessing`` forbids
    to have children.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send the outcome, leave without the parent's exit handlers
        os.close(read)
        try:
            outcome: object = _one_run(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            outcome = RuntimeError(f"{type(exc).__name__}: {exc}")
        with os.fdopen(write, "wb") as f:
            pickle.dump(outcome, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        outcome = pickle.load(f)
    os.waitpid(pid, 0)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _lazy_init_seconds(impl: str, model: nn.Module) -> tuple[float, float]:
    """The root's lazy init (private entry points: a benchmark, not library code)."""
    if impl != "fsdp2":
        t0 = time.perf_counter()
        model._get_fsdp_state()._lazy_init()
        return time.perf_counter() - t0, 0.0
    from fsdp2.runtime.hooks import divergence
    from fsdp2.runtime.hooks.state import state_of

    spent = []
    check = divergence.check_same_model

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return check(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t)

    state = state_of(model)
    import fsdp2.runtime.hooks.state as state_module

    state_module.check_same_model = timed
    try:
        t0 = time.perf_counter()
        state._lazy_init()
        total = time.perf_counter() - t0
    finally:
        state_module.check_same_model = check
    return total, sum(spent)


def materialize_body(rank: int, world_size: int, shape: dict, reps: int) -> dict:
    args, transformer = ModelArgs(**shape), Transformer
    mesh = cpu_mesh()
    times: dict[str, dict[str, list[float]]] = {
        impl: {"fully_shard": [], "to_empty": [], "to_empty_init": [], "lazy_init": [],
               "divergence_check": []}
        for impl in FSDP_IMPLS
    }
    numel = {}
    for i in range(reps):
        for impl in rotated(list(FSDP_IMPLS), i):
            run = _fresh(impl, args, transformer, mesh, lazy_init=False)
            times[impl]["fully_shard"].append(run["fully_shard"])
            times[impl]["to_empty"].append(run["to_empty"])
            times[impl]["to_empty_init"].append(run["to_empty"] + run["init"])
            numel[impl] = run["local_numel"]
    for i in range(min(reps, 3)):
        for impl in rotated(list(FSDP_IMPLS), i):
            run = _fresh(impl, args, transformer, mesh, lazy_init=True)
            times[impl]["lazy_init"].append(run["lazy_init"])
            times[impl]["divergence_check"].append(run["divergence_check"])
    return {"times": times, "local_numel": numel, "world_size": world_size, "shape": shape}
