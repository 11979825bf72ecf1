"""The NVMe tier's disk works behind the step: the order of reads, steps and writes, and errors.

A store instrumented here (``_Recorder``, wrapping one ``DiskStore``'s reader,
writer and step calls) records who does what, when. Overlapped, a unit's
step does not end before the next unit's read and the last unit's write have
started on their threads (the step waits for them, with a timeout: the plain
order never starts them, and fails), and the next step's first unit is read
before its backward. The plain order (the store's read-ahead switched off
here) gives the same bits, and both give the in-memory step's. A reader's or
writer's error is raised by ``optimizer.step()`` on the calling thread; after
one that stopped a step half way, the optimizer refuses to step until a
checkpoint is loaded. See [Note: Overlapping the disk with the step] in
``fsdp2/optim/state_store.py``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
from checks import check_case, sharded_linear_stack, square_loss_backward
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2 import OptimizerOffloadPolicy

pytestmark = pytest.mark.skipif(
    os.environ.get("FSDP2_TEST_IMPL") == "torch", reason="fsdp2's own feature"
)

NUM_LAYERS, DIM, STEPS = 6, 64, 3  # one unit per Linear (its three AdamW(amsgrad) moments)
WAIT_S = 60.0  # generous: the machine may be loaded; the plain order never gets there


def _model(seed: int = 3) -> torch.nn.Module:
    return sharded_linear_stack(NUM_LAYERS, DIM, seed)


def _optimizer(model: torch.nn.Module, folder: str | None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True, weight_decay=0.1, foreach=True)
    policy = folder and OptimizerOffloadPolicy(
        "nvme", folder, unit_bytes=3 * DIM * DIM * 4 // dist.get_world_size()
    )
    return opt, fsdp2.enable_local_shard_step(opt, offload=policy)


def _backward(model: torch.nn.Module, i: int) -> None:
    square_loss_backward(model, DIM, i)


def _state_of(opt) -> list[torch.Tensor]:
    return [
        (v.to_local() if isinstance(v, DTensor) else v).clone()
        for s in opt.state.values() for v in s.values()
    ]


def _assert_same(model, opt, ref, ref_opt, where: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), (where, name)
    got, want = _state_of(opt), _state_of(ref_opt)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), where


class _Recorder:
    """Records a store's reads, steps and writes in order: ``(kind, unit, thread name)``.

    ``overlapped=False`` switches the store's read-ahead off (the plain order).
    Overlapped, ``release(i)`` (the end of unit ``i``'s step) first waits for
    the read of unit ``i + 1`` and the write of unit ``i - 1`` of this step to
    have started. ``fail``: ``(kind, unit, count)`` makes the ``count``-th
    ``read``/``write`` of ``unit`` raise an ``OSError``, on its thread.
    """

    def __init__(self, store, overlapped: bool, fail: tuple[str, int, int] | None = None) -> None:
        self.events: list[tuple[str, int, str]] = []
        self.mark = 0  # where this step's events start
        self._changed = threading.Condition()
        self._fail, self._counts = fail, {}
        self.overlapped = overlapped
        read, write, views, release = store._read, store._write_back, store.views, store.release

        def on_thread(kind, fn, unit):
            self._add("start " + kind, unit)
            n = self._counts[(kind, unit)] = self._counts.get((kind, unit), 0) + 1
            if self._fail == (kind, unit, n):
                raise OSError(errno.EIO, f"injected {kind} error, unit {unit}")
            return fn(unit)

        def recorded_views(unit):
            out = views(unit)
            self._add("step", unit)
            return out

        def recorded_release(unit):
            if overlapped:
                if unit + 1 < NUM_LAYERS:
                    self.wait_for("start read", unit + 1)
                if unit > 0:
                    self.wait_for("start write", unit - 1)
            self._add("end step", unit)
            return release(unit)

        store._read = functools.partial(on_thread, "read", read)
        store._write_back = functools.partial(on_thread, "write", write)
        store.views, store.release = recorded_views, recorded_release
        if not overlapped:
            store.prefetch = lambda unit: None

    def _add(self, kind: str, unit: int) -> None:
        with self._changed:
            self.events.append((kind, unit, threading.current_thread().name))
            self._changed.notify_all()

    def new_step(self) -> None:
        with self._changed:
            self.mark = len(self.events)
            self.events.append(("optimizer.step", -1, threading.current_thread().name))

    def wait_for(self, kind: str, unit: int, since: int | None = None) -> int:
        """The index of the first ``kind`` event of ``unit`` at or after ``since`` (this step's)."""
        start = self.mark if since is None else since

        def found():
            return next((j for j in range(start, len(self.events))
                         if self.events[j][:2] == (kind, unit)), None)

        with self._changed:
            if not self._changed.wait_for(lambda: found() is not None, timeout=WAIT_S):
                raise AssertionError(f"no {kind!r} of unit {unit} within {WAIT_S} s: {self.events[start:]}")
            return found()


def _train(model, opt, recorder: _Recorder | None, first: int = 0, steps: int = STEPS) -> None:
    for i in range(first, first + steps):
        if recorder is not None and recorder.overlapped and i > first:
            # the last step's end asked for unit 0: it is read before this backward
            recorder.wait_for("start read", 0, since=recorder.mark)
        _backward(model, i)
        if recorder is not None:
            recorder.new_step()
        opt.step()
        opt.zero_grad()


@contextlib.contextmanager
def _shared_root():
    """One temporary folder for every rank (a checkpoint's), removed at the end."""
    root = [tempfile.mkdtemp(prefix="fsdp2-overlap-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    try:
        yield root[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root[0], ignore_errors=True)


def _order_case(rank, world_size):
    """Overlapped and plain NVMe steps: the same bits as in memory; reads and writes behind the steps."""
    ref = _model()
    ref_opt, _ = _optimizer(ref, None)
    _train(ref, ref_opt, None)
    with _shared_root() as root:
        runs = {}
        for overlapped in (False, True):
            model = _model()
            opt, handle = _optimizer(model, os.path.join(root, str(overlapped)))
            store = handle.engine.tier
            assert len(handle.engine.units) == NUM_LAYERS
            recorder = _Recorder(store, overlapped)
            _train(model, opt, recorder)
            store.wait()
            _assert_same(model, opt, ref, ref_opt, f"overlapped={overlapped}")
            runs[overlapped] = (model, opt, handle, recorder.events)
        plain, overlapped = runs[False][3], runs[True][3]
        assert not [e for e in plain if e[0] == "start read"], "the plain order reads nothing ahead"
        steps = [j for j, e in enumerate(overlapped) if e[0] == "optimizer.step"]
        assert len(steps) == STEPS
        index = {}
        for k, (lo, hi) in enumerate(zip(steps, steps[1:] + [len(overlapped)])):
            for j in range(lo, hi):
                index.setdefault((k, overlapped[j][0], overlapped[j][1]), j)
        for k in range(STEPS):
            for i in range(NUM_LAYERS):
                step, end = index[(k, "step", i)], index[(k, "end step", i)]
                assert overlapped[step][2] == threading.main_thread().name
                if i + 1 < NUM_LAYERS:
                    read = index[(k, "start read", i + 1)]
                    assert read < end and overlapped[read][2].startswith("fsdp2-state-read"), (k, i)
                if i > 0:
                    write = index[(k, "start write", i - 1)]
                    assert write < end and overlapped[write][2].startswith("fsdp2-state-writeback")
        reads0 = [j for j, e in enumerate(overlapped) if e[:2] == ("start read", 0)]
        for k in range(STEPS - 1):  # the next step's unit 0: read from this step's end, before backward
            last = index[(k, "end step", NUM_LAYERS - 1)]
            assert [j for j in reads0 if last < j < steps[k + 1]], (k, overlapped[last:steps[k + 1]])
        for *_, handle, _ in runs.values():
            handle.remove()


def _read_error_case(rank, world_size):
    """A read error half way raises OSError from step(); then step() refuses until a load."""
    ref = _model()
    ref_opt, _ = _optimizer(ref, None)
    _train(ref, ref_opt, None, steps=2)
    with _shared_root() as root:
        folder = os.path.join(root, "state")
        model = _model()
        opt, handle = _optimizer(model, folder)
        # step 1's read of unit 2 fails on rank 0 only: each rank raises what its own store raised
        _Recorder(handle.engine.tier, True, fail=("read", 2, 2) if rank == 0 else None)
        _train(model, opt, None, steps=1)
        fsdp2.save_checkpoint(os.path.join(root, "ckpt"), model, opt)
        _backward(model, 1)
        if rank == 0:
            with pytest.raises(OSError, match="injected read error, unit 2"):
                opt.step()
            with pytest.raises(RuntimeError, match=r"(?s)half stepped.*unit 2 of 6.*load a checkpoint"):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
        handle.engine.tier.wait()
        fsdp2.load_checkpoint(os.path.join(root, "ckpt"), model, opt)
        _train(model, opt, None, first=1, steps=1)
        _assert_same(model, opt, ref, ref_opt, "stepped again after the load")
        handle.remove()


def _first_read_error_case(rank, world_size):
    """A read error before any unit steps leaves the state whole: the same step again works."""
    ref = _model()
    ref_opt, _ = _optimizer(ref, None)
    _train(ref, ref_opt, None, steps=2)
    with _shared_root() as root:
        folder = os.path.join(root, "state")
        model = _model()
        opt, handle = _optimizer(model, folder)
        # the 2nd read of unit 0: asked for at step 0's end, taken by step 1
        _Recorder(handle.engine.tier, True, fail=("read", 0, 2))
        _train(model, opt, None, steps=1)
        _backward(model, 1)
        with pytest.raises(OSError, match="injected read error, unit 0"):
            opt.step()
        opt.step()  # the same gradients
        opt.zero_grad()
        _assert_same(model, opt, ref, ref_opt, "the step taken again")
        handle.remove()


def _write_error_case(rank, world_size):
    """A write-back error is raised on the stepping thread (by step() or the tier's wait())."""
    with _shared_root() as root:
        folder = os.path.join(root, "state")
        model = _model()
        opt, handle = _optimizer(model, folder)
        store = handle.engine.tier
        _Recorder(store, False, fail=("write", 1, 1))
        _backward(model, 0)
        with pytest.raises(OSError, match="injected write error, unit 1"):
            opt.step()  # unit 3's release waits for unit 1's write (units_in_memory=2)
            store.wait()
        with pytest.raises(RuntimeError, match="half stepped"):
            opt.step()
        handle.remove()


CASES = {
    "order": _order_case,
    "read_error": _read_error_case,
    "first_read_error": _first_read_error_case,
    "write_error": _write_error_case,
}


@pytest.mark.parametrize("case", list(CASES))
def test_nvme_overlap(case, launch_cases):
    """One case of the overlapped NVMe step, all cases in one W=2 launch."""
    check_case(launch_cases(2, CASES), case)
