"""accelerate's own FSDP2 functions running on fsdp2 through ``fsdp2.patch_torch()``.

On 2 gloo ranks, a tiny Hugging Face ``LlamaForCausalLM`` goes through
accelerate's real code (no mocks of accelerate or of the collectives):
``accelerate.utils.fsdp_utils.fsdp2_prepare_model`` with the
transformer-layer auto-wrap policy (``LlamaDecoderLayer``), a few SGD steps
of two micro-batches each (the first under ``Accelerator.no_sync``) with
``Accelerator.clip_grad_norm_``, and ``Accelerator.get_state_dict`` for full
state dicts. The second test takes accelerate's ``cpu_ram_efficient_loading``
path: the model moves to ``meta``, is sharded there, and
``fsdp2_load_full_state_dict`` fills it from rank 0's weights (the other
ranks start from NaNs). The same flow runs once with fsdp2 (inside
``patch_torch()``) and once with upstream ``fully_shard`` (unpatched), in the
same processes: losses, gradient norms and state dicts must be identical to
the last bit, and both must match a single-process reference.

accelerate enables FSDP only on an accelerator device, never on a CPU-only
host, so the test cannot build a working ``Accelerator(fsdp_plugin=...)``
here. It builds an ``Accelerator`` object without running its ``__init__`` and
gives it a stand-in for ``AcceleratorState`` that selects FSDP2 and carries a
real ``FullyShardedDataParallelPlugin``; accelerate's functions and
``Accelerator`` methods then run unmodified on it.

With ``FSDP2_TEST_IMPL=torch`` only the upstream flow runs (against the
reference), which checks the test itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.fsdp
from _impl import IMPL
from checks import check_case
from models import full, global_mean

import fsdp2

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils.fsdp_utils import fsdp2_prepare_model  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, MICRO = 64, 8, 4, 3, 2  # MICRO: micro-batches per step
LR, MAX_NORM = 0.1, 1.0  # the norm is above MAX_NORM at first, so clipping acts
RTOL, ATOL = 1e-5, 1e-6


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


def _batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + MICRO * step + micro)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


@dataclass
class Run:
    """What one flow produced: full state dicts (rank 0; empty elsewhere), losses, grad norms."""

    initial: dict
    losses: torch.Tensor
    norms: torch.Tensor
    final: dict


def _accelerator(plugin, rank: int, world_size: int) -> Accelerator:
    """An ``Accelerator`` whose state selects FSDP2 on CPU (see the module docstring)."""
    acc = Accelerator.__new__(Accelerator)
    acc.state = SimpleNamespace(
        distributed_type=DistributedType.FSDP, is_fsdp2=True, fsdp_plugin=plugin,
        is_main_process=rank == 0, process_index=rank, num_processes=world_size,
        mixed_precision="no", device=torch.device("cpu"), device_mesh=None,
        parallelism_config=None,
    )
    acc.native_amp = False  # read by Accelerator.unscale_gradients
    acc._models = []  # where Accelerator.prepare registers models; clip_grad_norm_ looks there
    return acc


def _accelerate_flow(rank: int, world_size: int, *, use_fsdp2: bool, ram_efficient: bool) -> Run:
    model = _llama()
    if ram_efficient and rank != 0:
        # cpu_ram_efficient_loading: only rank 0 holds the weights; garbage elsewhere
        # must be replaced by rank 0's values during fsdp2_prepare_model.
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
    with fsdp2.patch_torch() if use_fsdp2 else contextlib.nullcontext():
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            cpu_ram_efficient_loading=ram_efficient, state_dict_type="FULL_STATE_DICT",
        )
        acc = _accelerator(plugin, rank, world_size)
        model = fsdp2_prepare_model(acc, model)
        acc._models.append(model)
        assert isinstance(model, fsdp2.FSDPModule) == use_fsdp2, type(model).__mro__
        fsdp_module = torch.distributed.fsdp.FSDPModule  # fsdp2's class while patched
        for sub in (*model.model.layers, model.model.embed_tokens, model.lm_head, model):
            assert isinstance(sub, fsdp_module), f"{type(sub).__name__} was not sharded"
        initial = acc.get_state_dict(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses, norms = [], []
        for step in range(STEPS):
            for micro in range(MICRO):  # gradient accumulation: no_sync on all but the last
                ids = _batch(step, micro).chunk(world_size)[rank]
                with acc.no_sync(model) if micro < MICRO - 1 else contextlib.nullcontext():
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                losses.append(global_mean(loss))
            norms.append(full(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            opt.zero_grad()
        final = acc.get_state_dict(model)
    return Run(initial, torch.stack(losses), torch.stack(norms), final)


def _reference() -> Run:
    model = _llama()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            ids = _batch(step, micro)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
    return Run(initial, torch.stack(losses), torch.stack(norms), model.state_dict())


def _assert_matches_reference(run: Run, ref: Run, rank: int, who: str) -> None:
    torch.testing.assert_close(run.losses, ref.losses, rtol=RTOL, atol=ATOL, msg=f"{who} losses")
    torch.testing.assert_close(run.norms, ref.norms, rtol=RTOL, atol=ATOL, msg=f"{who} grad norms")
    assert ref.norms[0] > MAX_NORM, ref.norms  # clipping was exercised
    if rank != 0:  # full state dicts come to rank 0 only (cpu_offload=True)
        assert run.initial == {} and run.final == {}, (list(run.initial), list(run.final))
        return
    for label, got, want in (("initial", run.initial, ref.initial), ("final", run.final, ref.final)):
        assert list(got) == list(want), (who, label, list(got), list(want))
        for key, value in want.items():
            assert type(got[key]) is torch.Tensor, (who, label, key, type(got[key]))
            if label == "initial":  # sharding and gathering must not change a bit
                assert torch.equal(got[key], value), (who, label, key)
            else:
                torch.testing.assert_close(
                    got[key], value, rtol=RTOL, atol=ATOL, msg=f"{who} {label} {key}"
                )


def _assert_identical(ours: Run, upstream: Run) -> None:
    assert torch.equal(ours.losses, upstream.losses), (ours.losses, upstream.losses)
    assert torch.equal(ours.norms, upstream.norms), (ours.norms, upstream.norms)
    for label in ("initial", "final"):
        got, want = getattr(ours, label), getattr(upstream, label)
        assert list(got) == list(want), (label, list(got), list(want))
        for key in want:
            assert torch.equal(got[key], want[key]), (label, key)


def _case(ram_efficient: bool):
    def case(rank, world_size):
        ref = _reference()
        runs = {}
        if IMPL == "fsdp2":
            runs["fsdp2"] = _accelerate_flow(rank, world_size, use_fsdp2=True, ram_efficient=ram_efficient)
        runs["upstream"] = _accelerate_flow(rank, world_size, use_fsdp2=False, ram_efficient=ram_efficient)
        if "fsdp2" in runs:
            _assert_identical(runs["fsdp2"], runs["upstream"])
        for who, run in runs.items():
            _assert_matches_reference(run, ref, rank, who)

    return case


def test_prepare_model_trains_and_state_dict_like_upstream(launch_cases):
    """fsdp2_prepare_model (auto-wrap), training, get_state_dict: fsdp2 == upstream bitwise == reference."""
    check_case(launch_cases(2, {"prepare": _case(ram_efficient=False)}), "prepare")


def test_cpu_ram_efficient_loading_from_meta_like_upstream(launch_cases):
    """cpu_ram_efficient_loading: meta model + fsdp2_load_full_state_dict from rank 0, then training."""
    outcome = launch_cases(2, {"meta": _case(ram_efficient=True)})
    check_case(outcome, "meta")
