"""torchft heals a killed replica group from the live one, with fsdp2 as with upstream.

torchft (fault-tolerant HSDP) runs one FSDP model per replica group; when a
group restarts, it fetches the live group's state dict through a checkpoint
transport: ``PGTransport`` sends each tensor's storage through a process
group (received in place into the restarted group's state dict),
``HTTPTransport`` serves it with ``torch.save``. Four ranks: two replica
groups of two shard ranks each. Replica group 1 is killed (rebuilt from
another seed, fresh optimizer), heals from group 0 through one transport, and
must then hold group 0's exact values and keep training in step with it. The
same launch repeats the run on upstream's ``fully_shard``: the bytes each
transport carried must be equal.
"""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as upstream
from _impl import fully_shard
from checks import check_case, train_alone
from models import build_transformer, shard_transformer, transformer_batch, transformer_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

torchft = pytest.importorskip("torchft", reason="torchft is a test dependency (pip install -e '.[test]')")
from torchft.checkpointing import http_transport  # noqa: E402
from torchft.checkpointing.pg_transport import PGTransport  # noqa: E402

TIMEOUT = timedelta(seconds=60)
STEP = 3


class _CountingPG:
    """The replicate process group, counting the bytes ``PGTransport`` sends through it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.sent = 0

    def send(self, tensors, dst, tag):
        self.sent += sum(t.numel() * t.element_size() for t in tensors)
        return self.group.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self.group.recv(tensors, src, tag)


class _CountingReader(io.RawIOBase):
    """An HTTP response body, counting the bytes read from it."""

    def __init__(self, f) -> None:
        self.f, self.read_bytes = f, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        data = self.f.read(len(buf))
        buf[: len(data)] = data
        self.read_bytes += len(data)
        return len(data)


def _train_whole_batches(model, opt, steps: range) -> None:
    """Every rank of a replica group steps on the whole batch of each step."""
    train_alone(model, [transformer_batch(step, 4) for step in steps], transformer_loss, opt=opt)


def _replica(shard, mesh, seed: int):
    model = shard_transformer(build_transformer(seed=seed), shard, mesh=mesh["shard"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _locals(model) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _heal(shard, transport: str) -> int:
    """Kill replica group 1, heal it from group 0; returns the bytes the transport carried."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    replica = mesh.get_local_rank("replica")
    model, opt = _replica(shard, mesh, seed=0)
    _train_whole_batches(model, opt, range(STEP))  # both groups train the same steps
    if replica == 1:  # killed and restarted: other values, no optimizer state
        model, opt = _replica(shard, mesh, seed=1)
    carried = torch.zeros(1, dtype=torch.int64)
    if transport == "pg":
        pg = _CountingPG(mesh.get_group("replica"))
        ft = PGTransport(pg, TIMEOUT, torch.device("cpu"), state_dict=lambda: _state(model, opt))
        if replica == 0:
            ft.send_checkpoint([1], STEP, _state(model, opt), TIMEOUT)
            carried += pg.sent
        else:
            healed = ft.recv_checkpoint(0, "<n/a>", STEP, TIMEOUT)
    else:
        ft = http_transport.HTTPTransport(TIMEOUT, num_chunks=0)
        try:
            address = [ft.metadata() if replica == 0 else None]
            dist.broadcast_object_list(address, group=mesh.get_group("replica"), group_src=0)
            if replica == 0:
                ft.send_checkpoint([1], STEP, _state(model, opt), TIMEOUT)
            else:
                load, readers = http_transport._streaming_load, []

                def counting_load(f, **kwargs):
                    readers.append(_CountingReader(f))
                    return load(io.BufferedReader(readers[-1]), **kwargs)

                http_transport._streaming_load = counting_load
                try:
                    healed = ft.recv_checkpoint(0, address[0], STEP, TIMEOUT)
                finally:
                    http_transport._streaming_load = load
                carried += sum(r.read_bytes for r in readers)
            dist.barrier()  # the server stays up until the replica has read it all
        finally:
            ft.shutdown()
    if replica == 1:
        model.load_state_dict(healed["model"])
        opt.load_state_dict(healed["optim"])
        for p in model.parameters():
            assert isinstance(p, DTensor) and p.to_local().device.type == "cpu"
    # healed: same values as the live group, and in step with it afterwards
    for step in (STEP, STEP + 1):
        gathered = [None, None]
        dist.all_gather_object(gathered, _locals(model), group=mesh.get_group("replica"))
        for i, (live, healed_t) in enumerate(zip(*gathered)):
            assert torch.equal(live, healed_t), f"{transport}: parameter {i} after step {step}"
        _train_whole_batches(model, opt, range(step, step + 1))
    dist.all_reduce(carried)
    return int(carried)


def _heals(transport: str):
    def case(rank: int, world_size: int) -> None:
        ours = _heal(fully_shard, transport)
        theirs = _heal(upstream.fully_shard, transport)
        assert ours == theirs, f"{transport}: carried {ours} B, upstream {theirs} B"

    return case


def _cached_heals(shard) -> list[torch.Tensor]:
    """torchtitan's fault-tolerance flow: each group heals from the other's *cached* state dict.

    As torchtitan's FT optimizer container does, every replica group takes
    ``get_state_dict`` once after init and again after each load, and serves
    that cached dict: only the optimizer updating the very tensors it holds
    (in place) keeps it current. Group 1 is killed after step 3 and heals from
    group 0 at step 6 (PG transport, received in place into its own cached
    dict, then ``set_state_dict``); group 0 is killed at step 8 and heals from
    group 1's cache, taken right after group 1's load. Returns the final
    parameters (local shards).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    replica = mesh.get_local_rank("replica")
    group = mesh.get_group("replica")

    def start(seed: int):
        model, opt = _replica(shard, mesh, seed=seed)
        model_sd, optim_sd = get_state_dict(model, opt)  # initializes the state (a zero step)
        return model, opt, {"model": model_sd, "optim": optim_sd}

    model, opt, cache = start(seed=0)
    done = STEP  # steps the live group has taken
    _train_whole_batches(model, opt, range(done))
    for killed, step in ((1, 6), (0, 8)):
        if replica == killed:  # restarted: another seed, a fresh optimizer and cache
            model, opt, cache = start(seed=7)
        else:
            _train_whole_batches(model, opt, range(done, step))
        ft = PGTransport(group, TIMEOUT, torch.device("cpu"), state_dict=lambda cache=cache: cache)
        if replica == killed:
            healed = ft.recv_checkpoint(1 - killed, "<n/a>", step, TIMEOUT)
            set_state_dict(model, opt, model_state_dict=healed["model"],
                           optim_state_dict=healed["optim"])
            model_sd, optim_sd = get_state_dict(model, opt)  # cached again after the load
            cache = {"model": model_sd, "optim": optim_sd}
        else:
            ft.send_checkpoint([killed], step, cache, TIMEOUT)
        _train_whole_batches(model, opt, range(step, step + 2))
        done = step + 2
    gathered = [None, None]
    dist.all_gather_object(gathered, _locals(model), group=group)
    for i, (a, b) in enumerate(zip(*gathered)):
        assert torch.equal(a, b), f"parameter {i}: the replica groups differ after healing"
    return _locals(model)


def _cached(rank: int, world_size: int) -> None:
    ours = _cached_heals(fully_shard)
    theirs = _cached_heals(upstream.fully_shard)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"parameter {i}: differs from upstream's healed run"


_CASES = {"pg": _heals("pg"), "http": _heals("http"), "cached-state-dict": _cached}


@pytest.mark.parametrize("transport", list(_CASES))
def test_torchft_heals_replica_group(transport: str, launch_cases) -> None:
    """A killed replica group heals through torchft's transport, carrying upstream's bytes;
    healed from a cached state dict, both groups end bitwise equal and equal to upstream."""
    check_case(launch_cases(4, _CASES, timeout=180), transport)
