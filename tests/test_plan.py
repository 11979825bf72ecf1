"""fsdp2.plan: predicted peak memory and bytes against real gloo runs, and against FSDPMemTracker.

Each validation case builds the same model for real on W = 2 and 4 gloo ranks
(through the planner's own grouping, ``shard_model``), trains two warm-up
steps, then measures one step the way ``benchmarks/bench_bytes.py`` does:
``benchmarks/instruments.LiveBytes`` (live storage bytes, on from before the
model is built) and ``CommCounter`` (logical collective bytes). The planner
simulates the same step on fake tensors at the same W. Predicted peak must be
within 10% of the measured one and predicted bytes equal to counted bytes.
Under ``FSDP2_TEST_IMPL=torch`` both sides use upstream's ``fully_shard``.
Models: the demo model (examples/model.py), a small Hugging Face Llama and
GPT-2. All real runs of one W share one launch; the table of results prints
with ``pytest -s``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings

import pytest
import torch
from _impl import IMPL, fsdp2_only

pytest.importorskip("transformers")

from fsdp2.plan import PlanConfig, plan, search, workload  # noqa: E402
from fsdp2.plan.cost import get_device  # noqa: E402
from fsdp2.plan.simulate import _make_optimizer, shard_model  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SEQ = 2, 64


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def demo_model():
    return _load("examples/model.py", "_plan_demo_model").demo_model()


LLAMA = {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
}
GPT2 = {
    "model_type": "gpt2", "vocab_size": 512, "n_embd": 64, "n_layer": 3, "n_head": 4,
    "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0,
}
CASES = {
    "demo": {"model": demo_model},
    "demo, no reshard, bf16": {
        "model": demo_model, "reshard_after_forward": False, "param_dtype": "bf16",
        "reduce_dtype": "float32",
    },
    "hf llama": {"hf_config": LLAMA},
    "hf gpt2": {"hf_config": GPT2},
}


def _config(name: str, world_size: int) -> PlanConfig:
    return PlanConfig(
        world_size=world_size, batch_size=BATCH, seq_len=SEQ, implementation=IMPL, **CASES[name]
    )


def _train_step(model, optim, i: int) -> None:
    torch.manual_seed(100 + i)
    inputs, targets = workload.token_inputs(model, BATCH, SEQ)
    workload.lm_loss(model(*inputs), targets).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _measure(rank: int, world_size: int, names: list[str]) -> dict:
    """One measured step per case on this rank: peak live bytes and collective bytes."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    instruments = _load("benchmarks/instruments.py", "_plan_instruments")
    out = {}
    for name in names:
        cfg = _config(name, world_size)
        with instruments.LiveBytes() as live:
            torch.manual_seed(0)
            model = workload.build_model(cfg.hf_config, cfg.model, torch.float32)
            shard_model(cfg, model, init_device_mesh("cpu", (world_size,)), None)
            optim = _make_optimizer(cfg, model)
            for i in range(2):
                _train_step(model, optim, i)
            live.reset_peak()
            with instruments.CommCounter() as comms:
                _train_step(model, optim, 2)
            out[name] = {"peak": live.peak, "comm": dict(comms.bytes)}
        del model, optim
    if world_size == 2:
        out["FSDPMemTracker"] = _fsdp_mem_tracker_peak(world_size)
    return out


def _fsdp_mem_tracker_peak(world_size: int) -> int:
    """Upstream's FSDPMemTracker's peak for one step of the demo model on upstream's fully_shard."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh

    cfg = PlanConfig(world_size=world_size, batch_size=BATCH, seq_len=SEQ, implementation="torch",
                     model=demo_model)
    torch.manual_seed(0)
    model = demo_model()
    shard_model(cfg, model, init_device_mesh("cpu", (world_size,)), None)
    optim = _make_optimizer(cfg, model)
    batches = []
    for i in range(3):
        torch.manual_seed(100 + i)
        batches.append(workload.token_inputs(model, BATCH, SEQ))

    def step(inputs, targets) -> None:
        workload.lm_loss(model(*inputs), targets).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    for i in range(2):
        step(*batches[i])
    tracker = FSDPMemTracker(model, optim)
    tracker.track_inputs(batches[2][0])
    with tracker:
        step(*batches[2])
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _results(launch_cases, world_size: int) -> dict:
    """Measured (one launch per world size, shared by this module's tests) and predicted rows."""
    ok, outcome = launch_cases.run(_measure, world_size, list(CASES))
    assert ok, outcome
    measured = outcome[0]
    rows = {"FSDPMemTracker": measured.get("FSDPMemTracker")}
    for name in CASES:
        rows[name] = {"predicted": plan(_config(name, world_size)), "measured": measured[name]}
    return rows


def _kinds(comm: dict) -> dict:
    """CommCounter's per-function bytes by collective kind (``all_gather_single`` -> ``all_gather``)."""
    out: dict = {}
    for name, nbytes in comm.items():
        kind = next((k for k in ("all_gather", "reduce_scatter") if k in name), name)
        out[kind] = out.get(kind, 0) + nbytes
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_predicted_peak_and_bytes_match_real_runs(launch_cases, world_size):
    """Predicted peak within 10% of a real gloo run's, predicted bytes equal to counted bytes."""
    rows = _results(launch_cases, world_size)
    print(f"\n{IMPL}, W={world_size}: model | predicted peak | measured peak | ratio | "
          "predicted bytes | counted bytes")
    failures = []
    for name in CASES:
        p, m = rows[name]["predicted"], rows[name]["measured"]
        ratio = p.peak_bytes_per_rank / m["peak"]
        predicted = {k: v for k, v in p.comm_bytes_per_step.items() if k != "total"}
        counted = _kinds(m["comm"])
        print(f"  {name} | {p.peak_bytes_per_rank:,} | {m['peak']:,} | {ratio:.3f} | "
              f"{p.comm_bytes_per_step['total']:,} | {sum(counted.values()):,}")
        if not 0.9 <= ratio <= 1.1:
            failures.append(f"{name}: predicted peak {p.peak_bytes_per_rank:,} vs measured {m['peak']:,}")
        if predicted != counted:
            failures.append(f"{name}: predicted bytes {predicted} vs counted {counted}")
    assert not failures, "\n".join(failures)


def test_peak_matches_upstream_fsdp_mem_tracker(launch_cases):
    """On upstream's fully_shard (where FSDPMemTracker applies) its peak and the plan's agree within 10%."""
    ok, outcome = launch_cases.run(_measure, 2, list(CASES))
    assert ok, outcome
    measured = outcome[0]["FSDPMemTracker"]
    predicted = plan(_config("demo", 2).with_(implementation="torch")).peak_bytes_per_rank
    print(f"\nFSDPMemTracker, demo, W=2: predicted {predicted:,} vs tracker {measured:,} "
          f"({predicted / measured:.3f})")
    assert 0.9 <= predicted / measured <= 1.1, (predicted, measured)


def test_cli_json_plot_and_missing_matplotlib(tmp_path, monkeypatch, capsys):
    """The CLI writes JSON with the documented keys and a PNG; --plot without matplotlib says how to fix."""
    from fsdp2.plan.cli import main

    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    model = f"{os.path.join(REPO, 'examples', 'model.py')}:demo_model"
    main(["--model", model, "--world-size", "1024", "--mesh", "128,8", "--seq-len", "32",
          "--reshard-after-forward", "false", "--json", str(out_json), "--plot", str(out_png)])
    data = json.loads(out_json.read_text())
    assert data["peak_bytes_per_rank"] > 0 and data["comm_bytes_per_step"]["total"] > 0
    assert data["config"]["mesh"] == [128, 8]
    assert data["comm_bytes_per_step"]["all_reduce"] > 0  # HSDP: gradients all-reduced
    assert set(data["peak_breakdown_bytes"]) >= {"parameters", "optimizer", "activations"}
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert "Peak memory per rank" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        main(["--model", model, "--plot", str(out_png)])
    assert "pip install matplotlib" in capsys.readouterr().err


def test_bad_input_raises_early():
    """A mesh that does not multiply to W, a bad reshard size or group pattern raise naming the fix."""
    with pytest.raises(ValueError, match="world_size=8"):
        plan(model=demo_model, world_size=8, mesh=(3, 2))
    with pytest.raises(ValueError, match="reshard_after_forward=3"):
        plan(model=demo_model, world_size=8, reshard_after_forward=3)
    with pytest.raises(ValueError, match="--groups 'nope.*'"):
        plan(model=demo_model, world_size=2, groups=["nope.*"])
    with pytest.raises(ValueError, match="llama-3-8b"):
        plan(hf_config="no-such-config", world_size=2)


def test_search_ranks_and_extrapolates():
    """--search puts fitting configs first by time; depth extrapolation equals a full simulation."""
    from fsdp2.plan.search import _priced, candidates

    device = get_device("h100", gpus_per_node=2)
    base = _config("hf llama", 8).with_(hf_config={**LLAMA, "num_hidden_layers": 6})
    assert len(candidates(base, 2)) == 14  # (8,) x raf T/F/2 + (4,2), (2,4) x raf T/F; x AC off/on
    extrapolated = _priced(base, device, extrapolate=True)[0]
    full = plan(base, device)
    assert extrapolated.comm_bytes_per_step == full.comm_bytes_per_step
    assert abs(extrapolated.peak_bytes_per_rank / full.peak_bytes_per_rank - 1) < 0.01
    plans = search(_config("demo", 2), device, memory_limit=full.peak_bytes_per_rank)
    fits = [p.peak_bytes_per_rank <= full.peak_bytes_per_rank for p in plans]
    assert fits == sorted(fits, reverse=True)
    times = [p.step_seconds for p, ok in zip(plans, fits) if ok]
    assert times == sorted(times)


@fsdp2_only
def test_shard_optim_across_replicas():
    """HSDP 2x4 at W=8 with the optimizer state sharded across replicas: the state per rank
    halves; the all-reduce becomes a reduce-scatter and an all-gather of its bytes (the two
    halves of a ring all-reduce: the same time); a mesh without replicas is refused."""
    base = PlanConfig(model=demo_model, world_size=8, mesh=(2, 4), batch_size=BATCH, seq_len=SEQ)
    plain, sliced = plan(base), plan(base.with_(shard_optim_across_replicas=True))
    held, plain_held = (p.simulation.state_bytes["optimizer"] for p in (sliced, plain))
    # the slices are cut between rows: within a row of half each
    assert abs(held - plain_held // 2) <= plain_held // 100, (held, plain_held)
    assert sliced.peak_breakdown["optimizer"] <= plain.peak_breakdown["optimizer"] * 51 // 100
    ours, theirs = sliced.comm_bytes_per_step, plain.comm_bytes_per_step
    assert "all_reduce" not in ours and theirs["all_reduce"] > 0
    for kind in ("reduce_scatter", "all_gather"):  # each slice padded to the largest
        extra = ours[kind] - theirs[kind]
        assert theirs["all_reduce"] <= extra <= theirs["all_reduce"] * 101 // 100, kind
    # the same time on the wire (but the padding); each group's all-gather after the step
    # adds one latency
    extra_calls = sum(sliced.comm_calls_per_step.values()) - sum(plain.comm_calls_per_step.values())
    latency = extra_calls * plain.device.latency_us * 1e-6
    slower = sliced.time["comm_s"] - plain.time["comm_s"] - latency
    assert 0 <= slower <= plain.time["comm_s"] / 100, (slower, latency)
    assert "state sharded across replicas" in sliced.table()
    for bad in ({"mesh": None}, {"implementation": "torch"}):
        with pytest.raises(ValueError, match="replicate,shard mesh"):
            plan(base.with_(shard_optim_across_replicas=True, **bad))
