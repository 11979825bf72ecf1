"""Assertions and training loops shared by the tests (toy models live in models.py)."""

from __future__ import annotations

import contextlib
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _multiproc import RankError, run_ranks
from models import assert_grads_match, full, full_all, global_mean, rank_slice
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
    """AdamW for the reference and for the sharded model (built on its current parameters).

    ``ref`` may be None (no reference): its optimizer is then None too.
    """
    ref_opt = None if ref is None else torch.optim.AdamW(ref.parameters(), lr=lr)
    return ref_opt, torch.optim.AdamW(model.parameters(), lr=lr)


def train_steps(ref, model, batches, loss_fn, rank, world_size, opts=None, *, mean=True,
                record=None, micro_batches=1, after_backward=None, after_step=None,
                set_to_none=True, accumulate_with="set_requires_gradient_sync"):
    """The tests' training loop: one optimizer step per batch; (reference losses, losses).

    ``model`` trains on rank ``rank``'s slice of each batch (``rank=None``: on the
    whole batch, e.g. an unsharded run); ``ref``, unless None, on the whole batch,
    and after every backward the reduced gradients must equal the reference's.
    ``opts``: (reference optimizer or None, model optimizer), AdamW by default;
    either side may be a list of optimizers (e.g. Muon on the matrices and SGD
    on the rest). ``losses`` are global means over the ranks (``mean=False`` or
    ``rank=None``: this rank's own); the reference losses are ``[]`` without a
    reference.

    ``micro_batches``: each batch is cut into that many micro-batches, their
    gradients accumulated with the model's gradient sync off but for the last
    (``set_requires_gradient_sync``, or the ``FSDPModule`` setter named by
    ``accumulate_with``, e.g. ``"set_requires_all_reduce"``), each loss scaled by
    ``1 / micro_batches``.
    ``after_backward()`` runs after the step's backwards (e.g. a manual
    ``finalize_backward``, clipping), ``after_step()`` after the optimizer steps
    (a scheduler's step). ``set_to_none``: ``zero_grad``'s argument, or a function
    of the step's index giving it.

    ``record``: a context-manager factory (``count_collectives``,
    ``record_collective_bytes``, ...) entered around each step's forward and
    backward of ``model``; what it yields, one per step, comes back as a third
    item.
    """
    ref_opt, opt = make_opts(ref, model) if opts is None else opts
    optimizers = [o for side in (ref_opt, opt) if side is not None
                  for o in (side if isinstance(side, list) else [side])]
    ref_losses, losses, records = [], [], []
    scale = 1 / micro_batches
    for index, batch in enumerate(batches):
        micro = [batch] if micro_batches == 1 else [
            tuple(t.chunk(micro_batches)[m] for t in batch) for m in range(micro_batches)]
        if ref is not None:
            ref_loss = sum(loss_fn(ref, part) * scale if micro_batches > 1 else loss_fn(ref, part)
                           for part in micro)
            ref_loss.backward()
        parts = []
        with record() if record is not None else contextlib.nullcontext() as recorded:
            for m, part in enumerate(micro):
                if micro_batches > 1:
                    getattr(model, accumulate_with)(m == micro_batches - 1)
                part = part if rank is None else rank_slice(part, rank, world_size)
                part_loss = loss_fn(model, part)
                part_loss = part_loss * scale if micro_batches > 1 else part_loss
                part_loss.backward()
                parts.append(part_loss.detach())
        records.append(recorded)
        if after_backward is not None:
            after_backward()
        if ref is not None:
            # AdamW hides gradient-scale errors; compare the reduced grads directly
            assert_grads_match(ref, model, RTOL, ATOL)
            ref_losses.append(ref_loss.item())
        to_none = set_to_none(index) if callable(set_to_none) else set_to_none
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=to_none)
        if after_step is not None:
            after_step()
        loss = parts[0] if micro_batches == 1 else torch.stack(parts).sum()  # after the step:
        local = rank is None or not mean  # no allocation between backward and step
        losses.append(loss.item() if local else global_mean(loss).item())
    return (ref_losses, losses, records) if record is not None else (ref_losses, losses)


def train_alone(model, batches, loss_fn, rank=None, world_size=1, opt=None, *, mean=True,
                **options):
    """``train_steps`` without a reference: the model's losses alone (``options`` as there)."""
    opts = None if opt is None else (None, opt)
    return train_steps(None, model, batches, loss_fn, rank, world_size, opts, mean=mean,
                       **options)[1]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name as a full plain tensor (sharded or not), detached copies."""
    names, params = zip(*model.named_parameters())
    return {n: t.clone() for n, t in zip(names, full_all(p.detach() for p in params))}


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
# ``on_collectives``' patch list for "nothing communicates": the above and the rest
EVERY_COLLECTIVE = {
    **_PATCHED,
    "all_to_all": ("all_to_all_single", "all_to_all"),
    "broadcast": ("broadcast", "broadcast_object_list"),
    "other": ("all_gather_object", "scatter", "gather", "reduce", "barrier", "send", "recv"),
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
def log_collectives():
    """``count_collectives``'s log alone: one ``(kind, numel[, op])`` entry per call, in order."""
    log: list = []
    with count_collectives(log):
        yield log


@contextlib.contextmanager
def record_collectives():
    """Record ``(kind, group size)`` of every public all-gather / reduce-scatter / all-reduce."""
    calls: list[tuple[str, int]] = []

    def record(kind, args, kwargs):
        calls.append((kind, dist.get_world_size(kwargs.get("group"))))

    with on_collectives(record, TENSOR_COLLECTIVES):
        yield calls


class Launches:
    """Named cases batched into multi-rank launches, each launch run once, at first use.

    The ``launch_cases`` fixture (conftest.py, module scope) gives each test
    module its own ``Launches``: ``launch_cases(world_size, cases)`` runs the
    dict of named ``case(rank, world_size)`` bodies (see ``run_cases``) in one
    launch, and later tests of the module asking for the same case names (and
    launch options) read that launch's outcome; ``check_case`` turns one case's
    outcome into a pass or a failure. Outcomes live as long as the module's
    tests, not in a module global: a rerun (``-k``, another xdist worker)
    launches afresh, and nothing stale is shared across modules.

    Cases are batched because a launch costs seconds (fork, process group,
    first lazy init): one per test would multiply the suite's time. A case that
    fails an assertion fails its own test only: the ranks catch it and go on
    with the next case in step. A launch that crashes or times out
    (``RankError``) leaves no outcome for any of its cases, so every test
    reading one of them fails with the launch's error, and no other test does.
    """

    def __init__(self) -> None:
        self._outcomes: dict = {}

    def __call__(self, world_size: int, cases: dict, *, key: object = (), **launch):
        """``(True, per-rank outcomes)`` or ``(False, the launch's error text)``.

        ``launch`` goes to ``run_ranks`` (``timeout``, ``backend``). Case names
        identify the cases: a module gives one name one body, or tells bodies
        that differ by something else apart with ``key`` (e.g. a folder they read).
        """
        return self.run(run_cases, world_size, cases, key=(tuple(cases), key), **launch)

    def run(self, body, world_size: int, *args, key: object = (), **launch):
        """``run_ranks(body, world_size, *args, **launch)`` once per (body, world size, key)."""
        k = (body.__module__, body.__qualname__, world_size, key, tuple(sorted(launch.items())))
        if k not in self._outcomes:
            try:
                self._outcomes[k] = (True, run_ranks(body, world_size, *args, **launch))
            except RankError as e:
                self._outcomes[k] = (False, str(e))
        return self._outcomes[k]

    def clear(self) -> None:
        self._outcomes.clear()


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


# ---------------------------------------------------------------- checkpoint runs

CKPT_BATCH = 8


def sharded_transformer(mesh, seed: int = 31):
    """The checkpoint tests' model and optimizer: a sharded transformer with AdamW."""
    from _impl import fully_shard
    from models import build_transformer, shard_transformer

    model = build_transformer(seed=seed)
    shard_transformer(model, fully_shard, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_span(model, optim, first: int, last: int, rank, world_size, *, mean=False):
    """Steps ``first+1 .. last``, each on its own batch; this rank's losses (or the global mean)."""
    from models import transformer_batch, transformer_loss

    batches = [transformer_batch(step, CKPT_BATCH) for step in range(first + 1, last + 1)]
    return train_alone(model, batches, transformer_loss, rank, world_size, optim, mean=mean)


def full_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (a collective), cloned."""
    return full_params(model)


def assert_same_params(ours: nn.Module, theirs: nn.Module, where: str = "") -> None:
    """``ours``' parameters equal ``theirs``' to the bit, as full tensors, in order (any layouts)."""
    names, params = zip(*ours.named_parameters())
    others = list(theirs.parameters())
    assert len(others) == len(params), (where, len(params), len(others))
    fulls = full_all([p.detach() for p in params] + [q.detach() for q in others])
    for name, got, want in zip(names, fulls, fulls[len(params):]):
        assert torch.equal(got, want), f"{where}: {name} differs"


def assert_full_equal(model: nn.Module, expected: dict[str, torch.Tensor], where: str = "") -> None:
    """Every parameter of ``model`` equals ``expected``'s to the bit."""
    names, params = zip(*model.named_parameters())
    for name, got in zip(names, full_all(p.detach() for p in params)):
        assert torch.equal(got, expected[name]), f"{where}: {name} differs"


# ---------------------------------------------------------------- offloaded-state runs


def sharded_linear_stack(num_layers: int, dim: int, seed: int) -> nn.Module:
    """``num_layers`` bias-free ``Linear(dim, dim)``, each its own fsdp2 group, on a 1-D mesh:
    one optimizer-state unit per layer (the offload tests' model)."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(num_layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def square_loss_backward(model: nn.Module, dim: int, step: int) -> None:
    """Forward and backward of step ``step``'s batch (seeded by the step) with a squared loss."""
    x = torch.randn(4, dim, generator=torch.Generator().manual_seed(step))
    model(x).square().sum().backward()


def assert_same_optimizer_state(got_opt, want_opt, *, layouts_differ: bool = False) -> None:
    """Two optimizers' state dicts are equal: groups, key order, types, placements, values.

    ``layouts_differ``: DTensor state is compared whole (``full_tensor()``, a
    collective), not by placement and local shard (RaggedShard against Shard(0)).
    """
    got, want = got_opt.state_dict(), want_opt.state_dict()
    assert got["param_groups"] == want["param_groups"], "param_groups differ"
    assert list(got["state"]) == list(want["state"]), "state keys (or their order) differ"
    for idx, state in want["state"].items():
        assert list(got["state"][idx]) == list(state), idx
        for key, value in state.items():
            g = got["state"][idx][key]
            assert type(g) is type(value), (idx, key)
            if isinstance(value, DTensor) and layouts_differ:
                assert torch.equal(full(g), full(value)), f"state {idx} {key!r}"
            elif isinstance(value, DTensor):
                assert g.placements == value.placements, (idx, key, g.placements)
                assert torch.equal(g.to_local(), value.to_local()), f"state {idx} {key!r} differs"
            else:
                assert torch.equal(torch.as_tensor(g), torch.as_tensor(value)), (idx, key)


@contextlib.contextmanager
def persistent_cache_dir(name: str):
    """A folder named ``name`` (per torch version) that outlives the run: under
    ``$FSDP2_TEST_CACHE``, else the user's cache folder (``~/.cache/fsdp2-tests``); a
    temporary one where neither is writable. For caches whose keys are complete
    (inductor's, per rank: see test_compiled_step.py), so a later run starts warm."""
    import tempfile

    root = os.environ.get("FSDP2_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fsdp2-tests"
    )
    path = os.path.join(root, f"torch-{torch.__version__}", name)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
            yield tmp
        return
    yield path


def bind_row_hooks(model: torch.nn.Module, pick, calls: list | None = None) -> list[str]:
    """Identity all-gather hooks on the parameter-major parameters ``pick(name, param)`` chooses.

    Each rank sends its own rows, padded with zeros to the largest rank's, and
    the post hook puts every rank's rows back in order: the group's staged
    all-gather (see [Note: Extensions on the parameter-major layout]) with the
    plain path's values, so a run must match the plain one bit for bit.
    ``calls`` gets a parameter's name at each of its pre hook's calls.
    """
    from types import MethodType

    def hooks(name: str, bounds: tuple[int, ...]):
        most = max(b - a for a, b in zip(bounds, bounds[1:]))

        def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
            if calls is not None:
                calls.append(name)
            padded = self.new_zeros((most, *self.shape[1:]))
            padded[: self.shape[0]].copy_(self.detach())
            return (padded,), None

        def post(self, outputs, metadata, param_dtype, *, out=None):
            (rows,) = outputs
            whole = torch.cat([rows[r * most : r * most + b - a]
                               for r, (a, b) in enumerate(zip(bounds, bounds[1:]))]).to(param_dtype)
            if out is not None:
                out.data.copy_(whole)
                return None
            return whole, ()

        return pre, post

    chosen = []
    for name, param in model.named_parameters():
        if pick(name, param):
            pre, post = hooks(name, param.placements[-1].row_bounds)
            local = param._local_tensor  # the object upstream's tests patch too
            local.fsdp_pre_all_gather = MethodType(pre, local)
            local.fsdp_post_all_gather = MethodType(post, local)
            chosen.append(name)
    return chosen


class TorchAllGather:
    """A custom all-gather (``set_custom_all_gather``): its own output buffers, the collective
    through ``torch.distributed``, as upstream's interface has it."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


class TorchReduceScatter:
    """A custom reduce-scatter (``set_custom_reduce_scatter``), likewise."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


@contextlib.contextmanager
def packed_everywhere():
    """Every ``RaggedShard`` group planned in the block takes the packed plan (see [Note:
    Packed blocks] in fsdp2/runtime/storage/block_packing.py), which the small test models
    seldom need by themselves; yields the sizes of the groups planned so."""
    from fsdp2.runtime.storage import ragged_rows
    from fsdp2.runtime.storage.block_packing import pack_blocks

    made: list[int] = []
    choose = ragged_rows.choose_plan

    def packed(shapes, granularities, world_size, names=None):
        made.append(len(shapes))
        return pack_blocks([tuple(s) for s in shapes], granularities, world_size, names)

    ragged_rows.choose_plan = packed
    try:
        yield made
    finally:
        ragged_rows.choose_plan = choose
