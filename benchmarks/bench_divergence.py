"""The divergence check's cost (fsdp2/runtime/hooks/divergence.py): local work, and the store's load at W=16384.

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
import pickle  # noqa: E402
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
    from model import ModelArgs, Transformer

    from fsdp2 import fully_shard
    from fsdp2.runtime.hooks import divergence
    from fsdp2.runtime.hooks.state import state_of

    mesh = cpu_mesh()
    lazy, check, local = [], [], []
    for _ in range(reps):
        with torch.device("meta"):
            model = Transformer(ModelArgs(**shape))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        total, in_check = _lazy_init_seconds("fsdp2", model)
        lazy.append(total)
        check.append(in_check)
        groups = [s.param_group for s in state_of(model).root_steps.all_states if s.param_group]
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


def _describe(ref: str, bad: str, bad_ranks: list[int]) -> str:
    return f"ranks {bad_ranks} differ: {len(ref)} vs {len(bad)} characters"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# The timed rounds; the first only releases and collects the ranks (the benchmark's own
# requests, a baseline), the second warms the threads' stacks and connections.
ROUNDS = ("release only", "warm-up", "all agree", "last rank differs")
_RANKS_PER_PROCESS = 256  # thousands of threads in one process slow it down superlinearly


def _rank_thread(port: int, r: int, world: int, out: dict) -> None:
    """Simulated rank ``r``: its own client; each round waits for the go, then runs the check."""
    import torch.distributed as dist

    from fsdp2.runtime.hooks.divergence import exchange

    client = dist.TCPStore("127.0.0.1", port, is_master=False,
                           timeout=datetime.timedelta(seconds=300))
    client.add("bench/ready", 1)
    summary = "x" * SUMMARY_BYTES
    for i, name in enumerate(ROUNDS):
        client.get(f"bench/go/{i}")
        store = _Counting(dist.PrefixStore(f"fsdp2/divergence/bench/{i}", client))
        bad = world - 1 if name == "last rank differs" else None
        try:
            if name != "release only":
                verdict = exchange(store, r, range(world), "bad" if r == bad else "hash",
                                   lambda: summary, _describe, None, "benchmark")
                assert verdict.bad == ([] if bad is None else [bad]), verdict
            outcome: Any = dict(store.calls)
        except BaseException as e:  # noqa: BLE001 - reported by the driver
            outcome = repr(e)
        out[(r, i)] = (time.perf_counter(), outcome)
        if client.add(f"bench/finished/{i}", 1) == world:
            client.set(f"bench/end/{i}", "")


def _worker(port: int, lo: int, hi: int, world: int, fd: int) -> None:
    """A forked process playing ranks ``lo..hi-1``; sends their results through ``fd``."""
    threading.stack_size(256 * 1024)
    out: dict = {}
    threads = [threading.Thread(target=_rank_thread, args=(port, r, world, out), daemon=True)
               for r in range(lo, hi)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with os.fdopen(fd, "wb") as f:
        pickle.dump(out, f)


def store_body(rank: int, world_size: int, sim_world: int) -> dict:
    """One TCPStore server, ``sim_world`` simulated ranks in forked processes, ``ROUNDS``."""
    import torch.distributed as dist

    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    port = int(server.stdout.readline())
    driver = dist.TCPStore("127.0.0.1", port, is_master=False,
                           timeout=datetime.timedelta(seconds=300))
    t0 = time.perf_counter()
    workers = []
    for lo in range(0, sim_world, _RANKS_PER_PROCESS):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the caller's code
            code = 1
            try:
                os.close(read)
                _worker(port, lo, min(lo + _RANKS_PER_PROCESS, sim_world), sim_world, write)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        workers.append((pid, os.fdopen(read, "rb")))
    while driver.add("bench/ready", 0) < sim_world:
        time.sleep(0.2)
    connect_s = time.perf_counter() - t0
    rounds = []
    for i in range(len(ROUNDS)):
        cpu = _cpu_seconds(server.pid)
        start = time.perf_counter()
        driver.set(f"bench/go/{i}", "")
        driver.get(f"bench/end/{i}")
        rounds.append((start, _cpu_seconds(server.pid) - cpu))
    out: dict = {}
    for pid, f in workers:
        out.update(pickle.load(f))
        os.waitpid(pid, 0)
    server.stdin.write("done\n")
    server.stdin.flush()
    keys_left = int(server.stdout.readline()) - 1 - 3 * len(ROUNDS)  # less the bench's own
    server.wait(10)
    result = {"sim_world": sim_world, "connect_seconds": connect_s, "keys_left": keys_left}
    for i, (name, (start, cpu)) in enumerate(zip(ROUNDS, rounds)):
        outcomes = [out[(r, i)] for r in range(sim_world)]
        errors = [o for _, o in outcomes if isinstance(o, str)]
        if errors:
            raise RuntimeError(f"{name}: {len(errors)} simulated ranks failed, e.g. {errors[0]}")
        per_rank = [sum(o.values()) for _, o in outcomes]
        kinds: collections.Counter[str] = collections.Counter()
        for _, o in outcomes:
            kinds.update(o)
        result[name] = {
            "seconds": max(t for t, _ in outcomes) - start,
            "server_cpu_seconds": cpu,
            "requests_per_rank": collections.Counter(per_rank).most_common(1)[0][0],
            "requests_max": max(per_rank),
            "requests_total": sum(per_rank),
            "by_method": dict(kinds),
        }
    return result


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
        base = store["release only"]
        out.append(row(
            f"TCPStore, W={w} simulated ranks: releasing and collecting them only (s)",
            base["seconds"], None, None,
            f"baseline: {base['server_cpu_seconds']:.2f} s server CPU",
        ))
        for key in ("all agree", "last rank differs"):
            r = store[key]
            out.append(row(
                f"divergence check on one TCPStore, W={w} simulated ranks, {key} (s)",
                r["seconds"], None, None,
                f"{r['server_cpu_seconds']:.2f} s server CPU; {r['requests_per_rank']} "
                f"requests/rank (max {r['requests_max']}), {r['requests_total']} in all",
            ))
        out.append(row(f"keys the checks left on the TCPStore, W={w}",
                       float(store["keys_left"]), None, None, "each check deletes its keys"))
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
    store = launch(store_body, 1, sim_world, timeout=600)[0]
    print(markdown(rows(fake, store)))
    print(f"\n{sim_world} clients connected in {store['connect_seconds']:.1f} s (not timed); "
          "requests by method: " + "; ".join(
              f"{k}: {store[k]['by_method']}" for k in ("all agree", "last rank differs")))
    print(f"total {time.monotonic() - started:.0f} s, torch {torch.__version__}")


if __name__ == "__main__":
    main()
