"""float8::fp8_block_mm: y = dequant(a) @ dequant(w).t() (+ bias) for block-scaled FP8 operands (DeepSeek's scheme).

fp8_block_mm(a, a_scale_inv, w, w_scale_inv, bias=None, out_dtype=torch.bfloat16) -> y
    a (M, K) FP8 with a_scale_inv (M, K / C) float32: one scale per 1 x C block of a row (activations);
    w (N, K) FP8 with w_scale_inv (N / R, K / C) float32: one per R x C block, the grid tiling w exactly
    (a hub checkpoint's ceil-div grid is refined first: float8/hub_layout.py from_hub_blocks); R and C powers
    of two, C in 16..128, the same C for both.
    bias (N,) in out_dtype or None. y (M, N) in out_dtype (bfloat16 or float16).

Why: block-scaled weights otherwise run their GEMM on the dequantized weight (slower than bf16 at 4096 tokens
on the H100, docs/performance.md). Here each K step of C columns is one FP8 dot, accumulated in float32 on its
own, scaled by its row block's and column block's scale-inverses and added to the float32 sum: the scales
change along K, so they cannot wait for the end (the per-tensor GEMM's trick), and each step's dot stays
within one block. Non-finite values propagate through the dot and the scales.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import cdiv, refuse_redefinition, triton_op, use_triton
from .launch import FastLauncher
from .reference import FP8_DTYPES

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::fp8_block_mm", __name__)

# (BLOCK_M, BLOCK_N, num_warps, num_stages, GROUP_M); BLOCK_K is the scale block's width C (at most 128).
# GROUP_M: output tiles run GROUP_M row tiles at a time down each column of tiles, so that the weight tiles
# they share are read from L2 (1: row after row). GROUP_M 8 took the Llama-style layers' GEMMs at 4096 tokens
# from 3.35 to 2.93 ms (bf16: 2.38; .scratch sweep on the H100, 2026-11-26); wider, taller or 4-warp tiles
# were slower.
CONFIG = (128, 128, 8, 3, 8)


@triton.jit
def _fp8_block_mm_kernel(
    a_ptr,  # (M, K) fp8, row-major
    sa_ptr,  # (M, K / C) fp32, row-major
    w_ptr,  # (N, K) fp8, row-major
    sw_ptr,  # (N / R, K / C) fp32, row-major
    b_ptr,  # (N,) out dtype, or a_ptr when there is no bias (not read)
    y_ptr,  # (M, N) out dtype, row-major
    M,
    N,
    K,
    s_rows,  # R: weight rows per scale block
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # C
    GROUP_M: tl.constexpr,
):
    # One program per output tile, in groups of GROUP_M row tiles (see CONFIG).
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows
    pid_n = (pid % (GROUP_M * tiles_n)) // rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    kb = K // BLOCK_K  # scale blocks along K
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]  # the (BLOCK_K, BLOCK_N) tile of w.t()
    sa_ptrs = sa_ptr + rm.to(tl.int64) * kb
    sw_ptrs = sw_ptr + (rn // s_rows).to(tl.int64) * kb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, kb):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        sa = tl.load(sa_ptrs + i, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptrs + i, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * (sa[:, None] * sw[None, :])  # one block column: its own scales
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_launch = FastLauncher(_fp8_block_mm_kernel)


def fp8_block_mm_triton(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    w: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: Optional[tuple[int, int, int, int, int]] = None,
) -> torch.Tensor:
    """The kernel, no checks (fp8_block_mm checks). config: (BLOCK_M, BLOCK_N, warps, stages, GROUP_M)."""
    (m, k), n = a.shape, w.shape[0]
    block_m, block_n, warps, stages, group_m = config or CONFIG
    block_k = k // a_scale_inv.shape[1]
    s_rows = n // w_scale_inv.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=a.device)
    grid = (cdiv(n, block_n) * cdiv(m, block_m),)
    _launch(
        grid,
        a,
        a_scale_inv,
        w,
        w_scale_inv,
        a if bias is None else bias,
        y,
        m,
        n,
        k,
        s_rows,
        bias is not None,
        block_m,
        block_n,
        block_k,
        group_m,
        num_warps=warps,
        num_stages=stages,
    )
    return y


def fp8_block_mm_ref(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    w: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The semantics: both operands dequantized block by block in float32, multiplied, the bias added,
    rounded once to out_dtype."""
    k, n = a.shape[1], w.shape[0]
    cols = k // a_scale_inv.shape[1]
    da = a.float() * a_scale_inv.repeat_interleave(cols, 1)
    dw = w.float() * w_scale_inv.repeat_interleave(n // w_scale_inv.shape[0], 0).repeat_interleave(cols, 1)
    y = da @ dw.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def supported_width(c: int) -> bool:
    """Whether C-wide scale blocks along K fit the kernel: one K step (a power of two, 16..128) per block."""
    return 16 <= c <= 128 and _pow2(c)


def supports(a: torch.Tensor, a_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor) -> bool:
    """Whether fp8_block_mm takes these operands (see the module docstring)."""
    if a.dim() != 2 or w.dim() != 2 or a.dtype not in FP8_DTYPES or w.dtype not in FP8_DTYPES:
        return False
    if a_scale_inv.dim() != 2 or w_scale_inv.dim() != 2 or not a.is_contiguous() or not w.is_contiguous():
        return False
    (m, k), (n, k2) = a.shape, w.shape
    if k != k2 or a_scale_inv.shape[0] != m or 0 in a_scale_inv.shape or 0 in w_scale_inv.shape:
        return False
    if a_scale_inv.shape[1] != w_scale_inv.shape[1] or k % a_scale_inv.shape[1] or n % w_scale_inv.shape[0]:
        return False
    c, r = k // a_scale_inv.shape[1], n // w_scale_inv.shape[0]
    # Powers of two only: a hub checkpoint's ceil-div grid ((2, 1) for 200 rows) also divides some shapes, and
    # read as blocks of N / rows (100) it would scale rows 100-127 with the wrong block. Refined grids
    # (float8.hub_layout.from_hub_blocks: gcd(dim, 128)) and the block quantizer's are powers of two.
    return supported_width(c) and _pow2(r) and a_scale_inv.is_contiguous() and w_scale_inv.is_contiguous()


@triton_op("float8::fp8_block_mm")
def fp8_block_mm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    w: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """y (M, N) in out_dtype = dequant(a) @ dequant(w).t() (+ bias); see the module docstring."""
    if not supports(a, a_scale_inv, w, w_scale_inv):
        raise ValueError(
            f"fp8_block_mm: needs contiguous FP8 a (M, K) and w (N, K) with float32 scale-inverses (M, K / C) and "
            f"(N / R, K / C), C a power of two in 16..128; got a {tuple(a.shape)} {a.dtype}, a_scale_inv "
            f"{tuple(a_scale_inv.shape)}, w {tuple(w.shape)} {w.dtype}, w_scale_inv {tuple(w_scale_inv.shape)}"
        )
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_block_mm: out_dtype bfloat16 or float16, got {out_dtype}")
    if bias is not None and (tuple(bias.shape) != (w.shape[0],) or bias.dtype != out_dtype or not bias.is_contiguous()):
        raise ValueError(f"fp8_block_mm: bias must be a contiguous ({w.shape[0]},) {out_dtype} tensor")
    if use_triton(a):
        return fp8_block_mm_triton(a, a_scale_inv, w, w_scale_inv, bias, out_dtype)
    return fp8_block_mm_ref(a, a_scale_inv, w, w_scale_inv, bias, out_dtype)
