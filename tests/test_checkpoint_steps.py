"""Step checkpoints: atomic saves, keep-last-k, load_latest, async saves, resume after a kill.

The models are sharded by the implementation under test, so
``FSDP2_TEST_IMPL=torch`` runs every check on upstream's ``fully_shard`` too
(the checkpoint helpers use only public DCP and state-dict APIs).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist
from _multiproc import RankError, run_ranks
from checks import (
    ATOL,
    RTOL,
    assert_full_equal,
    full_snapshot,
    sharded_transformer,
    train_span,
)
from models import (
    build_transformer,
    cpu_mesh,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh

from fsdp2 import CheckpointError, load_checkpoint, load_latest, save_checkpoint
from fsdp2.checkpoint.integrity import MANIFEST
from fsdp2.checkpoint.step_dirs import CLAIM


def _names(root):
    """The entries of a checkpoint root, less this job's claim file (see test_checkpoint_lock)
    and the pruned steps still being deleted in the background (``.step-N.deleting``)."""
    return sorted(n for n in os.listdir(root) if n != CLAIM and not n.endswith(".deleting"))


def _barrier_then(rank, fn):
    """Rank 0 runs ``fn`` (a filesystem change) between two barriers."""
    dist.barrier()
    if rank == 0:
        fn()
    dist.barrier()


# ---------------------------------------------------------------- keep-last-k, latest, async


def _gate_writes():
    """Hold every FileSystemWriter write until the returned event is set (at most 60 s)."""
    gate, original = threading.Event(), FileSystemWriter.write_data

    def gated(self, *args, **kwargs):
        assert gate.wait(60), "the gate was never opened"
        return original(self, *args, **kwargs)

    FileSystemWriter.write_data = gated
    return gate


def _keep_body(rank, world_size, root):
    model, optim = sharded_transformer(cpu_mesh())
    assert load_latest(root, model, optim) is None  # no root yet: nothing to load
    snapshots, previous = {}, None
    for step in range(1, 6):
        train_span(model, optim, step - 1, step, rank, world_size)
        snapshots[step] = full_snapshot(model)
        gate = _gate_writes() if step == 5 else None
        pending = save_checkpoint(root, model, optim, step=step, keep=2, extra={"note": step},
                                  async_save=step % 2 == 1)
        assert isinstance(pending, Future) if step % 2 else pending is None
        if previous is not None:  # one save in flight at most: this call waited for it
            assert previous.done() and previous.result() == os.path.join(root, f"step-{step - 1}")
        previous = pending
    # the call returned before step 5 was written; training changes the parameters, then
    # the write goes on: it must write the copy taken at the call
    assert not pending.done()
    train_span(model, optim, 5, 6, rank, world_size)
    gate.set()
    assert pending.result() == os.path.join(root, "step-5")
    assert _names(root) == ["step-4", "step-5"], os.listdir(root)

    fresh, fresh_optim = sharded_transformer(cpu_mesh(), seed=32)
    extra = {"note": 0}
    assert load_latest(root, fresh, fresh_optim, extra=extra) == 5
    assert extra["note"] == 5
    assert_full_equal(fresh, snapshots[5])  # what was there at the call, bit for bit

    # a folder without DCP's metadata (a save that did not finish) never loads
    _barrier_then(rank, lambda: os.remove(os.path.join(root, "step-5", ".metadata")))
    with pytest.raises(ValueError, match=r"step-5 is damaged.* load_latest\(root\).*"
                                         r"\n  rank 0: \.metadata: missing"):
        load_checkpoint(os.path.join(root, "step-5"), fresh, fresh_optim)
    assert load_latest(root, fresh, fresh_optim, extra=extra) == 4
    assert extra["note"] == 4
    assert_full_equal(fresh, snapshots[4])


def test_keep_last_k_load_latest_and_async_saves(tmp_path):
    """keep=2 leaves the 2 newest steps; load_latest loads the newest complete one, as it was at the call."""
    run_ranks(_keep_body, 2, str(tmp_path / "ckpt"))


def test_save_checkpoint_rejects_bad_step_and_keep(tmp_path):
    """A negative step, keep < 1 or keep without step: ValueError before anything is written."""
    model = build_transformer(seed=1)
    for kwargs, pattern in [
        ({"step": -1}, "step must be an int >= 0, got -1"),
        ({"step": 3, "keep": 0}, "keep must be an int >= 1 or None, got 0"),
        ({"keep": 2}, r"keep needs step"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            save_checkpoint(tmp_path / "ckpt", model, **kwargs)
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------- killed mid-save, resumed


def _kill_self_after(cls, method):
    """Make ``cls.method`` do its work, then SIGKILL this process (a known point in the save)."""
    original = getattr(cls, method)

    def killed(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if isinstance(result, Future):
            result.result()  # the files are written
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(cls, method, killed)


# where the save dies: (rank, FileSystemWriter method, async_save)
_KILL_POINTS = {
    "rank1_in_async_write": (1, "write_data", True),  # its data file written, no metadata
    "rank0_before_rename": (0, "finish", False),  # every file and the metadata written
}


def _uninterrupted_body(rank, world_size):
    model, optim = sharded_transformer(cpu_mesh())
    return train_span(model, optim, 0, 6, rank, world_size)


def _killed_body(rank, world_size, root, point):
    victim, method, async_save = _KILL_POINTS[point]
    model, optim = sharded_transformer(cpu_mesh())
    train_span(model, optim, 0, 2, rank, world_size)
    save_checkpoint(root, model, optim, step=2)
    train_span(model, optim, 2, 4, rank, world_size)
    if rank == victim:
        _kill_self_after(FileSystemWriter, method)
    pending = save_checkpoint(root, model, optim, step=4, async_save=async_save)
    train_span(model, optim, 4, 5, rank, world_size)
    if pending is not None:
        pending.result()


def _resume_body(rank, world_size, root):
    model, optim = sharded_transformer(cpu_mesh(), seed=33)
    assert load_latest(root, model, optim) == 2  # the killed step 4 is not a checkpoint
    losses = train_span(model, optim, 2, 4, rank, world_size)
    save_checkpoint(root, model, optim, step=4, keep=2)  # over the killed save's leftovers
    assert _names(root) == ["step-2", "step-4"], os.listdir(root)
    return losses + train_span(model, optim, 4, 6, rank, world_size)


_uninterrupted: list = []


@pytest.mark.parametrize("point", sorted(_KILL_POINTS))
def test_a_rank_killed_mid_save_resumes_from_the_previous_step(tmp_path, point):
    """SIGKILL of one rank inside a save: load_latest resumes from the step before; losses equal an unbroken run's bit for bit."""
    root = str(tmp_path / "ckpt")
    with pytest.raises(RankError, match=f"rank {_KILL_POINTS[point][0]} exited with code -9"):
        run_ranks(_killed_body, 2, root, point, timeout=60)
    leftover = os.path.join(root, ".step-4.partial")
    assert _names(root) == [".step-4.partial", "step-2"], os.listdir(root)
    assert os.path.isfile(os.path.join(leftover, ".metadata")) == (point == "rank0_before_rename")
    if not _uninterrupted:
        _uninterrupted.extend(run_ranks(_uninterrupted_body, 2))
    resumed = run_ranks(_resume_body, 2, root)
    for rank, losses in enumerate(resumed):
        assert losses == _uninterrupted[rank][2:], (rank, losses, _uninterrupted[rank])


# ---------------------------------------------------------------- another world size, HSDP


def _hsdp_save_body(rank, world_size, root):
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model, optim = sharded_transformer(mesh)
    train_span(model, optim, 0, 2, rank, world_size)
    saved = full_snapshot(model)
    pending = save_checkpoint(root, model, optim, step=2, keep=1, async_save=True)
    losses = train_span(model, optim, 2, 4, rank, world_size, mean=True)
    pending.result()
    return saved, losses


def _fsdp_resume_body(rank, world_size, root, saved, uninterrupted):
    model, optim = sharded_transformer(cpu_mesh(), seed=34)
    assert load_latest(root, model, optim) == 2
    assert_full_equal(model, saved)
    losses = train_span(model, optim, 2, 4, rank, world_size, mean=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted),
                               rtol=RTOL, atol=ATOL)


def test_async_hsdp_save_at_4_ranks_resumes_at_2(tmp_path):
    """An async save of HSDP (2 x 2) at W=4, load_latest at W=2 (FSDP): same parameters, same next losses."""
    root = str(tmp_path / "ckpt")
    saved, losses = run_ranks(_hsdp_save_body, 4, root)[0]
    run_ranks(_fsdp_resume_body, 2, root, saved, losses)


# ---------------------------------------------------------------- disk full, unwritable, mismatch


def _errors_body(rank, world_size, root, blocked):
    model, optim = sharded_transformer(cpu_mesh())
    train_span(model, optim, 0, 1, rank, world_size)
    save_checkpoint(root, model, optim, step=1)
    kept = full_snapshot(model)
    train_span(model, optim, 1, 2, rank, world_size)
    messages = []

    original = FileSystemWriter.write_data

    def disk_full(self, *args, **kwargs):
        if rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return original(self, *args, **kwargs)

    FileSystemWriter.write_data = disk_full
    try:
        for async_save in (False, True):
            with pytest.raises(CheckpointError) as info:  # an Exception, DCP's as the cause
                pending = save_checkpoint(root, model, optim, step=2, keep=1,
                                          async_save=async_save)
                if pending is not None:
                    pending.result()
            assert isinstance(info.value.__cause__, CheckpointException), info.value.__cause__
            messages.append(str(info.value))
    finally:
        FileSystemWriter.write_data = original
    assert _names(root) == ["step-1"], os.listdir(root)  # no leftover either

    with pytest.raises(RuntimeError) as info:  # a file where a folder should be
        save_checkpoint(os.path.join(blocked, "ckpt"), model, optim, step=2)
    messages.append(str(info.value))
    for kwargs in ({"step": 2 + rank}, {"step": 2, "async_save": rank == 0}):
        with pytest.raises(ValueError) as info:
            save_checkpoint(root, model, optim, **kwargs)
        messages.append(str(info.value))

    fresh, fresh_optim = sharded_transformer(cpu_mesh(), seed=35)
    assert load_latest(root, fresh, fresh_optim) == 1
    assert_full_equal(fresh, kept)
    return messages


def test_write_errors_raise_the_same_error_on_every_rank_and_keep_the_previous_step(tmp_path):
    """Disk full on one rank (sync, async), an unwritable root, mismatched arguments: one error everywhere, step 1 kept."""
    root, blocked = str(tmp_path / "ckpt"), tmp_path / "a_file"
    blocked.write_text("not a folder")
    messages = run_ranks(_errors_body, 2, root, str(blocked))
    assert messages[0] == messages[1]  # the same error on every rank
    full_sync, full_async, unwritable, steps, modes = messages[0]
    step2 = os.path.join(root, "step-2")
    for message in (full_sync, full_async):
        assert f"writing {step2} failed" in message, message
        assert "rank 1: OSError: [Errno 28] No space left on device" in message, message
        assert "earlier checkpoints are as they were" in message, message
    assert f"cannot write into {blocked}" in unwritable and "NotADirectoryError" in unwritable
    assert "writable" in unwritable, unwritable
    assert "rank 0: (2, None, False, True, 'step-2'), rank 1: (3, None, False, True, 'step-3')" in steps
    assert "rank 0: (2, None, True, True, 'step-2'), rank 1: (2, None, False, True, 'step-2')" in modes


# ---------------------------------------------------------------- the guide's example

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "docs", "checkpoints.md")


def _readme_blocks():
    """The Python blocks of docs/checkpoints.md's first section, in order."""
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("\n## Sharded checkpoints, to resume training\n"):]
    section = section[: section.index("\n### ", 1)]
    return re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)


def _readme_body(rank, world_size, workdir, num_steps):
    os.chdir(workdir)  # the second block saves to a relative path
    model, optim = sharded_transformer(cpu_mesh())
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda i: 1.0 / (1 + i))
    losses = []

    def train_step(step):
        losses.extend(train_span(model, optim, step - 1, step, rank, world_size))
        sched.step()

    first, second = _readme_blocks()[:2]
    env = {"model": model, "optim": optim, "sched": sched, "train_step": train_step,
           "ckpt_dir": "steps", "num_steps": num_steps, "save_every": 1}
    exec(first, env)
    exec(second, env)  # the page goes on: same names
    return losses, sched.last_epoch


def test_readme_checkpoint_example_runs_and_resumes(tmp_path):
    """docs/checkpoints.md's calls: 4 steps, then a restart to 6 resumes at 4 with an unbroken run's losses; 3 newest kept."""
    workdir = str(tmp_path)
    first = run_ranks(_readme_body, 2, workdir, 4)
    second = run_ranks(_readme_body, 2, workdir, 6)
    (tmp_path / "unbroken").mkdir()
    unbroken = run_ranks(_readme_body, 2, str(tmp_path / "unbroken"), 6)
    for rank in range(2):
        assert first[rank][0] + second[rank][0] == unbroken[rank][0], rank
        assert second[rank][1] == 6  # the scheduler came back at step 4 and went on
    assert _names(tmp_path / "steps") == ["step-4", "step-5", "step-6"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["best"]


def test_one_process_without_a_process_group(tmp_path):
    """No init_process_group: sync and async saves, keep and load_latest work on a plain module."""
    model = build_transformer(seed=36)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    save_checkpoint(tmp_path, model, optim, step=1, keep=1)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    pending = save_checkpoint(tmp_path, model, optim, step=2, keep=1, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # after the call: not in the checkpoint
    assert pending.result() == str(tmp_path / "step-2")
    assert _names(tmp_path) == ["step-2"]
    fresh = build_transformer(seed=37)
    assert load_latest(tmp_path, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2)) == 2
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(p.detach(), saved[name], rtol=0, atol=0, msg=name)
    save_checkpoint(tmp_path, model, optim, step=3, keep=1)  # prunes step 2 in the background
    from fsdp2.checkpoint import step_dirs

    step_dirs._wait_for_deletions()  # (what a normal exit does too)
    assert sorted(os.listdir(tmp_path)) == [CLAIM, "step-3"]  # deleted, not only hidden


def _async_save_body(rank, world_size, root):
    model, optim = sharded_transformer(cpu_mesh())
    return save_checkpoint(root, model, optim, step=1, async_save=True).result()


def test_forked_ranks_save_after_the_parent_did(tmp_path):
    """An async save in this process, then forked ranks save async: the child's writer is its own."""
    model = build_transformer(seed=38)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    save_checkpoint(tmp_path / "parent", model, optim, step=1, async_save=True).result()
    root = str(tmp_path / "ranks")
    assert run_ranks(_async_save_body, 2, root, timeout=60) == [os.path.join(root, "step-1")] * 2


_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list",
                       "scatter_object_list", "all_gather", "all_reduce", "barrier")


def _counting(calls: list):
    """Patch the process-group calls DCP and fsdp2 make; each call appends its name."""
    patches = []
    for name in _OBJECT_COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        patches.append((name, original))
        setattr(dist, name, counted)
    return patches


def _save_collectives_body(rank, world_size, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = sharded_transformer(cpu_mesh())
    train_span(model, optim, 0, 1, rank, world_size)
    counts = {}
    for kind in ("dcp", "fsdp2", "fsdp2"):  # the second fsdp2 save also prunes the first
        calls: list = []
        patches = _counting(calls)
        try:
            if kind == "dcp":
                model_sd, optim_sd = get_state_dict(model, optim)
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/plain")
            else:
                save_checkpoint(root, model, optim, step=len(counts), keep=1)
        finally:
            for name, original in patches:
                setattr(dist, name, original)
        counts[kind if kind not in counts else "fsdp2 again"] = calls
    return counts


def test_a_save_adds_one_collective_to_dcp_and_commits_inside_its_last(tmp_path):
    """The manifest and the commit run on the coordinator inside DCP's last step (see [Note:
    Committing inside DCP's last step]): a save's collectives are DCP's and, before the write,
    the one that checks every rank's arguments; none follows the write."""
    root = str(tmp_path)
    for counts in run_ranks(_save_collectives_body, 2, root):
        plain = counts["dcp"]
        for ours in (counts["fsdp2"], counts["fsdp2 again"]):
            assert len(ours) == len(plain) + 1, (ours, plain)
            assert ours[1:] == plain, (ours, plain)  # the argument check comes first
    assert _names(root) == ["plain", "step-2"]  # step 1 pruned (keep=1)
    assert (tmp_path / "step-2" / MANIFEST).is_file()


def test_the_disk_write_starts_while_the_file_is_still_being_written(tmp_path, monkeypatch):
    """[Note: Early write-back]: every CHUNK bytes, the write-back of the bytes written so far
    starts (front to back, nothing skipped), all before the file's one fsync; what lands on
    disk is what was saved, and its recorded checksum is the file's."""
    import sys

    import torch.distributed.checkpoint as dcp

    from fsdp2.checkpoint import integrity, writeback
    from fsdp2.checkpoint.summing import SummingWriter

    if sys.platform.startswith("linux"):
        assert writeback.supported()  # the machines CI runs on can start it
    else:
        pytest.skip("sync_file_range is Linux's")
    events = []
    monkeypatch.setattr(writeback, "CHUNK", 1 << 20)
    monkeypatch.setattr(writeback, "_start", lambda fd, off, n: events.append(("start", off, n)))
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync",)), real_fsync(fd)))
    state = {f"t{i}": torch.randn(1 << 18) for i in range(6)}  # 1 MiB each
    writer = SummingWriter(tmp_path)
    dcp.save(state, storage_writer=writer)

    data = [name for name in os.listdir(tmp_path) if name.endswith(".distcp")]
    assert len(data) == 1
    size = os.path.getsize(tmp_path / data[0])
    starts = [e for e in events if e[0] == "start"]
    assert len(starts) >= 5, events
    assert starts[0][1] == 0 and all(n >= writeback.CHUNK for _, _, n in starts)
    assert all(a[1] + a[2] == b[1] for a, b in zip(starts, starts[1:])), starts  # contiguous
    assert starts[-1][1] + starts[-1][2] > size - writeback.CHUNK  # only the tail was left
    assert events.index(("fsync",)) > events.index(starts[-1])  # the sync still comes last
    assert writer.sums()[data[0]] == list(integrity.checksum(tmp_path / data[0], writer.algorithm))
    loaded = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=tmp_path)
    assert all(torch.equal(loaded[k], state[k]) for k in state)

    # save_checkpoint(checksums=False) writes through DCP's writer: early all the same
    events.clear()
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(6)])
    save_checkpoint(tmp_path / "plain", model, checksums=False)
    starts = [e for e in events if e[0] == "start"]
    assert len(starts) >= 5 and events.index(("fsync",)) > events.index(starts[-1]), events
    assert not (tmp_path / "plain" / MANIFEST).exists()
    again = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(6)])
    load_checkpoint(tmp_path / "plain", again)
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(model, again))


def test_the_write_back_call_is_the_kernels(tmp_path):
    """The real ``sync_file_range`` accepts a written file's range (no stand-in)."""
    import sys

    from fsdp2.checkpoint import writeback

    if not sys.platform.startswith("linux"):
        assert not writeback.supported()
        return
    n = writeback.CHUNK + 10
    with open(tmp_path / "a", "wb") as f:
        f.write(b"x" * n)
        f.flush()
        assert writeback._start(f.fileno(), 0, n) == 0
    with open(tmp_path / "b", "wb") as f:
        stream = writeback.WritebackStream(f)
        stream.write(b"y" * n)
        assert stream._done == n  # started through the real call
    assert (tmp_path / "b").read_bytes() == b"y" * n


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
def test_checksum_maps_windows_and_reads_where_it_cannot_map(tmp_path, monkeypatch, algorithm):
    """``integrity.checksum`` (a window of the file mapped at a time) is the algorithm's CRC of
    the whole file: empty, inside one window, across windows; and through plain reads where
    the file system cannot map files."""
    import mmap
    import zlib

    import crc32c

    from fsdp2.checkpoint import integrity

    whole = {"crc32": zlib.crc32, "crc32c": crc32c.crc32c}[algorithm]
    monkeypatch.setattr(integrity, "_WINDOW", mmap.ALLOCATIONGRANULARITY)
    data = os.urandom(3 * mmap.ALLOCATIONGRANULARITY + 5)
    for n in (0, 1, mmap.ALLOCATIONGRANULARITY, len(data)):
        (tmp_path / f"f{n}").write_bytes(data[:n])
        assert integrity.checksum(tmp_path / f"f{n}", algorithm) == (n, whole(data[:n])), n

    def no_mapping(*args, **kwargs):
        raise OSError("mmap: not supported here")

    monkeypatch.setattr(mmap, "mmap", no_mapping)
    assert integrity.checksum(tmp_path / f"f{len(data)}", algorithm) == (len(data), whole(data))
