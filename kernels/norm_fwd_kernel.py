"""The RMSNorm / LayerNorm forward kernels (Triton) and the device helpers the backward shares.

_norm_rows_kernel: BLOCK_M rows a program, their (mean, rstd), then y written (write_y 1, the forward) or
    max|y| folded into an amax (write_y 0, the first launch of norm_fp8).
_norm_fp8_tiles_kernel: norm_fp8's second launch, y recomputed tile by tile from x and the stats and cast
    to FP8 (data, and data_t through tl.trans).
Numerics: float32, IEEE div_rn / sqrt_rn, each step rounded in the references' order (launched without FMA).
Launchers and ops: kernels/norm.py; design notes: docs/design.md §10.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import abs_bits, atomic_amax, clamp_keep_nan, scale_from_amax

# The row kernel's runtime arguments that the JIT must not specialize on (tests/kernels/test_norm.py reads it):
# the forward and the FP8 first launch differ only in them, so they run one compiled kernel.
ROWS_NOT_SPECIALIZED = ("write_y",)


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
            n_a = tl.cast(n0, tl.float32)
            n_b = tl.cast(tl.minimum(N - n0, BLOCK_N), tl.float32)
            n_ab = n_a + n_b
            mean_b = tl.math.div_rn(tl.sum(x, axis=1), tl.full((BLOCK_M,), 1.0, tl.float32) * n_b)
            d = tl.where(mask, x - mean_b[:, None], 0.0)
            m2_b = tl.sum(d * d, axis=1)
            delta = mean_b - mean
            mean = mean + delta * tl.math.div_rn(n_b, n_ab)
            m2 = m2 + m2_b + delta * delta * tl.math.div_rn(n_a * n_b, n_ab)
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


@triton.jit
def _y_hp(
    x,  # (BLOCK_M, BLOCK_N) fp32 tile of x
    x_ptr,  # (M, N) hp: only its element type
    w_ptr,  # (N,) hp
    b_ptr,  # (N,) hp (HAS_BIAS)
    cols,  # (BLOCK_N,)
    N,
    mean,  # (BLOCK_M,) fp32
    rstd,  # (BLOCK_M,) fp32
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """y rounded to x.dtype, as the forward writes it; the FP8 outputs are cast from these values."""
    return _norm_y(x, w_ptr, b_ptr, cols, N, mean, rstd, IS_RMS, HAS_BIAS).to(x_ptr.dtype.element_ty)


@triton.jit
def _rows_y(
    x,  # (BLOCK_M, BLOCK_N) fp32 tile of x
    mask,  # (BLOCK_M, BLOCK_N) in bounds
    rows,  # (BLOCK_M,)
    cols,  # (BLOCK_N,)
    x_ptr,  # (M, N) hp
    w_ptr,  # (N,) hp
    b_ptr,  # (N,) hp (HAS_BIAS)
    y_ptr,  # (M, N) contiguous, x.dtype
    y_rows,  # rows of y to write: M, or 0 (none)
    N,
    mean,  # (BLOCK_M,) fp32
    rstd,  # (BLOCK_M,) fp32
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Write this tile of y (rows < y_rows); return |y| as int32 bits (0 outside the tensor) for amax."""
    y = _y_hp(x, x_ptr, w_ptr, b_ptr, cols, N, mean, rstd, IS_RMS, HAS_BIAS)
    _store_rows(y_ptr, y, rows, cols, y_rows, N)
    return tl.where(mask, abs_bits(y), 0)


@triton.jit
def _load_stats(
    mean_ptr,  # (M,) fp32 (not IS_RMS)
    rstd_ptr,  # (M,) fp32
    rows,  # (BLOCK_M,)
    M,
    IS_RMS: tl.constexpr,
):
    """(mean, rstd) of these rows, 0 past the end; mean is 0 for RMSNorm."""
    rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
    if IS_RMS:
        mean = tl.zeros_like(rstd)
    else:
        mean = tl.load(mean_ptr + rows, mask=rows < M, other=0.0)
    return mean, rstd


@triton.jit
def _store_rows(
    out_ptr,  # (M, N) contiguous
    v,  # (BLOCK_M, BLOCK_N)
    rows,  # (BLOCK_M,)
    cols,  # (BLOCK_N,)
    M,
    N,
):
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


# ---- kernels ----------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=ROWS_NOT_SPECIALIZED)
def _norm_rows_kernel(
    x_ptr,  # (M, N) hp, row stride stride_xm, unit column stride
    w_ptr,  # (N,) hp
    b_ptr,  # (N,) hp (HAS_BIAS)
    y_ptr,  # (M, N) contiguous, x.dtype: y (write_y 1); else a fresh (1,) tensor of x.dtype, never touched
    mean_ptr,  # (M,) fp32 (not IS_RMS)
    rstd_ptr,  # (M,) fp32
    amax_ptr,  # () fp32, zeroed: receives max|y| (write_y 0); else never touched
    M,
    N,
    n_f,  # float(N)
    stride_xm,
    eps,
    write_y,  # 1: write y (the forward); 0: fold max|y| into amax_ptr instead (FP8, first launch)
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """BLOCK_M rows per program: their stats, then y (written, or amax'ed).

    write_y is a runtime argument the JIT does not specialize on (ROWS_NOT_SPECIALIZED): the forward and the
    FP8 first launch are one compiled kernel, so their stats are the same bits whatever register layout (and
    with it, summation order) Triton picks for the row sums.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    if ONE_CHUNK:
        x, mask = _load_tile(x_ptr, rows, cols0, M, N, stride_xm)
        mean, var = _tile_stats(x, mask, n_f, IS_RMS)
    else:
        mean, var = _looped_stats(x_ptr, rows, M, N, n_f, stride_xm, IS_RMS, BLOCK_M, BLOCK_N)
    rstd = _rstd(var, eps)
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)
    if not IS_RMS:
        tl.store(mean_ptr + rows, mean, mask=rows < M)

    y_rows = M * write_y
    if ONE_CHUNK:
        bits = _rows_y(x, mask, rows, cols0, x_ptr, w_ptr, b_ptr, y_ptr, y_rows, N, mean, rstd, IS_RMS, HAS_BIAS)
    else:
        bits = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)  # elementwise max over the chunks
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + cols0
            x, mask = _load_tile(x_ptr, rows, cols, M, N, stride_xm)
            tile_bits = _rows_y(
                x, mask, rows, cols, x_ptr, w_ptr, b_ptr, y_ptr, y_rows, N, mean, rstd, IS_RMS, HAS_BIAS
            )
            bits = tl.maximum(bits, tile_bits)
    if write_y == 0:
        atomic_amax(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))


@triton.jit
def _norm_fp8_tiles_kernel(
    x_ptr,  # (M, N) hp, row stride stride_xm, unit column stride
    w_ptr,  # (N,) hp
    b_ptr,  # (N,) hp (HAS_BIAS)
    mean_ptr,  # (M,) fp32 (not IS_RMS), from _norm_rows_kernel
    rstd_ptr,  # (M,) fp32, from _norm_rows_kernel
    amax_ptr,  # () fp32: max|y|, from _norm_rows_kernel (CURRENT)
    scale_ptr,  # (1,) fp32: the given scale (not CURRENT)
    data_ptr,  # (M, N) contiguous FP8
    data_t_ptr,  # (N, M) contiguous FP8 (WITH_T)
    scale_inv_ptr,  # () fp32
    M,
    N,
    stride_xm,
    tiles_n,
    margin_div,  # 2.0**margin (CURRENT)
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,  # reference.min_scale(fp8_dtype), for scale_from_amax
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CURRENT: tl.constexpr,
    POWER_OF_2: tl.constexpr,
    WITH_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Second launch: one (BLOCK_M, BLOCK_N) tile of y, recomputed from x and the stats, and cast."""
    pid = tl.program_id(0)
    rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    x, mask = _load_tile(x_ptr, rows, cols, M, N, stride_xm)
    mean, rstd = _load_stats(mean_ptr, rstd_ptr, rows, M, IS_RMS)
    if CURRENT:
        scale = scale_from_amax(tl.load(amax_ptr), FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    else:
        scale = tl.load(scale_ptr)
    # y as the unfused op holds it (in x.dtype), elementwise: the FP8 bits equal quantize(norm(x)) bit for bit.
    y = _y_hp(x, x_ptr, w_ptr, b_ptr, cols, N, mean, rstd, IS_RMS, HAS_BIAS).to(tl.float32)
    q = clamp_keep_nan(y * scale, FP8_MAX).to(data_ptr.dtype.element_ty)
    _store_rows(data_ptr, q, rows, cols, M, N)
    if WITH_T:
        # (BLOCK_N, BLOCK_M): tile column c lands in row c of data_t, contiguous along M.
        offs_t = cols[:, None].to(tl.int64) * M + rows[None, :]
        mask_t = (cols[:, None] < N) & (rows[None, :] < M)
        tl.store(data_t_ptr + offs_t, tl.trans(q), mask=mask_t)
    tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=pid == 0)
