"""A differential harness: fsdp2 and upstream's ``fully_shard`` driven through one random call sequence.

Each rank builds the same toy Transformer twice, shards one copy with
fsdp2's ``fully_shard`` and the other with upstream's, gives each the same
optimizer (a seeded random class and flags), and then applies the same seeded
random sequence of user calls to both: forward and backward, ``step`` (also
with a closure, compiled, or one that raises), ``zero_grad`` both ways,
``state_dict`` / ``load_state_dict`` (torch's, a ``torch.save`` round trip,
DCP's ``get_state_dict`` / ``set_state_dict``, a DCP checkpoint on disk),
references held to state dicts and to state tensors, ``add_param_group``,
hyperparameter edits, freezing, scheduler steps; a quarter of the sequences
run every collective through custom comms (``set_custom_all_gather`` and
``set_custom_reduce_scatter``, on both sides), and a quarter, drawn apart,
gather with upstream's ``_set_unshard_async_op(True)``; a ``setting`` puts both
sides on an HSDP mesh, under tensor parallelism (upstream's Colwise/Rowwise plan
on a (dp, tp) mesh, FSDP on dp), in bf16 mixed precision, without resharding
after forward, or accumulating gradients (``set_requires_gradient_sync`` and
``set_is_last_backward`` set from each backward's draw). After **every** call it
compares what a user can observe: the parameters and their gradients to the
bit, the optimizer's param groups and state (keys, order, types, values),
the values behind every reference held so far, and whether (and with which
exception class) the call raised. The ranks agree on the verdict after each
call (one all-reduce), so a divergence on one rank stops every rank with the
same report instead of a hang.

``run_sequence(seed, rank, world_size, ragged=...)`` returns ``None`` or the
first divergence (the call number, the call and what differed); the calls
leading to it are in the report, so a seed replays it. Hand-picked cases find
the holes one thought of; sequences find the rest.
"""

from __future__ import annotations

import copy
import io
import random
import tempfile
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checks import TorchAllGather, TorchReduceScatter
from models import build_transformer, cpu_mesh, full_all, rank_slice, shard_transformer
from models import transformer_batch as batch_of
from models import transformer_loss as loss_of
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.versions import TORCH_RELEASE

# (class, the flags it may take: name -> choices). The elementwise optimizers the
# flat step takes by default, with the flags each accepts on CPU.
OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {"momentum": [0.9, 0.0], "nesterov": [False, True],
                              "weight_decay": [0.0, 0.1], "maximize": [False, True],
                              "foreach": [None, True, False]}),
    "Adam": (torch.optim.Adam, {"weight_decay": [0.0, 0.1], "amsgrad": [False, True],
                                "maximize": [False, True], "foreach": [None, True, False],
                                "fused": [None, True]}),
    "AdamW": (torch.optim.AdamW, {"weight_decay": [0.0, 0.1], "amsgrad": [False, True],
                                  "foreach": [None, True, False], "fused": [None, True]}),
    "Adagrad": (torch.optim.Adagrad, {"weight_decay": [0.0, 0.1], "lr_decay": [0.0, 0.01],
                                      "foreach": [None, True, False]}),
    "RMSprop": (torch.optim.RMSprop, {"momentum": [0.0, 0.9], "centered": [False, True],
                                      "weight_decay": [0.0, 0.1], "foreach": [None, True]}),
    "Adamax": (torch.optim.Adamax, {"weight_decay": [0.0, 0.1], "foreach": [None, True]}),
    "NAdam": (torch.optim.NAdam, {"decoupled_weight_decay": [False, True],
                                  "weight_decay": [0.0, 0.1], "foreach": [None, True]}),
    "RAdam": (torch.optim.RAdam, {"decoupled_weight_decay": [False, True],
                                  "weight_decay": [0.0, 0.1], "foreach": [None, True]}),
}
LR = {"SGD": 0.05, "Adagrad": 0.05}  # else 1e-2

# The calls and their weights: training calls come often, the rest now and then.
CALLS = {
    "backward": 8, "step": 6, "zero_grad": 3, "zero_grad_keep": 2, "hold_state_dict": 2,
    "hold_dcp_state_dict": 1, "hold_state_tensor": 2, "load_own_state_dict": 2,
    "load_saved_state_dict": 1, "dcp_roundtrip": 1, "dcp_checkpoint": 1, "add_param_group": 1,
    "edit_hyperparameters": 2, "freeze": 1, "unfreeze": 1, "closure_step": 1,
    "compiled_step": 1, "raising_step": 1, "scheduler_step": 1, "scale_grads": 1,
    "write_state_in_place": 1, "assign_state": 1, "drop_state": 1,
}


@dataclass
class Side:
    """One implementation's model, optimizer and scheduler, and what the user holds of them."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    later: list  # the param group added by ``add_param_group``
    sched: torch.optim.lr_scheduler.LRScheduler | None = None
    held_dicts: list = field(default_factory=list)
    held_tensors: list = field(default_factory=list)
    compiled_step: object = None


def _pick_optimizer(rng: random.Random, name: str | None) -> tuple[str, dict]:
    """An optimizer (``name``, else weighted as users pick them) and its flags.

    Each flag keeps its default (the first choice) half of the time, else takes
    any of its choices: the combinations near the defaults, where most users
    are, come often, and every combination comes now and then.
    """
    if name is None:
        names = sorted(OPTIMIZERS)
        name = rng.choices(names, [WEIGHTS.get(n, 1) for n in names])[0]
    _, flags = OPTIMIZERS[name]
    kwargs = {f: c[0] if rng.random() < 0.5 else rng.choice(c) for f, c in flags.items()}
    if kwargs.get("fused"):
        kwargs["foreach"] = None
    if name == "SGD" and kwargs["momentum"] == 0:
        kwargs["nesterov"] = False
    return name, kwargs


WEIGHTS = {"AdamW": 3, "Adam": 2, "SGD": 3}  # else 1


def _build(shard, mesh, name: str, kwargs: dict, ragged: bool, extra: dict,
           tp_mesh=None) -> Side:
    # odd sizes: shards of every length, so a kernel's vector loop and scalar tail both show
    # (tensor parallelism splits the hidden dim in two: 38, 19 rows a TP rank)
    model = build_transformer(seed=5, dim=12, hidden=37 if tp_mesh is None else 38, vocab=29)
    if tp_mesh is not None:  # upstream's Colwise/Rowwise plan on each block, then FSDP
        from test_tensor_parallel import TP_PLAN
        from torch.distributed.tensor.parallel import parallelize_module

        for layer in model.layers:
            parallelize_module(layer, tp_mesh, TP_PLAN)
    if ragged:
        extra = {**extra, "shard_placement_fn": lambda p: fsdp2.RaggedShard()}
    shard_transformer(model, shard, mesh=mesh, **extra)
    matrices = [p for n, p in model.named_parameters() if p.dim() > 1 and "output" not in n]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    later = [p for n, p in model.named_parameters() if "output" in n]
    cls = OPTIMIZERS[name][0]
    opt = cls([{"params": matrices}, {"params": rest, "weight_decay": 0.0}],
              lr=LR.get(name, 1e-2), **kwargs)
    return Side(model, opt, later)


class Sequence:
    """One seeded sequence of calls on the two sides (see the module docstring)."""

    def __init__(self, seed: int, rank: int, world_size: int, *, ragged: bool, length: int,
                 optimizer: str | None = None, tier: str | None = None,
                 setting: str | None = None):
        self.rng = random.Random(seed)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.length = length
        torch.compiler.reset()  # each sequence compiles its own steps (no recompile limit)
        self.name, self.kwargs = _pick_optimizer(self.rng, optimizer)
        if ragged and self.kwargs.get("fused"):
            # torch's fused kernels round an element by where it falls in its tensor (vector
            # loop or scalar tail), and a rank's rows are not Shard(0)'s: last bits differ
            # (docs/layouts.md). The zoo holds the fused step to torch's on the same rows.
            self.kwargs["fused"] = None
        import torch.distributed.fsdp as upstream

        mesh, ours, theirs, tp_mesh = cpu_mesh(), {}, {}, None
        # the rank's data-parallel place: its slice of each batch
        self.data_rank, self.data_size = rank, world_size
        if setting == "tensor_parallel":  # (dp, tp) = (W / 2, 2), FSDP on dp
            both = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
            mesh, tp_mesh = both["dp"], both["tp"]
            self.data_rank, self.data_size = mesh.get_local_rank(), mesh.size()
        elif setting in ("hsdp", "replica_slices"):  # (replicate, shard) = (2, W / 2)
            mesh = init_device_mesh("cpu", (2, world_size // 2),
                                    mesh_dim_names=("replicate", "shard"))
        elif setting == "mixed_precision":  # bf16 gathers and compute, fp32 reduction
            mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
            ours = {"mp_policy": fsdp2.MixedPrecisionPolicy(**mp)}
            theirs = {"mp_policy": upstream.MixedPrecisionPolicy(**mp)}
        elif setting == "no_reshard":
            ours = theirs = {"reshard_after_forward": False}
        elif setting == "cpu_offload":  # parameters, gradients and state in host memory
            # (pinned memory needs an accelerator: a CPU mesh pins nothing)
            ours = {"offload_policy": fsdp2.CPUOffloadPolicy(pin_memory=False)}
            theirs = {"offload_policy": upstream.CPUOffloadPolicy(pin_memory=False)}
        elif setting == "reshard_to_2":  # W = 4: kept over groups of 2 after forward
            ours = theirs = {"reshard_after_forward": 2}
        elif setting is not None and setting not in ("accumulation", "replica_slices"):
            raise ValueError(f"unknown setting {setting!r}")
        # gradient accumulation: each backward sets gradient sync and is_last_backward first
        self.accumulation = setting == "accumulation"
        self.sides = [
            _build(fsdp2.fully_shard, mesh, self.name, self.kwargs, ragged, ours, tp_mesh),
            _build(upstream.fully_shard, mesh, self.name, self.kwargs, False, theirs, tp_mesh),
        ]
        # fsdp2's optimizer state sliced across replicas, against plain HSDP (see
        # [Note: Replica slices]): its state is each rank's slice, so the sides' state is
        # compared through state_dict() (the true layout against upstream's, as whole
        # values), and the calls that pick a state tensor out of optimizer.state (a slice's
        # on fsdp2's side) are skipped; a gradient holds only its replica's slice
        # (documented), not compared. Every trainable parameter of a group must be in the
        # optimizer: those added later stay frozen until then.
        self.replica_slices = setting == "replica_slices"
        if self.replica_slices:
            for side in self.sides:
                for p in side.later:
                    p.requires_grad_(False)
            fsdp2.enable_local_shard_step(self.sides[0].opt, shard_across_replicas=True)
        # the sides' DTensors in other layouts: compared as whole values, not local shards
        self.other_layouts = ragged or self.replica_slices
        # Drawn apart from the calls' stream, so that a seed's calls stay what they were.
        self.comms = random.Random(f"custom comms {seed}").random() < 0.25
        if self.comms:
            for side in self.sides:
                for module in side.model.modules():
                    if hasattr(module, "set_custom_all_gather"):
                        module.set_custom_all_gather(TorchAllGather())
                        module.set_custom_reduce_scatter(TorchReduceScatter())
        # upstream's private switch (Unsloth's recipes set it): hooks gather async
        self.async_unshard = random.Random(f"unshard async {seed}").random() < 0.25
        if self.async_unshard:
            for side in self.sides:
                side.model._set_unshard_async_op(True)
        self.tier = tier
        if tier is not None:  # fsdp2's optimizer state tiers (upstream has none: its own step)
            self._folder = tempfile.TemporaryDirectory()
            policy = fsdp2.OptimizerOffloadPolicy(tier=tier, directory=self._folder.name,
                                                  unit_bytes=1024)
            fsdp2.enable_local_shard_step(self.sides[0].opt, offload=policy)
        self.batch = 0
        self.log: list[str] = [f"seed {seed}: {self.name}({self.kwargs}), W={world_size}"
                               + (", RaggedShard" if ragged else "")
                               + (", custom comms" if self.comms else "")
                               + (", async unshard" if self.async_unshard else "")
                               + (f", offload={tier}" if tier else "")
                               + (f", {setting}" if setting else "")]

    # ---- the calls ------------------------------------------------------------------

    def run(self) -> str | None:
        calls, weights = zip(*CALLS.items())
        for i in range(self.length):
            call = self.rng.choices(calls, weights)[0]
            arg = self.rng.random()  # each call's own random choice, the same on both sides
            self.log.append(f"{i}: {call}")
            outcomes = []
            for side in self.sides:
                try:
                    getattr(self, call)(side, arg)
                    outcomes.append(None)
                except Exception as e:  # noqa: BLE001 - compared across the sides below
                    outcomes.append(e)
                if side is self.sides[0] and _documented_refusal(outcomes[0]):
                    self.log[-1] += " (refused, as docs/optimizers.md says)"
                    outcomes.append(outcomes[0])  # upstream does not take the call
                    break
            if outcomes[0] is None and _upstream_bug(outcomes[1]):
                self.log[-1] += " (upstream's bug, docs/differences.md: the sides part here)"
                return None
            problems = []
            if type(outcomes[0]) is not type(outcomes[1]):
                problems.append(f"raised {outcomes[0]!r} vs upstream {outcomes[1]!r}")
                if outcomes[0] is not None:  # where fsdp2 raised, for the report
                    problems.append("".join(traceback.format_exception(outcomes[0])[-6:]))
            problems += self.compare()
            if self._any_rank(bool(problems)):
                return "\n".join(self.log + [f"rank {self.rank}: {p}" for p in problems[:8]])
            if call == "load_own_state_dict" and outcomes[1] is not None:
                break  # e.g. both refused a state dict: nothing more to compare
        return None

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def backward(self, side: Side, arg: float) -> None:
        batch = rank_slice(batch_of(self.batch, 2 * self.data_size), self.data_rank, self.data_size)
        if self.accumulation:  # (the call's own draw: the same on both sides)
            side.model.set_requires_gradient_sync(arg >= 0.4)
            side.model.set_is_last_backward(arg < 0.2 or arg >= 0.5)
        loss_of(side.model, batch).backward()
        if side is self.sides[-1]:
            self.batch += 1

    def step(self, side: Side, arg: float) -> None:
        side.opt.step()

    def zero_grad(self, side: Side, arg: float) -> None:
        side.opt.zero_grad()

    def zero_grad_keep(self, side: Side, arg: float) -> None:
        side.opt.zero_grad(set_to_none=False)

    def closure_step(self, side: Side, arg: float) -> None:
        batch = rank_slice(batch_of(self.batch, 2 * self.data_size), self.data_rank, self.data_size)

        def closure():
            side.opt.zero_grad()
            loss = loss_of(side.model, batch)
            loss.backward()
            return loss

        side.opt.step(closure)

    def compiled_step(self, side: Side, arg: float) -> None:
        if side.compiled_step is None:
            side.compiled_step = torch.compile(side.opt.step, backend="eager")
        # Both sides' steps run torch's optimizer code, and Dynamo counts recompiles per code
        # object: past the limit a frame such as `_get_value` runs eagerly inside a traced step
        # and hands it a float (torch's TypeError), on whichever side compiled the ninth
        # variant first (seed 604 at W = 2, host tier). Each side alone stays far below it.
        with torch._dynamo.config.patch(recompile_limit=64):
            side.compiled_step()

    def raising_step(self, side: Side, arg: float) -> None:
        """A step that raises inside the optimizer: ``capturable`` on CPU, or a failing hook."""
        group = side.opt.param_groups[0]
        # (not on the NVMe tier: torch creates the whole group's state before it refuses
        # capturable on CPU, the unit-by-unit step only the first unit's, and keeps none:
        # docs/optimizers.md)
        if "capturable" in group and arg < 0.5 and self.tier != "nvme":
            group["capturable"] = True
            try:
                side.opt.step()
            finally:
                group["capturable"] = False
            return

        def fail(*_):
            raise RuntimeError("a user's step hook failed")

        handle = side.opt.register_step_post_hook(fail)
        try:
            side.opt.step()
        finally:
            handle.remove()

    def scheduler_step(self, side: Side, arg: float) -> None:
        if side.sched is None:
            side.sched = torch.optim.lr_scheduler.StepLR(side.opt, 1, gamma=0.8)
        side.sched.step()

    def edit_hyperparameters(self, side: Side, arg: float) -> None:
        group = side.opt.param_groups[int(arg * len(side.opt.param_groups))]
        group["lr"] = group["lr"] * 0.5
        if "weight_decay" in group:
            group["weight_decay"] = 0.05 if arg < 0.5 else 0.0
        if "amsgrad" in group and arg > 0.8 and not group.get("fused"):
            group["amsgrad"] = not group["amsgrad"]

    def scale_grads(self, side: Side, arg: float) -> None:
        for p in side.model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)

    def _layer(self, side: Side, arg: float) -> torch.nn.Module:
        return side.model.layers[int(arg * len(side.model.layers))]

    def freeze(self, side: Side, arg: float) -> None:
        for p in self._layer(side, arg).parameters():
            p.requires_grad_(False)

    def unfreeze(self, side: Side, arg: float) -> None:
        waiting = {id(p) for p in side.later} if self.replica_slices else set()
        for p in side.model.parameters():
            if id(p) not in waiting:
                p.requires_grad_(True)

    def add_param_group(self, side: Side, arg: float) -> None:
        if self.tier is not None:  # refused at the next step (the state's place is planned)
            return
        if side.later:
            side.opt.add_param_group({"params": side.later, "lr": 3e-3})
            if self.replica_slices:
                for p in side.later:
                    p.requires_grad_(True)
            side.later = []

    def hold_state_dict(self, side: Side, arg: float) -> None:
        side.held_dicts.append(("torch", side.opt.state_dict()))
        del side.held_dicts[:-3]

    def hold_dcp_state_dict(self, side: Side, arg: float) -> None:
        side.held_dicts.append(("dcp", get_optimizer_state_dict(side.model, side.opt)))
        del side.held_dicts[:-3]

    def hold_state_tensor(self, side: Side, arg: float) -> None:
        if self.replica_slices:
            return
        tensors = [v for s in side.opt.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor)]
        if tensors:
            side.held_tensors.append(tensors[int(arg * len(tensors))])
            del side.held_tensors[:-4]

    def _state_tensor(self, side: Side, arg: float) -> tuple[dict, str] | None:
        """A (per-parameter state dict, key) holding a parameter-shaped tensor, or None."""
        if self.replica_slices:
            return None
        found = [(s, k) for s in side.opt.state.values() for k, v in s.items()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        return found[int(arg * len(found))] if found else None

    def drop_state(self, side: Side, arg: float) -> None:
        """A caller drops a parameter's state (``del optimizer.state[p]``): its next step
        starts afresh, and a tensor held from the dropped state keeps its values."""
        if self.replica_slices:
            return
        params = [p for g in side.opt.param_groups for p in g["params"]]
        with_state = [p for p in params if p in side.opt.state]
        if with_state:
            del side.opt.state[with_state[int(arg * len(with_state))]]

    def write_state_in_place(self, side: Side, arg: float) -> None:
        """A transport receiving into the state, or a user's ``mul_``: written in place."""
        found = self._state_tensor(side, arg)
        if found is not None:
            found[0][found[1]].mul_(0.5)

    def assign_state(self, side: Side, arg: float) -> None:
        """A user replaces a state tensor by a new one (the optimizer must step that one)."""
        found = self._state_tensor(side, arg)
        if found is not None:
            found[0][found[1]] = found[0][found[1]].clone()

    def load_own_state_dict(self, side: Side, arg: float) -> None:
        side.opt.load_state_dict(side.opt.state_dict())

    def load_saved_state_dict(self, side: Side, arg: float) -> None:
        buffer = io.BytesIO()
        torch.save(side.opt.state_dict(), buffer)
        buffer.seek(0)
        side.opt.load_state_dict(torch.load(buffer, weights_only=False))

    def dcp_roundtrip(self, side: Side, arg: float) -> None:
        model_sd, optim_sd = get_state_dict(side.model, side.opt)
        set_state_dict(side.model, side.opt, model_state_dict=copy.deepcopy(model_sd),
                       optim_state_dict=copy.deepcopy(optim_sd))

    def dcp_checkpoint(self, side: Side, arg: float) -> None:
        """Save model and optimizer with DCP, load back: the saved state again. Half the
        time fsdp2's side goes through ``fsdp2.save_checkpoint`` / ``load_checkpoint`` (the
        manifest, the commit inside DCP's last step, the verified load; or, a quarter of
        the time, ``checksums=False``) against upstream's plain DCP calls."""
        with tempfile.TemporaryDirectory() as folder:
            names = [folder]
            dist.broadcast_object_list(names, src=0)
            if arg >= 0.5 and side is self.sides[0]:
                path = f"{names[0]}/checkpoint"
                fsdp2.save_checkpoint(path, side.model, side.opt, checksums=arg < 0.75)
                fsdp2.load_checkpoint(path, side.model, side.opt)
                dist.barrier()
                return
            state = {"model": side.model.state_dict(),
                     "optim": get_optimizer_state_dict(side.model, side.opt)}
            dcp.save(state, checkpoint_id=names[0])
            dist.barrier()
            state = {"model": side.model.state_dict(),
                     "optim": get_optimizer_state_dict(side.model, side.opt)}
            dcp.load(state, checkpoint_id=names[0])
            side.model.load_state_dict(state["model"])
            set_optimizer_state_dict(side.model, side.opt, state["optim"])
            dist.barrier()

    # ---- what a user can observe ----------------------------------------------------

    def compare(self) -> list[str]:
        ours, theirs = self.sides
        problems: list[str] = []
        self._whole = []  # (ours, theirs, problem): other layouts, gathered together at the end
        same = self._same
        names = [n for n, _ in ours.model.named_parameters()]
        for n, p, q in zip(names, ours.model.parameters(), theirs.model.parameters()):
            if not same(p.detach(), q.detach(), f"parameter {n}"):
                problems.append(f"parameter {n}")
            if self.replica_slices:
                pass  # a gradient holds only its replica's slice (documented)
            elif (p.grad is None) != (q.grad is None):
                problems.append(f"{n}.grad is {p.grad is None and 'None' or 'set'}")
            elif p.grad is not None and not same(p.grad, q.grad, f"{n}.grad"):
                problems.append(f"{n}.grad")
            if p.requires_grad != q.requires_grad:
                problems.append(f"{n}.requires_grad")
        index = {id(p): n for n, p in ours.model.named_parameters()}
        index.update({id(q): n for n, q in theirs.model.named_parameters()})
        for i, (g, h) in enumerate(zip(ours.opt.param_groups, theirs.opt.param_groups)):
            if [index.get(id(p), "?") for p in g["params"]] != [index.get(id(p)) for p in h["params"]]:
                problems.append(f"param_groups[{i}]['params']")
            if {k: v for k, v in g.items() if k != "params"} != {
                k: v for k, v in h.items() if k != "params"
            }:
                problems.append(f"param_groups[{i}] hyperparameters")
        if len(ours.opt.param_groups) != len(theirs.opt.param_groups):
            problems.append("number of param groups")
        if self.replica_slices:  # a collective on fsdp2's side (every rank walks the same)
            problems += self._same_state(ours.opt.state_dict()["state"],
                                         theirs.opt.state_dict()["state"], "state_dict() state")
        else:
            for n, p, q in zip(names, ours.model.parameters(), theirs.model.parameters()):
                problems += self._same_state(ours.opt.state.get(p), theirs.opt.state.get(q),
                                             f"state[{n}]")
            if len(ours.opt.state) != len(theirs.opt.state):
                problems.append(f"{len(ours.opt.state)} state entries vs {len(theirs.opt.state)}")
        for i, ((kind, a), (_, b)) in enumerate(zip(ours.held_dicts, theirs.held_dicts)):
            problems += self._same_state(a, b, f"held {kind} state dict {i}")
        for i, (a, b) in enumerate(zip(ours.held_tensors, theirs.held_tensors)):
            if not same(a, b, f"held state tensor {i}"):
                problems.append(f"held state tensor {i}")
        # whole values: one batched gather on every rank (the walk above is the same on each)
        fulls = full_all([t for a, b, _ in self._whole for t in (a, b)])
        problems += [problem for (*_, problem), a, b in zip(self._whole, fulls[::2], fulls[1::2])
                     if not torch.equal(a, b)]
        return problems

    def _same(self, a: torch.Tensor, b: torch.Tensor, problem: str) -> bool:
        """False where ``a`` and ``b`` differ; DTensors on another layout are compared as whole
        values after the walk (reported there as ``problem``)."""
        if isinstance(a, DTensor) != isinstance(b, DTensor):
            return False
        if isinstance(a, DTensor):
            if self.other_layouts:
                if a.shape != b.shape:
                    return False
                self._whole.append((a, b, problem))
                return True
            a, b = a.to_local(), b.to_local()
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    def _same_state(self, a, b, where: str) -> list[str]:
        """Nested dicts/lists of tensors and numbers: the same keys in order, types, values."""
        if isinstance(b, dict):
            if not isinstance(a, dict) or list(map(str, a)) != list(map(str, b)):
                return [f"{where}: keys {list(a) if isinstance(a, dict) else a!r} vs {list(b)}"]
            return [p for k in b for p in self._same_state(a[k], b[k], f"{where}[{k!r}]")]
        if isinstance(b, (list, tuple)):
            if type(a) is not type(b) or len(a) != len(b):
                return [f"{where}: {a!r} vs {b!r}"]
            return [p for i, (x, y) in enumerate(zip(a, b)) for p in self._same_state(x, y, f"{where}[{i}]")]
        if isinstance(b, torch.Tensor):
            if type(a) is not type(b) or not self._same(a, b, f"{where} differs"):
                return [f"{where} differs"]
            return []
        if isinstance(a, torch.Tensor) or (a != b and not (a != a and b != b)):  # NaN == NaN
            return [f"{where}: {a!r} vs {b!r}"]
        return []


def _documented_refusal(error: Exception | None) -> bool:
    """fsdp2's documented refusals with state offloaded or sliced across replicas: a
    closure, a compiled ``step()``, parameters added after the state's place was planned,
    a sliced run some of whose parameters have no gradient (docs/meshes.md)."""
    text = str(error)
    return (isinstance(error, ValueError) and (
        "step(closure) is not supported" in text or "planned where their state lives" in text
    )) or (isinstance(error, NotImplementedError) and "call optimizer.step() uncompiled" in text) or (
        isinstance(error, RuntimeError) and "cannot step on its own" in text)


def _upstream_bug(error: Exception | None) -> bool:
    """An upstream failure fsdp2 does not share (docs/differences.md): torch 2.13's
    ``fully_shard`` under mixed precision refuses the bf16 gradient of a parameter
    unfrozen after a backward that ran with it frozen (fixed in torch 2.15)."""
    return (isinstance(error, RuntimeError) and TORCH_RELEASE < (2, 15)
            and "to a tensor with grad_dtype" in str(error))


def run_sequence(seed: int, rank: int, world_size: int, *, ragged: bool = False,
                 length: int = 16, optimizer: str | None = None,
                 tier: str | None = None, setting: str | None = None) -> str | None:
    """One seeded sequence on fsdp2 and upstream; ``None`` or the first divergence's report.

    ``optimizer``: a name of ``OPTIMIZERS`` (its flags still random), else drawn too;
    ``tier``: fsdp2's optimizer state offloaded (``"host"`` or ``"nvme"``); ``setting``:
    both sides on an HSDP mesh (``"hsdp"``, W = 4), under tensor parallelism
    (``"tensor_parallel"``, (dp, tp) = (W / 2, 2)), in bf16 mixed precision
    (``"mixed_precision"``), with ``reshard_after_forward=False`` (``"no_reshard"``) or
    ``2`` (``"reshard_to_2"``, W = 4), under ``CPUOffloadPolicy`` (``"cpu_offload"``),
    accumulating gradients (``"accumulation"``: each backward first sets
    ``set_requires_gradient_sync`` and ``set_is_last_backward`` from its draw), or on
    HSDP with fsdp2's state sliced across replicas (``"replica_slices"``, W = 4; not in
    CI yet: it finds the divergences docs/meshes.md lists as not yet fixed).
    """
    return Sequence(seed, rank, world_size, ragged=ragged, length=length,
                    optimizer=optimizer, tier=tier, setting=setting).run()
