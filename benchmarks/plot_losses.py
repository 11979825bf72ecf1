"""Loss curves of several demo runs in one plot, and their losses at every 50-step mark.

    python benchmarks/plot_losses.py OUT.png NAME=LOSSFILE ...

Each ``LOSSFILE`` is ``examples/train.py --loss-file``'s output (one mean loss
a line). The first run is the reference: the table gives each run's mean loss
over the 10 steps up to each 50-step mark and its difference from the
reference's there (the per-step losses of one random batch are noisy; all runs
share the seed, so they draw the same batches).
"""

from __future__ import annotations

import sys
from pathlib import Path


def _losses(path: str) -> list[float]:
    return [float(line) for line in Path(path).read_text().split()]


def table(runs: dict[str, list[float]], every: int = 50, window: int = 10) -> str:
    """Markdown: mean loss over the ``window`` steps up to each mark, and the gap to the first run."""
    names = list(runs)
    steps = min(len(v) for v in runs.values())
    marks = list(range(every, steps + 1, every))

    def at(name: str, mark: int) -> float:
        values = runs[name][mark - window : mark]
        return sum(values) / len(values)

    lines = ["| run | " + " | ".join(f"step {m}" for m in marks) + " |",
             "|---|" + "---:|" * len(marks)]
    for name in names:
        cells = []
        for m in marks:
            value, ref = at(name, m), at(names[0], m)
            cells.append(f"{value:.4f}" + ("" if name == names[0] else f" ({100 * (value / ref - 1):+.2f}%)"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    out, pairs = argv[0], [a.split("=", 1) for a in argv[1:]]
    runs = {name: _losses(path) for name, path in pairs}
    print(table(runs))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in runs.items():
        smooth = [sum(values[max(0, i - 9) : i + 1]) / len(values[max(0, i - 9) : i + 1])
                  for i in range(len(values))]
        ax.plot(range(1, len(values) + 1), smooth, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean of the last 10 steps)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
