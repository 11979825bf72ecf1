"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), resumable at any world size.

[Note: Sharded checkpoints]
The state is already sharded: ``model.state_dict()`` holds DTensors and so do
the optimizer's states. ``torch.distributed.checkpoint.state_dict`` keys the
optimizer state by parameter name, and DCP writes every rank's shards with
their global offsets, so a checkpoint saved at world size W loads at any W'
(each rank reads the byte ranges its new shards cover). Nothing is gathered.

These functions are that recipe plus what DCP leaves to its users: saves
that become visible only once complete (see [Note: Atomic checkpoints] in
``step_dirs.py``), numbered steps under one root with the newest ``keep``
kept and the newest complete one found again (:func:`load_latest`), saves
written in the background (see [Note: Asynchronous checkpoints] in
``async_save.py``), and the check DCP lacks: before anything is read,
the checkpoint's metadata is compared with the model and optimizer, and
every missing, unexpected or resized tensor is reported by name in one
``ValueError`` (DCP itself ignores tensors the model lacks and stops at the
first problem). Values are read in place into the live parameters and
optimizer states, so only an I/O error while reading can leave a partial load.
Before that, the files themselves are checked against the checksums the save
recorded (see [Note: Checkpoint integrity] in ``integrity.py``): a damaged
step is an error on every rank, and :func:`load_latest` falls back to the
newest intact one. Every error is an ``Exception`` (:class:`CheckpointError`
and its subclasses), DCP's ``BaseException`` kept as the cause.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..agree import agree
from . import integrity
from .async_save import background_group, stage, submit, wait_pending
from .errors import CheckpointDamagedError, CheckpointError
from .step_dirs import (
    commit,
    complete_steps,
    discard,
    partial_dir,
    prepare,
    step_dir,
)

# torch.distributed.checkpoint is imported inside the functions: it adds about
# half a second to `import fsdp2` and most runs never touch it.

__all__ = ["load_checkpoint", "load_latest", "save_checkpoint"]

_MAX_LISTED = 10
_WRITE_HINT = (
    "; nothing was committed and earlier checkpoints are as they were. Check that the "
    "directory is writable and its filesystem has room, or save to another directory"
)


def save_checkpoint(
    checkpoint_id: str | os.PathLike,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    step: int | None = None,
    keep: int | None = None,
    async_save: bool = False,
    checksums: bool = True,
) -> Future[str] | None:
    """Save a sharded checkpoint of ``model`` (and ``optim``); it appears only once complete.

    Collective: every rank calls it and writes its own shards (DCP's format,
    one file per rank plus metadata). ``extra`` holds anything else to resume
    with: values DCP can save (tensors, numbers, ...) and objects with
    ``state_dict``/``load_state_dict`` such as an LR scheduler.

    With ``step``, ``checkpoint_id`` is a root folder and the checkpoint goes
    to ``root/step-{step}``; ``keep=k`` then deletes all but the ``k`` newest
    complete steps, and :func:`load_latest` finds the newest. Without it,
    ``checkpoint_id`` is the checkpoint's own folder (an existing one is
    replaced).

    Every rank writes into a hidden sibling (``.step-N.partial``) that rank 0
    renames once every rank's files are written: a job killed mid-save leaves
    the earlier checkpoints as they were, and nothing that loads.

    With ``async_save=True`` it returns once this rank's state is copied to
    host memory (pinned on GPU), and a background thread writes and commits
    it, on a gloo group of its own, while training goes on. It returns a
    ``Future`` whose ``result()`` is the checkpoint's path, or raises the
    save's error; call it before ``destroy_process_group``. At most one save
    is in flight: the next save or load waits for it first.

    With ``checksums`` (the default) each rank records the size and CRC-32 of
    the files it wrote, in the checkpoint's manifest, which loads verify.
    With ``step``, the first save claims the root for this job: a second
    live job saving into it gets :class:`CheckpointLockedError` before
    writing anything (a crashed job's claim is recognised and replaced).

    Raises:
        ValueError: ``step < 0``, ``keep < 1``, ``keep`` without ``step``, or
            ranks passing different ``step``/``keep``/``async_save``.
        CheckpointError: (a ``RuntimeError``) the folder cannot be written
            (unwritable, disk full, ...): raised on every rank, naming the
            path; earlier checkpoints are kept. Errors of an asynchronous
            write surface from the future (or the next save).
        CheckpointLockedError: another live job owns the root.
    """
    _check_step_args(step, keep)
    wait_pending()
    final = step_dir(checkpoint_id, step) if step is not None else Path(checkpoint_id)
    state = _state(model, optim, extra)
    # On the default group: the ranks must agree on async_save before making its group.
    agree(
        f"save_checkpoint: cannot write into {final.parent}",
        lambda: prepare(final, owned_root=step is not None),
        key=(step, keep, async_save, checksums, final.name),
        error_type=CheckpointError,
        hint=_WRITE_HINT,
    )
    if not async_save:
        _write(state, final, keep, None, checksums)
        return None
    from .streaming import Snapshot

    group = background_group()
    snapshot = Snapshot()  # file-backed state is staged on its disk, not in host memory
    try:
        staged = stage(state, snapshot.copy)
    except BaseException:
        snapshot.close()
        raise
    del state

    def job() -> str:
        try:
            return _write(staged, final, keep, group, checksums)
        finally:
            snapshot.close()

    return submit(job)


def load_latest(
    root: str | os.PathLike,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    strict: bool = True,
    verify: bool = True,
) -> int | None:
    """Load the newest intact ``root/step-N`` written by ``save_checkpoint(root, step=N)``.

    Collective. Returns ``N``, or ``None`` (loading nothing) when ``root``
    holds no complete checkpoint. Leftovers of killed saves are never
    considered. A damaged step (a file missing, truncated or changed: see
    :func:`load_checkpoint`) is skipped with a warning naming the step, the
    file and the rank that saw it, and the next older one is loaded.
    Otherwise as :func:`load_checkpoint`, at any world size.

    Raises:
        CheckpointDamagedError: every complete step under ``root`` is damaged.
    """
    wait_pending()
    # Rank 0 lists the folder for everyone: one answer even if a filesystem
    # shows the ranks different states for a moment.
    steps = agree(f"load_latest: cannot list {root}", lambda: complete_steps(root),
                  error_type=CheckpointError)
    if not steps:
        return None
    skipped = []
    for step in reversed(steps):
        try:
            load_checkpoint(step_dir(root, step), model, optim, extra=extra, strict=strict,
                            verify=verify)
        except CheckpointDamagedError as exc:  # the same on every rank: all skip it
            warnings.warn(f"load_latest: skipping step {step}, it is damaged: {exc}",
                          stacklevel=2)
            skipped.append(step)
            continue
        return step
    raise CheckpointDamagedError(
        f"load_latest: every checkpoint under {os.fspath(root)} is damaged (steps "
        f"{', '.join(map(str, skipped))}); nothing was loaded. See the warnings above, or "
        "run python -m fsdp2.checkpoint.verify on the root"
    )


def load_checkpoint(
    checkpoint_id: str | os.PathLike,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    strict: bool = True,
    verify: bool = True,
) -> None:
    """Load a checkpoint written by :func:`save_checkpoint`, at any world size.

    Collective. The model (sharded with ``fully_shard`` on the new mesh, or
    plain) and the optimizer (built on its parameters) are filled in place.
    ``extra`` must have the keys that were saved: plain values are replaced
    in the dict, objects with ``load_state_dict`` (a scheduler) load theirs.

    First the files are checked against the sizes and checksums the save
    recorded (each rank hashes a share; ``verify=False`` checks sizes only);
    a checkpoint written before fsdp2 recorded checksums is checked for its
    metadata only.

    Raises:
        CheckpointDamagedError: (also a ``ValueError``) the folder is not a
            complete checkpoint (no metadata: a save that did not finish) or
            a file is missing, truncated, changed or unreadable: every
            problem with its file and the rank that saw it, the same on
            every rank; nothing was loaded.
        ValueError: the checkpoint does not match the model or optimizer
            (missing, unexpected or resized tensors, all named); nothing was
            loaded. ``strict=False`` skips model keys missing on either side.
        CheckpointError: (a ``RuntimeError``) DCP failed to read, its error
            as the cause.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from .streaming import StreamingLoadPlanner

    wait_pending()
    path = Path(checkpoint_id)
    saved = _checked_metadata(path, verify)
    model_sd = get_model_state_dict(model)
    problems = _compare("model", model_sd, saved, strict)
    if not strict:
        model_sd = {k: v for k, v in model_sd.items() if f"model.{k}" in saved}
    state: dict[str, Any] = {"model": model_sd}
    if extra:
        state["extra"] = {k: _unpacked_stateful(v) for k, v in extra.items()}
        problems += _compare("extra", state["extra"], saved, strict=True, unexpected=False)
    fresh = optim is not None and not optim.state
    try:
        if optim is not None:
            # Creates the optimizer's states if it has none yet, as targets to read into.
            state["optim"] = get_optimizer_state_dict(model, optim)
            if not any(k.startswith("optim.") for k in saved):
                problems.append("the checkpoint has no optimizer state: pass optim=None")
            else:
                problems += _compare("optim", state["optim"], saved, strict=True)
        if problems:
            raise ValueError(
                f"load_checkpoint: {os.fspath(checkpoint_id)} does not match the "
                "model/optimizer; nothing was loaded.\n  " + "\n  ".join(problems)
            )
        _dcp_call("load_checkpoint: reading", path, lambda: dcp.load(state, checkpoint_id=path,
                                                                    planner=StreamingLoadPlanner()))
    except BaseException:
        if fresh:
            optim.state.clear()  # leave the optimizer as it was
        raise
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
    if optim is not None:
        set_optimizer_state_dict(model, optim, state["optim"])
    for key, value in (extra or {}).items():
        if _is_stateful(value):
            value.load_state_dict(state["extra"][key])
        else:
            extra[key] = state["extra"][key]


def _check_step_args(step: int | None, keep: int | None) -> None:
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"save_checkpoint: step must be an int >= 0, got {step!r}")
    if keep is not None:
        if step is None:
            raise ValueError("save_checkpoint: keep needs step (keep counts root/step-N folders)")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"save_checkpoint: keep must be an int >= 1 or None, got {keep!r}")


def _state(model: nn.Module, optim: torch.optim.Optimizer | None, extra: dict | None) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optim is not None:
        state["optim"] = get_optimizer_state_dict(model, optim)
    if extra:
        state["extra"] = {k: _unpacked_stateful(v) for k, v in extra.items()}
    return state


def _write(state: dict, final: Path, keep: int | None, group: Any, checksums: bool) -> str:
    """Every rank writes ``state`` into ``final``'s partial folder; rank 0 commits it."""
    import torch.distributed.checkpoint as dcp

    from .streaming import StreamingSavePlanner
    from .summing import RankSums, SummingWriter
    from .writeback import WritebackWriter

    partial = partial_dir(final)

    def cleanup() -> None:
        # DCP's collectives still work (they carried the error): clean up in step.
        agree("save_checkpoint: cleaning up", lambda: discard(final), group=group,
              error_type=CheckpointError)

    def commit_summed(sums: RankSums) -> None:
        """The coordinator, inside DCP's last step: the manifest, then the commit (see
        [Note: Committing inside DCP's last step] in summing.py)."""
        algorithm = writer.algorithm
        entries: dict[str, list[int]] = {}
        for rank_algorithm, rank_sums in sums:
            if rank_algorithm == algorithm:  # a rank summing otherwise: re-summed below
                entries.update(rank_sums)
        for name in sorted(os.listdir(partial)):  # a file no writer summed as it wrote it
            if name not in entries and name != integrity.MANIFEST:
                entries[name] = list(integrity.checksum(partial / name, algorithm))
        integrity.write_manifest(partial, entries, algorithm)
        commit(final, keep)

    # Both start each file's disk write early ([Note: Early write-back] in writeback.py).
    writer = SummingWriter(partial, on_finish=commit_summed) if checksums else WritebackWriter(partial)
    _dcp_call(f"save_checkpoint: writing {final}", final,
              lambda: dcp.save(state, checkpoint_id=partial, storage_writer=writer,
                               process_group=group, planner=StreamingSavePlanner()),
              cleanup, _WRITE_HINT)
    if not checksums:  # no sums to carry: the commit follows, agreed on by every rank
        agree(f"save_checkpoint: cannot commit {final}", lambda: commit(final, keep),
              group=group, error_type=CheckpointError, hint=_WRITE_HINT)
    return str(final)


def _dcp_call(what: str, path: Path, call: Any, cleanup: Any = None, hint: str = "") -> Any:
    """``call()``, with DCP's ``CheckpointException`` (a ``BaseException``) as a CheckpointError."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call()
    except CheckpointException as exc:  # DCP raises it on every rank, with every rank's error
        if cleanup is not None:
            cleanup()
        failures = "; ".join(
            f"rank {rank}: {type(err).__name__}: {err}"
            for rank, (err, _) in sorted(exc.failures.items())
        )
        raise CheckpointError(f"{what} failed ({failures}){hint}") from exc


def _checked_metadata(path: Path, verify: bool) -> Any:
    """DCP's metadata of ``path`` once every rank found its files intact; else one error on all."""
    import torch.distributed.checkpoint as dcp

    rank, world = _rank(None), _world(None)
    found = integrity.problems(path, rank, world, hashes=verify)
    metadata = None
    if not found:
        try:
            full = dcp.FileSystemReader(path).read_metadata()
        except Exception as exc:  # noqa: BLE001 - a garbled file: agreed on below
            found.append(f"{integrity.METADATA}: unreadable ({type(exc).__name__}: {exc})")
        else:
            metadata = full.state_dict_metadata
            found += integrity.short_files(path, full)
    everyone = dict(enumerate(_gather(found, None)))
    if any(everyone.values()):
        raise CheckpointDamagedError(
            f"load_checkpoint: {os.fspath(path)} is damaged; nothing was loaded. Load an "
            "earlier checkpoint, or use load_latest(root), which skips damaged steps.\n  "
            + integrity.describe({r: p for r, p in everyone.items() if p})
        )
    return metadata


def _rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _gather(value: Any, group: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _unpacked_stateful(value: Any) -> Any:
    # DCP only unpacks Stateful objects at the top level; nested ones would be
    # pickled whole (an LR scheduler with its lambdas cannot be).
    return value.state_dict() if _is_stateful(value) else value


def _compare(
    prefix: str, state: Any, saved: Mapping[str, Any], strict: bool, unexpected: bool = True
) -> list[str]:
    """What differs between ``state`` (flattened the way DCP does) and the checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    expected: dict[str, Any] = {}
    _flatten(prefix, state, expected)
    problems = []
    missing = [k for k in expected if k not in saved]
    if missing and strict:
        problems.append(_listing("missing (in the model, not in the checkpoint)", missing))
    extra = [k for k in saved if k.startswith(prefix + ".") and k not in expected]
    if extra and strict and unexpected:
        problems.append(_listing("unexpected (in the checkpoint, not in the model)", extra))
    resized = []
    for key, value in expected.items():
        meta = saved.get(key)
        if meta is None or not isinstance(value, torch.Tensor):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            resized.append(f"{key}: not a tensor in the checkpoint")
        elif tuple(meta.size) != tuple(value.shape):
            resized.append(f"{key}: {tuple(meta.size)} in the checkpoint, "
                           f"{tuple(value.shape)} in the model")
    if resized:
        problems.append(_listing("size mismatches", resized))
    return problems


def _flatten(path: str, value: Any, out: dict[str, Any]) -> None:
    # DCP's key scheme: dict keys and list indices joined by dots; a list is a
    # leaf unless it holds tensors or containers.
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{path}.{k}", v, out)
    elif isinstance(value, list) and any(
        isinstance(v, (torch.Tensor, Mapping, list)) for v in value
    ):
        for i, v in enumerate(value):
            _flatten(f"{path}.{i}", v, out)
    else:
        out[path] = value


def _listing(what: str, items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = f" ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"{what}: {shown}{more}"
