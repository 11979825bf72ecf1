"""FSDP1 checkpoints load into ``fully_shard`` models at another world size.

torch's own FSDP1 (``FullyShardedDataParallel``, CPU gloo) trains a model on 2
ranks and saves it the ways FSDP1 scripts do: sharded DCP checkpoints
(``SHARDED_STATE_DICT`` + ``FSDP.optim_state_dict``, with ``use_orig_params``
True and False) and rank-0 full files (``FULL_STATE_DICT`` + the full optimizer
dict keyed by parameter name, or by parameter index after
``FSDP.rekey_optim_state_dict(..., PARAM_ID, ...)``, or a plain unsharded
model's ``optimizer.state_dict()``). Each loads into a model sharded by the
implementation under test on 3 ranks and on 1: parameters and optimizer state
equal FSDP1's, and the next two steps' losses equal FSDP1's next two steps.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _impl import fully_shard
from _multiproc import run_ranks
from checks import check_case
from models import (
    Block,
    build_transformer,
    cpu_mesh,
    global_mean,
    rank_slice,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateKeyType,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp2 import load_checkpoint, set_full_state_dict

SEED, LR, BATCH, SAVED_STEPS = 21, 1e-2, 6, 2  # BATCH divides over 1, 2 and 3 ranks
RTOL, ATOL = 1e-5, 1e-6


def _batches():
    return [transformer_batch(s, BATCH) for s in range(SAVED_STEPS + 2)]


def _step(model, opt, batch, rank, world_size):
    loss = transformer_loss(model, rank_slice(batch, rank, world_size))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _next_losses(model, opt, rank, world_size, mean=global_mean):
    """The loss of the step after the checkpoint (then its update), and of the step after that."""
    batches = _batches()
    first = mean(_step(model, opt, batches[SAVED_STEPS], rank, world_size)).item()
    with torch.no_grad():
        loss = transformer_loss(model, rank_slice(batches[SAVED_STEPS + 1], rank, world_size))
    return [first, mean(loss).item()]


def _save_body(rank, world_size, root):
    """FSDP1 on 2 ranks: train, save every kind of checkpoint, then record the next losses."""
    losses = {}
    for use_orig_params in (True, False):
        model = FSDP1(build_transformer(seed=SEED), auto_wrap_policy=ModuleWrapPolicy({Block}),
                      device_id=torch.device("cpu"), use_orig_params=use_orig_params)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        for batch in _batches()[:SAVED_STEPS]:
            _step(model, opt, batch, rank, world_size)
        with FSDP1.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP1.optim_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=os.path.join(root, f"sharded_{use_orig_params}"))
        # offload_to_cpu=False: on a CPU-only build the offloaded full optimizer state
        # aliases one reused buffer (see the issue); on CPU it is on the CPU anyway.
        with FSDP1.state_dict_type(
            model, StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        ):
            msd, osd = model.state_dict(), FSDP1.optim_state_dict(model, opt)
        if rank == 0:
            # use_orig_params=False: FSDP1's own parameters are flat; rekey with the plain model
            named = model if use_orig_params else build_transformer(seed=SEED)
            by_index = FSDP1.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, named)
            assert all(isinstance(k, int) for k in by_index["state"])
            torch.save({"model": msd, "optim": osd}, os.path.join(root, f"full_{use_orig_params}.pt"))
            torch.save({"model": msd, "optim": by_index},
                       os.path.join(root, f"full_ids_{use_orig_params}.pt"))
        losses[use_orig_params] = _next_losses(model, opt, rank, world_size)
    if rank == 0:  # an unsharded model and its plain optimizer.state_dict() (keyed by index)
        plain = build_transformer(seed=SEED)
        opt = torch.optim.Adam(plain.parameters(), lr=LR)
        for batch in _batches()[:SAVED_STEPS]:
            _step(plain, opt, batch, 0, 1)
        torch.save({"model": plain.state_dict(), "optim": opt.state_dict()},
                   os.path.join(root, "plain.pt"))
        names = [n for n, _ in plain.named_parameters()]
        by_name = {"state": {names[i]: s for i, s in opt.state_dict()["state"].items()}}
        torch.save({"model": plain.state_dict(), "optim": by_name},
                   os.path.join(root, "plain_by_name.pt"))
        losses["plain"] = _next_losses(plain, opt, 0, 1, mean=lambda t: t.detach())
    return losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Run the FSDP1 save launch once: (directory, FSDP1's next losses per run)."""
    root = str(tmp_path_factory.mktemp("fsdp1_ckpt"))
    results = run_ranks(_save_body, 2, root)
    return root, results[0]


# (how it is loaded, which FSDP1 run / file) -> where the expected values come from
VARIANTS = {
    "load_checkpoint_orig_params": ("load_checkpoint", "sharded_True", True),
    "load_checkpoint_flat_params": ("load_checkpoint", "sharded_False", False),
    "dcp_orig_params": ("dcp", "sharded_True", True),
    "dcp_flat_params": ("dcp", "sharded_False", False),
    "full_by_name_orig_params": ("full", "full_True.pt", True),
    "full_by_name_flat_params": ("full", "full_False.pt", False),
    "full_by_index_orig_params": ("full", "full_ids_True.pt", True),
    "full_by_index_flat_params": ("full", "full_ids_False.pt", False),
    "plain_optimizer_state_dict": ("full", "plain.pt", "plain"),
}


def _expected(root, run):
    name = "plain_by_name.pt" if run == "plain" else f"full_{run}.pt"
    return torch.load(os.path.join(root, name), weights_only=False)


def _load_case(root, fsdp1_losses, how, source, run):
    def case(rank, world_size):
        model = build_transformer(seed=SEED + 1)  # other values: the load must set them all
        shard_transformer(model, fully_shard, mesh=cpu_mesh())
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        path = os.path.join(root, source)
        if how == "load_checkpoint":
            load_checkpoint(path, model, opt)
        elif how == "dcp":
            state = {"model": get_model_state_dict(model),
                     "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, state["optim"])
        else:
            sd = torch.load(path, weights_only=False) if rank == 0 else {"model": None, "optim": None}
            set_full_state_dict(model, opt, model_state_dict=sd["model"],
                                optim_state_dict=sd["optim"])
        expected = _expected(root, run)
        full = StateDictOptions(full_state_dict=True)
        msd = get_model_state_dict(model, options=full)
        assert sorted(msd) == sorted(expected["model"])
        for key, value in expected["model"].items():
            torch.testing.assert_close(msd[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
        osd = get_optimizer_state_dict(model, opt, options=full)
        assert sorted(osd["state"]) == sorted(expected["optim"]["state"])
        for fqn, entry in expected["optim"]["state"].items():
            assert sorted(osd["state"][fqn]) == sorted(entry), (fqn, osd["state"][fqn].keys())
            for key, value in entry.items():
                torch.testing.assert_close(osd["state"][fqn][key], value, rtol=0, atol=0,
                                           msg=lambda m, k=f"{fqn}.{key}": f"{k}: {m}")
        losses = _next_losses(model, opt, rank, world_size)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(fsdp1_losses[run]),
                                   rtol=RTOL, atol=ATOL)

    return case


def _index_mismatch_case(root):
    def case(rank, world_size):
        model = shard_transformer(build_transformer(seed=SEED), fully_shard, mesh=cpu_mesh())
        params = list(model.parameters())
        opt = torch.optim.Adam([{"params": params[:3]}, {"params": params[3:]}], lr=LR)
        path = os.path.join(root, "full_ids_True.pt")
        sd = torch.load(path, weights_only=False) if rank == 0 else {"model": None, "optim": None}
        with pytest.raises(ValueError, match="keyed by parameter index and has 1 parameter group"):
            set_full_state_dict(model, opt, model_state_dict=sd["model"],
                                optim_state_dict=sd["optim"])
        assert not opt.state  # refused on every rank before anything was written

    return case


def _cases(root, losses):
    cases = {name: _load_case(root, losses, *spec) for name, spec in VARIANTS.items()}
    cases["index_keyed_other_groups"] = _index_mismatch_case(root)
    return cases


@pytest.mark.parametrize("world_size", [3, 1])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fsdp1_checkpoint_loads(saved, variant, world_size, launch_cases):
    """An FSDP1 checkpoint saved on 2 ranks loads on ``world_size``: state and next losses equal."""
    root, losses = saved
    check_case(launch_cases(world_size, _cases(root, losses), key=root),
               variant)


@pytest.mark.parametrize("world_size", [3, 1])
def test_index_keyed_optimizer_needs_the_saved_groups(saved, world_size, launch_cases):
    """Index-keyed optimizer state into an optimizer with other groups: one ValueError on every rank."""
    root, losses = saved
    check_case(launch_cases(world_size, _cases(root, losses), key=root),
               "index_keyed_other_groups")
