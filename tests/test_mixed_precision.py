"""Mixed precision: bf16 compute and communication around fp32 sharded parameters.

The reference is one unsharded model doing the same casts by hand: a bf16
(or per-module) copy of the fp32 master weights runs forward and backward on
every rank's slice in turn, the per-rank gradients are averaged in the stated
reduce dtype, and AdamW updates the fp32 master. fully_shard must match it
within bf16 rounding (the only freedom left is the order in which the
collective sums the ranks' gradients).

All checks of one world size run in one process launch (the ``launch_cases``
fixture keeps it for the module's tests); each pytest case then reads its own
check's outcome.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _impl import IMPL, MixedPrecisionPolicy, fsdp2_only, fully_shard
from _multiproc import run_ranks
from checks import TENSOR_COLLECTIVES, check_case, on_collectives, run_cases
from models import (
    build_mlp,
    build_transformer,
    cpu_mesh,
    full,
    make_pair,
    mlp_batch,
    mlp_loss,
    rank_slice,
    shard_mlp,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.tensor import DTensor

from fsdp2.versions import ACCUMULATE_IN_GRAD_DTYPE, REDUCE_IN_PARAM_DTYPE_BY_DEFAULT

BF16, FP32 = torch.bfloat16, torch.float32
STEPS = 3
PER_RANK_BATCH = 2
# bf16 has an 8-bit significand: one rounding is a relative error of <= 2**-9.
# Gradients differ from the hand reference only by the collective's summation
# order (a few bf16 roundings); parameters and later losses by what AdamW makes
# of that: its normalized update turns the rounding of a near-zero gradient
# entry into a step off by up to 2 x lr (2e-2) on that entry. Observed: bit-equal at
# W=2; at W=4 (bf16 reduction) about 2.3e-2 of a gradient's largest entry, 1e-2
# on a parameter entry and 5e-4 on losses.
GRAD_RTOL, GRAD_ATOL = 2e-2, 2e-3
PARAM_RTOL, PARAM_ATOL = 1e-2, 2e-2
LOSS_RTOL, LOSS_ATOL = 0.0, 5e-3


# ---------------------------------------------------------------- hand-cast reference


class HandCastReference:
    """FSDP's mixed precision done by hand on one unsharded fp32 model.

    ``policies`` lists ``(module fqn, policy kwargs)`` bottom-up, as the
    fully_shard calls; each parameter follows the innermost listed module that
    holds it. Forward runs a compute copy whose parameters are the master
    weights cast to ``param_dtype``, with each listed module's floating inputs
    cast to ``param_dtype`` and outputs to ``output_dtype``.
    """

    def __init__(self, master: nn.Module, policies: list[tuple[str, dict]]) -> None:
        self.master = master
        self.compute = copy.deepcopy(master)
        self.policy_of: dict[str, dict] = {}
        for fqn, policy in policies:
            module = self.compute.get_submodule(fqn)
            for name, _ in module.named_parameters():
                self.policy_of.setdefault(f"{fqn}.{name}" if fqn else name, policy)
            module.register_forward_pre_hook(self._cast_inputs(policy.get("param_dtype")))
            module.register_forward_hook(self._cast_outputs(policy.get("output_dtype")))
        self.opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
        self.exact_means: dict[str, torch.Tensor] = {}

    @staticmethod
    def _cast_inputs(dtype):
        def hook(module, args):
            if dtype is None:
                return None
            return tuple(a.to(dtype) if torch.is_floating_point(a) else a for a in args)

        return hook

    @staticmethod
    def _cast_outputs(dtype):
        def hook(module, args, output):
            if dtype is None or not torch.is_floating_point(output):
                return None
            return output.to(dtype)

        return hook

    def step(self, batch, loss_fn, world_size: int) -> list[float]:
        """Per-rank losses of one step; leaves the reduced fp32 grads on the master.

        Also keeps the exact (float64) mean of the per-rank gradients in
        ``exact_means``: what any reduction of those same gradients aims at.
        """
        masters = dict(self.master.named_parameters())
        with torch.no_grad():
            for name, p in self.compute.named_parameters():
                p.data = masters[name].detach().to(self.policy_of[name].get("param_dtype") or FP32)
                if ACCUMULATE_IN_GRAD_DTYPE and p.dtype != self._reduce_dtype(name):
                    # torch >= 2.15's FSDP takes the gradient a reducing backward produces
                    # as it comes (an fp32 norm-weight gradient is not rounded to bf16)
                    p.grad_dtype = None
        per_rank: dict[str, list[torch.Tensor]] = {name: [] for name in masters}
        losses = []
        for r in range(world_size):
            self.compute.zero_grad(set_to_none=True)
            loss = loss_fn(self.compute, rank_slice(batch, r, world_size))
            loss.backward()
            losses.append(loss.item())
            for name, p in self.compute.named_parameters():
                per_rank[name].append(p.grad)
        for name, grads in per_rank.items():
            reduce_dtype = self._reduce_dtype(name)
            total = grads[0].to(reduce_dtype)
            for g in grads[1:]:
                total = total + g.to(reduce_dtype)
            masters[name].grad = (total / world_size).to(FP32)
            self.exact_means[name] = torch.stack([g.double() for g in grads]).mean(0)
        return losses

    def _reduce_dtype(self, name: str) -> torch.dtype:
        policy = self.policy_of[name]
        # reduce_dtype=None: param_dtype before torch 2.15, the parameter's fp32 after
        default = FP32 if REDUCE_IN_PARAM_DTYPE_BY_DEFAULT else policy.get("param_dtype")
        return policy.get("reduce_dtype") or default or FP32

    def optim_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


def _shard_by_fqn(model: nn.Module, policies: list[tuple[str, dict]], mesh) -> None:
    """``fully_shard`` each listed submodule (bottom-up) with its own policy kwargs."""
    for fqn, policy in policies:
        fully_shard(model.get_submodule(fqn), mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy))


def _transformer_policies(reduce_dtype, fp32_norms: bool = False) -> list[tuple[str, dict]]:
    block = {"param_dtype": BF16, "reduce_dtype": reduce_dtype}
    norm = {"param_dtype": FP32, "output_dtype": BF16}
    policies = []
    for i in range(2):
        if fp32_norms:
            policies += [(f"layers.{i}.attention_norm", norm), (f"layers.{i}.ffn_norm", norm)]
        policies.append((f"layers.{i}", block))
    if fp32_norms:
        policies.append(("norm", norm))
    policies.append(("", {**block, "output_dtype": FP32}))
    return policies


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _train_against_reference(rank, world_size, policies, metrics: dict, label: str):
    """Train fully_shard and the hand-cast reference side by side.

    Returns the first step's reduced gradients (full tensors) and the exact
    mean of the per-rank gradients they were reduced from.
    """
    master = build_transformer(seed=5)
    model = copy.deepcopy(master)
    _shard_by_fqn(model, policies, cpu_mesh(world_size))
    ref = HandCastReference(master, policies)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first_grads = None
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        batch = transformer_batch(step, PER_RANK_BATCH * world_size)
        ref_losses = ref.step(batch, transformer_loss, world_size)
        loss = transformer_loss(model, rank_slice(batch, rank, world_size))
        loss.backward()
        losses = torch.tensor(ref_losses)
        got = [torch.zeros(()) for _ in range(world_size)]
        dist.all_gather(got, loss.detach().float().reshape(()))
        got = torch.stack(got)
        if step == 0:  # same weights, same casts: the forward is bit-identical
            torch.testing.assert_close(got, losses, rtol=0, atol=0)
        torch.testing.assert_close(got, losses, rtol=LOSS_RTOL, atol=LOSS_ATOL)
        worst["loss"] = max(worst["loss"], (got - losses).abs().max().item())
        grads = {}
        for name, p in model.named_parameters():
            assert isinstance(p.grad, DTensor) and p.grad.dtype == FP32, (name, p.grad.dtype)
            grads[name] = p.grad.full_tensor()
        for name, p in ref.master.named_parameters():
            torch.testing.assert_close(
                grads[name],
                p.grad,
                rtol=GRAD_RTOL,
                atol=GRAD_ATOL,
                msg=lambda m, n=name: f"{n}: {m}",
            )
            worst["grad"] = max(worst["grad"], _max_rel(grads[name], p.grad))
        if first_grads is None:
            first_grads = grads, dict(ref.exact_means)
        opt.step()
        opt.zero_grad()
        ref.optim_step()
    for name, p in model.named_parameters():
        ref_p = ref.master.get_parameter(name)
        value = full(p.detach())
        torch.testing.assert_close(
            value,
            ref_p.detach(),
            rtol=PARAM_RTOL,
            atol=PARAM_ATOL,
            msg=lambda m, n=name: f"{n}: {m}",
        )
        worst["param"] = max(worst["param"], (value - ref_p.detach()).abs().max().item())
        # the master weights and the optimizer state stay in full precision
        assert p.dtype == FP32 and p.to_local().dtype == FP32, (name, p.dtype)
        assert all(s.dtype == FP32 for s in opt.state[p].values() if torch.is_tensor(s) and s.dim())
    metrics[label] = worst
    return first_grads


def _fp32_grads(world_size: int) -> dict[str, torch.Tensor]:
    """First-step full-batch gradients of the fp32 model, no mixed precision at all."""
    model = build_transformer(seed=5)
    transformer_loss(model, transformer_batch(0, PER_RANK_BATCH * world_size)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _rel_dist(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """``|grads - ref| / |ref|`` over all parameters together (L2, in float64)."""
    diff = torch.cat([(grads[n].double() - ref[n].double()).flatten() for n in ref])
    return (diff.norm() / torch.cat([g.double().flatten() for g in ref.values()]).norm()).item()


# ---------------------------------------------------------------- checks (run in every rank)


def _check_parity_and_reduce_precision(rank, world_size, metrics):
    bf16_reduced, exact_mean = _train_against_reference(
        rank, world_size, _transformer_policies(BF16), metrics, "bf16 reduce"
    )
    fp32_reduced, fp32_exact_mean = _train_against_reference(
        rank, world_size, _transformer_policies(FP32), metrics, "fp32 reduce"
    )
    # The reduction alone: distance to the exact mean of the same per-rank grads (the
    # same bf16 grads before torch 2.15; from 2.15 an fp32-reduced group keeps a
    # gradient autograd made in fp32, e.g. nn.RMSNorm's weight's, as it comes).
    r_bf16 = _rel_dist(bf16_reduced, exact_mean)
    r_fp32 = _rel_dist(fp32_reduced, fp32_exact_mean)
    # The whole recipe: distance to the gradients of the plain fp32 model.
    fp32_model = _fp32_grads(world_size)
    d_bf16, d_fp32 = _rel_dist(bf16_reduced, fp32_model), _rel_dist(fp32_reduced, fp32_model)
    metrics["reduction error"] = {"bf16 reduce": r_bf16, "fp32 reduce": r_fp32}
    metrics["distance to fp32 model grads"] = {"bf16 reduce": d_bf16, "fp32 reduce": d_fp32}
    assert r_fp32 < 1e-6, f"fp32 reduction of bf16 grads is not exact to fp32: {r_fp32:.3e}"
    assert r_bf16 > 100 * max(r_fp32, 1e-9), f"bf16 reduction shows no rounding: {r_bf16:.3e}"
    assert d_fp32 < d_bf16, (
        f"fp32 reduction ({d_fp32:.4e}) is not closer to the fp32 model's gradients "
        f"than bf16 reduction ({d_bf16:.4e})"
    )


def _check_per_module_policies(rank, world_size, metrics):
    policies = _transformer_policies(FP32, fp32_norms=True)
    seen: dict[str, set] = {"norm": set(), "linear": set()}

    def record(kind):
        def hook(module, args):
            seen[kind].add((args[0].dtype, module.weight.dtype))

        return hook

    _train_against_reference(rank, world_size, policies, metrics, "fp32 norms, bf16 blocks")
    hooked = build_transformer(seed=5)
    for m in hooked.modules():
        if type(m).__name__ == "RMSNorm":
            m.register_forward_pre_hook(record("norm"))
        elif isinstance(m, nn.Linear):
            m.register_forward_pre_hook(record("linear"))
    _shard_by_fqn(hooked, policies, cpu_mesh(world_size))
    out = hooked(transformer_batch(0, PER_RANK_BATCH * world_size)[0])
    assert out.dtype == FP32, f"root output_dtype=float32 not applied: {out.dtype}"
    assert seen["norm"] == {(FP32, FP32)}, f"norms must compute in fp32: {seen['norm']}"
    assert seen["linear"] == {(BF16, BF16)}, f"linears must compute in bf16: {seen['linear']}"


@contextlib.contextmanager
def _record_collectives():
    """Record (kind, dtype, bytes) of every all-gather / reduce-scatter output."""
    calls: list[tuple[str, torch.dtype, int]] = []

    def record(kind, args, kwargs):
        if kind == "all_reduce":
            return
        names = ("output_tensor", "output"), ("input_tensor", "input")
        output, input = (
            args[i] if len(args) > i else next(kwargs[n] for n in keys if n in kwargs)
            for i, keys in enumerate(names)
        )
        assert input.dtype == output.dtype, (kind, input.dtype, output.dtype)
        calls.append((kind, output.dtype, output.numel() * output.element_size()))

    with on_collectives(record, TENSOR_COLLECTIVES):
        yield calls


def _check_collective_dtypes(rank, world_size, metrics):
    batch = rank_slice(mlp_batch(0, PER_RANK_BATCH * world_size), rank, world_size)
    observed = {}
    for label, policy in (
        ("fp32", {}),
        ("bf16", {"param_dtype": BF16}),
        ("bf16+fp32 reduce", {"param_dtype": BF16, "reduce_dtype": FP32}),
    ):
        model = build_mlp(seed=3)
        shard_mlp(
            model, fully_shard, mesh=cpu_mesh(world_size), mp_policy=MixedPrecisionPolicy(**policy)
        )
        with _record_collectives() as calls:
            mlp_loss(model, batch).backward()
        observed[label] = calls
        for name, p in model.named_parameters():
            assert p.dtype == FP32 and p.to_local().dtype == FP32, (label, name, p.dtype)
            assert p.grad.dtype == FP32 and p.grad.to_local().dtype == FP32, (label, name)

    def summary(label, kind):
        calls = [c for c in observed[label] if c[0] == kind]
        return {c[1] for c in calls}, sum(c[2] for c in calls), len(calls)

    ag32, rs32 = summary("fp32", "all_gather"), summary("fp32", "reduce_scatter")
    ag16, rs16 = summary("bf16", "all_gather"), summary("bf16", "reduce_scatter")
    ag16r, rs16r = (
        summary("bf16+fp32 reduce", "all_gather"),
        summary("bf16+fp32 reduce", "reduce_scatter"),
    )
    assert ag32[0] == {FP32} and rs32[0] == {FP32}, (ag32, rs32)
    assert ag16[0] == {BF16} and ag16r[0] == {BF16}, "the all-gather must carry param_dtype"
    # reduce_dtype=None: param_dtype before torch 2.15, the parameters' dtype after
    default = FP32 if REDUCE_IN_PARAM_DTYPE_BY_DEFAULT else BF16
    assert rs16[0] == {default}, f"reduce_dtype=None reduces in {default}, got {rs16[0]}"
    assert rs16r[0] == {FP32}, f"reduce_dtype=float32 must reduce in fp32, got {rs16r[0]}"
    # same collectives, half the bytes on the wire
    assert ag16[2] == ag32[2] and ag16[1] * 2 == ag32[1], (ag16, ag32)
    assert rs16[1] * (2 if default == BF16 else 1) == rs32[1], (rs16, rs32)
    assert rs16r[1] == rs32[1], (rs16r, rs32)
    metrics["all-gather bytes fp32 -> bf16"] = (ag32[1], ag16[1])


class _IntTable(nn.Module):
    """Looks up a frozen int64 parameter whose values bf16 could not represent."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = nn.Parameter(torch.arange(7, dtype=torch.int64) * 1000003, requires_grad=False)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        self.seen = self.ids.detach().clone()
        return self.ids[pos]


class _WithBuffers(nn.Module):
    """A linear layer with an int64 index buffer, a float buffer and an int64 table."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 5)
        self.register_buffer("index", torch.tensor([4, 0, 2, 1], dtype=torch.int64))
        self.register_buffer("scale", torch.full((4,), 0.1234567, dtype=torch.float32))
        self.table = _IntTable()
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.index.dtype, self.scale.dtype, x.dtype))
        y = self.proj(x)[:, self.index]
        ids = self.table(self.index)
        return y * self.scale.to(y.dtype) + (ids % 2).to(y.dtype)


def _check_non_floating_untouched(rank, world_size, metrics):
    torch.manual_seed(0)
    model = _WithBuffers()
    expected_ids = model.table.ids.detach().clone()
    index, scale = model.index.clone(), model.scale.clone()
    mesh = cpu_mesh(world_size)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    fully_shard(model.table, mesh=mesh, mp_policy=policy)  # a group of one int64 parameter
    fully_shard(model, mesh=mesh, mp_policy=policy)
    out = model(torch.randn(3, 6))
    out.float().sum().backward()
    assert out.dtype == BF16
    assert model.seen == [(torch.int64, FP32, BF16)], model.seen
    seen_ids = model.table.seen
    assert seen_ids.dtype == torch.int64 and torch.equal(seen_ids, expected_ids), (
        f"an int parameter must be gathered exactly: {seen_ids}"
    )
    assert model.index.dtype == torch.int64 and torch.equal(model.index, index)
    assert model.scale.dtype == FP32 and torch.equal(model.scale, scale)
    ids = model.table.ids
    assert ids.dtype == torch.int64 and torch.equal(full(ids), expected_ids)
    assert model.proj.weight.grad.dtype == FP32


Pair = namedtuple("Pair", ["a", "b"])


@dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor


class _Recorder(nn.Module):
    """Records the dtypes of every tensor it receives; returns float and int outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)
        self.seen = None

    def forward(self, x, pair, batch, extra=None, *, opts=None):
        leaves = [x, pair.a, pair.b, batch.x, batch.mask, extra["t"], extra["ids"], opts[0]]
        self.seen = [t.dtype for t in leaves]
        assert (
            isinstance(pair, Pair) and isinstance(batch, Batch) and isinstance(extra, OrderedDict)
        )
        h = self.w(x.to(self.w.weight.dtype))
        return {"h": h, "ids": extra["ids"], "pair": Pair(h * 2, batch.mask)}


def _check_forward_io_casting(rank, world_size, metrics):
    def run(**policy):
        model = _Recorder()
        fully_shard(model, mesh=cpu_mesh(world_size), mp_policy=MixedPrecisionPolicy(**policy))
        x = torch.randn(2, 4)
        out = model(
            x,
            Pair(torch.randn(2, dtype=torch.float64), torch.arange(2)),
            Batch(torch.randn(2), torch.ones(2, dtype=torch.bool)),
            extra=OrderedDict(t=torch.randn(2), ids=torch.arange(3)),
            opts=[torch.randn(1, dtype=torch.float16)],
        )
        return model.seen, out

    f64, i64, b = torch.float64, torch.int64, torch.bool
    seen, out = run(param_dtype=BF16)
    assert seen == [BF16, BF16, i64, BF16, b, BF16, i64, BF16], seen
    assert out["h"].dtype == BF16 and out["ids"].dtype == i64
    seen, out = run(param_dtype=BF16, cast_forward_inputs=False, output_dtype=f64)
    assert seen == [FP32, f64, i64, FP32, b, FP32, i64, torch.float16], seen
    assert out["h"].dtype == f64 and out["pair"].a.dtype == f64, (
        "output_dtype must reach nested outputs"
    )
    assert out["ids"].dtype == i64 and out["pair"].b.dtype == b, (
        "non-floating outputs are never cast"
    )
    seen, _ = run(output_dtype=FP32)  # no param_dtype: inputs are left alone
    assert seen == [FP32, f64, i64, FP32, b, FP32, i64, torch.float16], seen


def _check_fp16_reduction_in_range(rank, world_size, metrics):
    # Per-rank gradients near fp16's maximum (65504): their plain sum over 4
    # ranks would overflow to inf; their mean (31536 at W=4) is representable.
    torch.manual_seed(0)
    model = nn.Linear(1, 4, bias=False)
    fully_shard(
        model, mesh=cpu_mesh(world_size), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16)
    )
    x = torch.full((1, 1), 30000.0 + 1024.0 * rank)  # the weight's gradient, in fp16 exactly
    out = model(x)
    assert out.dtype == torch.float16
    out.float().sum().backward()
    grad = model.weight.grad.full_tensor()
    expected = 30000.0 + 1024.0 * (world_size - 1) / 2
    assert torch.isfinite(grad).all(), f"fp16 reduction overflowed: {grad.flatten().tolist()}"
    assert grad.dtype == FP32
    # a few fp16 roundings (spacing 32 near the sum) of the exact mean
    torch.testing.assert_close(grad, torch.full((4, 1), expected), rtol=4e-3, atol=0)


CHECKS = {
    "parity": _check_parity_and_reduce_precision,
    "per_module": _check_per_module_policies,
    "collectives": _check_collective_dtypes,
    "non_floating": _check_non_floating_untouched,
    "io_casting": _check_forward_io_casting,
    "fp16_range": _check_fp16_reduction_in_range,
}


def _body(rank: int, world_size: int) -> dict:
    """Every check (``run_cases``), then the metrics they recorded, printed by the tests."""
    metrics: dict = {}
    cases = {name: functools.partial(check, metrics=metrics) for name, check in CHECKS.items()}
    return {**run_cases(rank, world_size, cases), "metrics": metrics}


def _check(launch_cases, world_size: int, check: str) -> None:
    """Fail unless ``check`` passed on every rank of this world size's one launch."""
    outcome = launch_cases.run(_body, world_size)
    check_case(outcome, check)
    print(f"world_size={world_size} metrics: {outcome[1][0]['metrics']}")


WORLD_SIZES = pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")


@WORLD_SIZES
def test_bf16_training_matches_hand_cast_reference(world_size, launch_cases):
    """bf16 compute with bf16 or fp32 reduction matches the hand-cast reference; fp32 reduction is closer to fp32 grads."""
    _check(launch_cases, world_size, "parity")


@WORLD_SIZES
def test_per_module_policies_fp32_norms_bf16_blocks(world_size, launch_cases):
    """fp32 norms (output_dtype=bf16) inside bf16 blocks compute in their own dtypes and train with parity."""
    _check(launch_cases, world_size, "per_module")


@WORLD_SIZES
def test_collectives_carry_param_and_reduce_dtypes(world_size, launch_cases):
    """All-gathers carry param_dtype (half the bytes), reduce-scatters reduce_dtype; sharded params and grads stay fp32."""
    _check(launch_cases, world_size, "collectives")


@WORLD_SIZES
def test_non_floating_params_and_buffers_never_cast(world_size, launch_cases):
    """int64 parameters and buffers and float buffers keep their dtype and exact values under param_dtype=bf16."""
    _check(launch_cases, world_size, "non_floating")


@WORLD_SIZES
def test_forward_inputs_and_outputs_cast(world_size, launch_cases):
    """Floating inputs in nested args/kwargs are cast to param_dtype (unless disabled); outputs to output_dtype."""
    _check(launch_cases, world_size, "io_casting")


@WORLD_SIZES
def test_fp16_reduction_divides_before_and_after_the_sum(world_size, launch_cases):
    """fp16 gradients near the dtype's maximum are averaged without overflow (pre/post division)."""
    _check(launch_cases, world_size, "fp16_range")


def _upstream_policy_body(rank, world_size):
    from torch.distributed import fsdp as upstream

    policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours_ref, theirs = make_pair(lambda: build_transformer(seed=21))
    shard_transformer(ours_ref, fully_shard, mesh=cpu_mesh(), mp_policy=MixedPrecisionPolicy(**policy))
    shard_transformer(theirs, fully_shard, mesh=cpu_mesh(), mp_policy=upstream.MixedPrecisionPolicy(**policy))
    batch = rank_slice(transformer_batch(0, 2 * world_size), rank, world_size)
    a, b = transformer_loss(ours_ref, batch), transformer_loss(theirs, batch)
    assert b.dtype == a.dtype and torch.equal(a, b), (a, b)
    a.backward()
    b.backward()
    for (n, p), q in zip(ours_ref.named_parameters(), theirs.parameters()):
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), n


@fsdp2_only
def test_upstream_policy_objects_accepted():
    """torch.distributed.fsdp.MixedPrecisionPolicy passed to fsdp2.fully_shard acts as ours."""
    run_ranks(_upstream_policy_body, 2)


def _unfrozen_after_a_frozen_backward(rank, world_size):
    """bf16 compute: a block frozen for one backward, then trainable again (fine-tuning that
    unfreezes): its gradient is the second backward's alone, the rest add up both."""
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    batches = [rank_slice(transformer_batch(i, 2 * world_size), rank, world_size) for i in (0, 1)]
    grads = []
    for unfreeze in (True, False):
        model = build_transformer(seed=23)
        shard_transformer(model, fully_shard, mesh=cpu_mesh(), mp_policy=policy)
        block = model.layers[0]
        if unfreeze:
            block.requires_grad_(False)
        transformer_loss(model, batches[0]).backward()
        if unfreeze:
            block.requires_grad_(True)
        else:  # the same gradients by hand: the block's first one dropped
            for p in block.parameters():
                p.grad = None
        transformer_loss(model, batches[1]).backward()
        grads.append({n: full(p.grad) for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name


@pytest.mark.skipif(IMPL == "torch" and not ACCUMULATE_IN_GRAD_DTYPE,
                    reason="torch 2.13's fully_shard raises here (docs/differences.md)")
def test_unfreezing_after_a_frozen_backward(world_size=2):
    """Unfrozen after a backward that ran with it frozen: the gradients a plain loop gives."""
    run_ranks(_unfrozen_after_a_frozen_backward, world_size)


class _WithIntParameter(nn.Module):
    """Two linears and a frozen int64 parameter in the same fully_shard group (a LoRA base's
    quantized weight, an index table)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.table = nn.Parameter(torch.arange(16, dtype=torch.int64), requires_grad=False)

    def forward(self, x):
        return self.layers(x)


def _frozen_first_forward_with_an_int_parameter(rank, world_size):
    """A first forward with everything frozen, then the linears trainable: their gradients are
    in fp32 and equal those of a model trainable from the start (as upstream's test)."""
    grads = []
    for frozen_first in (True, False):
        torch.manual_seed(3)
        model = _WithIntParameter()
        fully_shard(model, mesh=cpu_mesh(), mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        inp = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
        if frozen_first:
            model.requires_grad_(False)
            with torch.no_grad():
                model(inp)
            model.layers.requires_grad_(True)
        model(inp).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert sorted(grads[0]) == sorted(grads[1]) and len(grads[0]) == 4, (list(grads[0]), list(grads[1]))
    for name, grad in grads[0].items():
        assert grad.dtype == torch.float32, (name, grad.dtype)
        assert torch.equal(full(grad), full(grads[1][name])), name


@pytest.mark.skipif(IMPL == "torch" and not ACCUMULATE_IN_GRAD_DTYPE,
                    reason="torch 2.13's fully_shard raises here (docs/differences.md)")
def test_frozen_first_forward_beside_an_int_parameter(world_size=2):
    """A group whose only parameters at the first forward are frozen, one of them int64."""
    run_ranks(_frozen_first_forward_with_an_int_parameter, world_size)
