"""Multi-node launch: two torchrun agents on this host act as the two nodes of an HSDP run.

Each agent is started as on a real node (``torchrun --nnodes 2
--nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id
JOB``, the same command on both); their four workers run
tests/_multinode_train.py on a (replicate=2, shard=2) mesh. The launch runs
once per module (15-20 s on 2 idle cores, mostly six processes importing torch) and
the tests check what it left behind.

``--node-rank`` is not passed: the c10d rendezvous ignores it and numbers the
nodes itself (by host name, then by the agent's process id), so which agent
becomes node 1 is not fixed; the tests check that whichever did got global
ranks 2 and 3.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import _multinode_train as script
import pytest
import torch
from _multiproc import run_ranks
from checks import ATOL, RTOL
from models import build_transformer, transformer_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_multinode_train.py")
NUM_NODES, PER_NODE = script.MESH_SHAPE
WORLD_SIZE = NUM_NODES * PER_NODE
# Far above a normal launch; a hung rendezvous or collective fails the test instead.
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(agents: list[subprocess.Popen], out_dir: str) -> None:
    """Stop the agents and any worker they left behind (workers run in sessions of their own)."""
    for proc in agents:
        if proc.poll() is None:
            proc.terminate()  # an agent stops its workers on SIGTERM
    deadline = time.monotonic() + 10
    for proc in agents:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    for rank in range(WORLD_SIZE):
        pid_file = os.path.join(out_dir, f"pid{rank}")
        if os.path.exists(pid_file):
            with open(pid_file) as f:
                pid = int(f.read())
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited already


def _log_tails(out_dir: str) -> str:
    tails = []
    for node in range(NUM_NODES):
        with open(os.path.join(out_dir, f"agent{node}.log"), errors="replace") as f:
            tails.append(f"--- agent {node} log (tail):\n{f.read()[-4000:]}")
    return "\n".join(tails)


def _launch_two_nodes(out_dir: str) -> tuple[list[int], list[dict]]:
    """Start one torchrun agent per node, wait for both; return agent pids and per-rank results."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(NUM_NODES),
        "--nproc-per-node", str(PER_NODE),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        "--rdzv-id", f"fsdp2-multinode-{uuid.uuid4().hex[:8]}",
        "--log-dir", os.path.join(out_dir, "torchelastic"),  # not a new folder in /tmp
        SCRIPT, out_dir,
    ]  # fmt: skip
    agents: list[subprocess.Popen] = []
    failure = None
    try:
        for node in range(NUM_NODES):
            with open(os.path.join(out_dir, f"agent{node}.log"), "w") as log:
                agents.append(
                    subprocess.Popen(
                        command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        for node, proc in enumerate(agents):
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failure = f"the two-node launch did not finish within {TIMEOUT_S} s"
                break
            if code != 0:
                failure = f"agent {node} exited with code {code}"
                break
    finally:
        if failure is not None or any(p.poll() is None for p in agents):
            _stop(agents, out_dir)
    if failure is not None:
        pytest.fail(f"{failure}\n{_log_tails(out_dir)}", pytrace=False)
    results = []
    for rank in range(WORLD_SIZE):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        assert os.path.exists(path), f"rank {rank} wrote no result\n{_log_tails(out_dir)}"
        results.append(torch.load(path, weights_only=True))
    return [p.pid for p in agents], results


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    return _launch_two_nodes(str(tmp_path_factory.mktemp("multinode")))


def _node_of(results: list[dict]) -> dict[int, int]:
    return {rank: int(r["env"]["GROUP_RANK"]) for rank, r in enumerate(results)}


def test_each_agent_is_one_node_of_consecutive_ranks(two_nodes):
    """Each agent's workers get LOCAL_RANK 0, 1 and one GROUP_RANK; node g holds ranks 2g, 2g+1."""
    agent_pids, results = two_nodes
    for rank, r in enumerate(results):
        assert r["dist_rank"] == rank == int(r["env"]["RANK"]), r
        assert r["env"]["WORLD_SIZE"] == str(WORLD_SIZE), r["env"]
        assert r["env"]["LOCAL_WORLD_SIZE"] == str(PER_NODE), r["env"]
    group_ranks = []
    for pid in agent_pids:
        mine = {rank: r["env"] for rank, r in enumerate(results) if r["agent_pid"] == pid}
        assert len(mine) == PER_NODE, (pid, mine)
        (node,) = {int(env["GROUP_RANK"]) for env in mine.values()}
        assert sorted(int(env["LOCAL_RANK"]) for env in mine.values()) == list(range(PER_NODE))
        assert sorted(mine) == [node * PER_NODE + i for i in range(PER_NODE)], (node, mine)
        for rank, env in mine.items():
            assert rank == node * PER_NODE + int(env["LOCAL_RANK"]), (rank, env)
        group_ranks.append(node)
    assert sorted(group_ranks) == list(range(NUM_NODES)), group_ranks


def test_shard_collectives_stay_inside_a_node(two_nodes):
    """All-gathers and reduce-scatters run among one node's ranks; only all-reduces cross nodes."""
    _, results = two_nodes
    node_of = _node_of(results)
    for rank, r in enumerate(results):
        assert {kind for kind, _ in r["groups"]} == {"all_gather", "reduce_scatter", "all_reduce"}
        for kind, ranks in r["groups"]:
            assert rank in ranks, (rank, kind, ranks)
            nodes = sorted(node_of[member] for member in ranks)
            if kind == "all_reduce":  # over "replicate": this rank's peer on every node
                assert nodes == list(range(NUM_NODES)), (rank, kind, ranks)
            else:  # over "shard": the ranks of this rank's own node
                assert nodes == [node_of[rank]] * PER_NODE, (rank, kind, ranks)


def test_two_node_run_matches_one_launch(two_nodes):
    """Two agents give bitwise the losses, parameters and collectives of one 4-rank launch."""
    _, results = two_nodes
    single = run_ranks(script.train, WORLD_SIZE, backend="gloo")  # torchrun's agents run gloo
    # Same ranks, same groups, same gloo algorithms: only the launch path differs.
    assert [r["losses"] for r in results] == [s["losses"] for s in single]
    assert [r["groups"] for r in results] == [s["groups"] for s in single]
    params, expected = results[0]["params"], single[0]["params"]
    assert list(params) == list(expected)
    for name, value in expected.items():
        assert torch.equal(params[name], value), name


def test_two_node_run_matches_unsharded_training(two_nodes):
    """Losses and final parameters match full-batch training of the plain model (rtol 1e-5)."""
    _, results = two_nodes
    model = build_transformer(seed=script.SEED)
    optim = torch.optim.AdamW(model.parameters(), lr=script.LR)
    losses = []
    for step in range(script.STEPS):
        loss = transformer_loss(model, script.batch(step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=RTOL, atol=ATOL)
    params = results[0]["params"]
    assert sorted(params) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=RTOL, atol=ATOL, msg=name)
