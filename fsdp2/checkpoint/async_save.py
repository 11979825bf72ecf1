"""Saving in the background: copy this rank's state, write it on a thread.

[Note: Asynchronous checkpoints]
A synchronous save stalls training for the whole write. An asynchronous one
stalls it for a copy of this rank's shards only: into pinned host memory on
GPU (kept from one save to the next, so pinning is paid once), a clone on
CPU. One background thread then writes the copy with DCP and commits it
(see [Note: Atomic checkpoints]) while training goes on. Two rules keep that
correct:

- The background save's collectives (DCP's plan exchange, the commit) run on
  a gloo group of their own. On the default group they would interleave with
  training's collectives in a different order on each rank.
- At most one save is in flight. The next save, and any load, first wait for
  it (and raise its error), so a staged copy is never overwritten while it is
  being written, and a load never sees a half-committed root.

The copy is ours rather than ``dcp.async_save``'s stager: DCP's copies whole
storages, and a sharded parameter may be a view into a larger buffer, so it
would copy (or, on torch 2.13, fail on) that buffer; ours copies each
tensor's own elements. DCP's ``save`` does the write itself, as it would in
``async_save``'s thread.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._torch_compat import dtensor_like

logger = logging.getLogger(__name__)

_executor: ThreadPoolExecutor | None = None
_in_flight: SaveFuture | None = None
_group: tuple[Any, Any] | None = None  # (the default group it was made for, the gloo group)
_pinned: dict[tuple, torch.Tensor] = {}  # staging buffers in pinned memory, by key path


class SaveFuture(Future):
    """A save in flight. Its error is raised once: by ``result()``, or else by the next save."""

    _seen = False

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        finally:
            self._seen = self._seen or self.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        self._seen = True
        return error


def wait_pending() -> None:
    """Wait for the save in flight, if any; raise its error here unless it was seen already."""
    global _in_flight
    future, _in_flight = _in_flight, None
    if future is not None:
        wait([future])
        if not future._seen:
            future.result()


def background_group() -> Any:
    """The gloo group the background saves coordinate on (made once per default group).

    Collective the first time (``new_group``): every rank calls it, as every
    rank calls ``save_checkpoint``.
    """
    global _group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _group is None or _group[0] is not world:
        _group = (world, dist.new_group(backend="gloo"))
    return _group[1]


def submit(job: Callable[[], Any]) -> SaveFuture:
    """Run ``job`` on the checkpoint thread; it is the save in flight until it is waited for."""
    global _executor, _in_flight
    if _in_flight is not None:
        raise AssertionError("a checkpoint save is already in flight")
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp2-checkpoint")
    future = _in_flight = SaveFuture()

    def run() -> None:
        try:
            future.set_result(job())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(exc)

    _executor.submit(run)
    return future


def stage(state: Any, file_backed: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> Any:
    """A copy of ``state`` that training may not touch: tensors on the host, containers new.

    ``file_backed``: stages a host tensor that lives in a file off the heap
    (returns ``None`` for the others; see [Note: Streaming file-backed state]
    in streaming.py).
    """
    devices: set[torch.device] = set()
    copied = _copy(state, (), devices, file_backed)
    for device in devices:  # the non-blocking device-to-host copies have landed
        torch.cuda.synchronize(device)
    return copied


def _copy(value: Any, path: tuple, devices: set, file_backed: Any) -> Any:
    if isinstance(value, DTensor):
        return dtensor_like(value, _host_copy(value.to_local(), path, devices, file_backed))
    if isinstance(value, torch.Tensor):
        return _host_copy(value, path, devices, file_backed)
    if isinstance(value, dict):
        return {k: _copy(v, (*path, k), devices, file_backed) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_copy(v, (*path, i), devices, file_backed) for i, v in enumerate(value)]
        return items if isinstance(value, list) else type(value)(items)
    return value  # numbers, strings: immutable


def _host_copy(tensor: torch.Tensor, path: tuple, devices: set, file_backed: Any) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        staged = file_backed(tensor) if file_backed is not None else None
        return tensor.clone() if staged is None else staged
    if tensor.device.type != "cuda":  # no pinned memory to reuse: a plain copy
        return tensor.to("cpu")
    buf = _pinned.get(path)
    if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
        buf = _pinned[path] = torch.empty(
            tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True
        )
    buf.copy_(tensor, non_blocking=True)
    devices.add(tensor.device)
    return buf


def _forget_in_child() -> None:
    # A forked child has none of the parent's threads: an executor inherited from
    # the parent would queue saves that never run, and an in-flight save or a
    # process group of the parent's is not the child's.
    global _executor, _in_flight, _group
    _executor, _in_flight, _group = None, None, None
    _pinned.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _report_at_exit() -> None:
    # Python lets the thread finish its save before exiting; a failure nobody
    # waited for would otherwise vanish with the process.
    future = _in_flight
    if future is not None and future.done() and not future._seen and future.exception():
        logger.error("the last asynchronous checkpoint save failed: %s", future.exception())
