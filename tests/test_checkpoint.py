"""Sharded checkpoints with torch.distributed.checkpoint: save at W, resume at W' on the same trajectory.

``save_checkpoint`` / ``load_checkpoint`` are fsdp2's API over torch's
``get_state_dict`` and DCP; the models are sharded by the implementation under
test, so ``FSDP2_TEST_IMPL=torch`` runs the same checks on upstream models.
"""

from __future__ import annotations

import pytest
import torch
from _impl import fully_shard
from _multiproc import run_ranks
from checks import ATOL, RTOL, assert_losses_match, train_steps
from models import (
    assert_params_match,
    build_mlp,
    build_transformer,
    cpu_mesh,
    full,
    make_pair,
    shard_mlp,
    shard_transformer,
    transformer_batch,
    transformer_loss,
)
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from fsdp2 import load_checkpoint, save_checkpoint

_GLOBAL_BATCH = 12  # divides evenly over 1, 2, 3 and 4 ranks
_SAVED_AT, _STEPS = 3, 5


def _optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=5e-2, momentum=0.9)


def _batches():
    return [transformer_batch(s, _GLOBAL_BATCH) for s in range(_STEPS)]


def _save_body(rank, world_size, ckpt, optim_name):
    ref, model = make_pair(lambda: build_transformer(seed=21))
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    opts = _optimizer(optim_name, ref.parameters()), _optimizer(optim_name, model.parameters())
    batches = _batches()
    ref_losses, losses = train_steps(
        ref, model, batches[:_SAVED_AT], transformer_loss, rank, world_size, opts
    )
    assert_losses_match(ref_losses, losses)
    # what DCP writes: DTensor values under parameter names, optimizer state included
    msd, osd = get_state_dict(model, opts[1])
    names = [n for n, _ in ref.named_parameters()]
    assert list(msd) == names and all(isinstance(v, DTensor) for v in msd.values())
    assert sorted(osd["state"]) == sorted(names), list(osd["state"])
    for fqn, state in osd["state"].items():
        sharded = [k for k, v in state.items() if isinstance(v, DTensor)]
        assert sharded, f"{fqn}: no sharded optimizer state in {list(state)}"
    saved = {n: full(p.detach()) for n, p in model.named_parameters()}
    save_checkpoint(ckpt, model, opts[1], extra={"step": _SAVED_AT})
    # the uninterrupted run goes on
    ref_losses, more = train_steps(
        ref, model, batches[_SAVED_AT:], transformer_loss, rank, world_size, opts
    )
    assert_losses_match(ref_losses, more)
    return losses + more, saved


def _resume_body(rank, world_size, ckpt, optim_name, uninterrupted, saved):
    ref = build_transformer(seed=21)
    ref_opt = _optimizer(optim_name, ref.parameters())
    batches = _batches()
    for batch in batches[:_SAVED_AT]:
        transformer_loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = build_transformer(seed=22)  # different values: all must come from the checkpoint
    shard_transformer(model, fully_shard, mesh=cpu_mesh())
    opt = _optimizer(optim_name, model.parameters())
    extra = {"step": 0}
    load_checkpoint(ckpt, model, opt, extra=extra)
    assert extra["step"] == _SAVED_AT
    for name, p in model.named_parameters():  # bit for bit what was saved
        torch.testing.assert_close(full(p.detach()), saved[name], rtol=0, atol=0, msg=name)
    ref_losses, losses = train_steps(
        ref, model, batches[_SAVED_AT:], transformer_loss, rank, world_size, (ref_opt, opt)
    )
    assert_losses_match(ref_losses, losses)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(uninterrupted[_SAVED_AT:]), rtol=RTOL, atol=ATOL
    )
    assert_params_match(ref, model, RTOL, ATOL)


@pytest.mark.parametrize(
    "save_ws,load_ws,optim_name", [(4, 2, "adamw"), (2, 3, "sgd"), (2, 1, "adamw")]
)
def test_resume_at_another_world_size_follows_the_uninterrupted_run(
    tmp_path, save_ws, load_ws, optim_name
):
    """Save model+optimizer with DCP at W, load at W': every later loss, grad and param matches."""
    ckpt = str(tmp_path / "ckpt")
    uninterrupted, saved = run_ranks(_save_body, save_ws, ckpt, optim_name)[0]
    run_ranks(_resume_body, load_ws, ckpt, optim_name, uninterrupted, saved)


def _mismatch_body(rank, world_size, ckpt):
    source = build_transformer(seed=23)
    shard_transformer(source, fully_shard, mesh=cpu_mesh())
    source_opt = torch.optim.AdamW(source.parameters(), lr=1e-2)
    save_checkpoint(ckpt, source, source_opt)

    def expect_error(build, shard, pattern, optim_name="adamw", extra=None):
        model = build()
        shard(model, fully_shard, mesh=cpu_mesh())
        opt = _optimizer(optim_name, model.parameters())
        before = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match=pattern):
            load_checkpoint(ckpt, model, opt, extra=extra)
        for n, p in model.named_parameters():
            torch.testing.assert_close(full(p.detach()), before[n], rtol=0, atol=0, msg=n)
        assert not opt.state, "a failed load left optimizer state behind"

    expect_error(lambda: build_transformer(seed=1, hidden=12), shard_transformer,
                 r"size mismatches: model\.layers\.0\.feed_forward\.w1\.weight: \(11, 8\) in "
                 r"the checkpoint, \(12, 8\) in the model")
    expect_error(lambda: build_transformer(seed=1, n_layers=1), shard_transformer,
                 r"unexpected .*: model\.layers\.1\.attention_norm\.weight")
    expect_error(lambda: build_transformer(seed=1, n_layers=3), shard_transformer,
                 r"missing .*: model\.layers\.2\.attention_norm\.weight")
    expect_error(build_mlp, shard_mlp,
                 r"(?s)missing .*model\.in_proj\.weight.*unexpected .*model\.tok_embeddings")
    expect_error(lambda: build_transformer(seed=1), shard_transformer,
                 r"(?s)missing .*momentum_buffer.*unexpected .*exp_avg", "sgd")
    expect_error(lambda: build_transformer(seed=1), shard_transformer,
                 r"missing .*: extra\.epoch", extra={"epoch": 0})


def test_load_checkpoint_rejects_another_model_and_loads_nothing(tmp_path):
    """A checkpoint of another model/optimizer: one error naming every key; params and optimizer untouched."""
    run_ranks(_mismatch_body, 2, str(tmp_path / "ckpt"))
