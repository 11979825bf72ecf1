"""Checkpoint saves: how long training stalls, and what a save in flight costs a step.

fsdp2's column is a fsdp2 model saved with ``fsdp2.save_checkpoint`` (atomic,
``step=``/``keep=``), synchronously or with ``async_save=True``; torch's is
upstream's ``fully_shard`` model saved the way DCP's documentation shows:
``dcp.save`` and ``dcp.async_save`` (on a gloo group of its own, as
torchtitan does) of ``get_state_dict``, straight into the folder.

* stall: from the call to its return (the slowest rank), i.e. the time
  training waits. A synchronous save returns after the write; an async one
  once the state is copied to host memory.
* step time with a save in flight: steps started right after an async save
  returned, counted while the save is still running on every rank, against
  steps with no save; both medians of the slowest rank.
* integrity (fsdp2 only): a synchronous save with checksums (the default)
  against one with ``checksums=False``, and a load with verification
  against one with ``verify=False`` (of the same checkpoint, so both read
  from the page cache), taking turns; medians of the slowest rank.

Every timed save and load starts from a full garbage collection (``settled``):
a load allocates enough Python objects that one in about four runs a
generation-2 collection (150 ms here, a fifth of the load), and with two
variants taking turns it landed on the same one each time (verified loads
looked 1.2x unverified ones; 1.06x with it out of the way: the CRC pass).
"""

from __future__ import annotations

import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from common import FSDP_IMPLS, Trainer, max_over_ranks, rotated, settled

_STEPS_PER_SAVE = 6  # steps run after each async save (those that overlap it count)


def _savers(impl: str, tr: Trainer, root: str):
    """(sync save, async save -> future) of ``tr``'s model and optimizer into ``root``."""
    if impl == "fsdp2":
        from fsdp2 import save_checkpoint

        def sync(n):
            save_checkpoint(root, tr.model, tr.optim, step=n, keep=1)

        def background(n):
            return save_checkpoint(root, tr.model, tr.optim, step=n, keep=1, async_save=True)

        return sync, background
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    group = dist.new_group(backend="gloo")

    def state():
        model_sd, optim_sd = get_state_dict(tr.model, tr.optim)
        return {"model": model_sd, "optim": optim_sd}

    def sync(n):
        dcp.save(state(), checkpoint_id=f"{root}/step-{n}")

    def background(n):
        return dcp.async_save(state(), checkpoint_id=f"{root}/step-{n}", process_group=group)

    return sync, background


def _one_round(tr: Trainer, savers, n: int, times: dict) -> None:
    """Idle steps, a sync save, an async save and the steps that overlap it."""
    sync, background = savers
    for i in range(_STEPS_PER_SAVE):
        dist.barrier()
        t0 = time.perf_counter()
        tr.step(i)
        times["step_idle"].append(time.perf_counter() - t0)
    settled()
    t0 = time.perf_counter()
    sync(2 * n)
    times["stall_sync"].append(time.perf_counter() - t0)
    settled()
    t0 = time.perf_counter()
    pending = background(2 * n + 1)
    times["stall_async"].append(time.perf_counter() - t0)
    for i in range(_STEPS_PER_SAVE):
        in_flight = _on_every_rank(not pending.done())
        dist.barrier()
        t0 = time.perf_counter()
        tr.step(i)
        if in_flight:
            times["step_busy"].append(time.perf_counter() - t0)
    pending.result()


def _integrity_round(tr: Trainer, root: str, n: int, times: dict) -> None:
    """Saves with and without checksums, loads with and without verification, taking turns."""
    from fsdp2 import load_checkpoint, save_checkpoint

    def save(on: bool) -> None:
        save_checkpoint(root, tr.model, tr.optim, step=2 * n + on, keep=2, checksums=on)

    def load(on: bool) -> None:
        load_checkpoint(f"{root}/step-{2 * n + 1}", tr.model, tr.optim, verify=on)

    for kind, fn in (("save", save), ("load", load)):
        for on in rotated([True, False], n):
            settled()
            t0 = time.perf_counter()
            fn(on)
            times[f"{kind}_{'on' if on else 'off'}"].append(time.perf_counter() - t0)


def _on_every_rank(flag: bool) -> bool:
    """True when ``flag`` holds on every rank (so all ranks count the same steps)."""
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def checkpoint_body(rank: int, world_size: int, cfg: dict) -> dict:
    """Runs on every rank: both implementations in turns, saving into a temporary folder."""
    root = [tempfile.mkdtemp(prefix="fsdp2_bench_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(root)
    try:
        trainers = {impl: Trainer(impl, cfg) for impl in FSDP_IMPLS}
        savers = {}
        for impl, tr in trainers.items():
            for i in range(cfg["warmup"]):
                tr.step(i)
            savers[impl] = _savers(impl, tr, f"{root[0]}/{impl}")
        keys = ("stall_sync", "stall_async", "step_idle", "step_busy")
        times = {impl: {k: [] for k in keys} for impl in FSDP_IMPLS}
        # Disk speed drifts on a shared machine: the implementations take turns.
        for n in range(cfg["ckpt_reps"]):
            for impl in rotated(list(FSDP_IMPLS), n):
                _one_round(trainers[impl], savers[impl], n, times[impl])
        integrity: dict = {f"{k}_{v}": [] for k in ("save", "load") for v in ("on", "off")}
        # the first load builds DCP's reader and planner: a warm-up round, not counted
        warm: dict = {k: [] for k in integrity}
        _integrity_round(trainers["fsdp2"], f"{root[0]}/integrity", 0, warm)
        for n in range(1, cfg.get("ckpt_integrity_reps", 3) + 1):
            _integrity_round(trainers["fsdp2"], f"{root[0]}/integrity", n, integrity)
        out = {"integrity": {k: max_over_ranks(v) for k, v in integrity.items()}}
        for impl, t in times.items():
            # every rank counted the same overlapped steps (_on_every_rank)
            out[impl] = {k: max_over_ranks(v) for k, v in t.items()}
            out[impl]["busy_steps"] = len(t["step_busy"])
        return out
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root[0], ignore_errors=True)
