"""Run one benchmark body in forked rank processes, with a hard timeout.

``launch(fn, world_size, backend="gloo")`` forks ``world_size`` processes
that each set ``torch.set_num_threads(1)``, join a real gloo group (or, with
``backend="fake"``, one process joins torch's fake process group of
``world_size`` ranks, where collectives are no-ops), run
``fn(rank, world_size, *args)`` and send its (picklable) result back through
a pipe. ``backend="nccl"`` (GPU benchmarks) puts rank ``r`` on GPU ``r`` with
NCCL for CUDA tensors and gloo for CPU ones; ``start_method="spawn"`` (needed
wherever a rank uses CUDA, which does not survive ``fork``) takes module-level
functions and picklable arguments. Any failure or timeout kills every rank and raises ``RankFailure``
with the ranks' tracebacks, so a benchmark never hangs the run.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailure(RuntimeError):
    """A rank raised, died or ran past the timeout."""


def _rank_main(fn, rank, world_size, backend, store_port, args, conn) -> None:
    status, payload = "ok", None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            store = _store_client(store_port, world_size)
            dist.init_process_group(
                "cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=world_size,
                device_id=device,
            )
        elif backend == "fake":
            from fsdp2._torch_compat import init_fake_process_group

            init_fake_process_group(world_size)
        else:
            store = _store_client(store_port, world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        payload = fn(rank, world_size, *args)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every error goes back to the parent
        status, payload = "error", traceback.format_exc()
    try:
        conn.send((status, payload))
        conn.close()
    finally:
        os._exit(0 if status == "ok" else 1)


_STORE_TIMEOUT = datetime.timedelta(seconds=300)


def _store_client(port: int, world_size: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=_STORE_TIMEOUT)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    start_method: str = "fork",
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; the list of per-rank results."""
    ctx = mp.get_context(start_method)
    nprocs = 1 if backend == "fake" else world_size
    # The store torchrun gives its ranks, a TCPStore (a FileStore polls every 10 ms for a key
    # another rank has yet to set, and every store exchange would be timed with that), served
    # from this process on a socket bound before the ranks start.
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = listener.getsockname()[1]
    listen_fd = listener.detach()  # the store server owns (and closes) it
    server = None
    procs, conns = [], []
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        for rank in range(nprocs):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, backend, port, args, send),
                daemon=True,
            )
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        import torch.distributed as dist

        server = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=_STORE_TIMEOUT,
                               wait_for_workers=False, master_listen_fd=listen_fd)
        while len(results) < nprocs:
            pending = [r for r in range(nprocs) if r not in results]
            ready = multiprocessing.connection.wait([conns[r] for r in pending], timeout=1.0)
            for r in pending:
                if conns[r] in ready:
                    try:
                        results[r] = conns[r].recv()
                    except EOFError:
                        results[r] = ("error", f"died with exit code {procs[r].exitcode}")
            failed = [r for r, (s, _) in results.items() if s != "ok"]
            if failed:
                time.sleep(0.5)  # let the other ranks report their own errors
                break
            if time.monotonic() > deadline:
                raise RankFailure(f"{fn.__name__} timed out after {timeout:.0f} s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        if server is None:
            os.close(listen_fd)
        del server
    errors = [f"rank {r}: {payload}" for r, (s, payload) in sorted(results.items()) if s != "ok"]
    if errors or len(results) < nprocs:
        raise RankFailure(f"{fn.__name__} failed:\n" + "\n".join(errors or ["rank missing"]))
    return [results[r][1] for r in range(nprocs)]
