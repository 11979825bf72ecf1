"""Run a test body in ``world_size`` real processes on a gloo process group.

Usage (``_body`` must be a module-level function; it is inherited through
``fork``, so closures work too, but module-level keeps tests readable)::

    def _body(rank, world_size, extra):
        ...

    def test_something():
        run_ranks(_body, 2, extra)

Every rank runs ``fn(rank, world_size, *args)`` inside an initialized default
process group: by default the suite's shared-memory backend
(``tests/_shm_backend.py``: gloo's results without gloo's wake-ups, which cost
0.6-1.6 ms a collective on a small VM); gloo with ``backend="gloo"`` or
``FSDP2_TEST_BACKEND=gloo``; or with ``backend="nccl"`` NCCL for CUDA tensors (gloo for
CPU ones) with rank ``r`` on GPU ``r``. NCCL ranks start with ``spawn`` (CUDA
does not survive ``fork``), so ``fn`` and ``args`` must then be picklable
(module-level functions, ``functools.partial`` of them). The return values of
all ranks come back as a list (they must be picklable). If any rank raises,
exits non-zero or the run exceeds ``timeout`` seconds, all ranks are killed
and :class:`RankError` is raised
with every failing rank's traceback text.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import _shm_backend

# Generous for ~2 s launches on a loaded 2-core box, short enough that a
# deadlocking implementation cannot stall the whole suite for long.
DEFAULT_TIMEOUT_S = float(os.environ.get("FSDP2_TEST_TIMEOUT", "90"))
_LAUNCH_DIR_ENV = "FSDP2_TEST_LAUNCH_DIR"
# After the first rank fails, give the others this long to report their own
# errors before killing them (they are usually blocked in a collective).
_GRACE_S = 1.0


class RankError(AssertionError):
    """One or more ranks failed (raised, crashed or timed out)."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    store_port: int,
    out_dir: str,
    backend: str = "gloo",
    shm_dir: str = "",
) -> None:
    code = 0
    try:
        # Our own process group: no signal handlers or stdin from pytest.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ[_LAUNCH_DIR_ENV] = out_dir
        # the parent serves the store (see run_ranks)
        store = dist.TCPStore(
            "127.0.0.1", store_port, world_size, is_master=False,
            timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S),
        )
        if backend == _shm_backend.NAME:
            os.environ[_shm_backend.DIR_ENV] = shm_dir
            _shm_backend.register()
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        elif backend == "nccl":
            # CUDA tensors through NCCL, CPU ones (e.g. offloaded shards) through gloo
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            dist.init_process_group(
                "cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=world_size,
                device_id=device,
            )
        else:
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size,
                pg_options=_oversubscribed(rank, world_size),
            )
        profile_dir = os.environ.get("FSDP2_PROFILE_DIR")  # where the suite's time goes
        if profile_dir:
            import cProfile

            profile = cProfile.Profile()
            result = profile.runcall(fn, rank, world_size, *args)
            profile.dump_stats(os.path.join(profile_dir, f"rank{rank}-{os.getpid()}.prof"))
        else:
            result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        # Only tear down on success: after an error other ranks may be stuck
        # in a collective, and the parent kills them.
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything, incl. SystemExit
        code = 1
        try:
            with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


_STORE_TIMEOUT_S = 300  # a store read's bound (the launch's own timeout usually comes first)


def _serve_store(listen_fd: int, port: int, world_size: int) -> Any:
    """The TCPStore server of one launch on the listening socket ``listen_fd`` (it closes it)."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=True,
        timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S), wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def _oversubscribed(rank: int, world_size: int) -> Any:
    """More ranks than cores (W = 3 or 4 on 2): pin each rank to a core, one gloo thread.

    Unpinned, the ranks migrate between the cores at every handoff to gloo's
    worker threads (``futex``), and system time grew to half the CPU time: a
    W = 4 optimizer-zoo launch took 45 s, 31 s pinned with one gloo thread
    (W = 3: 46 s, 36 s; W = 2, not oversubscribed: unchanged, so left alone).
    Returns the gloo options for ``init_process_group`` (``None``: the default).
    """
    import torch.distributed as dist

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cores or world_size <= len(cores):
        return None
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    options = dist.ProcessGroupGloo._Options()  # private in torch; tests only
    options._threads = 1
    return options


def launch_dir(name: str) -> str:
    """A folder all ranks of this launch share (the same path on each), removed with the launch."""
    path = os.path.join(os.environ[_LAUNCH_DIR_ENV], name)
    os.makedirs(path, exist_ok=True)
    return path


def default_backend() -> str:
    """The suite's backend: ``FSDP2_TEST_BACKEND`` (``gloo`` or ``shm``), else shared memory on x86."""
    chosen = os.environ.get("FSDP2_TEST_BACKEND", "shm")
    if chosen not in ("gloo", "shm"):
        raise ValueError(f"FSDP2_TEST_BACKEND={chosen!r}: expected 'gloo' or 'shm'")
    return _shm_backend.NAME if chosen == "shm" and _shm_backend.available() else "gloo"


_PRELOADED = False


def _preload() -> None:
    """Import heavy modules once in the parent so every forked rank inherits them.

    ``torch._dynamo`` alone costs ~2 s to import and is pulled in lazily by
    DTensor/FSDP code paths; importing it before forking keeps launches fast.
    """
    global _PRELOADED
    if _PRELOADED:
        return
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    _PRELOADED = True


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return per-rank results.

    ``backend``: ``None`` for the suite's default (see the module docstring), or
    ``"gloo"``, ``"nccl"`` by name.
    """
    __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not this helper
    backend = backend or default_backend()
    if backend == "nccl":
        ctx = multiprocessing.get_context("spawn")
    else:
        _preload()
        ctx = multiprocessing.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="fsdp2_test_")
    shm_dir = ""
    if backend == _shm_backend.NAME:  # memory, not disk, where there is a /dev/shm
        in_memory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        shm_dir = tempfile.mkdtemp(prefix="fsdp2_shm_", dir=in_memory)
    # The ranks' store: a TCPStore served from this process on a socket bound before the
    # ranks start (no port race), its server thread started after they are forked. A
    # FileStore polls every 10 ms for a key another rank has yet to set: each store
    # exchange (group setup, fsdp2's divergence check at lazy init) cost 5-15 ms there.
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    store_port = listener.getsockname()[1]
    listen_fd = listener.detach()  # the store server owns (and closes) it
    procs = []
    server = None
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(fn, rank, world_size, args, store_port, tmp, backend, shm_dir),
                daemon=True,
            )
            p.start()
            procs.append(p)
        server = _serve_store(listen_fd, store_port, world_size)

        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        timed_out = False
        while True:
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            now = time.monotonic()
            if any(p.exitcode not in (None, 0) for p in procs) and first_failure is None:
                first_failure = now
            if first_failure is not None and now - first_failure > _GRACE_S:
                break
            if now > deadline:
                timed_out = True
                break
            wait_until = deadline if first_failure is None else first_failure + _GRACE_S
            multiprocessing.connection.wait(
                [p.sentinel for p in alive], timeout=max(0.0, min(wait_until - now, 1.0))
            )

        killed = []
        for rank, p in enumerate(procs):
            if p.exitcode is None:
                p.kill()
                killed.append(rank)
        for p in procs:
            p.join(5)

        messages = []
        for rank, p in enumerate(procs):
            err_file = os.path.join(tmp, f"error{rank}.txt")
            if os.path.exists(err_file):
                with open(err_file) as f:
                    messages.append(f"--- rank {rank} raised:\n{f.read()}")
            elif rank in killed:
                why = "timed out" if timed_out else "killed after another rank failed"
                messages.append(f"--- rank {rank} {why}")
            elif p.exitcode != 0:
                messages.append(f"--- rank {rank} exited with code {p.exitcode}")
        if timed_out:
            messages.insert(0, f"run_ranks timed out after {timeout:.0f} s")
        if messages:
            raise RankError(
                f"{getattr(fn, '__name__', fn)} failed on world_size={world_size}:\n"
                + "\n".join(messages)
            )

        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(5)
        if server is None:
            os.close(listen_fd)
        del server
        shutil.rmtree(tmp, ignore_errors=True)
        if shm_dir:
            shutil.rmtree(shm_dir, ignore_errors=True)
