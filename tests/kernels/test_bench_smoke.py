"""float8.bench.kernels runs end to end on the CPU (tiny shape, reference paths): the GPU run will not trip
over plumbing."""

import json

from float8.bench import kernels as bench


def test_bench_cpu_smoke(tmp_path, capsys):
    result = bench.main(["--cpu-smoke", "--no-compile", "--out", str(tmp_path)])
    names = {r["kernel"] for r in result["records"]}
    assert len(names) == 8 and {r["impl"] for r in result["records"]} == {"ours", "eager"}
    data = json.loads((tmp_path / "kernels_cpu.json").read_text())
    assert data["meta"]["device"] == "cpu" and data["meta"]["copy_gbps"] > 0
    md = (tmp_path / "kernels_cpu.md").read_text()
    assert "| quantize blockwise 128x128 | eager |" in md
    assert "| kernel | impl | B/elem | ms | GB/s | of copy | vs eager | vs compiled |" in capsys.readouterr().out


def test_bench_check_catches_a_wrong_kernel(monkeypatch):
    import pytest
    import torch

    x = torch.randn(4, 256)
    wrong = lambda x, s, d: bench.K.cast_ref(x * 1.01, s, d)  # noqa: E731
    with pytest.raises(AssertionError, match="cast: output 0 differs"):
        bench.check([("cast", 3, wrong, bench.K.cast_ref, (x, torch.tensor([1.0]), torch.float8_e4m3fn))])
