"""From raw per-stage results to table rows, with the analytic models.

Analytic values, per rank, fp32, W ranks, sizes padded on dim 0 to a multiple
of W; P = all parameters, R = the root's own group (embedding, final norm,
head), B_i = block i:

* communicated (logical bytes: all-gather output + reduce-scatter input):
  every group is all-gathered in forward, blocks again in backward when
  ``reshard_after_forward=True`` (the root never is: it stays unsharded), and
  every group is reduce-scattered once: ``3 sum(B_i) + 2 R`` (about 3P) with
  resharding, ``2P`` without. DDP: one all-reduce of P.
* peak live, with resharding: sharded params P/W + sharded grads P/W +
  AdamW state 2P/W + unsharded groups (R + the two largest blocks: the one
  computing and the one prefetched) + activations A, where A is the unsharded
  model's peak of bytes that are not parameters, gradients or optimizer state,
  at the same per-rank batch. Without resharding the peak is at the start of
  backward: 3P/W (no sharded grads yet) + all of P unsharded + A + the largest
  block's gradients and reduce-scatter input (2 B_max).
"""

from __future__ import annotations

from bench_hsdp_optim import NOTES as HSDP_OPTIM_NOTES
from bench_hsdp_optim import hsdp_optim_rows as _hsdp_optim_rows
from bench_moe import NOTES as MOE_NOTES
from bench_moe import moe_rows as _moe_rows
from bench_muon import NOTES as MUON_NOTES
from bench_muon import muon_rows as _muon_rows
from bench_small_params import small_params_rows as _small_params_rows
from common import median
from report import MB, ratio_row, row


def _step_rows(raw: dict) -> list[dict]:
    rows = []
    for key, label in (
        ("step_raf", "reshard_after_forward=True"),
        ("step_noraf", "reshard_after_forward=False"),
    ):
        s = raw.get("step", {}).get(key)
        if not s:
            continue
        t = {n: 1e3 * median(v) for n, v in s["times"].items()}
        rows.append(ratio_row(f"step time, {label} (ms)", t["fsdp2"], t["torch"], t.get("ddp")))
        # Steps ran back to back, so per-step ratios cancel slow drifts of the machine.
        paired = [a / b for a, b in zip(s["times"]["fsdp2"], s["times"]["torch"])]
        rows[-1]["paired_ratio"] = median(paired)
        d = s["loss_diff"]
        ok = d["torch"] <= 1e-4
        rows.append(
            row(
                f"max abs loss diff vs fsdp2, {label}",
                None,
                d["torch"],
                d.get("ddp"),
                "torch ~0 (<= 1e-4)",
                ok,
            )
        )
    return rows


def _optim_rows(raw: dict) -> list[dict]:
    o = raw.get("step", {}).get("optim")
    if not o:
        return []
    opt = {n: 1e3 * median(v) for n, v in o["optim"].items()}
    clip = {n: 1e3 * median(v) for n, v in o["clip"].items()}
    both = {n: opt[n] + clip[n] for n in opt}
    return [
        ratio_row(
            "AdamW(foreach).step on sharded params (ms)",
            opt["fsdp2"],
            opt["torch"],
            opt.get("ddp"),
            0.7,
        ),
        ratio_row(
            "clip_grad_norm_ on sharded grads (ms)",
            clip["fsdp2"],
            clip["torch"],
            clip.get("ddp"),
            0.7,
        ),
        ratio_row(
            "AdamW.step + clip_grad_norm_ (ms)", both["fsdp2"], both["torch"], both.get("ddp"), 0.7
        ),
    ]


def _checkpoint_rows(raw: dict) -> list[dict]:
    c = raw.get("checkpoint")
    if not isinstance(c, dict) or not isinstance(c.get("fsdp2"), dict):  # absent or failed
        return []
    ms = {n: {k: 1e3 * median(v) for k, v in c[n].items() if k != "busy_steps"} for n in c}
    f, t = ms["fsdp2"], ms["torch"]
    checked = []
    if "integrity" in ms:  # fsdp2 against itself: the torch column is the unchecked run
        i = ms["integrity"]
        checked = [
            ratio_row("checkpoint save, checksums on (ms; torch col.: fsdp2 off)",
                      i["save_on"], i["save_off"], None, 1.1),
            ratio_row("checkpoint load, verified (ms; torch col.: fsdp2 verify=False)",
                      i["load_on"], i["load_off"], None, 1.1),
        ]
    return [*checked,
        ratio_row("checkpoint save stall, sync (ms)", f["stall_sync"], t["stall_sync"], None, 1.1),
        ratio_row("checkpoint save stall, async (ms)", f["stall_async"], t["stall_async"], None,
                  1.1),
        row("async stall / sync stall", f["stall_async"] / f["stall_sync"],
            t["stall_async"] / t["stall_sync"], None, "fsdp2 < 0.5",
            f["stall_async"] < 0.5 * f["stall_sync"]),
        ratio_row("step time, no save in flight (ms)", f["step_idle"], t["step_idle"]),
        ratio_row(f"step time, async save in flight (ms; {c['fsdp2']['busy_steps']} / "
                  f"{c['torch']['busy_steps']} steps)", f["step_busy"], t["step_busy"], None, 1.1),
    ]


def _hook_rows(raw: dict) -> list[dict]:
    rows = []
    for key, label in (("hooks_w1", "W=1 gloo"), ("hooks_fake", "W=8 fake PG")):
        h = raw.get(key)
        if not h or "times" not in h:
            continue
        n, t = h["n_layers"], h["times"]
        for stat, fn in (("median", median), ("min", min)):
            per = {k: 1e6 * (fn(t[k]) - fn(t["plain"])) / n for k in ("fsdp2", "torch")}
            rows.append(
                ratio_row(
                    f"hook overhead, {label}, {stat} (us/layer)",
                    per["fsdp2"],
                    per["torch"],
                    None,
                    0.5,
                )
            )
        plain = 1e6 * median(t["plain"]) / n
        rows[-2]["ref"] = plain  # the unsharded model's own time per layer
    return rows


def _materialize_rows(raw: dict) -> list[dict]:
    m = raw.get("materialize")
    if not m or "times" not in m:
        return []
    where = f"{m['shape']['n_layers']}-layer 70B-shaped Llama on meta, W={m['world_size']} fake PG"
    rows = []
    for key, label in (
        ("fully_shard", "fully_shard"),
        ("to_empty", "to_empty"),
        ("to_empty_init", "to_empty + reset_parameters"),
    ):
        t = {impl: 1e3 * median(m["times"][impl][key]) for impl in ("fsdp2", "torch")}
        rows.append(ratio_row(f"{label}, {where} (ms)", t["fsdp2"], t["torch"]))
    if "lazy_init" in m["times"]["fsdp2"]:
        t = {impl: 1e3 * median(m["times"][impl]["lazy_init"]) for impl in ("fsdp2", "torch")}
        rows.append(ratio_row(f"root lazy init, {where} (ms)", t["fsdp2"], t["torch"]))
        ours = m["times"]["fsdp2"]
        check = 1e3 * median(ours["divergence_check"])
        rows.append(
            row(f"of which the divergence check (fsdp2 only), {where} (ms)", check, None, None,
                "skipped under the fake PG; see bench_divergence.py")
        )
        rest = 1e3 * median([a - b for a, b in zip(ours["lazy_init"], ours["divergence_check"])])
        rows.append(ratio_row(f"root lazy init without that check, {where} (ms)", rest, t["torch"]))
    return rows


def _offload_rows(raw: dict) -> list[dict]:
    from bench_offload import rows

    return rows(raw["offload"])


def _divergence_rows(raw: dict) -> list[dict]:
    from bench_divergence import rows

    store = raw.get("divergence")
    return rows(None, store) if store and "sim_world" in store else []


def _analytic(groups: dict, world_size: int, raf: bool, activations: float) -> tuple[float, float]:
    blocks, root, total = groups["blocks"], groups["root"], groups["total"]
    gathered = (2 * sum(blocks) if raf else sum(blocks)) + root
    comm = gathered + total
    if raf:
        memory = 4 * total / world_size + root + sum(sorted(blocks)[-2:]) + activations
    else:
        # Peak at the start of backward: everything unsharded, no sharded grads
        # yet, plus the first block's gradients and its reduce-scatter input.
        memory = 3 * total / world_size + total + 2 * max(blocks) + activations
    return comm, memory


def _bytes_rows(raw: dict) -> list[dict]:
    b = raw.get("bytes")
    if not b or "groups" not in b:
        return []
    ws = raw["world_size"]
    rows = []
    copies = {
        k: sum(b[f"counted/{k}"]["copy_bytes"].values()) for k in ("fsdp2", "torch", "ddp", "plain")
    }
    extra = {k: (copies[k] - copies["plain"]) / MB for k in copies}
    rows.append(
        ratio_row(
            "bytes copied/step outside collectives, minus unsharded model (MB)",
            extra["fsdp2"],
            extra["torch"],
            extra["ddp"],
            0.5,
        )
    )
    act = b["memory/plain"]["activations"]
    for suffix, raf, label in (
        ("", True, "reshard_after_forward=True"),
        ("_noraf", False, "reshard_after_forward=False"),
    ):
        comm = {
            k: sum(b[f"counted{suffix}/{k}"]["comm_bytes"].values()) / MB
            for k in ("fsdp2", "torch")
        }
        want, memory = _analytic(b["groups"], ws, raf, act)
        ddp = sum(b["counted/ddp"]["comm_bytes"].values()) / MB if raf else None
        rows.append(
            row(
                f"bytes communicated/step, {label} (MB)",
                comm["fsdp2"],
                comm["torch"],
                ddp,
                f"== analytic {want / MB:.2f}",
                abs(comm["fsdp2"] - want / MB) < 1e-6,
            )
        )
        peak = {k: b[f"memory{suffix}/{k}"]["peak"] / MB for k in ("fsdp2", "torch")}
        ddp_peak = b["memory/ddp"]["peak"] / MB if raf else None
        ok = peak["fsdp2"] <= peak["torch"] and abs(peak["fsdp2"] / (memory / MB) - 1) <= 0.1
        rows.append(
            row(
                f"peak live bytes/rank, {label} (MB)",
                peak["fsdp2"],
                peak["torch"],
                ddp_peak,
                f"<= torch, within 10% of analytic {memory / MB:.1f}",
                ok,
            )
        )
    return rows


def _pipeline_rows(raw: dict) -> list[dict]:
    """PP x FSDP (bench_pipeline.py): the busiest rank's collectives and bytes per step."""
    per_rank = raw.get("pipeline")
    if not per_rank or "error" in per_rank:
        return []
    rows = []
    for schedule in per_rank[0]:
        busiest = {
            impl: tuple(max(r[schedule][impl][i] for r in per_rank) for i in (0, 1))
            for impl in ("fsdp2", "torch", "plain")
        }
        calls = {k: v[0] for k, v in busiest.items()}
        sent = {k: v[1] / MB for k, v in busiest.items()}
        rows.append(ratio_row(f"PP x FSDP, {schedule}: collectives/step",
                              calls["fsdp2"], calls["torch"], calls["plain"]))
        rows.append(ratio_row(f"PP x FSDP, {schedule}: bytes sent/step (MB)",
                              sent["fsdp2"], sent["torch"], sent["plain"]))
    return rows


NOTES = """\
- ratio = fsdp2 / torch of the two columns (lower is better); MB = 10^6 bytes; per rank.
- DDP/ref: DDP for step time, bytes, memory and optimizer rows; for hook rows the
  unsharded model's own forward+backward time per layer (us).
- step time: forward + backward + AdamW(foreach).step + zero_grad, slowest rank, steps of
  all implementations interleaved; paired ratio = median over steps of fsdp2/torch.
- bytes copied: copy-like aten ops outside collectives (instruments.py lists them), minus the
  same count for the unsharded model (the model's own copies).
- bytes communicated: all-gather output + reduce-scatter input (+ all-reduce) bytes per rank;
  analytic = 3*sum(blocks) + 2*root with resharding, 2*P without (summary.py docstring).
- peak live: every tensor storage alive at once on a rank during one step; analytic =
  4P/W + root + 2 largest blocks + activations (without resharding:
  3P/W + P + 2 largest-block grads + activations).
- materialization rows: a model built on meta, sharded (81 fully_shard calls) and then
  to_empty(device="cpu") and reset_parameters() of every Linear/Embedding/RMSNorm, at
  W=1024 under torch's fake process group (bench_materialize.py); medians over repetitions.
- PP x FSDP rows: W=4 as (pp=2, dp=2), 8 micro-batches, second step, busiest rank
  (bench_pipeline.py): all-gathers + reduce-scatters + all-reduces, and the bytes a rank sends
  in them; fsdp2 with fsdp2.pipelining.PipelineStage, torch with its own stage and
  fully_shard; ref = fsdp2's modules under torch's plain PipelineStage.
- optimizer rows: the fsdp2 column uses fsdp2.enable_local_shard_step (bitwise the same
  AdamW update) and fsdp2.clip_grad_norm_; torch and DDP the stock torch functions."""
NOTES += "\n" + MUON_NOTES + "\n" + HSDP_OPTIM_NOTES + "\n" + MOE_NOTES


def build_rows(raw: dict) -> list[dict]:
    rows = []
    for make in (
        _step_rows, _hook_rows, _bytes_rows, _optim_rows, _materialize_rows, _pipeline_rows,
        _checkpoint_rows, _muon_rows, _hsdp_optim_rows, _moe_rows, _offload_rows,
        _divergence_rows, _small_params_rows,
    ):
        try:
            rows += make(raw)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a failed stage: skip its rows
            rows.append(row(f"{make.__name__[1:]} unavailable: {exc!r:.60}", None, None))
    return rows


def profile_text(hooks: dict) -> str:
    p = hooks["profile"]
    n = hooks["n_layers"]
    lines = [
        f"cProfile of fsdp2, W=1 hook benchmark ({n} layers), per iteration: "
        f"{p['total_us_per_iter']:.0f} us self time in total",
        "",
        "| function | calls/iter | self us/iter | cum us/iter |",
        "|---|---:|---:|---:|",
    ]
    for title, key in (("all", "top"), ("fsdp2 only", "top_fsdp2")):
        lines.append(f"| **{title}** | | | |")
        for r in p[key]:
            lines.append(
                f"| `{r['function']}` | {r['calls_per_iter']:.0f} | "
                f"{r['self_us_per_iter']:.0f} | {r['cum_us_per_iter']:.0f} |"
            )
    return "\n".join(lines)
