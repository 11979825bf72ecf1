"""docs/migrating-from-fsdp1.md: every Python block of the guide runs, on 2 ranks.

The guide's snippets import ``fsdp2`` themselves (it is fsdp2's guide), so the
file is fsdp2-only. Each block runs in a fresh namespace holding the names the
guide lists (``rank``, ``world_size``, ``device_type``, ``build_model``,
``Block``, ``loss_fn``, ``ckpt_dir``, ``fsdp1_dir``, ``fsdp1_file``); the FSDP1
checkpoint the last section loads is saved by torch's FSDP1 in the same launch.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
from _impl import fsdp2_only
from _multiproc import run_ranks
from models import Block, build_transformer, rank_slice, transformer_batch, transformer_loss

import fsdp2

# the guide's snippets import fsdp2 itself; examples of the API, run once per CI run
pytestmark = [fsdp2_only, pytest.mark.torch_independent]

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "docs", "migrating-from-fsdp1.md")
_BLOCK = re.compile(r"^## (.+?)$|^```python\n(.*?)^```", re.S | re.M)


def _snippets() -> dict[str, str]:
    """The guide's Python blocks, named after their section."""
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    snippets, section = {}, "intro"
    for heading, code in _BLOCK.findall(text):
        if heading:
            section = re.sub(r"[^a-z0-9]+", "_", heading.lower()).strip("_")
        else:
            snippets[section] = code
    return snippets


def _save_fsdp1(rank, world_size, root):
    """A checkpoint from torch's FSDP1: sharded (DCP) and a rank-0 full file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP1(build_transformer(seed=2), auto_wrap_policy=ModuleWrapPolicy({Block}),
                  device_id=torch.device("cpu"), use_orig_params=True)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    transformer_loss(model, rank_slice(transformer_batch(0, 4), rank, world_size)).backward()
    optim.step()
    with FSDP1.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP1.optim_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=os.path.join(root, "fsdp1_sharded"))
    with FSDP1.state_dict_type(
        model, StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
    ):
        msd, osd = model.state_dict(), FSDP1.optim_state_dict(model, optim)
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, os.path.join(root, "fsdp1_full.pt"))
    dist.barrier()


def _run_guide(rank, world_size, root):
    _save_fsdp1(rank, world_size, root)
    batch = rank_slice(transformer_batch(1, 2 * world_size), rank, world_size)
    outcome = {}
    for name, code in _snippets().items():
        namespace = {
            "rank": rank,
            "world_size": world_size,
            "device_type": "cpu",
            "build_model": lambda: build_transformer(seed=1),
            "Block": Block,
            "loss_fn": lambda model: transformer_loss(model, batch),
            "ckpt_dir": os.path.join(root, "ckpt"),
            "fsdp1_dir": os.path.join(root, "fsdp1_sharded"),
            "fsdp1_file": os.path.join(root, "fsdp1_full.pt"),
        }
        exec(compile(code, f"{GUIDE}:{name}", "exec"), namespace)  # noqa: S102
        model = namespace.get("model")
        outcome[name] = isinstance(model, fsdp2.FSDPModule)
    return outcome


@pytest.fixture(scope="module")
def guide_run(tmp_path_factory):
    return run_ranks(_run_guide, 2, str(tmp_path_factory.mktemp("guide")))


EXPECTED = [
    "sharding_strategy_mesh_shape_and_reshard_after_forward",
    "auto_wrap_policy_shard_model",
    "mixed_precision_mixedprecisionpolicy",
    "cpu_offload_cpuoffloadpolicy",
    "backward_prefetch_forward_prefetch_limit_all_gathers",
    "sync_module_states_param_init_fn_set_full_state_dict_from_rank_0",
    "no_sync_set_requires_gradient_sync",
    "summon_full_params",
    "clip_grad_norm",
    "state_dict_types_functions",
    "fsdp1_checkpoints",
]


def test_guide_has_a_snippet_per_feature():
    """The guide has one Python block for each FSDP1 feature it maps."""
    assert list(_snippets()) == EXPECTED


@pytest.mark.parametrize("section", EXPECTED)
def test_guide_snippet_runs(guide_run, section):
    """The guide's block for ``section`` runs on 2 ranks and leaves a sharded ``model``."""
    assert all(rank_outcome[section] for rank_outcome in guide_run)
