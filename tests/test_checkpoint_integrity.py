"""Checkpoints you can trust after a bad disk: checksums, fallback to the newest intact step, one job per root.

Each damage kind (a data file truncated to half or to 0 bytes, deleted, 64
bytes flipped in its middle; ``.metadata`` garbled, resized or deleted; the
checksum manifest garbled; and, for checkpoints written before checksums, a
truncated file and a garbled ``.metadata``) is made to the newest of two
steps at W=2: ``load_checkpoint`` raises the same ``CheckpointDamagedError``
on every rank naming the file, ``load_latest`` warns and resumes from the
older step, and training on from there is bit-identical to the undamaged
run. Then HSDP (2 x 2), the ``verify`` function and command, and the root
claim (two live jobs, a claim left by a SIGKILLed job).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist
from _multiproc import run_ranks
from checks import assert_full_equal, full_snapshot, sharded_transformer, train_span
from models import build_transformer, cpu_mesh
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2 import (
    CheckpointDamagedError,
    CheckpointLockedError,
    load_checkpoint,
    load_latest,
    save_checkpoint,
    verify_checkpoint,
)
from fsdp2.checkpoint import crc, step_dirs
from fsdp2.checkpoint.integrity import MANIFEST, checksum
from fsdp2.checkpoint.step_dirs import CLAIM
from fsdp2.checkpoint.verify import main as verify_main

_REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the damage kinds

def _truncate(fraction):
    def damage(step):
        path = step / "__1_0.distcp"
        os.truncate(path, int(path.stat().st_size * fraction))
    return damage


def _flip(step):
    path = step / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def _garble_metadata(resize):
    def damage(step):
        path = step / ".metadata"
        size = 100 if resize else path.stat().st_size
        path.write_bytes(os.urandom(size))
    return damage


def _crc32_manifest(damage):
    """The manifest as fsdp2 wrote it before CRC-32C (zlib's CRC-32), then ``damage``."""
    def both(step):
        data = json.loads((step / MANIFEST).read_text())
        data["algorithm"] = "crc32"
        data["files"] = {name: list(checksum(step / name, "crc32")) for name in data["files"]}
        (step / MANIFEST).write_text(json.dumps(data))
        damage(step)
    return both


def _manifest_algorithm(name):
    def damage(step):
        data = json.loads((step / MANIFEST).read_text())
        data["algorithm"] = name
        (step / MANIFEST).write_text(json.dumps(data))
    return damage


def _legacy(damage):
    def both(step):
        (step / MANIFEST).unlink()  # as written before checksums
        damage(step)
    return both


# kind: (damage to step 8, what the error must say about which file)
DAMAGE = {
    "truncated_half": (_truncate(0.5), "__1_0.distcp: "),
    "truncated_zero": (_truncate(0.0), "__1_0.distcp: 0 bytes"),
    "deleted": (lambda s: (s / "__1_0.distcp").unlink(), "__1_0.distcp: missing"),
    "flipped": (_flip, f"__0_0.distcp: {crc.LABELS[crc.DEFAULT]} "),
    "metadata_garbled": (_garble_metadata(False), f".metadata: {crc.LABELS[crc.DEFAULT]} "),
    "crc32_manifest_flipped": (_crc32_manifest(_flip), "__0_0.distcp: CRC-32 "),
    "manifest_unknown_algorithm": (_manifest_algorithm("md5"), f"{MANIFEST}: unreadable"),
    "metadata_garbled_resized": (_garble_metadata(True), ".metadata: 100 bytes"),
    "metadata_deleted": (lambda s: (s / ".metadata").unlink(), ".metadata: missing"),
    "manifest_garbled": (lambda s: (s / MANIFEST).write_text("{oops"), f"{MANIFEST}: unreadable"),
    "legacy_truncated": (_legacy(_truncate(0.5)), "DCP's metadata needs"),
    "legacy_metadata_garbled": (_legacy(_garble_metadata(True)), ".metadata: unreadable"),
}


def _damage_body(rank, world_size, base):
    base = Path(base)
    model, optim = sharded_transformer(cpu_mesh())
    train_span(model, optim, 0, 7, rank, world_size)
    save_checkpoint(base / "pristine", model, optim, step=7, keep=2)
    at7 = full_snapshot(model)
    train_span(model, optim, 7, 8, rank, world_size)
    save_checkpoint(base / "pristine", model, optim, step=8, keep=2)
    at8 = full_snapshot(model)
    out = {}
    for kind, (damage, _) in DAMAGE.items():
        root = base / kind
        if rank == 0:
            shutil.copytree(base / "pristine", root)
            damage(root / "step-8")
        dist.barrier()
        fresh, fresh_optim = sharded_transformer(cpu_mesh(), seed=35)
        with pytest.raises(CheckpointDamagedError) as info:
            load_checkpoint(root / "step-8", fresh, fresh_optim)
        assert isinstance(info.value, Exception) and not fresh_optim.state
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert load_latest(root, fresh, fresh_optim) == 7, kind
        assert_full_equal(fresh, at7, f"{kind}: loaded")
        train_span(fresh, fresh_optim, 7, 8, rank, world_size)
        assert_full_equal(fresh, at8, f"{kind}: resumed")  # as if nothing had happened
        out[kind] = (str(info.value), [str(w.message) for w in caught])
    # a checkpoint written before checksums (no manifest) still loads
    legacy = base / "legacy"
    if rank == 0:
        shutil.copytree(base / "pristine", legacy)
        (legacy / "step-8" / MANIFEST).unlink()
    dist.barrier()
    fresh, fresh_optim = sharded_transformer(cpu_mesh(), seed=36)
    assert load_latest(legacy, fresh, fresh_optim) == 8
    assert_full_equal(fresh, at8, "legacy")
    # and one whose manifest has zlib's CRC-32 (written before CRC-32C) loads, verified
    older = base / "crc32"
    if rank == 0:
        shutil.copytree(base / "pristine", older)
        _crc32_manifest(lambda step: None)(older / "step-8")
    dist.barrier()
    fresh, fresh_optim = sharded_transformer(cpu_mesh(), seed=37)
    assert load_latest(older, fresh, fresh_optim) == 8
    assert_full_equal(fresh, at8, "crc32 manifest")
    out["recorded"] = json.loads((base / "pristine" / "step-8" / MANIFEST).read_text())["algorithm"]
    return out


def test_every_damage_kind_is_detected_and_load_latest_resumes_from_the_intact_step(tmp_path, capsys):
    """W=2, steps 7 and 8, step 8 damaged each way: one error on every rank, fallback to 7, same results."""
    results = run_ranks(_damage_body, 2, str(tmp_path))
    assert results[0] == results[1]  # the same error and warning on every rank
    assert results[0]["recorded"] == crc.DEFAULT
    for kind, (_, names_the_file) in DAMAGE.items():
        message, warned = results[0][kind]
        step8 = str(tmp_path / kind / "step-8")
        assert message.startswith(f"load_checkpoint: {step8} is damaged"), (kind, message)
        assert names_the_file in message and "rank " in message, (kind, message)
        if kind == "metadata_deleted":  # not a complete step: load_latest never considers it
            assert warned == [], warned
            continue
        assert len(warned) == 1 and warned[0].startswith("load_latest: skipping step 8"), warned
        assert names_the_file in warned[0] and "rank " in warned[0], (kind, warned)
    # the same verdict without a process group, as a function and a command
    for kind in DAMAGE:
        report = verify_checkpoint(tmp_path / kind)
        assert report[str(tmp_path / kind / "step-7")] == [], (kind, report)
        assert report[str(tmp_path / kind / "step-8")], (kind, report)
    run = [sys.executable, "-m", "fsdp2.checkpoint.verify"]
    env = {**os.environ, "PYTHONPATH": str(_REPO)}
    bad = subprocess.run([*run, str(tmp_path / "flipped")], capture_output=True, text=True,
                         env=env, cwd=tmp_path)
    assert bad.returncode == 1 and "step-8: DAMAGED" in bad.stdout, bad
    assert "__0_0.distcp: CRC-32" in bad.stdout and "step-7: ok" in bad.stdout, bad.stdout
    # the exit code of an intact one: the command's function, in this process
    assert verify_main([str(tmp_path / "pristine" / "step-8")]) == 0
    assert capsys.readouterr().out.strip().endswith("step-8: ok")


def _every_step_damaged_body(rank, world_size, root):
    model, optim = sharded_transformer(cpu_mesh())
    save_checkpoint(root, model, optim, step=1)
    if rank == 0:
        (Path(root) / "step-1" / "__1_0.distcp").unlink()
    dist.barrier()
    with warnings.catch_warnings(record=True), pytest.raises(CheckpointDamagedError) as info:
        warnings.simplefilter("always")
        load_latest(root, model, optim)
    return str(info.value)


def test_load_latest_raises_when_every_step_is_damaged(tmp_path):
    """No intact step: an error (never a silent fresh start), the same on every rank."""
    messages = run_ranks(_every_step_damaged_body, 2, str(tmp_path))
    assert messages[0] == messages[1] and "every checkpoint under" in messages[0], messages


def _hsdp_body(rank, world_size, root):
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model, optim = sharded_transformer(mesh)
    train_span(model, optim, 0, 1, rank, world_size)
    save_checkpoint(root, model, optim, step=1)
    at1 = full_snapshot(model)
    train_span(model, optim, 1, 2, rank, world_size)
    save_checkpoint(root, model, optim, step=2, async_save=True).result()
    at2 = full_snapshot(model)
    if rank == 0:
        _flip(Path(root) / "step-2")
    dist.barrier()
    fresh, fresh_optim = sharded_transformer(mesh, seed=35)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_latest(root, fresh, fresh_optim) == 1
    assert_full_equal(fresh, at1, "loaded")
    train_span(fresh, fresh_optim, 1, 2, rank, world_size)
    assert_full_equal(fresh, at2, "resumed")
    return [str(w.message) for w in caught]


def test_hsdp_flipped_bytes_fall_back(tmp_path):
    """HSDP 2 x 2 at W=4, async save, flipped bytes in step 2: step 1 loads, training resumes identically."""
    warned = run_ranks(_hsdp_body, 4, str(tmp_path))
    assert all(w == warned[0] for w in warned) and "__0_0.distcp: CRC-32" in warned[0][0], warned


def test_pruning_never_shows_a_half_deleted_step(tmp_path, monkeypatch):
    """A prune that stops after deleting .metadata (killed mid-delete) leaves no step-N without it."""
    model = build_transformer(seed=37)

    def killed_midway(path, ignore_errors=False):
        if os.path.exists(os.path.join(path, ".metadata")):
            os.remove(os.path.join(path, ".metadata"))

    save_checkpoint(tmp_path, model, step=1, keep=1)
    monkeypatch.setattr(step_dirs.shutil, "rmtree", killed_midway)
    save_checkpoint(tmp_path, model, step=2, keep=1)
    visible = [n for n in os.listdir(tmp_path) if n.startswith("step-")]
    assert visible == ["step-2"], os.listdir(tmp_path)
    assert verify_checkpoint(tmp_path) == {str(tmp_path / "step-2"): []}


# ---------------------------------------------------------------- one job per root

_JOB = """
import os, sys, time, torch, fsdp2
fsdp2.save_checkpoint(sys.argv[1], torch.nn.Linear(2, 2), step=1)
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[3]):
    time.sleep(0.05)
"""


def _start_job(tmp_path, root):
    ready, done = tmp_path / "ready", tmp_path / "done"
    job = subprocess.Popen([sys.executable, "-c", _JOB, str(root), str(ready), str(done)],
                           env={**os.environ, "PYTHONPATH": str(_REPO)})
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert job.poll() is None and time.monotonic() < deadline, "the first job did not save"
        time.sleep(0.05)
    return job, done


def _second_job_body(rank, world_size, root):
    model, optim = sharded_transformer(cpu_mesh())
    try:
        save_checkpoint(root, model, optim, step=5)
    except CheckpointLockedError as exc:
        return "locked", str(exc), sorted(os.listdir(root))
    assert load_latest(root, model, optim) == 5
    return "saved", None, sorted(os.listdir(root))


def test_a_second_live_job_is_refused_before_writing(tmp_path):
    """Job A (alive) owns the root: job B (W=2) gets CheckpointLockedError on every rank, writes nothing."""
    root = tmp_path / "root"
    job, done = _start_job(tmp_path, root)
    try:
        results = run_ranks(_second_job_body, 2, str(root))
    finally:
        done.touch()
        job.wait(60)
    assert results[0] == results[1], results
    outcome, message, listing = results[0]
    assert outcome == "locked" and f"pid {job.pid}" in message and str(root) in message, message
    assert listing == [CLAIM, "step-1"], listing  # no .step-5.partial
    assert not (root / CLAIM).exists()  # A released its claim on exit
    assert run_ranks(_second_job_body, 2, str(root))[0][0] == "saved"


def test_a_killed_jobs_claim_does_not_block_a_restart(tmp_path):
    """Job A is SIGKILLed holding the claim (a zombie, then reaped): the restart saves and loads."""
    root = tmp_path / "root"
    job, done = _start_job(tmp_path, root)
    job.send_signal(signal.SIGKILL)
    time.sleep(0.5)  # a zombie until waited for: still gone
    outcome, _, listing = run_ranks(_second_job_body, 2, str(root))[0]
    assert outcome == "saved" and "step-5" in listing, listing
    job.wait(60)


def test_exceptions_are_exceptions():
    """Every checkpoint error class is an Exception (DCP's CheckpointException is a BaseException)."""
    for cls in (fsdp2.CheckpointError, CheckpointDamagedError, CheckpointLockedError):
        assert issubclass(cls, Exception) and issubclass(cls, RuntimeError)
    assert issubclass(CheckpointDamagedError, ValueError)


def test_checksum_algorithms_give_their_check_values_in_any_chunking():
    """CRC-32 and CRC-32C of "123456789" are their catalogued check values, summed whole or in
    pieces; a save on this machine records CRC-32C where the ``crc32c`` package has hardware."""
    data = memoryview(bytearray(b"123456789"))
    for algorithm, check in (("crc32", 0xCBF43926), ("crc32c", 0xE3069283)):
        extend = crc.extender(algorithm)
        assert extend(data, 0) == check
        assert extend(data[4:], extend(data[:4], 0)) == check
    import crc32c  # a dependency of fsdp2
    assert crc.DEFAULT == ("crc32c" if crc32c.hardware_based else "crc32")
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        crc.extender("md5")
