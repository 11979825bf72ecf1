"""Training cases that run on any device: CUDA (tests/test_cuda.py) and CPU (forced mode).

Each case trains the toy transformer three ways in one process: unsharded (the
reference), with the implementation under test (``_impl``) and with upstream's
``fully_shard``, on a shard group of every rank with
``FSDP2_FORCE_COLLECTIVES=1``, so that a one-rank group (one GPU, a one-rank
NCCL group) runs every all-gather, reduce-scatter, copy, stream and event of a
multi-rank run (see [Note: Forcing collectives on one rank] in
fsdp2/runtime/comm/force_collectives.py). It compares per-step losses and reduced
gradients and the final parameters with the reference and with upstream.

``cases(device_type)`` returns the cases as picklable ``functools.partial``
objects (``run_cases`` runs them; NCCL ranks are spawned, not forked). On CPU
with gloo the same bodies run in the normal suite (tests/test_force_collectives.py);
the CUDA-only parts (pinned memory, the optimizer on a delayed side stream,
collectives on a delayed stream) reduce there to the same calls with nothing
to wait for.

The cases assume one rank (the CUDA tests run one GPU); the bf16 reference
reproduces mixed precision by hand (bf16 compute copy, fp32 master weights),
which matches the sharded run exactly only when nothing is reduced across
ranks.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from _impl import IMPL, CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from checks import count_collectives
from models import (
    build_transformer,
    full,
    global_mean,
    rank_slice,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as UpstreamCPUOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as UpstreamMixedPrecision
from torch.distributed.fsdp import fully_shard as upstream_fully_shard

FORCE_ENV = "FSDP2_FORCE_COLLECTIVES"
STEPS = 3
PER_RANK_BATCH = 2
N_LAYERS = 3
LR = 0.1
# Delay of each collective in the stream-safety case: ~10-20 ms on current GPUs.
SLEEP_CYCLES = 20_000_000

# (rtol, atol) per comparison. fp32 against the reference is the parity suite's;
# bf16 compute gives bf16 gradients (cast to fp32), so one bf16 ulp.
TOL = {
    ("fp32", "grads"): (1e-5, 1e-6),
    ("fp32", "params"): (1e-5, 1e-6),
    ("bf16", "grads"): (1.6e-2, 1e-4),
    ("bf16", "params"): (1e-3, 1e-5),
}


@contextlib.contextmanager
def forced_collectives() -> Iterator[None]:
    """``FSDP2_FORCE_COLLECTIVES=1`` while the block runs (read by ``fully_shard``)."""
    old = os.environ.get(FORCE_ENV)
    os.environ[FORCE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[FORCE_ENV]
        else:
            os.environ[FORCE_ENV] = old


def device_of(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


# ---------------------------------------------------------------- models and training


class Setup:
    """What one case varies: dtype, resharding, offload, prefetch, AC, compile."""

    def __init__(
        self,
        device_type: str,
        dtype: str = "fp32",
        reshard_after_forward: bool = True,
        offload: bool = False,
        prefetch: bool = False,
        checkpoint: bool = False,
        compile_block: bool = False,
    ) -> None:
        self.device = device_of(device_type)
        self.dtype = dtype
        self.reshard_after_forward = reshard_after_forward
        self.offload = offload
        self.prefetch = prefetch
        self.checkpoint = checkpoint
        self.compile_block = compile_block

    @property
    def backend(self) -> str:
        # inductor on GPUs; on CPU graph capture without C++ codegen (see test_compile.py)
        return "inductor" if self.device.type == "cuda" else "aot_eager"

    def blocks(self, model: nn.Module) -> None:
        """Activation checkpointing of every block and/or compile of the first, before sharding."""
        for i, layer in enumerate(model.layers):
            if self.checkpoint:
                model.layers[i] = checkpoint_wrapper(layer)
        if self.compile_block:  # one block: compiling costs seconds per model
            model.layers[0].compile(backend=self.backend)

    def shard(self, model: nn.Module, upstream: bool) -> nn.Module:
        shard_fn = upstream_fully_shard if upstream else fully_shard
        kwargs: dict = {
            "mesh": init_device_mesh(self.device.type, (dist.get_world_size(),)),
            "reshard_after_forward": self.reshard_after_forward,
        }
        if self.dtype == "bf16":
            policy = UpstreamMixedPrecision if upstream else MixedPrecisionPolicy
            kwargs["mp_policy"] = policy(param_dtype=torch.bfloat16)
        if self.offload:
            policy = UpstreamCPUOffload if upstream else CPUOffloadPolicy
            # upstream pins unconditionally and fails without an accelerator
            kwargs["offload_policy"] = policy(pin_memory=self.device.type != "cpu")
        self.blocks(model)
        for layer in model.layers:
            shard_fn(layer, **kwargs)
        del kwargs["reshard_after_forward"]  # the root: the default (kept until backward)
        shard_fn(model, **kwargs)
        if self.prefetch:
            layers = list(model.layers)
            model.set_modules_to_forward_prefetch([layers[0]])
            for i, layer in enumerate(layers):
                if i + 1 < len(layers):
                    layer.set_modules_to_forward_prefetch([layers[i + 1]])
                if i > 0:
                    layer.set_modules_to_backward_prefetch([layers[i - 1]])
        return model

    def build(self, seed: int) -> tuple[nn.Module, nn.Module, nn.Module]:
        """(reference on the device, model under test, upstream), equal initial values."""
        base = build_transformer(seed=seed, n_layers=N_LAYERS)
        ref = copy.deepcopy(base).to(self.device)
        self.blocks(ref)  # the same compute (compiled kernels, recompute) as the sharded ones
        host = self.device if not self.offload else torch.device("cpu")
        with forced_collectives():
            ours = self.shard(copy.deepcopy(base).to(host), upstream=False)
            theirs = self.shard(copy.deepcopy(base).to(host), upstream=True)
        return ref, ours, theirs


class Trained:
    """Per-step losses and reduced gradients, and the final parameters (CPU, fp32)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.params: dict[str, torch.Tensor] = {}


def _snapshot(named: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {
        name.replace("._checkpoint_wrapped_module", ""): full(t).detach().float().cpu()
        for name, t in named
        if t is not None
    }


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return _snapshot((n, p.grad) for n, p in model.named_parameters())


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum: updates proportional to the gradients (a scale error shows),
    # and optimizer state that must live where the sharded parameters do.
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


OptimStep = Callable[[torch.optim.Optimizer, nn.Module], None]


def _plain_step(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    opt.step()
    opt.zero_grad()


def train(
    model: nn.Module,
    setup: Setup,
    rank: int,
    world_size: int,
    optim_step: OptimStep = _plain_step,
) -> Trained:
    """Train ``model`` (sharded) on this rank's slices of the shared batches."""
    out, opt = Trained(), _optimizer(model)
    for step in range(STEPS):
        batch = transformer_batch(step, PER_RANK_BATCH * world_size)
        batch = tuple(t.to(setup.device) for t in rank_slice(batch, rank, world_size))
        loss = transformer_loss(model, batch)
        loss.backward()
        out.losses.append(global_mean(loss.float()).item())
        out.grads.append(_grads(model))
        optim_step(opt, model)
    if setup.device.type == "cuda":
        torch.cuda.synchronize()  # the last step may have run on a side stream
    out.params = _snapshot(model.named_parameters())
    return out


def train_reference(ref: nn.Module, setup: Setup, world_size: int) -> Trained:
    """The unsharded model on the whole batch; bf16: compute copy in bf16, fp32 master."""
    out, opt = Trained(), _optimizer(ref)
    compute = ref
    if setup.dtype == "bf16":
        compute = copy.deepcopy(ref).to(torch.bfloat16)
        for layer in compute.layers:  # as param_dtype casts a block's inputs (the RoPE tables too)
            layer.register_forward_pre_hook(_floating_args_to_bf16)
    for step in range(STEPS):
        batch = transformer_batch(step, PER_RANK_BATCH * world_size)
        batch = tuple(t.to(setup.device) for t in batch)
        if compute is not ref:
            with torch.no_grad():
                for c, m in zip(compute.parameters(), ref.parameters()):
                    c.copy_(m)
        loss = transformer_loss(compute, batch)
        loss.backward()
        if compute is not ref:
            for c, m in zip(compute.parameters(), ref.parameters()):
                m.grad, c.grad = c.grad.float(), None
        out.losses.append(loss.float().item())
        out.grads.append(_grads(ref))
        _plain_step(opt, ref)
    out.params = _snapshot(ref.named_parameters())
    return out


def _floating_args_to_bf16(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.to(torch.bfloat16) if torch.is_floating_point(a) else a for a in args)


def assert_trained_close(got: Trained, expected: Trained, dtype: str, what: str) -> None:
    """Losses, every step's gradients and the final parameters agree within ``TOL``."""
    rtol, atol = TOL[(dtype, "grads")]
    torch.testing.assert_close(
        torch.tensor(got.losses), torch.tensor(expected.losses), rtol=rtol, atol=atol,
        msg=lambda m: f"{what}: losses: {m}",
    )
    for step, (g, e) in enumerate(zip(got.grads, expected.grads)):
        assert sorted(g) == sorted(e), (what, step, sorted(g), sorted(e))
        for name in e:
            torch.testing.assert_close(
                g[name], e[name], rtol=rtol, atol=atol,
                msg=lambda m, n=name, s=step: f"{what}: step {s} grad {n}: {m}",
            )
    rtol, atol = TOL[(dtype, "params")]
    assert sorted(got.params) == sorted(expected.params), what
    for name in expected.params:
        torch.testing.assert_close(
            got.params[name], expected.params[name], rtol=rtol, atol=atol,
            msg=lambda m, n=name: f"{what}: param {n}: {m}",
        )


def _sdpa_math() -> contextlib.AbstractContextManager:
    """The math attention kernel on CUDA: deterministic, the same in every run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _parity(rank: int, world_size: int, setup: Setup, optim_step: OptimStep = _plain_step):
    """Train reference, model under test and upstream; compare; return the three results."""
    torch._dynamo.reset()
    with _sdpa_math():
        ref, ours, theirs = setup.build(seed=11)
        expected = train_reference(ref, setup, world_size)
        got = train(ours, setup, rank, world_size, optim_step)
        upstream = train(theirs, setup, rank, world_size, optim_step)
    assert_trained_close(got, expected, setup.dtype, f"{IMPL} vs the unsharded reference")
    assert_trained_close(got, upstream, setup.dtype, f"{IMPL} vs upstream fully_shard")
    return ours, theirs, got


# ---------------------------------------------------------------- the cases


def case_parity(rank: int, world_size: int, *, device_type: str, dtype: str, raf: bool) -> None:
    """Plain training: fp32 or bf16 compute, resharding after forward or not."""
    _parity(rank, world_size, Setup(device_type, dtype=dtype, reshard_after_forward=raf))


def case_offload(rank: int, world_size: int, *, device_type: str) -> None:
    """CPU offload (pinned host memory on an accelerator): parity, state stays on the host."""
    setup = Setup(device_type, offload=True)
    ours, theirs, _ = _parity(rank, world_size, setup)
    for model, who in ((ours, IMPL), (theirs, "upstream")):
        for name, p in model.named_parameters():
            local = p.to_local()
            assert local.device.type == "cpu", f"{who}: {name} on {local.device}"
            if setup.device.type != "cpu":
                assert local.is_pinned(), f"{who}: {name} is not in pinned memory"


def case_prefetch(rank: int, world_size: int, *, device_type: str) -> None:
    """Explicit forward/backward prefetching: parity, and no collective more than without."""
    setup = Setup(device_type, prefetch=True)
    ours, _, _ = _parity(rank, world_size, setup)
    if IMPL != "fsdp2":
        return  # upstream skips the collectives of a one-rank group whatever we ask
    batch = tuple(t.to(setup.device) for t in transformer_batch(0, PER_RANK_BATCH))
    with count_collectives() as counts:
        transformer_loss(ours, batch).backward()
    # forward: the root and every block; backward: every block again (the root stays)
    assert counts == {"all_gather": 1 + 2 * N_LAYERS, "reduce_scatter": 1 + N_LAYERS}, counts


def _side_stream_step(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    """The optimizer step on a delayed side stream; the next forward waits on its event."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        _plain_step(opt, model)
        model.set_post_optim_event(torch.Event(device=device))
        return
    side = getattr(opt, "_side_stream", None) or torch.cuda.Stream()
    opt._side_stream = side  # one stream: its memory (momentum buffers) stays on it
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # an all-gather that does not wait reads old values
        opt.step()
        opt.zero_grad(set_to_none=False)  # zeroed on the side stream, never freed early
    model.set_post_optim_event(side.record_event())


def case_post_optim_event(rank: int, world_size: int, *, device_type: str) -> None:
    """set_post_optim_event: the step runs on a delayed side stream; forward waits on its event."""
    _parity(rank, world_size, Setup(device_type), optim_step=_side_stream_step)


def case_checkpoint(rank: int, world_size: int, *, device_type: str) -> None:
    """checkpoint_wrapper on every block, then fully_shard: parity (recompute in backward)."""
    _parity(rank, world_size, Setup(device_type, checkpoint=True))


def case_compiled(rank: int, world_size: int, *, device_type: str) -> None:
    """The first block compiled (inductor on CUDA), then fully_shard: parity, same kernels."""
    _parity(rank, world_size, Setup(device_type, compile_block=True))


class _DelayedWork:
    """An in-flight collective on the slow stream; ``wait`` orders the caller's stream after it."""

    def __init__(self, work: dist.Work | None, slow: torch.cuda.Stream) -> None:
        self._work, self._slow = work, slow

    def wait(self, *args, **kwargs) -> bool:
        if self._work is not None:
            self._work.wait(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(self._slow)
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


_DELAYED = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
)


@contextlib.contextmanager
def delayed_collectives(device: torch.device) -> Iterator[None]:
    """Every collective starts on a side stream behind a long kernel (CUDA; else unchanged).

    The caller's stream runs on meanwhile, as it does with NCCL's own stream
    under load: a buffer read before ``wait``, or freed / reused / written while
    its collective is pending, then holds other values than it should.
    """
    if device.type != "cuda":
        yield
        return
    slow = torch.cuda.Stream()
    saved = {name: getattr(dist, name) for name in _DELAYED if hasattr(dist, name)}

    def delayed(orig):
        @functools.wraps(orig)
        def wrapper(*args, async_op: bool = False, **kwargs):
            slow.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(slow):
                torch.cuda._sleep(SLEEP_CYCLES)
                work = orig(*args, async_op=async_op, **kwargs)
            delayed_work = _DelayedWork(work, slow)
            if async_op:
                return delayed_work
            delayed_work.wait()  # a synchronous collective: the caller's stream waits for it
            return None

        return wrapper

    for name, orig in saved.items():
        setattr(dist, name, delayed(orig))
    try:
        yield
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)


def case_stream_safety(
    rank: int, world_size: int, *, device_type: str, dtype: str, offload: bool
) -> None:
    """Collectives delayed behind a long kernel on their own stream: the undelayed results."""
    setup = Setup(device_type, dtype=dtype, prefetch=True, offload=offload)
    torch._dynamo.reset()
    runs = []
    with _sdpa_math():
        for delay in (False, True):
            _, ours, _ = setup.build(seed=13)
            with delayed_collectives(setup.device) if delay else contextlib.nullcontext():
                runs.append(train(ours, setup, rank, world_size))
    # Reading a buffer early, or writing one that a pending collective uses, gives
    # other values (stale parameters, garbage), far outside these tolerances.
    assert_trained_close(runs[1], runs[0], dtype, f"{IMPL} with delayed collectives")


def cases(device_type: str) -> dict[str, Callable[[int, int], None]]:
    """Every case, named, for ``run_cases``/``launch_cases`` on ``device_type``."""
    out: dict[str, Callable[[int, int], None]] = {}
    for dtype in ("fp32", "bf16"):
        for raf in (True, False):
            out[f"parity-{dtype}-raf{raf}"] = functools.partial(
                case_parity, device_type=device_type, dtype=dtype, raf=raf
            )
    for name, fn in (
        ("offload", case_offload),
        ("prefetch", case_prefetch),
        ("post_optim_event", case_post_optim_event),
        ("checkpoint", case_checkpoint),
        ("compiled", case_compiled),
    ):
        out[name] = functools.partial(fn, device_type=device_type)
    for dtype, offload in (("fp32", False), ("fp32", True), ("bf16", False)):
        out[f"stream_safety-{dtype}-offload{offload}"] = functools.partial(
            case_stream_safety, device_type=device_type, dtype=dtype, offload=offload
        )
    return out
