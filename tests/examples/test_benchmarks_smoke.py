"""`python -m benchmarks.step_llama --tiny` runs every variant that runs on a CPU (torchao's need CUDA and
are recorded as errors) and writes its report: the GPU run will not trip over plumbing."""

import json
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).parents[2]


def _run_module(*args: str, timeout: int) -> subprocess.CompletedProcess:
    """`python -m <args>` from the repository root, output captured."""
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_step_llama_tiny_runs_every_cpu_variant(tmp_path):
    run = _run_module("benchmarks.step_llama", "--tiny", "--out", str(tmp_path), timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    section = json.loads((tmp_path / "latest.json").read_text())["step_llama"]
    rows = {r["variant"]: r for r in section["detail"]["rows"]}
    for variant, row in rows.items():
        if variant.startswith("torchao"):
            assert "CUDA" in row["error"]
        else:
            assert "error" not in row, (variant, row.get("error"))
            assert row["ms_per_step"] > 0 and row["tokens_per_s"] > 0 and row["ms_per_step_back_to_back"] > 0
    # One model, one data: every variant starts from the same loss (FP8 rounding apart).
    losses = [r["final_loss"] for v, r in rows.items() if not v.startswith("torchao")]
    assert max(losses) - min(losses) < 0.05, losses
    assert "| float8 ops eager |" in (tmp_path / "latest.md").read_text()
    figures = {(f["variant"], f["metric"]) for f in section["figures"]}
    assert figures >= {("bf16 eager", "ms_per_step"), ("float8 ops eager", "tokens_per_s")}


def test_step_llama_separate_projections_run_the_converted_model_and_refuse_ops_blocks(tmp_path):
    variants = "bf16 eager,float8 converted eager,float8 ops eager"
    args = (
        "--tiny",
        "--separate-gate-up",
        "--separate-qkv",
        "--variants",
        variants,
        "--area",
        "x",
        "--out",
        str(tmp_path),
    )
    run = _run_module("benchmarks.step_llama", *args, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = {r["variant"]: r for r in json.loads((tmp_path / "latest.json").read_text())["x"]["detail"]["rows"]}
    converted = rows["float8 converted eager"]
    assert converted["mlp"] == "gate, up" and converted["attention"] == "q, k, v" and converted["ms_per_step"] > 0
    assert "one qkv and one gate-and-up projection" in rows["float8 ops eager"]["error"]


def test_kernel_groups_name_each_family():
    from benchmarks.harness import kernel_group

    assert kernel_group("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT") == "GEMM (cuBLAS)"
    # Inductor's names carry what they fuse: still inductor's.
    assert kernel_group("triton_poi_fused__fused_rms_norm__scaled_mm_add_7") == "inductor"
    assert kernel_group("_pack_heads_kernel") == "float8: casts, amax, transposes"
    assert kernel_group("cudnn::fusion::compute_dot_do_o_specialized<true, 128>") == "attention (SDPA)"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add>") == "elementwise (ATen)"
    assert kernel_group("some_vendor_kernel") == "other"


def test_gaps_tiny_runs(tmp_path):
    run = _run_module("benchmarks.gaps", "--tiny", "--json", str(tmp_path / "gaps.json"), timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    # No kernels on the CPU: an empty report per variant, recorded in the folder the old --json path names.
    section = json.loads((tmp_path / "latest.json").read_text())["gaps"]
    assert section["detail"] == {"float8 ops eager": {}} and section["figures"] == []


def test_inference_tiny_runs_every_cpu_variant(tmp_path):
    """`python -m benchmarks.inference --tiny` on the CPU: eager variants timed, compiled, CUDA-graph and
    torchao ones skipped with their reason, generate() timed for bf16 and float8, the report written."""
    run = _run_module("benchmarks.inference", "--tiny", "--out", str(tmp_path), timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    section = json.loads((tmp_path / "latest.json").read_text())["inference"]
    result = section["detail"]
    rows = result["rows"]
    assert {(r["model"], r["tokens"]) for r in rows} == {(m, t) for m in ("llama", "hf") for t in (1, 16)}
    for r in rows:
        if r["variant"].startswith("torchao"):
            assert r.get("error") or r.get("skipped"), r
        elif "skipped" not in r:
            assert "error" not in r, r
            assert r["ms"] > 0 and r["vs_bf16_eager"] > 0, r
    for model in ("llama", "hf"):
        assert [r["ms"] for r in rows if r["model"] == model and r["variant"] == "float8 eager"], model
    generate = {(r["variant"], r["batch"]): r for r in result["generate"]}
    for variant in ("bf16 eager", "float8 eager"):
        for batch in (1, 16):
            assert generate[variant, batch]["tokens_per_s"] > 0, generate[variant, batch]
    assert all(r.get("error") or r.get("skipped") for (v, _), r in generate.items() if v.startswith("torchao"))
    assert result["floors"]["copy_Bps"] > 0 and section["command"].startswith("python -m benchmarks.inference")
    assert section["device"] == "cpu" and "## generate()" in (tmp_path / "latest.md").read_text()
    figures = {(f["case"], f["variant"], f["metric"]) for f in section["figures"]}
    assert ("model llama, tokens 16", "float8 eager", "ms") in figures
    history = (tmp_path / "history.csv").read_text().splitlines()
    assert len(history) - 1 == len(section["figures"])  # rewritten after every stage, each figure kept once


def test_inference_ranks_every_compiled_or_graphed_variant():
    """Each variant with a compile or graph mode has a place in the order its warm-ups run in (a variant left
    out failed the whole forward stage with 'not in list' on the H100, 2026-11-26)."""
    from benchmarks.inference import COMPILE_PRIORITY, VARIANTS

    assert {n for n, (_, mode) in VARIANTS.items() if mode is not None} <= set(COMPILE_PRIORITY)


def _agree(rank, world):
    from benchmarks.distributed import _agree_on_errors

    results = {"a": {"rounds_ms": []}, "b": {"rounds_ms": []}}
    if rank == 1:
        results["b"] = {"error": "RuntimeError: only here"}
    _agree_on_errors(results, ["a", "b"], torch.device("cpu"))
    return results


def test_distributed_benchmark_drops_a_variant_that_failed_on_any_rank():
    """A variant that raised on one rank is dropped on every rank (one carrying on alone would pair its
    collectives with the other ranks' next ones)."""
    from tests.distributed.harness import run_ranks

    r0, r1 = run_ranks(_agree, timeout=60)
    assert r0["b"] == {"error": "failed on another rank"} and r1["b"]["error"] == "RuntimeError: only here"
    assert "error" not in r0["a"] and "error" not in r1["a"]


def test_host_inference_says_it_needs_a_gpu_and_records_nothing(tmp_path):
    """benchmarks.host_inference times CUDA launches: on a CPU it imports, says so, and writes no results."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_inference", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "without a GPU" in out.stdout and not any(tmp_path.iterdir())


def test_timeline_figures_split_communication_compute_and_host_waits():
    # benchmarks.distributed --profile: per step, NCCL time, the part no other kernel hides, and the time no
    # kernel runs at all (the GPU waiting on the host). Two steps of a made-up timeline, in microseconds:
    # compute 0-100 and 150-250 (overlapping kernels 150-200 and 180-250), NCCL 90-130 (10 hidden, 30
    # exposed) and 300-320 (exposed); nothing runs in 130-150 and 250-300.
    from benchmarks.distributed import timeline_figures

    kernels = [(0, 100, False), (150, 200, False), (180, 250, False), (90, 130, True), (300, 320, True)]
    got = timeline_figures(kernels, steps=2)
    assert got == {
        "nccl_kernel_ms_per_step": 0.03,
        "exposed_nccl_ms_per_step": 0.025,
        "gpu_idle_ms_per_step": 0.035,
        "kernels_per_step": 2.5,
        "longest_exposed_nccl_ms": 0.03,
    }
    assert timeline_figures([], steps=1)["gpu_idle_ms_per_step"] == 0.0


def test_weight_only_tiny_records_its_area(tmp_path):
    """`python -m benchmarks.weight_only --tiny` runs the reference path and records the area it is given."""
    run = _run_module("benchmarks.weight_only", "--tiny", "--out", str(tmp_path), "--area", "wo_test", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert list(latest) == ["wo_test"] and latest["wo_test"]["figures"]


def test_weight_only_sweeps_the_decode_family_at_17_to_32_tokens():
    from benchmarks.weight_only import candidate_tiles

    decode = lambda m: [c for c in candidate_tiles(m) if c[1] == "decode"]  # noqa: E731
    assert decode(24) and decode(32) and not decode(16) and not decode(64)
    assert all(tile[0] == 32 and not tile[5] for tile, _ in decode(32))  # 32-row unswapped tiles
    assert {c for c in candidate_tiles(32) if c[1] is None} >= {(tile, None) for tile, _ in decode(32)}
