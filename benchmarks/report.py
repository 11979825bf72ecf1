"""Turn the raw benchmark results into rows, one markdown table, JSON and a PNG chart.

A row: ``name`` (with its unit), ``fsdp2``, ``torch``, ``ratio`` (fsdp2 /
torch), ``ref`` (DDP or the unsharded model, where one applies), ``target``
(text) and ``ok`` (whether the target is met; None where it does not apply).
"""

from __future__ import annotations

import json
import math
import os

MB = 1e6


def row(name, fsdp2, torch, ref=None, target="", ok=None) -> dict:
    ratio = fsdp2 / torch if fsdp2 is not None and torch else None
    return {
        "name": name,
        "fsdp2": fsdp2,
        "torch": torch,
        "ratio": ratio,
        "ref": ref,
        "target": target,
        "ok": ok,
    }


def ratio_row(name, fsdp2, torch, ref=None, limit=1.0) -> dict:
    r = row(name, fsdp2, torch, ref, f"ratio <= {limit:g}")
    r["ok"] = r["ratio"] is not None and r["ratio"] <= limit
    r["limit"] = limit
    return r


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 0.01:
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
    return f"{x:.2g}"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| benchmark | fsdp2 | torch | ratio (fsdp2/torch) | DDP/ref | target | met |",
        "|---|---:|---:|---:|---:|---|:-:|",
    ]
    for r in rows:
        met = "-" if r["ok"] is None else ("yes" if r["ok"] else "NO")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(
            f"| {r['name']} | {_fmt(r['fsdp2'])} | {_fmt(r['torch'])} | {ratio} "
            f"| {_fmt(r['ref'])} | {r['target']} | {met} |"
        )
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    with open(path, "w") as f:
        json.dump(clean(payload), f, indent=1)


def write_png(path: str, rows: list[dict], title: str) -> str:
    """Horizontal bars of fsdp2/torch per row; returns a message for the console."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: skipped the PNG (pip install matplotlib)"
    rows = [r for r in rows if r["ratio"] is not None]
    if not rows:  # every stage run failed or has no ratio: nothing to draw
        return "no row with a ratio: skipped the PNG"
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.4))
    names = [r["name"] for r in rows][::-1]
    ratios = [r["ratio"] for r in rows][::-1]
    colors = [{True: "tab:green", False: "tab:red", None: "tab:gray"}[r["ok"]] for r in rows][::-1]
    ax.barh(names, ratios, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    for y, r in enumerate(rows[::-1]):
        ax.text(r["ratio"], y, f" {r['ratio']:.2f}", va="center", fontsize=8)
        if "limit" in r:  # the target, as a tick on the bar's row
            ax.plot([r["limit"]], [y], marker="|", markersize=14, color="black")
    ax.set_xlim(0, max(1.25, 1.15 * max(ratios)))
    ax.set_xlabel("fsdp2 / torch (lower is better); | = target; green = target met")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
