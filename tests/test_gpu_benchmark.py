"""benchmarks/gpu.py keeps working: its whole code path on CPU with a tiny model (--smoke).

The GPU benchmark runs only where there is a GPU; ``--device cpu --smoke``
runs the same stages (fake process group at W = 8, a forced one-rank group),
the same measurements (profiler, copy counter, hook timing) and the same
report on CPU, so a change that breaks it fails here. Nothing is timed or
compared for speed: the test checks the report's rows and that the forced
one-rank run trains exactly like upstream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_benchmark_smoke_on_cpu(tmp_path):
    """gpu.py --device cpu --smoke: every stage runs, every row is there, losses equal upstream's."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("FSDP2_FORCE_COLLECTIVES", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--device", "cpu",
         "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=float(os.environ.get("FSDP2_TEST_TIMEOUT", 300)),
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "gpu.json") as f:
        report = json.load(f)
    names = [r["name"] for r in report["rows"]]
    for setting in ("fake W=8", "gloo W=1 forced"):
        for what in ("step time", "copy kernels/step", "bytes copied/step", "hook CPU time"):
            assert any(n.startswith(what) and setting in n for n in names), (what, setting, names)
    loss_diff = next(r for r in report["rows"] if r["name"].startswith("max abs loss diff"))
    assert loss_diff["torch"] == 0, loss_diff
    raw = report["raw"]
    assert raw["step gloo W=1 forced"]["forced_collectives"] is True
    assert raw["step fake W=8"]["forced_collectives"] is False
    for impl in ("fsdp2", "torch", "plain"):
        assert raw["step gloo W=1 forced"]["results"][impl]["copy_kernels"] > 0, impl
    assert (tmp_path / "gpu.png").exists() or "matplotlib" in proc.stdout
