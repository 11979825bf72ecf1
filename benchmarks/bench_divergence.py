"""The divergence check's cost (fsdp2/divergence.py): local work, and the store's load at W=16384.

    python benchmarks/bench_divergence.py           # W=16384 on one TCPStore, 80-layer 70B: ~1-2 min
    python benchmarks/bench_divergence.py --quick   # W=1024, 8 layers: ~20 s

Two parts:

* ``check_cost_body`` (W = 1024, torch's fake process group, one process): the
  Llama-3-70B-shaped model of ``bench_materialize.py``, one ``fully_shard``
  per block and the root, ``to_empty``; the root's lazy init with the check
  timed on its own (under the fake PG it is skipped: one process plays every
  rank, nobody else would answer), then the local work a rank of a real run
  does before its first store request, timed directly: summarizing every
  group and hashing the summary.
* ``store_body``: one real ``TCPStore`` server (its own process, libuv
  backend, as ``torchrun`` starts it) and ``sim_world`` simulated ranks, each
  a thread with its own client connection running the check's store protocol
  (``divergence.exchange``), once with every rank agreeing and once with the
  last rank's model differing (each summary ~100 KB, the 80-layer model's
  size). Reported: wall time from releasing every rank at once to the last
  rank's verdict, the store requests per rank (counted per method on each
  client: the same for every rank except the reference, the last to arrive
  and the last to leave, which do a few more), the total, and the keys left
  on the server after the check (0: every check deletes its own). Connecting
  the clients is not timed (a real run's ranks are connected at rendezvous).

This sandbox's DNS resolver stalls about 5 s on one reverse lookup in 50, and
TCPStore resolves each peer's address for its log text on connect: the script
sets ``RES_OPTIONS`` so that lookups fail fast (connection setup only).
"""

from __future__ import annotations

import os

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # before any lookup

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SUMMARY_BYTES = 100_000  # about the 80-layer model's JSON summary


def check_cost_body(rank: int, world_size: int, shape: dict, reps: int) -> dict:
    """Fake PG, W = world_size: the check inside lazy init, and the summary + hash on their own."""
    import json

    import torch
    from bench_materialize import _lazy_init_seconds
    from common import cpu_mesh
    from model import _examples_module

    from fsdp2 import divergence, fully_shard
    from fsdp2.state import state_of

    module = _examples_module()
    mesh = cpu_mesh()
    lazy, check, local = [], [], []
    for _ in range(reps):
        with torch.device("meta"):
            model = module.Transformer(module.ModelArgs(**shape))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        total, in_check = _lazy_init_seconds("fsdp2", model)
        lazy.append(total)
        check.append(in_check)
        groups = [s.param_group for s in state_of(model).root_ctx.all_states if s.param_group]
        t0 = time.perf_counter()
        meshes: dict[int, str] = {}
        digest = divergence._hash([divergence.group_fingerprint(g, meshes) for g in groups])
        local.append(time.perf_counter() - t0)
        assert len(digest) == 32
        summary = len(json.dumps([divergence.group_fingerprint(g, {}) for g in groups]))
        del model
    return {"world_size": world_size, "layers": shape["n_layers"], "groups": len(groups),
            "lazy_init": lazy, "check": check, "summary_and_hash": local,
            "summary_bytes": summary}


# The server: a process of its own (its sockets count against its own descriptor limit).
_SERVER = """
import datetime, resource, sys
import torch.distributed as dist
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=300))
print(store.port, flush=True)
sys.stdin.readline()  # serve until the benchmark is done
print(store.num_keys(), flush=True)
"""


class _Counting:
    """A store that counts the requests made through it, per method."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


def _one_check(clients: list, prefix: str, bad_rank: int | None) -> dict:
    """Every simulated rank runs ``exchange`` at once; timings and request counts."""
    import torch.distributed as dist

    from fsdp2.divergence import exchange

    world = len(clients)
    ranks = list(range(world))
    summary = "x" * SUMMARY_BYTES
    stores = [_Counting(dist.PrefixStore(prefix, c)) for c in clients]
    go = threading.Event()
    finished = [0.0] * world
    verdicts: list[Any] = [None] * world

    def rank(r: int) -> None:
        go.wait()
        try:
            verdicts[r] = exchange(stores[r], r, ranks, "bad" if r == bad_rank else "hash",
                                   lambda: summary, None, "benchmark")
        except BaseException as e:  # noqa: BLE001 - reported below
            verdicts[r] = e
        finished[r] = time.perf_counter()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    errors = [v for v in verdicts if isinstance(v, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} simulated ranks failed, e.g. {errors[0]!r}")
    expected = [] if bad_rank is None else [bad_rank]
    assert all(v.bad == expected for v in verdicts), "ranks disagree on the verdict"
    per_rank = [sum(s.calls.values()) for s in stores]
    common = collections.Counter(per_rank).most_common(1)[0][0]
    kinds: collections.Counter[str] = collections.Counter()
    for s in stores:
        kinds.update(s.calls)
    return {
        "seconds": max(finished) - start,
        "requests_per_rank": common,  # all but the few ranks with a role
        "requests_max": max(per_rank),
        "requests_total": sum(per_rank),
        "by_method": dict(kinds),
    }


def store_body(rank: int, world_size: int, sim_world: int) -> dict:
    """One TCPStore server, ``sim_world`` client threads: a passing and a failing check."""
    import torch.distributed as dist

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < sim_world + 256 <= hard:  # one socket per simulated rank
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    port = int(server.stdout.readline())
    t0 = time.perf_counter()
    clients: list[Any] = [None] * sim_world

    def connect(lo: int, hi: int) -> None:
        for r in range(lo, hi):
            clients[r] = dist.TCPStore("127.0.0.1", port, is_master=False,
                                       timeout=datetime.timedelta(seconds=120))

    workers = 16  # overlap the connects' occasional resolver stalls
    threading.stack_size(256 * 1024)  # thousands of mostly blocked threads
    pool = [threading.Thread(target=connect, args=(i * sim_world // workers,
                                                   (i + 1) * sim_world // workers))
            for i in range(workers)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    connect_s = time.perf_counter() - t0
    agree = _one_check(clients, "fsdp2/divergence/bench/0", None)
    differ = _one_check(clients, "fsdp2/divergence/bench/1", sim_world - 1)
    server.stdin.write("done\n")
    server.stdin.flush()
    keys_left = int(server.stdout.readline())
    server.wait(10)
    return {"sim_world": sim_world, "connect_seconds": connect_s, "agree": agree,
            "differ": differ, "keys_left": keys_left}


def rows(fake: dict | None, store: dict | None) -> list[dict]:
    """Table rows (report.row) for run.py and this script."""
    from common import median
    from report import row

    out = []
    if fake:
        where = f"{fake['layers']}-layer 70B-shaped Llama, W={fake['world_size']} fake PG"
        out.append(row(f"divergence check inside lazy init, {where} (ms)",
                       1e3 * median(fake["check"]), None, None, "skipped under the fake PG"))
        out.append(row(f"its local work on a real PG: summary + hash, {where} (ms)",
                       1e3 * median(fake["summary_and_hash"]), None, None,
                       f"once per root; summary {fake['summary_bytes'] / 1e3:.0f} KB"))
    if store:
        w = store["sim_world"]
        for key, label in (("agree", "all agree"), ("differ", "last rank differs")):
            s = store[key]
            out.append(row(
                f"divergence check on one TCPStore, W={w} simulated ranks, {label} (s)",
                s["seconds"], None, None,
                f"{s['requests_per_rank']} requests/rank (max {s['requests_max']}), "
                f"{s['requests_total']} total",
            ))
        out.append(row(f"keys left on the TCPStore after both checks, W={w}",
                       float(store["keys_left"]), None, None, "0: each check deletes its keys"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="W=1024 store, 8 layers: ~20 s")
    args = parser.parse_args()
    import torch
    from _ranks import launch
    from bench_materialize import LLAMA_70B
    from report import markdown

    torch.set_num_threads(1)
    import fsdp2  # noqa: F401 - imported once, inherited by the forked parts

    started = time.monotonic()
    shape = {**LLAMA_70B, "n_layers": 8} if args.quick else LLAMA_70B
    fake = launch(check_cost_body, 1024, shape, 1 if args.quick else 3, backend="fake",
                  timeout=300)[0]
    sim_world = 1024 if args.quick else 16384
    store = launch(store_body, 1, sim_world, timeout=300)[0]
    print(markdown(rows(fake, store)))
    print(f"\nclients connected in {store['connect_seconds']:.1f} s (not timed above); "
          f"requests by method, all agree: {store['agree']['by_method']}; "
          f"last rank differs: {store['differ']['by_method']}")
    print(f"total {time.monotonic() - started:.0f} s, torch {torch.__version__}")


if __name__ == "__main__":
    main()
