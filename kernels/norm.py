"""RMSNorm and LayerNorm: forward, backward, and forward straight to FP8 (per-tensor scaling).

rmsnorm_fwd(x, weight, eps) -> (y, rstd)
layernorm_fwd(x, weight, bias, eps) -> (y, mean, rstd)
rmsnorm_fp8(x, weight, eps, fp8_dtype, margin, power_of_2, with_transpose) -> (data, data_t, scale_inv, amax, rstd)
layernorm_fp8(x, weight, bias, eps, fp8_dtype, margin, power_of_2, with_transpose)
    -> (data, data_t, scale_inv, amax, mean, rstd)
rmsnorm_fp8_scaled(x, weight, eps, scale, fp8_dtype, with_transpose) -> (data, data_t, scale_inv, amax, rstd)
layernorm_fp8_scaled(x, weight, bias, eps, scale, fp8_dtype, with_transpose)
    -> (data, data_t, scale_inv, amax, mean, rstd)
rmsnorm_bwd(dy, x, weight, rstd) -> (dx, dweight)
layernorm_bwd(dy, x, weight, mean, rstd) -> (dx, dweight, dbias)

x is (..., N), normalised over its last dim: M = x.numel() // N rows. y and dx have x's shape and dtype;
mean and rstd are (M,) float32; dweight/dbias have weight's dtype (accumulated in float32). All
arithmetic is float32, every step rounded on its own (kernels launch with enable_fp_fusion=False, so no
FMA contraction), in the order of the `*_ref` formulas:
    RMSNorm:   rstd = 1 / sqrt(sum(x*x) / N + eps)                  y = (x * rstd) * w
    LayerNorm: mean = sum(x) / N, rstd = 1 / sqrt(sum((x-mean)^2) / N + eps)
                                                                     y = ((x - mean) * rstd) * w + b
with IEEE division and square root (div_rn / sqrt_rn, not Triton's approximate `/` and `sqrt`). Only the
order of the row sums differs from torch's, so given the same mean/rstd, y and the FP8 bits are
bit-exact with the references (tests/kernels/test_norm.py); the stats themselves agree to an ulp or two
(exactly, where every partial sum is exact).

FP8 outputs: y is first rounded to x.dtype, then amax'ed and cast exactly like kernels/quantize.py does,
so rmsnorm_fp8(x, ...) == quantize_tensorwise(rmsnorm_fwd(x)[0], ...) bit for bit (same stats). y itself
is never written:
- current scaling (`*_fp8`), two launches, no host sync: the row kernel computes the stats and the amax
  of y (stats written, y not); the tile kernel recomputes y from x and the stats, derives the scale from
  the amax on the device (common.scale_from_amax), casts, writes data and data_t; program 0 writes
  scale_inv. x is read twice (the second time mostly from L2 for a row kernel, from HBM for large x).
- delayed scaling (`*_fp8_scaled`, scale given), one launch: the row kernel casts as it goes and folds
  amax(y) into the amax output (for the history). scale_inv = 1 / scale.
data is x.shape, data_t is (N, M) contiguous (the rows flattened: what the weight-gradient GEMM reads),
both written from the same 2-D tile, the second time through tl.trans. custom_op cannot return an
Optional[Tensor], so without with_transpose data_t is an empty (0,) tensor of the FP8 dtype.

Row kernels hold a (BLOCK_M, BLOCK_N) tile: the whole row when N <= 8192 (ONE_CHUNK: x read once from
HBM), else they loop over N in 4096-wide chunks, twice (stats, then y): the second pass re-reads the row
from L2 (one 16384-wide bf16 row is 32 KiB). LayerNorm's chunked statistics merge per-chunk (mean, M2)
pairs (Chan et al.), so the variance never comes from sum(x^2) - sum(x)^2.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .common import (
    abs_bits,
    atomic_amax,
    check_hp_input,
    check_scale,
    check_scaling_args,
    clamp_keep_nan,
    margin_div,
    next_pow2,
    scale_from_amax,
)
from .reference import amax_ref, cast_to_fp8_ref, check_fp8_dtype, fp8_max
from .reference import scale_from_amax as scale_from_amax_ref

# Tile shapes. Row kernels: one tile of at most 8192 elements per step, >= 16 rows for small N.
MAX_ONE_CHUNK = 8192  # N up to this: the whole row stays in registers
CHUNK = 4096  # beyond it: loop over N in chunks of this many columns
ROWS_TILE = 4096  # BLOCK_M * BLOCK_N of a row kernel when the row is short
T_ROWS = dict(BLOCK_M=32, BLOCK_N=128, num_warps=4)  # row kernel writing a transpose: 32 B segments of data_t
TILES = dict(BLOCK_M=16, BLOCK_N=256, num_warps=4)  # current scaling, second launch, no transpose
TILES_T = dict(BLOCK_M=64, BLOCK_N=128, num_warps=8)  # ... with transpose (as kernels/cast_transpose.py)

MODE_Y = 0  # row kernel: write y in x.dtype
MODE_AMAX = 1  # row kernel: fold amax(y) into amax_ptr, write nothing else (current scaling, first launch)
MODE_FP8 = 2  # row kernel: cast y with the given scale, write data (+ data_t) and fold amax(y)


# ---- device helpers ---------------------------------------------------------------------------------


@triton.jit
def _load_tile(
    x_ptr,  # (M, N) hp, row stride stride_xm, unit column stride
    rows,  # (BLOCK_M,) int
    cols,  # (BLOCK_N,) int
    M,
    N,
    stride_xm,
):
    """(BLOCK_M, BLOCK_N) float32 tile (0 outside the tensor) and its in-bounds mask."""
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _tile_stats(x, mask, n_f, IS_RMS: tl.constexpr):
    """Per-row (mean, variance) of a tile holding whole rows; mean is 0 for RMSNorm (variance = mean(x^2))."""
    if IS_RMS:
        var = tl.math.div_rn(tl.sum(x * x, axis=1), n_f)
        mean = tl.zeros_like(var)
    else:
        mean = tl.math.div_rn(tl.sum(x, axis=1), n_f)
        d = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.math.div_rn(tl.sum(d * d, axis=1), n_f)
    return mean, var


@triton.jit
def _looped_stats(
    x_ptr,  # (M, N) hp
    rows,  # (BLOCK_M,)
    M,
    N,
    n_f,
    stride_xm,
    IS_RMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Per-row (mean, variance) over N in BLOCK_N chunks, one read of x."""
    cols0 = tl.arange(0, BLOCK_N)
    if IS_RMS:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            x, mask = _load_tile(x_ptr, rows, n0 + cols0, M, N, stride_xm)
            acc += x * x
        var = tl.math.div_rn(tl.sum(acc, axis=1), n_f)
        mean = tl.zeros_like(var)
    else:
        # Chan et al.: merge each chunk's (count, mean, M2) into the running one.
        mean = tl.zeros((BLOCK_M,), tl.float32)
        m2 = tl.zeros((BLOCK_M,), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            x, mask = _load_tile(x_ptr, rows, n0 + cols0, M, N, stride_xm)
            n_a = n0.to(tl.float32)
            n_b = tl.minimum(N - n0, BLOCK_N).to(tl.float32)
            n_ab = n_a + n_b
            mean_b = tl.math.div_rn(tl.sum(x, axis=1), tl.full((BLOCK_M,), 1.0, tl.float32) * n_b)
            d = tl.where(mask, x - mean_b[:, None], 0.0)
            m2_b = tl.sum(d * d, axis=1)
            delta = mean_b - mean
            mean = mean + delta * (n_b / n_ab)
            m2 = m2 + m2_b + delta * delta * (n_a * n_b / n_ab)
        var = tl.math.div_rn(m2, tl.full((BLOCK_M,), 1.0, tl.float32) * n_f)
    return mean, var


@triton.jit
def _rstd(var, eps):
    return tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.sqrt_rn(var + eps))


@triton.jit
def _norm_y(
    x,  # (BLOCK_M, BLOCK_N) fp32
    w_ptr,  # (N,) hp
    b_ptr,  # (N,) hp (HAS_BIAS)
    cols,  # (BLOCK_N,)
    N,
    mean,  # (BLOCK_M,) fp32
    rstd,  # (BLOCK_M,) fp32
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """y in float32, each step rounded: (x * rstd) * w, or ((x - mean) * rstd) * w + b."""
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if IS_RMS:
        y = (x * rstd[:, None]) * w[None, :]
    else:
        y = ((x - mean[:, None]) * rstd[:, None]) * w[None, :]
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = y + b[None, :]
    return y


