"""benchmarks.kernels runs end to end on the CPU (tiny shape, reference paths): the GPU run will not trip
over plumbing."""

import json

from benchmarks import kernels as bench

from .helpers import needs_interpreter


def test_bench_cpu_smoke(tmp_path, capsys):
    result = bench.main(["--cpu-smoke", "--no-compile", "--out", str(tmp_path)])
    names = {r["kernel"] for r in result["records"]}
    assert len(names) == 8 and {r["impl"] for r in result["records"]} == {"ours", "eager"}
    data = json.loads((tmp_path / "latest.json").read_text())["kernels"]["detail"]  # the area it records
    assert data["meta"]["device"] == "cpu" and data["meta"]["copy_gbps"] > 0
    md = (tmp_path / "latest.md").read_text()
    assert "| quantize blockwise 128x128 | eager |" in md
    assert "| kernel | impl | B/elem | ms | GB/s | of copy | vs eager | vs compiled |" in capsys.readouterr().out


def test_bench_check_catches_a_wrong_kernel(monkeypatch):
    import pytest
    import torch

    x = torch.randn(4, 256)
    wrong = lambda x, s, d: bench._cast.cast_ref(x * 1.01, s, d)  # noqa: E731
    with pytest.raises(AssertionError, match="cast: output 0 differs"):
        bench.check([("cast", 3, wrong, bench._cast.cast_ref, (x, torch.tensor([1.0]), torch.float8_e4m3fn))])


@needs_interpreter
def test_gemm_epilogue_bench_cpu_smoke(tmp_path):
    # The Triton-GEMM-with-epilogue comparison runs end to end (interpreter, one tiny shape) and both
    # pipelines compute the same quantized gelu(a @ b + bias) to FP8 accuracy.
    from benchmarks import gemm_epilogue

    (rec,) = gemm_epilogue.main(["--device", "cpu", "--out", str(tmp_path)])
    for name in ("identity_cublas", "identity_triton", "gelu_cublas", "gelu_triton"):
        assert rec[f"{name}_ms"] > 0 and rec[f"{name}_sqnr_db"] >= 25, (name, rec[f"{name}_sqnr_db"])
    assert rec["cublas_gemm_ms"] > 0 and all(t > 0 for t in rec["triton_gemm_ms"].values())
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["gemm_epilogue"]["detail"]["records"][0]["shape"] == [64, 64, 64]


@needs_interpreter
def test_act_sweep_cpu_smoke():
    # Every variant is checked bit for bit against the default before it is timed; one variant here.
    from benchmarks import act_sweep

    rows = act_sweep.sweep(40, 48, "cpu", variants=[dict(BLOCK_S=16, BLOCK_N=32, num_warps=2, T_MODE=2)])
    names = [r[0] for r in rows]
    assert names.count("fwd pass 2 (cast + transpose)") == 2 and names.count("bwd pass 2 (cast + transpose)") == 2
    assert all(ms > 0 for _, _, ms, _ in rows)
