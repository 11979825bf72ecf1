"""Materialization in any order: meta-device models loaded or initialized module by module.

Every pattern real stacks use to materialize a model built on ``meta`` and
sharded (torchtitan's ``to_empty`` + init with a ``[norm, out]`` group,
torchtune's and accelerate's ``load_state_dict(assign=True)`` of distributed
full weights, loads per submodule, ``module.to(dtype)``, DCP's
``set_model_state_dict(broadcast_from_rank0=True)``) runs twice in one
launch: with the implementation under test and with upstream's
``fully_shard``. The materialized state (values, dtypes, devices,
placements, ``requires_grad``) must be identical, and so must three training
steps; where the values are the reference's (loads), the losses must also
match the unsharded model. Models: list groups with a frozen bias and a
frozen bf16 parameter (mixed dtypes), and tied embedding/output weights; on
W = 1, 2, 3, with CPU offload, and on a 2x2 HSDP mesh.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _impl import IMPL, CPUOffloadPolicy, fsdp2_only, fully_shard
from _multiproc import run_ranks
from checks import check_case, train_alone
from models import cpu_mesh, shard_groups
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as UpstreamCPUOffload
from torch.distributed.fsdp import fully_shard as upstream_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

VOCAB, DIM, SEQ = 13, 8, 5


class _Block(nn.Module):
    def __init__(self, mixed: bool) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, 2 * DIM)
        self.lin2 = nn.Linear(2 * DIM, DIM)
        # a frozen parameter of another dtype in the same group (LoRA-like base)
        self.scale = nn.Parameter(torch.ones(DIM, dtype=torch.bfloat16), requires_grad=False) if mixed else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.lin2(torch.relu(self.lin1(h)))
        return out * self.scale.float() if self.scale is not None else out


class Net(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([_Block(variant == "list") for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        if variant == "tied":
            self.out.weight = self.tok.weight
        self.blocks[0].lin1.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(self.norm(h))

    def reset_parameters(self) -> None:
        """Random init of every submodule, as torchtitan's init_weights does after to_empty."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                    module.reset_parameters()
            for block in self.blocks:
                if block.scale is not None:
                    block.scale.fill_(0.5)


def _reference(variant: str) -> Net:
    torch.manual_seed(7)
    model = Net(variant)
    with torch.no_grad():  # non-trivial norm and scale values
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.1, 0.1)
        for block in model.blocks:
            if block.scale is not None:
                block.scale.uniform_(0.5, 1.5)
    return model


def _shard_net(model: Net, shard_fn, mesh, offload: bool = False) -> Net:
    """Blocks, ``[norm, out]`` together (list variant), the root; ``offload`` without pinning."""
    kwargs = {"mesh": mesh}
    if offload:  # each implementation's own policy; no pinning on a CPU-only host
        policy = UpstreamCPUOffload if shard_fn is upstream_fully_shard else CPUOffloadPolicy
        kwargs["offload_policy"] = policy(pin_memory=False)
    # torchtitan groups the final norm with the output head
    head = [[model.norm, model.out]] if model.variant == "list" else []
    return shard_groups(model, shard_fn, [*model.blocks, *head], **kwargs)


def _distributed(full_sd: dict, like: dict) -> dict:
    """``full_sd`` as DTensors laid out like the model's own state dict ``like``."""
    return {
        k: distribute_tensor(full_sd[k], v.device_mesh, v.placements) for k, v in like.items()
    }


# ---- the materialization patterns: (meta model, sharded) -> materialized ---------


def _to_empty_reset(model, full_sd):
    model.to_empty(device="cpu")
    torch.manual_seed(11)
    model.reset_parameters()


def _to_empty_load(model, full_sd):
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(full_sd[name], p.device_mesh, p.placements))


def _to_empty_per_module(model, full_sd):
    # module by module, the two halves of the [norm, out] group apart
    for name in ("out", "blocks", "norm", "tok"):
        model.get_submodule(name).to_empty(device="cpu")
    _to_empty_load(model, full_sd)  # to_empty of what is already materialized is harmless


def _assign_root(model, full_sd):
    """torchtune's load_from_full_model_state_dict: each full tensor cast to the meta
    parameter's dtype, distributed like it, then one strict load with assign=True."""
    meta_sd = model.state_dict()
    sharded = {}
    for name, full_tensor in full_sd.items():
        meta = meta_sd[name]
        sharded[name] = nn.Parameter(  # requires_grad then follows the model's parameter
            distribute_tensor(full_tensor.to(meta.dtype), meta.device_mesh, meta.placements)
        )
    model.load_state_dict(sharded, strict=True, assign=True)


def _assign_per_module(model, full_sd):
    # one submodule at a time, the output head (half of a list group) first
    order = ["out", "blocks.1", "norm", "blocks.0", "tok"]
    if model.variant == "tied":
        order.remove("out")  # its weight is tok's: loaded with tok
    for prefix in order:
        sub = model.get_submodule(prefix)
        sub_full = {k[len(prefix) + 1 :]: v for k, v in full_sd.items() if k.startswith(prefix + ".")}
        result = sub.load_state_dict(_distributed(sub_full, sub.state_dict()), assign=True)
        assert not result.missing_keys and not result.unexpected_keys, result


def _to_empty_load_to_f64(model, full_sd):
    _to_empty_load(model, full_sd)
    model.to(torch.float64)


def _dcp_broadcast(model, full_sd):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_sd if dist.get_rank() == 0 else {}, options=options)


PATTERNS = {
    "to_empty_reset": _to_empty_reset,
    "to_empty_load": _to_empty_load,
    "to_empty_per_module": _to_empty_per_module,
    "assign_root": _assign_root,
    "assign_per_module": _assign_per_module,
    "to_empty_load_to_f64": _to_empty_load_to_f64,
    "dcp_broadcast": _dcp_broadcast,
}
# Patterns whose values are the reference's (the others draw random values).
LOADS = {"to_empty_load", "to_empty_per_module", "assign_root", "assign_per_module", "to_empty_load_to_f64", "dcp_broadcast"}


def _state(model: nn.Module) -> dict:
    """What must match upstream: per parameter its full value and its metadata."""
    out = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p, nn.Parameter), (name, type(p))
        meta = (p.dtype, p.device, tuple(p.placements), p.requires_grad, p.shape)
        # a tied weight loaded through one owner only is re-tied at lazy init
        out[name] = (meta, None if p.is_meta else p.full_tensor().detach().clone())
    return out


def _assert_views_of_flat_buffers(model: nn.Module) -> None:
    """fsdp2's layout: every sharded parameter views its group's flat buffer."""
    from fsdp2.runtime.hooks.state import state_of

    for module in model.modules():
        state = state_of(module)
        if state is None or state.param_group is None:
            continue
        flat = state.param_group.sharded_flat
        start, stop = flat.data_ptr(), flat.data_ptr() + flat.nbytes
        for p in state.param_group.fsdp_params:
            local = p.sharded_param.to_local()
            assert start <= local.data_ptr() < stop, p.fqn  # the buffer's memory
            slot_nbytes = p.padded_shard_numel * local.element_size()
            assert local.untyped_storage().nbytes() == slot_nbytes, p.fqn  # its slot only


def _train_next_token(model: nn.Module, dtype: torch.dtype, world_size: int,
                      rank: int | None) -> list[float]:
    """Three AdamW steps on ``2 * world_size`` sequences: this rank's share, or all (``None``)."""
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, VOCAB, (2 * world_size, SEQ), generator=gen),) for _ in range(3)]

    def next_token_loss(model, batch):  # logits in ``dtype``; the tokens are their own targets
        (x,) = batch
        return nn.functional.cross_entropy(model(x).flatten(0, 1).to(dtype), x.flatten())

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return train_alone(model, batches, next_token_loss, rank, world_size, opt)


def _mesh(setup: str):
    if setup == "hsdp":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return cpu_mesh()


def _flow(variant, setup, pattern, shard_fn, rank, world_size):
    full_sd = {k: v.detach().clone() for k, v in _reference(variant).state_dict().items()}
    with torch.device("meta"):
        model = Net(variant)
    _shard_net(model, shard_fn, _mesh(setup), offload=setup == "offload")
    PATTERNS[pattern](model, full_sd)
    state = _state(model)
    dtype = torch.float64 if pattern.endswith("f64") else torch.float32
    losses = _train_next_token(model, dtype, world_size, rank)
    return model, state, losses, _state(model)


def _case(variant, setup, pattern):
    def body(rank, world_size):
        model, state, losses, final = _flow(
            variant, setup, pattern, fully_shard, rank, world_size
        )
        if IMPL == "fsdp2":
            _assert_views_of_flat_buffers(model)
        _, up_state, up_losses, up_final = _flow(
            variant, setup, pattern, upstream_fully_shard, rank, world_size
        )
        for got, want, when in ((state, up_state, "materialized"), (final, up_final, "trained")):
            assert list(got) == list(want), (when, list(got), list(want))
            for name in want:
                assert got[name][0] == want[name][0], (when, name, got[name][0], want[name][0])
                if want[name][1] is not None:
                    assert torch.equal(got[name][1], want[name][1]), (when, name)
        assert losses == up_losses, (losses, up_losses)
        if pattern in LOADS:  # the unsharded model, trained on the same data
            ref = _reference(variant)
            if pattern.endswith("f64"):
                ref = ref.to(torch.float64)
            dtype = torch.float64 if pattern.endswith("f64") else torch.float32
            ref_losses = _train_next_token(ref, dtype, world_size, None)
            torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
            for name, p in ref.named_parameters():
                torch.testing.assert_close(final[name][1], p.detach(), rtol=1e-4, atol=1e-5)

    return body


CASES = {
    f"{variant}-{setup}-{pattern}": _case(variant, setup, pattern)
    for variant, setup in (("list", "fsdp"), ("tied", "fsdp"), ("list", "offload"))
    for pattern in PATTERNS
}
HSDP_CASES = {f"list-hsdp-{pattern}": _case("list", "hsdp", pattern) for pattern in PATTERNS}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_materialize_pattern_matches_upstream(case, world_size, launch_cases):
    """A meta model materialized by one pattern equals upstream's, before and after training."""
    check_case(launch_cases(world_size, CASES), case)


@pytest.mark.parametrize("case", list(HSDP_CASES))
def test_materialize_pattern_matches_upstream_hsdp(case, launch_cases):
    """The same on a 2x2 HSDP mesh (placements Replicate, Shard(0))."""
    check_case(launch_cases(4, HSDP_CASES), case)


def _partial_body(rank, world_size, use):
    with torch.device("meta"):
        model = Net("list")
    _shard_net(model, fully_shard, cpu_mesh())
    model.to_empty(device="cpu")  # everything, then the output head goes back to meta
    model.out.to_empty(device="meta")
    try:
        if use == "forward":
            model(torch.zeros(1, SEQ, dtype=torch.long))
        else:
            model.norm.unshard()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("use", ["forward", "unshard"])
def test_partly_materialized_group_names_params_on_meta(use):
    """Using a group half on meta raises upstream's RuntimeError on every rank, naming the rest."""
    messages = run_ranks(_partial_body, 2, use)
    # Before lazy init names are relative to the fully_shard call (upstream prints None).
    name = "out.weight" if use == "forward" else "Linear[1].weight"
    for message in messages:
        assert message is not None, "no error"
        assert "still on meta device" in message, message
        if IMPL == "fsdp2" or use == "forward":
            assert f"still on meta device: ['{name}']" in message, message


def _to_empty_views_body(rank, world_size):
    with torch.device("meta"):
        model = Net("list")
    _shard_net(model, fully_shard, cpu_mesh())
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.to_local().device.type == "cpu", name
    _assert_views_of_flat_buffers(model)  # already, before any forward


@fsdp2_only
def test_to_empty_allocates_each_group_once():
    """FSDPModule.to_empty makes every sharded parameter a view of its group's one buffer."""
    run_ranks(_to_empty_views_body, 3)
