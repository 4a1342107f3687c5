"""An FP8 GEMM in Triton with a fused epilogue, built to answer one question: does fusing the bias, the
activation and the output's amax into the GEMM beat cuBLASLt (`torch._scaled_mm`, bias in its epilogue)
followed by our separate activation -> FP8 kernel? (`python -m benchmarks.gemm_epilogue` measures it;
the library keeps cuBLASLt while the answer is no, see examples/results/NOTES.md.)

gemm_epilogue(a, a_scale_inv, b, b_scale_inv, bias, kind) -> (y, amax)

    y = act(dequant(a) @ dequant(b) + bias) in bf16, amax = max|act(...)| over its float32 values
    a (M, K) FP8 row-major, b (K, N) FP8 column-major (strides (1, K): a weight (N, K) viewed transposed),
    per-tensor float32 scale-inverses (0-d), bias (N,) or None, kind one of activation.KINDS but swiglu.

The amax is what current scaling of y needs: with it, y's FP8 cast is one pass over y (cast with the
scale from this amax) instead of an amax pass plus a cast pass. Accumulation: the tensor cores' FP8
accumulator promoted to float32 every PROMOTE_EVERY_K products, scaled once at the end, like cuBLASLt
without fast accumulation; the bits differ from cuBLASLt's by its summation order, so the test compares
with a float64 reference.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .activation import KINDS, act_ref_fp32
from .activation_math import _act
from .common import cdiv, abs_bits, atomic_amax, use_triton
from .reference import dequantize_ref

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
        a, b, y, bias if bias is not None else y, sa, sb, amax, m, n, k,
        KIND=kind, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        PROMOTE_K=min(PROMOTE_EVERY_K, bk),  # at most one dot's K (Triton requires it)
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y, amax


def _check(a, sa, b, sb, bias, kind):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm_epilogue: shapes do not chain: {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or b.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"gemm_epilogue: a and b must be FP8, got {a.dtype} and {b.dtype}")
    if not a.is_contiguous() or not b.mT.is_contiguous():
        raise ValueError("gemm_epilogue: a must be row-major and b column-major (a weight (N, K) viewed .t())")
    if sa.numel() != 1 or sb.numel() != 1 or sa.dtype != torch.float32 or sb.dtype != torch.float32:
        raise ValueError("gemm_epilogue: per-tensor float32 scale-inverses only")
    if kind not in KINDS or kind == "swiglu":
        raise ValueError(f"gemm_epilogue: kind must be one of {[k for k in KINDS if k != 'swiglu']}, got {kind!r}")
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
    y = act_ref_fp32(v.float(), kind)
    return y.to(torch.bfloat16), y.abs().max() if y.numel() else torch.zeros((), dtype=torch.float32)
