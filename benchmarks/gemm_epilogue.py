"""Own Triton FP8 GEMM with a fused epilogue against cuBLASLt plus our separate kernel (issue 4, item 4).

    python -m benchmarks.gemm_epilogue [--out DIR] [--device cpu]   (cpu: tiny shapes, interpreter)

For each shape, y = act(a @ b + bias) quantized to E4M3 with current scaling (act: none, or GELU), two ways:
  cuBLASLt:  torch._scaled_mm (bias in its epilogue, bf16 out) -> our quantize / act_fp8 (amax pass + cast pass)
  Triton:    gemm_epilogue (bias, act and the amax in the GEMM's epilogue, bf16 out) -> one cast pass
             (every tile configuration timed; the best kept)
and the bare GEMMs (no bias, no activation) in TFLOP/s: cuBLASLt, and each Triton tile configuration.
Every pipeline and tile configuration is checked before it is timed: its FP8 output against the float64
reference, SQNR >= MIN_SQNR_DB (FP8 E4M3 rounding gives ~31 dB), else AssertionError.
Writes DIR/gemm_epilogue_<gpu>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

from benchmarks.harness import make_timer
from float8.kernels import activation as act
from float8.kernels import gemm_epilogue as G
from float8.kernels import quantize
from float8.kernels.cast import launch_cast
from float8.kernels.reference import dequantize_ref

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
SHAPES = {"cuda": [(8192, 8192, 8192), (16384, 4096, 16384)], "cpu": [(64, 64, 64)]}
KINDS = ("identity", "gelu")  # bias + FP8 output with amax; the same with a GELU
MIN_SQNR_DB = 25.0


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp_min(1e-300)))


def pipelines(a, sa, b, sb, bias, kind, config):
    """{name: fn() -> (fp8 data, scale_inv)}: two ways to get fp8(act(a @ b + bias)), current scaling."""
    cuda = a.is_cuda

    def cublas():
        y = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=BF16)
        if kind == "identity":  # amax pass + cast pass
            data, _, scale_inv, _ = (quantize.quantize_tensorwise_triton if cuda else quantize.quantize_tensorwise_ref)(y, E4M3)
        else:  # act recomputed in both passes of the fused activation kernel
            data, _, scale_inv, _ = (act.act_fp8_triton if cuda else act.act_fp8_ref)(y, kind, None, E4M3)
        return data, scale_inv

    def triton_fused():
        y, amax = G.gemm_epilogue_triton(a, sa, b, sb, bias, kind, config)
        return launch_cast(y, amax, E4M3, current=True)

    return {"cublas": cublas, "triton": triton_fused}


def run_shape(m, k, n, device, bench) -> dict:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(E4M3).to(device)
    b = torch.randn(n, k, generator=g).to(E4M3).to(device).t()
    sa = torch.tensor(1.0 / 16, device=device)
    sb = torch.tensor(1.0 / 16, device=device)
    bias = torch.randn(n, generator=g).to(BF16).to(device)
    rec = {"shape": [m, k, n], "gemm_flops": 2 * m * k * n}
    configs = G.CONFIGS if device == "cuda" else [(16, 32, 32, 2, 4, 2)]
    one = torch.ones((), device=device)
    rec["cublas_gemm_ms"] = bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=BF16))
    rec["triton_gemm_ms"] = {
        "x".join(map(str, c)): bench(lambda c=c: G.gemm_epilogue_triton(a, one, b, one, None, "identity", c))
        for c in configs
    }
    for kind in KINDS:
        ref = G.gemm_epilogue_ref(a, sa, b, sb, bias, kind)[0].float()

        def checked(fn, what):
            db = _sqnr(ref, dequantize_ref(*fn(), torch.float32))
            if not db >= MIN_SQNR_DB:
                raise AssertionError(f"{what} at {m}x{k}x{n}, {kind}: SQNR {db:.1f} dB < {MIN_SQNR_DB} against float64")
            return db

        cub = pipelines(a, sa, b, sb, bias, kind, None)["cublas"]
        rec[f"{kind}_cublas_sqnr_db"] = checked(cub, "cuBLASLt pipeline")
        rec[f"{kind}_cublas_ms"] = bench(cub)
        per_config, sqnr = {}, {}
        for c in configs:
            fused = pipelines(a, sa, b, sb, bias, kind, c)["triton"]
            name = "x".join(map(str, c))
            sqnr[name] = checked(fused, f"Triton pipeline {name}")
            per_config[name] = bench(fused)
        best = min(per_config, key=per_config.get)
        rec[f"{kind}_triton_ms"] = per_config[best]
        rec[f"{kind}_triton_config"] = best
        rec[f"{kind}_triton_ms_per_config"] = per_config
        rec[f"{kind}_triton_sqnr_db"] = sqnr[best]
    return rec


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    bench = make_timer(cuda)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    records = [run_shape(*s, args.device, bench) for s in SHAPES["cuda" if cuda else "cpu"]]
    meta = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    print(f"FP8 GEMM + bias (+ act) -> E4M3, current scaling; {name}, torch {meta['torch']}, triton {meta['triton']}")
    print("| M x K x N | epilogue | cuBLASLt + separate kernel ms | Triton fused + cast ms | fused vs cuBLASLt | "
          "SQNR dB (cuBLASLt / Triton) | GEMM alone TFLOP/s (cuBLASLt / best Triton) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in records:
        tf = lambda ms: r["gemm_flops"] / ms / 1e9  # noqa: E731
        rates = f"{tf(r['cublas_gemm_ms']):.0f} / {tf(min(r['triton_gemm_ms'].values())):.0f}"
        for kind in KINDS:
            c, t = r[f"{kind}_cublas_ms"], r[f"{kind}_triton_ms"]
            print(f"| {'x'.join(map(str, r['shape']))} | bias{'' if kind == 'identity' else ' + ' + kind} + amax | "
                  f"{c:.3f} | {t:.3f} ({r[f'{kind}_triton_config']}) | {c / t:.2f}x | "
                  f"{r[f'{kind}_cublas_sqnr_db']:.1f} / {r[f'{kind}_triton_sqnr_db']:.1f} | {rates} |")
        r.update(meta)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        with open(os.path.join(args.out, f"gemm_epilogue_{slug}.json"), "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
