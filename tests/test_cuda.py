"""The CUDA path on one GPU: a one-rank NCCL group with FSDP2_FORCE_COLLECTIVES=1.

With the switch a one-rank shard group runs every all-gather and
reduce-scatter through NCCL, with the copies, pinned host copies and events
of a multi-rank run (see [Note: Forcing collectives on one rank] in
fsdp2/runtime/comm/force_collectives.py). The cases are tests/device_cases.py's, the ones
tests/test_force_collectives.py runs on CPU: parity with the unsharded
reference and with upstream's ``fully_shard`` for fp32 and bf16 with and
without resharding after forward, CPU offload from pinned memory, explicit
prefetching, ``set_post_optim_event`` after an optimizer step on a delayed
side stream, activation checkpointing and an inductor-compiled block; and the
stream-safety cases, where every collective waits behind a long kernel on a
stream of its own while compute runs on, and training must give the
undelayed results.

All cases run in one spawned NCCL process (GPU 0). Skipped without CUDA or
without NCCL, with the reason::

    python -m pytest -q tests/test_cuda.py              # on a machine with a GPU
    FSDP2_TEST_IMPL=torch python -m pytest -q tests/test_cuda.py   # the same on upstream
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from checks import check_case
from device_cases import cases

_REASON = (
    "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if not torch.cuda.is_available()
    else "needs NCCL (torch.distributed.is_nccl_available() is False)"
)
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()), reason=_REASON
)

CASES = cases("cuda")
# spawn, CUDA init and an inductor compile: minutes, not seconds, on a cold cache
TIMEOUT_S = 900
NCCL = {"backend": "nccl", "timeout": TIMEOUT_S}  # one launch on one rank, for every test


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("parity-")])
def test_parity_one_rank_nccl(name, launch_cases):
    """fp32 / bf16, reshard_after_forward True / False: reference and upstream parity on NCCL."""
    check_case(launch_cases(1, CASES, **NCCL), name)


def test_offload_pinned_memory(launch_cases):
    """CPUOffloadPolicy(pin_memory=True): parity; sharded parameters stay in pinned host memory."""
    check_case(launch_cases(1, CASES, **NCCL), "offload")


def test_explicit_prefetch(launch_cases):
    """set_modules_to_forward/backward_prefetch: parity; no collective beyond the usual ones."""
    check_case(launch_cases(1, CASES, **NCCL), "prefetch")


def test_post_optim_event_side_stream(launch_cases):
    """The optimizer steps on a delayed side stream; the next forward waits on its event: parity."""
    check_case(launch_cases(1, CASES, **NCCL), "post_optim_event")


def test_activation_checkpointing(launch_cases):
    """checkpoint_wrapper on every block, then fully_shard: parity on NCCL."""
    check_case(launch_cases(1, CASES, **NCCL), "checkpoint")


def test_compiled_block(launch_cases):
    """An inductor-compiled block, then fully_shard: parity with the compiled reference."""
    check_case(launch_cases(1, CASES, **NCCL), "compiled")


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("stream_safety-")])
def test_stream_safety_delayed_collectives(name, launch_cases):
    """Collectives delayed behind torch.cuda._sleep on their own stream: the undelayed results."""
    check_case(launch_cases(1, CASES, **NCCL), name)
