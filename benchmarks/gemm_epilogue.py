"""Own Triton FP8 GEMM with a fused epilogue against cuBLASLt plus our separate kernel (issue 4, item 4).

    python -m benchmarks.gemm_epilogue [--out DIR] [--device cpu]   (cpu: tiny shapes, interpreter)

For each shape, y = act(a @ b + bias) quantized to E4M3 with current scaling (act: none, or GELU), two ways:
  cuBLASLt:  torch._scaled_mm (bias in its epilogue, bf16 out) -> our quantize / act_fp8 (amax pass + cast pass)
  Triton:    gemm_epilogue (bias, act and the amax in the GEMM's epilogue, bf16 out) -> one cast pass
             (every tile configuration timed; the best kept)
and the bare GEMMs (no bias, no activation) in TFLOP/s: cuBLASLt, and each Triton tile configuration.
Every pipeline and tile configuration is checked before it is timed: its FP8 output against the float64
reference, SQNR >= MIN_SQNR_DB (FP8 E4M3 rounding gives ~31 dB), else AssertionError.
Prints a table and records it as the area "gemm_epilogue" in DIR (default benchmarks/results/;
benchmarks.harness.record: latest.json, latest.md, history.csv).

The Triton GEMM lives here, not in the library, which keeps cuBLASLt (docs/performance.md has the numbers):
    gemm_epilogue(a, a_scale_inv, b, b_scale_inv, bias, kind) -> (y, amax)
    y = act(dequant(a) @ dequant(b) + bias) in bf16, amax = max|act(...)| over its float32 values;
    a (M, K) FP8 row-major, b (K, N) FP8 column-major (a weight (N, K) viewed .t()), per-tensor float32
    scale-inverses, bias (N,) or None, kind one of activation.KINDS but swiglu.
Numerics: the FP8 tensor-core accumulator promoted to float32 every PROMOTE_EVERY_K products (as cuBLASLt
without fast accumulation), scaled once at the end; gemm_epilogue_ref is float64, the tests' yardstick.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import torch
import triton
import triton.language as tl

from benchmarks.harness import command_line, figure, make_timer, record
from float8.kernels import activation as act
from float8.kernels import quantize
from float8.kernels.activation_math import _act
from float8.kernels.cast import launch_cast
from float8.kernels.common import abs_bits, atomic_amax, cdiv, use_triton
from float8.kernels.reference import dequantize_ref

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
SHAPES = {"cuda": [(8192, 8192, 8192), (16384, 4096, 16384)], "cpu": [(64, 64, 64)]}
KINDS = ("identity", "gelu")  # bias + FP8 output with amax; the same with a GELU
MIN_SQNR_DB = 25.0


# ---- the kernel -------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages). The first is the default; the bench times all.
CONFIGS = [
    (128, 256, 128, 8, 8, 3),
    (128, 128, 128, 8, 8, 4),
    (128, 128, 128, 8, 4, 4),
    (256, 128, 128, 8, 8, 3),
    (128, 256, 64, 8, 8, 4),
]
# Hopper's FP8 tensor cores accumulate in reduced precision; Triton's FP8 dot, left to its default, never
# promotes to float32 (cuBLASLt's "fast accumulation"). Promoting every 128 products of K is what
# cuBLASLt does without fast accumulation (and what the gradient GEMMs here use): a fair comparison.
PROMOTE_EVERY_K = 128


@triton.jit
def _gemm_epilogue_kernel(
    a_ptr,  # (M, K) fp8, row-major
    b_ptr,  # (K, N) fp8, column-major: element (k, n) at b_ptr + n * K + k
    y_ptr,  # (M, N) bf16, row-major
    bias_ptr,  # (N,) (HAS_BIAS), else unused
    sa_ptr,  # () fp32: a's scale_inv
    sb_ptr,  # () fp32: b's scale_inv
    amax_ptr,  # () fp32, zeroed: receives max|y| over float32 values
    M,
    N,
    K,
    KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROMOTE_K: tl.constexpr,
):
    # Grouped program order: GROUP_M row tiles share each column tile of b while it is in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    size_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    b_tile = b_ptr + cols[None, :].to(tl.int64) * K + ks[:, None]
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = ks < K - k * BLOCK_K
        a = tl.load(a_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_K)
        a_tile += BLOCK_K
        b_tile += BLOCK_K

    v = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _act(v, KIND)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    atomic_amax(amax_ptr, tl.max(tl.max(abs_bits(tl.where(mask, y, 0.0)), axis=1), axis=0))


def gemm_epilogue_triton(a, sa, b, sb, bias, kind, config=None):
    (m, k), n = a.shape, b.shape[1]
    bm, bn, bk, group, warps, stages = config or CONFIGS[0]
    y = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    amax = torch.zeros((), dtype=torch.float32, device=a.device)
    grid = (max(1, cdiv(m, bm) * cdiv(n, bn)),)
    _gemm_epilogue_kernel[grid](
        a,
        b,
        y,
        bias if bias is not None else y,
        sa,
        sb,
        amax,
        m,
        n,
        k,
        KIND=kind,
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=group,
        PROMOTE_K=min(PROMOTE_EVERY_K, bk),  # at most one dot's K (Triton requires it)
        num_warps=warps,
        num_stages=stages,
    )
    return y, amax


def _check(a, sa, b, sb, bias, kind):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm_epilogue: shapes do not chain: {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or b.dtype not in (
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ):
        raise TypeError(f"gemm_epilogue: a and b must be FP8, got {a.dtype} and {b.dtype}")
    if not a.is_contiguous() or not b.mT.is_contiguous():
        raise ValueError("gemm_epilogue: a must be row-major and b column-major (a weight (N, K) viewed .t())")
    if sa.numel() != 1 or sb.numel() != 1 or sa.dtype != torch.float32 or sb.dtype != torch.float32:
        raise ValueError("gemm_epilogue: per-tensor float32 scale-inverses only")
    if kind not in act.KINDS or kind == "swiglu":
        raise ValueError(f"gemm_epilogue: kind must be one of {[k for k in act.KINDS if k != 'swiglu']}, got {kind!r}")
    if bias is not None and tuple(bias.shape) != (b.shape[1],):
        raise ValueError(f"gemm_epilogue: bias must be ({b.shape[1]},), got {tuple(bias.shape)}")


def gemm_epilogue(a, sa, b, sb, bias: Optional[torch.Tensor] = None, kind: str = "identity", config=None):
    """(y bf16 (M, N), amax () fp32): the Triton kernel on CUDA, the reference elsewhere."""
    _check(a, sa, b, sb, bias, kind)
    if use_triton(a):
        return gemm_epilogue_triton(a, sa, b, sb, bias, kind, config)
    return gemm_epilogue_ref(a, sa, b, sb, bias, kind)


def gemm_epilogue_ref(a, sa, b, sb, bias=None, kind="identity"):
    """The same in float64 then float32 (the kernel's epilogue precision): the test's yardstick."""
    v = dequantize_ref(a, sa, torch.float64) @ dequantize_ref(b, sb, torch.float64)
    if bias is not None:
        v = v + bias.double()
    y = act.act_ref_fp32(v.float(), kind)
    return y.to(torch.bfloat16), y.abs().max() if y.numel() else torch.zeros((), dtype=torch.float32)


# ---- the benchmark ----------------------------------------------------------------------------------


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp_min(1e-300)))


def pipelines(a, sa, b, sb, bias, kind, config):
    """{name: fn() -> (fp8 data, scale_inv)}: two ways to get fp8(act(a @ b + bias)), current scaling."""
    cuda = a.is_cuda

    def cublas():
        y = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=BF16)
        if kind == "identity":  # amax pass + cast pass
            data, _, scale_inv, _ = (quantize.quantize_tensorwise_triton if cuda else quantize.quantize_tensorwise_ref)(
                y, E4M3
            )
        else:  # act recomputed in both passes of the fused activation kernel
            data, _, scale_inv, _ = (act.act_fp8_triton if cuda else act.act_fp8_ref)(y, kind, None, E4M3)
        return data, scale_inv

    def triton_fused():
        y, amax = gemm_epilogue_triton(a, sa, b, sb, bias, kind, config)
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
    configs = CONFIGS if device == "cuda" else [(16, 32, 32, 2, 4, 2)]
    one = torch.ones((), device=device)
    rec["cublas_gemm_ms"] = bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=BF16))
    rec["triton_gemm_ms"] = {
        "x".join(map(str, c)): bench(lambda c=c: gemm_epilogue_triton(a, one, b, one, None, "identity", c))
        for c in configs
    }
    for kind in KINDS:
        ref = gemm_epilogue_ref(a, sa, b, sb, bias, kind)[0].float()

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


def figures(records: list) -> list:
    """Per shape: the bare GEMMs (cuBLASLt, the best Triton tile), then per epilogue both pipelines' ms and
    SQNR and the fused one's speedup over cuBLASLt's."""
    out = []
    for r in records:
        shape = "x".join(map(str, r["shape"]))
        best = min(r["triton_gemm_ms"].values())
        for variant, ms in (("cuBLASLt", r["cublas_gemm_ms"]), ("Triton, best tile", best)):
            out += [
                figure(f"{shape} GEMM alone", variant, "ms", ms),
                figure(f"{shape} GEMM alone", variant, "TFLOP/s", r["gemm_flops"] / ms / 1e9),
            ]
        for kind in KINDS:
            case = f"{shape} bias{'' if kind == 'identity' else ' + ' + kind} + amax"
            c, t = r[f"{kind}_cublas_ms"], r[f"{kind}_triton_ms"]
            out += [
                figure(case, "cuBLASLt + separate kernel", "ms", c),
                figure(case, "cuBLASLt + separate kernel", "sqnr_db", r[f"{kind}_cublas_sqnr_db"]),
                figure(case, "Triton fused + cast", "ms", t),
                figure(case, "Triton fused + cast", "sqnr_db", r[f"{kind}_triton_sqnr_db"]),
                figure(case, "Triton fused + cast", "speedup_vs_cublaslt", c / t),
            ]
    return out


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    bench = make_timer(cuda)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    records = [run_shape(*s, args.device, bench) for s in SHAPES["cuda" if cuda else "cpu"]]
    meta = {
        "device": name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command_line(None if argv is None else ["", *argv], module="benchmarks.gemm_epilogue"),
    }
    meta["triton"] = triton.__version__
    lines = [
        f"FP8 GEMM + bias (+ act) -> E4M3, current scaling; {name}, torch {meta['torch']}, triton {meta['triton']}",
        "",
        "| M x K x N | epilogue | cuBLASLt + separate kernel ms | Triton fused + cast ms | fused vs cuBLASLt | "
        "SQNR dB (cuBLASLt / Triton) | GEMM alone TFLOP/s (cuBLASLt / best Triton) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        tf = lambda ms: r["gemm_flops"] / ms / 1e9  # noqa: E731
        rates = f"{tf(r['cublas_gemm_ms']):.0f} / {tf(min(r['triton_gemm_ms'].values())):.0f}"
        for kind in KINDS:
            c, t = r[f"{kind}_cublas_ms"], r[f"{kind}_triton_ms"]
            epilogue = "bias" + ("" if kind == "identity" else " + " + kind) + " + amax"
            lines.append(
                f"| {'x'.join(map(str, r['shape']))} | {epilogue} | "
                f"{c:.3f} | {t:.3f} ({r[f'{kind}_triton_config']}) | {c / t:.2f}x | "
                f"{r[f'{kind}_cublas_sqnr_db']:.1f} / {r[f'{kind}_triton_sqnr_db']:.1f} | {rates} |"
            )
        r.update(meta)
    print("\n".join(lines))
    record("gemm_epilogue", args.out, meta, figures(records), "\n".join(lines) + "\n", {"records": records})
    return records


if __name__ == "__main__":
    main()
