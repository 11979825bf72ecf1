"""The one rule for claim files (fsdp2/claim_file.py) and the one agree-or-raise (fsdp2/agree.py).

Both checkpoint roots and the NVMe optimizer-state tier claim folders through
``ClaimFile``; everything that must fail on every rank together goes through
``agree``. These tests pin the rule itself: live, dead, zombie, reused-pid,
torn and other-host owners; one error on every rank, mismatched arguments,
and what a rank that succeeded gives back.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from _multiproc import run_ranks

from fsdp2.agree import agree
from fsdp2.claim_file import ClaimFile, OwnerStatus, owner_status, start_time

pytestmark = pytest.mark.torch_independent  # the same on every torch: CI runs it once


def _record(pid, **extra):
    return {"host": socket.gethostname(), "pid": pid, "started": start_time(pid), **extra}


def test_owner_status_of_each_kind_of_owner():
    me = os.getpid()
    assert owner_status(_record(me, token="t"), "t") is OwnerStatus.MINE
    assert owner_status(_record(me, token="other"), "t") is OwnerStatus.LIVE
    assert owner_status({**_record(me), "host": "another-host"}) is OwnerStatus.ELSEWHERE
    # the pid is reused by a newer process: its start time differs
    assert owner_status({**_record(me), "started": start_time(me) - 1}) is OwnerStatus.GONE
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert owner_status(_record(dead.pid)) is OwnerStatus.GONE
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    record = _record(zombie.pid)
    time.sleep(0.5)  # exited, not yet waited for: a zombie
    try:
        assert owner_status(record) is OwnerStatus.GONE
    finally:
        zombie.wait()
    assert owner_status({"pid": "garbage", "host": socket.gethostname()}) is OwnerStatus.GONE


def test_take_replaces_only_a_gone_owner(tmp_path):
    path = tmp_path / "OWNER"
    first = ClaimFile(path, "first", model="a")
    first.take(lambda owner: None)
    assert json.loads(path.read_text())["model"] == "a"
    first.take(lambda owner: pytest.fail("our own claim is never refused"))  # MINE
    second = ClaimFile(path, "second")
    seen = []
    with pytest.raises(RuntimeError, match="held by"):  # refuse said nothing: still refused
        second.take(lambda owner: seen.append(owner.status))
    assert seen == [OwnerStatus.LIVE]
    with pytest.raises(KeyError):  # the caller's own error class
        second.take(lambda owner: KeyError("busy"))
    first.release()
    assert not path.exists()
    path.write_text('{"host": "')  # torn by a killed writer: gone
    second.take(lambda owner: None)
    assert json.loads(path.read_text())["token"] == "second"
    second.release()
    second.release()  # twice is harmless


def test_release_leaves_another_owners_claim(tmp_path):
    path = tmp_path / "OWNER"
    mine = ClaimFile(path, "mine")
    mine.take(lambda owner: None)
    path.write_text(json.dumps(_record(os.getpid(), token="newer")))  # taken over meanwhile
    mine.release()
    assert path.exists()


def _agree_body(rank, world_size, case):
    undone = []
    if case == "one_fails":
        def make():
            if rank == world_size - 1:
                raise OSError("disk full")
            return f"store{rank}"
        with pytest.raises(KeyError) as info:
            agree("making stores", make, every_rank=True, error_type=KeyError,
                  undo=undone.append, hint=" (free space)")
        return str(info.value), undone
    if case == "rank0_value":
        return agree("listing", lambda: [rank, 7]), undone
    if case == "keys_differ":
        with pytest.raises(ValueError, match="different arguments") as info:
            agree("saving", lambda: None, key=("step", rank % 2))
        return str(info.value), undone
    raise AssertionError(case)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_agree_one_error_on_every_rank(world_size):
    out = run_ranks(_agree_body, world_size, "one_fails")
    if world_size == 1:
        assert out == [("'making stores: OSError: disk full (free space)'", [])]
        return
    last = world_size - 1
    messages = {m for m, _ in out}
    assert messages == {f"'making stores: rank {last}: OSError: disk full (free space)'"}, messages
    # the ranks whose own store was made close it; the failing one had none
    assert [u for _, u in out] == [[f"store{r}"] if r != last else [] for r in range(world_size)]


def test_agree_returns_rank0s_value_and_checks_keys():
    assert [v for v, _ in run_ranks(_agree_body, 3, "rank0_value")] == [[0, 7]] * 3
    messages = [m for m, _ in run_ranks(_agree_body, 2, "keys_differ")]
    assert messages[0] == messages[1] and "rank 1: ('step', 1)" in messages[0]


def test_agree_without_a_process_group():
    assert not dist.is_initialized()
    assert agree("x", lambda: 5, every_rank=True) == 5
    with pytest.raises(RuntimeError, match="^x: ValueError: bad$"):
        agree("x", lambda: (_ for _ in ()).throw(ValueError("bad")))
