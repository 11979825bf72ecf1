"""Every optimizer torch ships, with every flag that changes its kernel, steps with upstream's bits.

The flat step is on by default (see [Note: The flat step by default] in
fsdp2/optim/default_step.py), so whatever a user passes to a ``torch.optim``
optimizer must give what upstream's ``fully_shard`` gives: the same
parameters and the same optimizer state, bit for bit, at every world size.
Each config steps an MLP of odd sizes (three groups, two param groups, some
shards empty) on fsdp2 and on upstream side by side in one process; a config
upstream refuses (``capturable`` on CPU, ``fused`` with ``differentiable``,
...) must be refused by fsdp2 the same way, leaving its parameters intact.
"""

from __future__ import annotations

import copy
import inspect
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _impl import IMPL
from checks import assert_same_optimizer_state, check_case
from models import cpu_mesh, rank_slice, shard_groups
from torch.distributed.tensor import DTensor

import fsdp2

pytestmark = pytest.mark.skipif(IMPL == "torch", reason="compares fsdp2 with upstream itself")

# Flags whose value picks another kernel or another branch of one; each is crossed
# with every other one the optimizer takes (pairs), and tensor ``lr`` with each.
KERNEL_FLAGS = (
    "foreach", "fused", "capturable", "differentiable", "maximize", "amsgrad", "nesterov",
    "centered", "decoupled_weight_decay",
)
# What some flags need to mean anything (nesterov without momentum is refused by both).
NEEDS = {"nesterov": {"momentum": 0.9}, "centered": {"momentum": 0.5}}
BASE = {  # hyperparameters that reach every branch: decay, momentum, ...
    torch.optim.SGD: {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    torch.optim.Adam: {"lr": 0.01, "weight_decay": 0.01},
    torch.optim.AdamW: {"lr": 0.01},
    torch.optim.Adagrad: {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.01},
    torch.optim.RMSprop: {"lr": 0.01, "weight_decay": 0.01},
    torch.optim.Adamax: {"lr": 0.01, "weight_decay": 0.01},
    torch.optim.NAdam: {"lr": 0.01, "weight_decay": 0.01},
    torch.optim.RAdam: {"lr": 0.01, "weight_decay": 0.01},
    torch.optim.Adadelta: {"lr": 0.5, "weight_decay": 0.01},
    torch.optim.ASGD: {"lr": 0.01, "weight_decay": 0.01, "t0": 1},
    torch.optim.Rprop: {"lr": 0.01},
}
STEPS = 3


def _configs() -> dict[str, tuple[type, dict]]:
    configs = {}
    for cls, base in BASE.items():
        taken = inspect.signature(cls.__init__).parameters
        flags = [f for f in KERNEL_FLAGS if f in taken]
        configs[cls.__name__] = (cls, base)
        configs[f"{cls.__name__}-tensor_lr"] = (cls, {**base, "lr": torch.tensor(base["lr"])})
        for n in (1, 2):
            for combo in itertools.combinations(flags, n):
                kwargs = dict(base)
                for flag in combo:
                    kwargs.update(NEEDS.get(flag, {}), **{flag: True})
                configs[f"{cls.__name__}-{'-'.join(combo)}"] = (cls, kwargs)
                if n == 1:
                    tensor_lr = {**kwargs, "lr": torch.tensor(base["lr"])}
                    configs[f"{cls.__name__}-{combo[0]}-tensor_lr"] = (cls, tensor_lr)
    return configs


CONFIGS = _configs()


class _MLP(nn.Module):
    """Odd sizes: no parameter's shard is a multiple of a vector width; some shards empty."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 37)
        self.b = nn.Linear(37, 29)
        self.c = nn.Linear(29, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _param_groups(model: nn.Module, kwargs: dict) -> list[dict]:
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() == 1]
    lr = kwargs["lr"]
    other_lr = lr * 0.5 if isinstance(lr, torch.Tensor) else lr * 0.5
    return [{"params": weights}, {"params": biases, "lr": other_lr}]


def _batch(step: int, world_size: int):
    g = torch.Generator().manual_seed(17 + step)
    return torch.randn(2 * world_size, 7, generator=g), torch.randn(2 * world_size, 3, generator=g)


_PAIRS: dict[tuple, tuple] = {}  # (world size, ragged) -> (ours, theirs, initial local shards)


def _pair(world_size: int, ragged: bool = False):
    """fsdp2's and upstream's sharding of one MLP, at its initial values again.

    Sharded once per launch and reset in place for each config: sharding
    anew for each of hundreds of configs cost more than their steps.
    ``ragged``: both are fsdp2's parameter-major layout (``RaggedShard``),
    ``theirs`` for a per-tensor step on its local shards.
    """
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    if (world_size, ragged) not in _PAIRS:
        torch.manual_seed(3)
        ref = _MLP()
        ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
        mesh = cpu_mesh(world_size)
        if ragged:
            kwargs = {"mesh": mesh, "shard_placement_fn": lambda p: fsdp2.RaggedShard()}
            shard_groups(ours, fsdp2.fully_shard, [ours.a, ours.b], **kwargs)
            shard_groups(theirs, fsdp2.fully_shard, [theirs.a, theirs.b], **kwargs)
        else:
            shard_groups(ours, fsdp2.fully_shard, [ours.a, ours.b], mesh=mesh)
            shard_groups(theirs, upstream_fully_shard, [theirs.a, theirs.b], mesh=mesh)
        initial = [p.to_local().detach().clone() for p in ours.parameters()]
        _PAIRS[world_size, ragged] = (ours, theirs, initial)
    ours, theirs, initial = _PAIRS[world_size, ragged]
    with torch.no_grad():
        for model in (ours, theirs):
            for p, value in zip(model.parameters(), initial):
                p.to_local().copy_(value)
                p.grad = None
    return ours, theirs


def _clone_kwargs(kwargs: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


class _LocalStep:
    """Upstream's model stepped on plain copies of its local shards: the per-tensor step.

    The reference where upstream refuses only because DTensor has no sharding
    rule for the kernel (``_fused_sgd_``, ``_fused_adagrad_``): what its step
    would compute with one, each local shard a tensor of its own. fsdp2 steps
    there (see docs/differences.md).
    """

    def __init__(self, model: nn.Module, cls: type, kwargs: dict) -> None:
        self.params = list(model.parameters())
        self.locals = {p: p.to_local().detach().clone().requires_grad_() for p in self.params}
        groups = [{**g, "params": [self.locals[p] for p in g["params"]]}
                  for g in _param_groups(model, kwargs)]
        self.opt = cls(groups, **_clone_kwargs(kwargs))

    def step(self) -> None:
        for p in self.params:
            self.locals[p].grad = p.grad.to_local()
        self.opt.step()
        with torch.no_grad():
            for p in self.params:
                p.to_local().copy_(self.locals[p])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def assert_same_state(self, opt: torch.optim.Optimizer, model: nn.Module) -> None:
        """``opt`` over ``model`` (DTensors) holds this step's state, local tensor by local tensor."""
        for p, q in zip(model.parameters(), self.params):
            got, want = opt.state[p], self.opt.state[self.locals[q]]
            assert list(got) == list(want), (list(got), list(want))
            for key, value in want.items():
                g = got[key]
                g = g.to_local() if isinstance(g, DTensor) else g
                assert torch.equal(torch.as_tensor(g), torch.as_tensor(value)), key


def _no_sharding_rule(e: BaseException | None) -> bool:
    return isinstance(e, NotImplementedError) and "sharding strategy" in str(e)


def _step_both(models, opts, batch) -> list[BaseException | None]:
    outcomes = []
    for model, opt in zip(models, opts):
        x, y = batch
        F.mse_loss(model(x), y).backward()
        try:
            opt.step()
            outcomes.append(None)
        except Exception as e:  # upstream's refusal must be ours too
            outcomes.append(e)
        opt.zero_grad()
    return outcomes


def _params_differ(ours, theirs, where: str) -> list[str]:
    """Where fsdp2's parameters differ from upstream's, local shard by local shard.

    Both shard dim 0 alike, so equal local shards on every rank are equal
    parameters, with no collective; a rank that finds a difference goes on
    stepping, so every rank issues the same collectives.
    """
    return [
        f"{where}: {name} differs" if isinstance(p, DTensor) else f"{where}: {name} lost its DTensor"
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters())
        if not isinstance(p, DTensor) or not torch.equal(p.to_local(), q.to_local())
    ]


def _run_config(cls: type, kwargs: dict, rank: int, world_size: int) -> list[str]:
    """One config's steps on fsdp2 and upstream: what differs (empty: bit for bit the same)."""
    ours, theirs = _pair(world_size)
    try:
        opts = [cls(_param_groups(m, kwargs), **_clone_kwargs(kwargs)) for m in (ours, theirs)]
    except Exception:  # refused at construction: torch's own check, nothing of ours
        return []
    problems: list[str] = []
    for step in range(STEPS):
        batch = rank_slice(_batch(step, world_size), rank, world_size)
        mine, upstream = _step_both((ours, theirs), opts, batch)
        if step == 0 and mine is None and _no_sharding_rule(upstream):
            # ours stepped; the reference is the per-tensor step upstream lacks
            ours, theirs = _pair(world_size)
            opts = [cls(_param_groups(ours, kwargs), **_clone_kwargs(kwargs)),
                    _LocalStep(theirs, cls, kwargs)]
            mine, upstream = _step_both((ours, theirs), opts, batch)
        if upstream is not None or mine is not None:  # the same refusal on every rank
            if type(mine) is not type(upstream) or str(mine) != str(upstream):
                problems.append(f"step {step}: fsdp2 {mine!r}, upstream {upstream!r}")
            if not all(isinstance(p, DTensor) for g in opts[0].param_groups for p in g["params"]):
                problems.append(f"step {step}: the refusal left plain tensors in the groups")
            return problems + _params_differ(ours, theirs, f"step {step}, after the refusal")
        problems += _params_differ(ours, theirs, f"step {step}")
    try:
        if isinstance(opts[1], _LocalStep):
            opts[1].assert_same_state(opts[0], ours)
        else:
            assert_same_optimizer_state(opts[0], opts[1])
    except AssertionError as e:
        problems.append(f"state: {e}")
    return problems


def _zoo(rank: int, world_size: int) -> None:
    failures = []
    for name, (cls, kwargs) in CONFIGS.items():
        failures += [f"{name}: {p}" for p in _run_config(cls, kwargs, rank, world_size)]
    assert not failures, f"{len(failures)} differences in {len(CONFIGS)} configs:\n" + "\n".join(
        failures
    )


def _run_ragged_config(cls: type, kwargs: dict, rank: int, world_size: int) -> list[str]:
    """One config on the parameter-major layout: the flat step against torch's per-tensor step
    on the same local shards (each rank's rows, a tensor of their own), bit for bit."""
    ours, theirs = _pair(world_size, ragged=True)
    try:
        opts = [cls(_param_groups(ours, kwargs), **_clone_kwargs(kwargs)),
                _LocalStep(theirs, cls, kwargs)]
    except Exception:  # refused at construction: torch's own check, nothing of ours
        return []
    problems: list[str] = []
    for step in range(STEPS):
        batch = rank_slice(_batch(step, world_size), rank, world_size)
        mine, _ = _step_both((ours, theirs), opts, batch)
        if mine is not None:  # torch's own step on the DTensors: upstream's refusal on its own
            upstream = _pair(world_size)[1]
            opt = cls(_param_groups(upstream, kwargs), **_clone_kwargs(kwargs))
            (refused,) = _step_both((upstream,), [opt], batch)
            if type(refused) is not type(mine):
                problems.append(f"step {step}: fsdp2 {mine!r}, upstream {refused!r}")
            return problems
        problems += _params_differ(ours, theirs, f"step {step}")
    from fsdp2.optim.step_plan import ELEMENTWISE_OPTIMIZERS

    if (fsdp2.optim.flat_step_engine(opts[0]) is None) == (cls in ELEMENTWISE_OPTIMIZERS):
        problems.append("the flat step attached where it should not, or not where it should")
    try:
        opts[1].assert_same_state(opts[0], ours)
    except AssertionError as e:
        problems.append(f"state: {e}")
    return problems


# What the flat step takes (it leaves capturable and differentiable groups to torch),
# one flag at a time: the parameter-major layout steps the same kernels on other rows.
RAGGED_CONFIGS = {
    name: config for name, config in CONFIGS.items()
    if name.count("-") <= 1 and "capturable" not in name and "differentiable" not in name
}


def _ragged_zoo(rank: int, world_size: int) -> None:
    failures = []
    for name, (cls, kwargs) in RAGGED_CONFIGS.items():
        failures += [f"{name}: {p}" for p in _run_ragged_config(cls, kwargs, rank, world_size)]
    assert not failures, f"{len(failures)} differences in {len(RAGGED_CONFIGS)} configs:\n" + (
        "\n".join(failures)
    )


CASES = {"zoo": _zoo}
RAGGED_CASES = {"ragged_zoo": _ragged_zoo}  # a launch of its own: W=3 only


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_optimizer_and_flag_matches_upstream(world_size, launch_cases):
    """Every torch optimizer x every kernel flag (and pairs): upstream's parameters and state, bitwise."""
    check_case(launch_cases(world_size, CASES, timeout=600), "zoo")


def test_every_optimizer_and_flag_on_the_parameter_major_layout(launch_cases):
    """RaggedShard groups: the flat step equals torch's per-tensor step on each rank's rows.

    At W=3 (rows uneven over the ranks, runs of every length): the kernels are
    the dim-0 zoo's, only the rows differ (the dim-0 zoo runs every world size)."""
    check_case(launch_cases(3, RAGGED_CASES, timeout=600), "ragged_zoo")


def test_the_zoo_covers_every_elementwise_optimizer_and_flag():
    """The configs reach every optimizer the flat step takes, and fused ones among them."""
    from fsdp2.optim.step_plan import ELEMENTWISE_OPTIMIZERS

    assert set(ELEMENTWISE_OPTIMIZERS) <= set(BASE)
    names = set(CONFIGS)
    for flag in ("fused", "foreach", "maximize", "amsgrad", "nesterov", "centered",
                 "decoupled_weight_decay", "differentiable", "capturable"):
        assert any(flag in n.split("-") for n in names), flag
    assert "AdamW-fused" in names and "AdamW-fused-tensor_lr" in names
