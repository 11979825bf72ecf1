"""Run a test body in ``world_size`` threads of this process on torch's threaded process group.

Upstream's own FSDP tests (``FSDPTestMultiThread``) and many users' unit tests
run ranks as threads: one process, one ``init_process_group("threaded", ...)``
per thread, each thread seeing a process-group world of its own. fsdp2 must
behave there exactly as with a process per rank, so the tests of that use this
launcher; every other multi-rank test uses ``_multiproc.run_ranks``.

    results = run_threads(_body, 4, extra)   # _body(rank, world_size, extra)

Everything else in the process is shared between ranks: module globals, the
default RNG (bodies draw from explicit ``torch.Generator``s), intra-op threads
(set to 1 for the run). If a rank raises, the others are woken from their
collectives and stopped; if the run exceeds ``timeout`` seconds (a hang), the
same happens and :class:`RankError` names the ranks that were stuck.
"""

from __future__ import annotations

import datetime
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _multiproc import DEFAULT_TIMEOUT_S, RankError


class _ThreadedWorld:
    """torch's threaded process group: ranks as threads of this process.

    Upstream's own tests run FSDP this way, and so do many users' unit
    tests. Between ``install()`` and ``uninstall()``, each
    thread that calls ``init_process_group("threaded", rank=..., world_size=...,
    store=...)`` joins one world as that rank, with process-group state of
    its own. ``abort()`` wakes every thread blocked in a collective (they
    raise ``SystemExit``). Wraps ``torch.testing._internal.distributed.
    multi_threaded_pg`` (``_install_threaded_pg``, ``_uninstall_threaded_pg``,
    ``ProcessLocalGroup.exception_handle`` / ``reset``) and
    ``torch._C._distributed_c10d._set_thread_isolation_mode`` (torch 2.13, 2.15).
    """

    def __init__(self) -> None:
        from torch.testing._internal.distributed import multi_threaded_pg

        self._mt = multi_threaded_pg

    def install(self) -> None:
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        self._mt._install_threaded_pg()

    def abort(self, exc: BaseException) -> None:
        self._mt.ProcessLocalGroup.exception_handle(exc)

    def uninstall(self) -> None:
        try:
            self._mt.ProcessLocalGroup.reset()
            self._mt._uninstall_threaded_pg()
        finally:
            torch._C._distributed_c10d._set_thread_isolation_mode(False)


# After an abort, how long stopped ranks get to unwind before being reported as stuck.
_GRACE_S = 5.0


def run_threads(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` thread ranks; return their results."""
    __tracebackhide__ = True
    world = _ThreadedWorld()
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    errors: dict[int, str] = {}
    aborted = threading.Event()

    def worker(rank: int) -> None:
        dist.init_process_group(
            "threaded", rank=rank, world_size=world_size, store=store,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            results[rank] = fn(rank, world_size, *args)
        except BaseException as e:  # noqa: BLE001 - report everything, incl. SystemExit
            if not (aborted.is_set() and isinstance(e, SystemExit)):
                errors[rank] = traceback.format_exc()
            aborted.set()
            world.abort(e)
        finally:
            dist.destroy_process_group()

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    world.install()
    threads = [
        threading.Thread(target=worker, args=(r,), name=f"rank{r}", daemon=True)
        for r in range(world_size)
    ]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            aborted.set()
            world.abort(TimeoutError(f"run_threads timed out after {timeout:.0f} s"))
            for t in threads:
                t.join(_GRACE_S)
    finally:
        world.uninstall()
        torch.set_num_threads(num_threads)
    messages = [f"--- rank {r} raised:\n{errors[r]}" for r in sorted(errors)]
    if stuck:
        messages.insert(0, f"run_threads timed out after {timeout:.0f} s; ranks {stuck} were stuck")
        left = [r for r, t in enumerate(threads) if t.is_alive()]
        if left:
            messages.append(f"ranks {left} did not stop (threads left running)")
    if messages:
        raise RankError(f"{getattr(fn, '__name__', fn)} failed on world_size={world_size} "
                        "(threaded process group):\n" + "\n".join(messages))
    return results


def _spawned_run(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> Any:
    return run_threads(fn, world_size, *args, timeout=timeout)


def run_threads_spawned(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """``run_threads`` in a fresh (spawned) interpreter; returns its results or raises its error.

    Autograd on thread ranks leaves a process unable to fork ranks later (torch's
    CUDA builds refuse), and thread ranks in a *forked* child share its
    fork-inherited thread pools (a segfault, seen once): suites that fork ranks
    run their thread worlds this way. ``fn`` must be importable (module level).
    """
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(_spawned_run, (fn, world_size, args, timeout)).get(timeout + 60)
