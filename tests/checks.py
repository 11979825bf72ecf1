"""Assertions and training loops shared by the tests (toy models live in models.py)."""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _multiproc import RankError, run_ranks
from models import assert_grads_match, global_mean, rank_slice
from torch.distributed.tensor import DTensor, Shard

RTOL, ATOL = 1e-5, 1e-6

def expected_local_shape(full_shape: torch.Size, rank: int, world_size: int) -> torch.Size:
    """Rank ``rank``'s dim-0 chunk shape with torch.chunk semantics (0 rows past the end)."""
    chunks = torch.empty(full_shape, device="meta").chunk(world_size)
    if rank < len(chunks):
        return chunks[rank].shape
    return torch.Size([0, *full_shape[1:]])


def assert_sharded(model: nn.Module, rank: int, world_size: int, where: str = "") -> None:
    """Every registered parameter is a Shard(0) DTensor with a chunk-shaped local tensor."""
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), (
            f"{where}: {name} is {type(p).__name__}, not a sharded DTensor"
        )
        assert isinstance(p, nn.Parameter), f"{where}: {name} is not an nn.Parameter"
        assert tuple(p.placements) == (Shard(0),), f"{where}: {name} placements {p.placements}"
        exp = expected_local_shape(p.shape, rank, world_size)
        assert p.to_local().shape == exp, (
            f"{where}: {name} local shape {p.to_local().shape} != {exp}"
        )


def assert_nested_close(got, expected, where, rtol=RTOL, atol=ATOL):
    """Equal nested dicts/lists; tensors are plain CPU tensors close to ``expected``."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), (where, list(got), list(expected))
        for k in expected:
            assert_nested_close(got[k], expected[k], f"{where}.{k}", rtol, atol)
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_nested_close(g, e, f"{where}[{i}]", rtol, atol)
    elif isinstance(expected, torch.Tensor):
        assert type(got) is torch.Tensor and got.device.type == "cpu", (where, type(got))
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")
    else:
        assert got == expected, (where, got, expected)


def make_opts(ref, model, lr=1e-2):
    """AdamW for the reference and for the sharded model (built on its current parameters)."""
    return torch.optim.AdamW(ref.parameters(), lr=lr), torch.optim.AdamW(model.parameters(), lr=lr)


def train_steps(ref, model, batches, loss_fn, rank, world_size, opts=None):
    """Train ref on full batches and model on rank slices; return (ref losses, global losses)."""
    ref_opt, opt = make_opts(ref, model) if opts is None else opts
    ref_losses, losses = [], []
    for batch in batches:
        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        loss = loss_fn(model, rank_slice(batch, rank, world_size))
        loss.backward()
        # AdamW hides gradient-scale errors; compare the reduced grads directly
        assert_grads_match(ref, model, RTOL, ATOL)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        ref_losses.append(ref_loss.item())
        losses.append(global_mean(loss).item())
    return ref_losses, losses


def assert_losses_match(ref_losses, losses):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)


_ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather")
_REDUCE_SCATTERS = (
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "reduce_scatter",
)


def _collective_numel(kind: str, args: tuple, kwargs: dict) -> int:
    """All-gather output / reduce-scatter input numel: the group's padded full size."""
    if kind == "all_gather":
        t = args[0] if args else kwargs.get("output_tensor", kwargs.get("output"))
    else:
        t = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
    if isinstance(t, (list, tuple)):
        return sum(x.numel() for x in t)
    return t.numel()


def _collective_op(args: tuple, kwargs: dict):
    return kwargs.get("op", args[2] if len(args) > 2 else dist.ReduceOp.SUM)


_PATCHED = {
    "all_gather": _ALL_GATHERS,
    "reduce_scatter": _REDUCE_SCATTERS,
    "all_reduce": ("all_reduce",),
}


# The tensor-in, tensor-out collectives (no list variants): what fsdp2 issues.
TENSOR_COLLECTIVES = {
    "all_gather": ("all_gather_single", "all_gather_into_tensor"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "all_reduce": ("all_reduce",),
}


@contextlib.contextmanager
def on_collectives(callback, patched: dict = _PATCHED):
    """Call ``callback(kind, args, kwargs)`` before every public torch.distributed collective.

    ``kind`` is "all_gather", "reduce_scatter" or "all_reduce". A collective
    implemented by another one (e.g. ``all_gather_into_tensor`` calling
    ``_all_gather_base``) is reported once: nested calls are not.
    """
    depth = [0]
    saved = {}

    def wrap(kind, name):
        orig = saved[name] = getattr(dist, name)

        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                callback(kind, args, kwargs)
            depth[0] += 1
            try:
                return orig(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(dist, name, wrapper)

    for kind, names in patched.items():
        for name in names:
            if hasattr(dist, name):
                wrap(kind, name)
    try:
        yield
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)


@contextlib.contextmanager
def count_collectives(log: list | None = None):
    """Count public torch.distributed all-gather / reduce-scatter calls (nested calls count once).

    With ``log``, also append one entry per call in issue order:
    ``("all_gather", numel)`` or ``("reduce_scatter", numel, op)``, numel being
    the all-gather output's / reduce-scatter input's.
    """
    counts = {"all_gather": 0, "reduce_scatter": 0}

    def count(kind, args, kwargs):
        if kind not in counts:
            return
        counts[kind] += 1
        if log is not None:
            entry = (kind, _collective_numel(kind, args, kwargs))
            if kind == "reduce_scatter":
                entry += (_collective_op(args, kwargs),)
            log.append(entry)

    with on_collectives(count):
        yield counts


@contextlib.contextmanager
def record_collectives():
    """Record ``(kind, group size)`` of every public all-gather / reduce-scatter / all-reduce."""
    calls: list[tuple[str, int]] = []

    def record(kind, args, kwargs):
        calls.append((kind, dist.get_world_size(kwargs.get("group"))))

    with on_collectives(record, TENSOR_COLLECTIVES):
        yield calls


_LAUNCHES: dict = {}


def launch_cases(key: object, world_size: int, cases: dict, **launch) -> tuple[bool, object]:
    """Run ``cases`` (see ``run_cases``) in one launch per ``key``, reused by later tests.

    Returns ``(True, per-rank results)`` or ``(False, the launch's error text)``;
    ``check_case`` turns one case's outcome into a pass or a failure. ``launch``
    goes to ``run_ranks`` (``timeout``, ``backend``).
    """
    if key not in _LAUNCHES:
        try:
            _LAUNCHES[key] = (True, run_ranks(run_cases, world_size, cases, **launch))
        except RankError as e:
            _LAUNCHES[key] = (False, str(e))
    return _LAUNCHES[key]


def run_cases(rank: int, world_size: int, cases: dict) -> dict:
    """Run named ``case(rank, world_size)`` bodies in one launch; a failure's traceback per name.

    Assertions are evaluated identically on every rank after the collectives,
    so one failing case does not stop the next ones from running in step.
    """
    outcome = {}
    for name, case in cases.items():
        try:
            case(rank, world_size)
            outcome[name] = None
        except AssertionError:
            outcome[name] = traceback.format_exc()
    return outcome


def check_case(result, name: str) -> None:
    """Fail the calling test with every rank's traceback for case ``name``."""
    ok, per_rank = result
    if not ok:
        pytest.fail(f"launch failed:\n{per_rank}", pytrace=False)
    errors = [f"--- rank {r}:\n{res[name]}" for r, res in enumerate(per_rank) if res[name]]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)


@contextlib.contextmanager
def record_collective_bytes():
    """Record ``(kind, input dtype, input bytes)`` of every public all-gather / reduce-scatter.

    ``kind`` is ``"all_gather"`` or ``"reduce_scatter"``; the input is what this
    rank sends, so the bytes show what the collective really carries.
    """
    calls: list[tuple[str, torch.dtype, int]] = []

    def record(kind, args, kwargs):
        if kind == "all_reduce":
            return
        inp = kwargs.get("input_tensor", kwargs.get("input"))
        if inp is None:
            inp = args[1]
        calls.append((kind, inp.dtype, inp.numel() * inp.element_size()))

    with on_collectives(record, TENSOR_COLLECTIVES):
        yield calls
