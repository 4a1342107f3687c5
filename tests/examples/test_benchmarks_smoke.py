"""`python -m benchmarks.step_llama --tiny` runs every variant that runs on a CPU (torchao's need CUDA and
are recorded as errors) and writes its report: the GPU run will not trip over plumbing."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]


def test_step_llama_tiny_runs_every_cpu_variant(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_llama", "--tiny", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    (report,) = tmp_path.glob("step_llama_cpu_*.json")
    rows = {r["variant"]: r for r in json.loads(report.read_text())["rows"]}
    for variant, row in rows.items():
        if variant.startswith("torchao"):
            assert "CUDA" in row["error"]
        else:
            assert "error" not in row, (variant, row.get("error"))
            assert row["ms_per_step"] > 0 and row["tokens_per_s"] > 0
    # One model, one data: every variant starts from the same loss (FP8 rounding apart).
    losses = [r["final_loss"] for v, r in rows.items() if not v.startswith("torchao")]
    assert max(losses) - min(losses) < 0.05, losses
    assert (tmp_path / report.name.replace(".json", ".md")).exists()
