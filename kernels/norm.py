"""RMSNorm and LayerNorm: forward, backward, and forward straight to FP8 (per-tensor scaling).

norm_fwd(x, weight, bias, eps, rms) -> (y, mean, rstd)
norm_fp8(x, weight, bias, eps, rms, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False)
    -> (data, data_t, scale_inv, amax, mean, rstd)
norm_bwd(dy, x, weight, mean, rstd, dres=None) -> (dx, dweight, dbias)      dx + dres, when given

rms=True is RMSNorm (no bias: one is refused), rms=False LayerNorm (bias optional). A custom op cannot
return None, so RMSNorm's mean output is an empty (0,) float32 tensor; norm_bwd takes mean None for
RMSNorm and returns an empty (0,) dbias of weight's dtype then. norm_fp8's scale: None for current
scaling (the scale derived on the device from max|y|, with margin and power_of_2), or a one-element
float32 tensor on x's device (delayed or static scaling; margin and power_of_2 are ignored); amax = max|y|
either way (what a delayed-scaling history records). Each op runs its launcher norm_*_triton (the op's
arguments, plus config: tile overrides) on a CUDA tensor and its reference norm_*_ref elsewhere.

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
so norm_fp8(x, ...) == quantize_tensorwise(norm_fwd(x)[0], ...) bit for bit. y itself is never written.
Two launches, no host sync, for current (scale None) and delayed (scale given) scaling alike:
the row kernel computes the stats and the amax of y (stats written, y not; for delayed scaling amax feeds the
history); the tile kernel recomputes y from x and the stats, takes the scale (derived from the amax on the
device, common.scale_from_amax, or the given one), casts, writes data and data_t; program 0 writes
scale_inv (= 1 / scale). x is read twice (the second time mostly from L2 for a row kernel, from HBM for
large x).
Same stats as the forward, bit for bit, by construction: the first launch is the forward's own compiled
kernel (the row kernel's write_y is a runtime argument the JIT does not specialize on). That matters: the
order of a row sum follows the register layout Triton picks, and the layout follows the kernel's stores.
A row kernel that cast to FP8 as it went (one launch for delayed scaling, as this module once had) held 16
elements of x a thread (the FP8 store's 16 bytes) where the forward holds 16 bytes of x (8 bf16, 4 fp32),
and its rstd differed from the forward's in the last bit (H100: 28 of 129 fp16 rows; then y by an ulp in
up to 13% of the elements). The tile kernel has no sums: y there is
elementwise from the stored stats, so its layout cannot change it.

data is x.shape, data_t is (N, M) contiguous (the rows flattened: what the weight-gradient GEMM reads),
both written from the same 2-D tile, the second time through tl.trans. custom_op cannot return an
Optional[Tensor], so without with_transpose data_t is an empty (0,) tensor of the FP8 dtype.

Row kernels hold a (BLOCK_M, BLOCK_N) tile: the whole row when N <= 8192 (ONE_CHUNK: x read once from
HBM), else they loop over N in 4096-wide chunks, twice (stats, then y): the second pass re-reads the row
from L2 (one 16384-wide bf16 row is 32 KiB). LayerNorm's chunked statistics merge per-chunk (mean, M2)
pairs (Chan et al.), so the variance never comes from sum(x^2) - sum(x)^2. The tile kernel writing a
transpose takes (64, 64) tiles: 64-byte segments of data and data_t. The backward runs ~2 programs per SM,
each over many row blocks, holding whole rows up to N = 4096 (two passes over 2-row, 2048-wide chunks
beyond); each program sums its rows' dy * xhat (and dy) into its own float32 row of a (programs, N) buffer,
which torch then sums (no atomics, deterministic).
Register use of every default tile was checked with ptxas for sm_90 (see the table above the configs).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .common import (
    cdiv,
    abs_bits,
    atomic_amax,
    check_flag,
    check_hp_input,
    check_tensorwise_args,
    clamp_keep_nan,
    custom_op,
    fake_fp8_outputs,
    fp8_constants,
    margin_div,
    next_pow2,
    scale_from_amax,
    use_triton,
)
from .reference import quantize_tensorwise_ref

# Tile shapes (registers per thread on sm_90, from ptxas, in brackets; none spill). Row kernels: a tile of
# at most 8192 elements, >= 4096 while rows are short (<= 64 rows).
MAX_ONE_CHUNK = 8192  # N up to this: the whole row stays in registers (65-90)
CHUNK = 4096  # beyond it: loop over N in chunks of this many columns (80-98)
ROWS_TILE = 4096  # BLOCK_M * BLOCK_N of a row kernel when the row is short
TILES = dict(BLOCK_M=16, BLOCK_N=256, num_warps=8)  # FP8, second launch, no transpose (64-83)
TILES_T = dict(BLOCK_M=64, BLOCK_N=64, num_warps=8)  # ... with transpose: 64 B segments both ways (120-145)
BWD_ONE_CHUNK = 4096  # backward: whole rows up to this (89-95 at 16 warps; 8192 would spill)
BWD_CHUNKED = dict(BLOCK_M=2, BLOCK_N=2048, num_warps=8)  # beyond (86-115): 2 rows share a partial-dw update

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


@triton.jit
def _bwd_tile(
    x_ptr,  # (M, N) hp
    dy_ptr,  # (M, N) hp
    w_ptr,  # (N,) hp
    rows,  # (BLOCK_M,)
    cols,  # (BLOCK_N,)
    M,
    N,
    stride_xm,
    stride_dym,
    mean,  # (BLOCK_M,) fp32
    rstd,  # (BLOCK_M,) fp32
    IS_RMS: tl.constexpr,
):
    """(xhat, g = dy * w, dy) float32 tiles, 0 outside the tensor."""
    x, mask = _load_tile(x_ptr, rows, cols, M, N, stride_xm)
    dy, _ = _load_tile(dy_ptr, rows, cols, M, N, stride_dym)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if IS_RMS:
        xhat = x * rstd[:, None]
    else:
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    g = dy * w[None, :]
    return xhat, g, dy


@triton.jit
def _bwd_dx(xhat, g, c1, c2, rstd, IS_RMS: tl.constexpr):
    """dx = (g - xhat * c1) * rstd, LayerNorm: ((g - c2) - xhat * c1) * rstd."""
    if IS_RMS:
        return (g - xhat * c1[:, None]) * rstd[:, None]
    else:
        return ((g - c2[:, None]) - xhat * c1[:, None]) * rstd[:, None]


@triton.jit
def _plus_dres(dx, dres_ptr, dx_ptr, rows, cols, M, N, stride_rm, HAS_DRES: tl.constexpr):
    """dx, or dx rounded to its output dtype plus the residual's gradient in float32 (rounded again when
    stored): the bits of a separate add of the two tensors, without its pass over memory."""
    if HAS_DRES:
        r, _ = _load_tile(dres_ptr, rows, cols, M, N, stride_rm)
        dx = dx.to(dx_ptr.dtype.element_ty).to(tl.float32) + r
    return dx


@triton.jit
def _norm_bwd_kernel(
    dy_ptr,  # (M, N) hp, row stride stride_dym, unit column stride
    x_ptr,  # (M, N) hp, row stride stride_xm, unit column stride
    w_ptr,  # (N,) hp
    mean_ptr,  # (M,) fp32 (not IS_RMS)
    rstd_ptr,  # (M,) fp32
    dx_ptr,  # (M, N) contiguous, x.dtype
    dres_ptr,  # (M, N) x.dtype, row stride stride_rm, unit column stride (HAS_DRES): added to dx
    dw_ptr,  # (G, N) fp32, zeroed: row g = program g's sum of dy * xhat over its rows
    db_ptr,  # (G, N) fp32, zeroed: row g = program g's sum of dy (not IS_RMS)
    M,
    N,
    n_f,  # float(N)
    stride_xm,
    stride_dym,
    stride_rm,
    row_blocks,  # cdiv(M, BLOCK_M)
    IS_RMS: tl.constexpr,
    HAS_DRES: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """G persistent programs; program g takes row blocks g, g + G, ...: dx, and its partial dw (db)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_N)
    part = pid.to(tl.int64) * N
    if ONE_CHUNK:
        dw_acc = tl.zeros((BLOCK_N,), tl.float32)
        db_acc = tl.zeros((BLOCK_N,), tl.float32)
        for rb in range(pid, row_blocks, n_prog):
            rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
            mean, rstd = _load_stats(mean_ptr, rstd_ptr, rows, M, IS_RMS)
            xhat, g, dy = _bwd_tile(
                x_ptr, dy_ptr, w_ptr, rows, cols0, M, N, stride_xm, stride_dym, mean, rstd, IS_RMS
            )
            c1 = tl.math.div_rn(tl.sum(g * xhat, axis=1), n_f)
            c2 = tl.math.div_rn(tl.sum(g, axis=1), n_f)
            dx = _plus_dres(_bwd_dx(xhat, g, c1, c2, rstd, IS_RMS), dres_ptr, dx_ptr, rows, cols0, M, N, stride_rm, HAS_DRES)
            _store_rows(dx_ptr, dx, rows, cols0, M, N)
            dw_acc += tl.sum(dy * xhat, axis=0)
            db_acc += tl.sum(dy, axis=0)
        tl.store(dw_ptr + part + cols0, dw_acc, mask=cols0 < N)
        if not IS_RMS:
            tl.store(db_ptr + part + cols0, db_acc, mask=cols0 < N)
    else:
        for rb in range(pid, row_blocks, n_prog):
            rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
            mean, rstd = _load_stats(mean_ptr, rstd_ptr, rows, M, IS_RMS)
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for n0 in range(0, N, BLOCK_N):
                xhat, g, dy = _bwd_tile(
                    x_ptr, dy_ptr, w_ptr, rows, n0 + cols0, M, N, stride_xm, stride_dym, mean, rstd, IS_RMS
                )
                acc1 += g * xhat
                acc2 += g
            c1 = tl.math.div_rn(tl.sum(acc1, axis=1), n_f)
            c2 = tl.math.div_rn(tl.sum(acc2, axis=1), n_f)
            for n0 in range(0, N, BLOCK_N):
                cols = n0 + cols0
                xhat, g, dy = _bwd_tile(
                    x_ptr, dy_ptr, w_ptr, rows, cols, M, N, stride_xm, stride_dym, mean, rstd, IS_RMS
                )
                dx = _plus_dres(_bwd_dx(xhat, g, c1, c2, rstd, IS_RMS), dres_ptr, dx_ptr, rows, cols, M, N, stride_rm, HAS_DRES)
                _store_rows(dx_ptr, dx, rows, cols, M, N)
                # This program's own row of the partial sums: no other program touches it.
                dw = tl.load(dw_ptr + part + cols, mask=cols < N, other=0.0) + tl.sum(dy * xhat, axis=0)
                tl.store(dw_ptr + part + cols, dw, mask=cols < N)
                if not IS_RMS:
                    db = tl.load(db_ptr + part + cols, mask=cols < N, other=0.0) + tl.sum(dy, axis=0)
                    tl.store(db_ptr + part + cols, db, mask=cols < N)


# ---- launchers --------------------------------------------------------------------------------------


def _rows_config(N: int, config: Optional[dict] = None) -> dict:
    """Tile of a row kernel (also the backward's): the whole row up to MAX_ONE_CHUNK, else CHUNK-wide steps."""
    if config is not None:
        cfg = dict(config)
    else:
        block_n = next_pow2(N) if N <= MAX_ONE_CHUNK else CHUNK
        block_m = max(1, min(64, ROWS_TILE // block_n))
        tile = block_m * block_n
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if tile <= 2048 else 8 if tile <= 4096 else 16)
    cfg["ONE_CHUNK"] = N <= cfg["BLOCK_N"]
    return cfg


def _tiles_config(N: int, with_t: bool, config: Optional[dict] = None) -> dict:
    if config is not None:
        return dict(config)
    if with_t:
        return dict(TILES_T)
    block_n = min(TILES["BLOCK_N"], next_pow2(N))
    return dict(TILES, BLOCK_N=block_n, BLOCK_M=max(TILES["BLOCK_M"], min(64, ROWS_TILE // block_n)))


def _bwd_config(N: int, config: Optional[dict] = None) -> dict:
    if config is not None:
        cfg = dict(config)
    elif N <= BWD_ONE_CHUNK:
        block_n = next_pow2(N)
        block_m = max(1, min(64, ROWS_TILE // block_n))
        tile = block_m * block_n
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if tile <= 1024 else 8 if tile <= 2048 else 16)
    else:
        cfg = dict(BWD_CHUNKED)
    cfg["ONE_CHUNK"] = N <= cfg["BLOCK_N"]
    return cfg


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _rows_2d(t: torch.Tensor, N: int) -> torch.Tensor:
    """(M, N) view of t (a copy only when the rows cannot be addressed with one stride)."""
    t2 = t.reshape(-1, N)
    if t2.stride(-1) != 1 and t2.shape[-1] > 1:
        t2 = t2.contiguous()
    return t2


def _launch_rows(x2, weight, bias, eps, is_rms, y, amax, config):
    """Run _norm_rows_kernel over x2 (M, N): write y (amax None), or fold max|y| into amax (y None).
    Returns (mean or None, rstd).

    Both uses launch the same specialization: write_y is not specialized on, and in place of the missing
    tensor goes a fresh allocation of the same dtype (so of the same 16-byte alignment), never touched.
    """
    M, N = x2.shape
    dev = x2.device
    rstd = torch.empty((M,), dtype=torch.float32, device=dev)
    mean = None if is_rms else torch.empty((M,), dtype=torch.float32, device=dev)
    if M == 0:
        return mean, rstd
    write_y = y is not None
    if y is None:
        y = torch.empty((1,), dtype=x2.dtype, device=dev)
    if amax is None:
        amax = rstd  # fp32, fresh: the same specialization as a zeroed amax
    cfg = _rows_config(N, config)
    _norm_rows_kernel[(cdiv(M, cfg["BLOCK_M"]),)](
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        mean if mean is not None else rstd,
        rstd,
        amax,
        M,
        N,
        float(N),
        x2.stride(0),
        float(eps),
        int(write_y),
        IS_RMS=is_rms,
        HAS_BIAS=bias is not None,
        ONE_CHUNK=cfg["ONE_CHUNK"],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False,  # no FMA contraction: the references' rounding, step by step
    )
    return mean, rstd


def _contig(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _no_mean(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm's mean output: an empty (0,) float32 tensor (a custom op cannot return None)."""
    return torch.empty((0,), dtype=torch.float32, device=x.device)


def norm_fwd_triton(x, weight, bias, eps, rms, config=None):
    """norm_fwd on the GPU: (y (x.shape, x.dtype), mean (M,) fp32 or (0,) for RMSNorm, rstd (M,) fp32)."""
    N = x.shape[-1]
    x2 = _rows_2d(x, N)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean, rstd = _launch_rows(x2, weight.contiguous(), _contig(bias), eps, rms, y, None, config)
    return y, _no_mean(x) if mean is None else mean, rstd


def _fp8_outputs(x, fp8_dtype, with_transpose):
    N = x.shape[-1]
    M = x.numel() // N
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    data_t = torch.empty((N, M) if with_transpose else (0,), dtype=fp8_dtype, device=x.device)
    return data, data_t


def _launch_tiles(x2, w, b, mean, rstd, amax, scale, data, data_t, with_t, margin, power_of_2, config):
    """Run _norm_fp8_tiles_kernel: cast y at scale_from_amax(amax) (scale None) or at `scale`.
    Returns scale_inv."""
    M, N = x2.shape
    if M == 0:  # no program to write it
        if scale is None:
            return torch.ones((), dtype=torch.float32, device=x2.device)  # amax 0 -> scale 1
        return scale.reshape(()).reciprocal()
    scale_inv = torch.empty((), dtype=torch.float32, device=x2.device)
    cfg = _tiles_config(N, with_t, config)
    tiles_n = cdiv(N, cfg["BLOCK_N"])
    _norm_fp8_tiles_kernel[(cdiv(M, cfg["BLOCK_M"]) * tiles_n,)](
        x2,
        w,
        b if b is not None else w,
        mean if mean is not None else rstd,
        rstd,
        amax,
        scale if scale is not None else amax,
        data,
        data_t if with_t else data,
        scale_inv,
        M,
        N,
        x2.stride(0),
        tiles_n,
        margin_div(margin),
        **fp8_constants(data.dtype),
        IS_RMS=mean is None,
        HAS_BIAS=b is not None,
        CURRENT=scale is None,
        POWER_OF_2=power_of_2,
        WITH_T=with_t,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )
    return scale_inv


def norm_fp8_triton(
    x, weight, bias, eps, rms, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False, config=None
):
    """norm_fp8 on the GPU, current scaling (scale None) or a given scale: two launches, no host sync.
    (data, data_t (N, M) or (0,), scale_inv, amax, mean (M,) or (0,) for RMSNorm, rstd)."""
    N = x.shape[-1]
    x2 = _rows_2d(x, N)
    w = weight.contiguous()
    b = _contig(bias)
    data, data_t = _fp8_outputs(x, fp8_dtype, with_transpose)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    if scale is not None:
        scale = scale.reshape(1).float()
    # Stats and amax(y) first, by the forward's own compiled kernel (so with its stats, bit for bit); then y
    # again, tile by tile, cast and written in both layouts. A given scale takes this route too, though one
    # row kernel could cast as it goes: its FP8 store changes the register layout Triton picks for the row
    # (16 elements a thread instead of 16 bytes), with it the order of the row sums, and the stats then
    # differ from the forward's in the last bit (measured on the H100: rstd in 28 of 129 fp16 rows).
    mean, rstd = _launch_rows(x2, w, b, eps, rms, None, amax, config)
    scale_inv = _launch_tiles(
        x2, w, b, mean, rstd, amax, scale, data, data_t, with_transpose, margin, power_of_2, config
    )
    return data, data_t, scale_inv, amax, _no_mean(x) if mean is None else mean, rstd


def norm_bwd_triton(dy, x, weight, mean, rstd, config=None, dres=None):
    """norm_bwd on the GPU (mean None: RMSNorm): (dx (x.shape, x.dtype), dweight (N,), dbias (N,) or (0,)
    for RMSNorm, in weight.dtype). Partial column sums per program, summed by torch (no atomics).
    dres: added to dx (see norm_bwd)."""
    is_rms = mean is None
    N = x.shape[-1]
    x2 = _rows_2d(x, N)
    dy2 = _rows_2d(dy, N)
    dres2 = _rows_2d(dres, N) if dres is not None else x2
    M = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cfg = _bwd_config(N, config)
    row_blocks = cdiv(M, cfg["BLOCK_M"])
    if "GRID" in cfg:
        grid = cfg["GRID"]
    elif x.device.type == "cuda":
        grid = 2 * _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())
    else:
        grid = 4
    grid = max(1, min(grid, row_blocks))
    dw_part = torch.zeros((grid, N), dtype=torch.float32, device=x.device)
    db_part = None if is_rms else torch.zeros((grid, N), dtype=torch.float32, device=x.device)
    if M:
        _norm_bwd_kernel[(grid,)](
            dy2,
            x2,
            weight.contiguous(),
            mean.contiguous() if mean is not None else rstd,
            rstd.contiguous(),
            dx,
            dres2,
            dw_part,
            db_part if db_part is not None else dw_part,
            M,
            N,
            float(N),
            x2.stride(0),
            dy2.stride(0),
            dres2.stride(0),
            row_blocks,
            IS_RMS=is_rms,
            HAS_DRES=dres is not None,
            ONE_CHUNK=cfg["ONE_CHUNK"],
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"],
            enable_fp_fusion=False,
        )
    dw = dw_part.sum(0).to(weight.dtype)
    db = weight.new_empty((0,)) if is_rms else db_part.sum(0).to(weight.dtype)
    return dx, dw, db


# ---- checks -----------------------------------------------------------------------------------------


def _check_vec(v, name, N, x, op):
    check_hp_input(v, op, name)
    if v.dim() != 1 or v.shape[0] != N:
        raise ValueError(
            f"{op}: {name} must have shape ({N},), the last dim of x {tuple(x.shape)}; got {tuple(v.shape)}"
        )
    if v.device != x.device:
        raise ValueError(f"{op}: {name} is on {v.device} but x is on {x.device}")


def _check_fwd(op, x, weight, bias, eps, rms) -> None:
    check_hp_input(x, op)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dim to normalise over, got shape {tuple(x.shape)}")
    N = x.shape[-1]
    _check_vec(weight, "weight", N, x, op)
    if not isinstance(rms, bool):
        raise TypeError(f"{op}: rms must be a bool (True: RMSNorm, False: LayerNorm), got {type(rms).__name__}")
    if bias is not None:
        if rms:
            raise ValueError(f"{op}: rms=True (RMSNorm) takes no bias, got a bias of shape {tuple(bias.shape)}")
        _check_vec(bias, "bias", N, x, op)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (0.0 <= eps < math.inf):
        raise ValueError(f"{op}: eps must be a finite float >= 0, got {eps!r}")


def _check_fp8(op, x, weight, bias, eps, rms, fp8_dtype, scale, margin, power_of_2, with_transpose) -> None:
    _check_fwd(op, x, weight, bias, eps, rms)
    check_tensorwise_args(x, fp8_dtype, scale, margin, power_of_2, op)
    check_flag(with_transpose, "with_transpose", op)


def _check_stat(t, name, M, x, op):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be a float32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != (M,):
        raise ValueError(
            f"{op}: {name} must have shape ({M},) for x of shape {tuple(x.shape)}, got {tuple(t.shape)}"
        )
    if t.device != x.device:
        raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")


def _check_bwd(op, dy, x, weight, mean, rstd, dres=None) -> None:
    _check_fwd(op, x, weight, None, 0.0, mean is None)
    check_hp_input(dy, op, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy must have the shape of x {tuple(x.shape)}, got {tuple(dy.shape)}")
    if dy.device != x.device:
        raise ValueError(f"{op}: dy is on {dy.device} but x is on {x.device}")
    if dres is not None:
        check_hp_input(dres, op, "dres")
        if dres.shape != x.shape or dres.dtype != x.dtype or dres.device != x.device:
            raise ValueError(
                f"{op}: dres must have x's shape, dtype and device {tuple(x.shape)}, {x.dtype}, {x.device}; got "
                f"{tuple(dres.shape)}, {dres.dtype}, {dres.device}"
            )
    M = _rows(x)
    if mean is not None:
        _check_stat(mean, "mean", M, x, op)
    _check_stat(rstd, "rstd", M, x, op)


def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def _fake_stats(x, rms):
    """(mean (M,) or (0,) for RMSNorm, rstd (M,)), float32."""
    M = _rows(x)
    return x.new_empty((0 if rms else M,), dtype=torch.float32), x.new_empty((M,), dtype=torch.float32)


# ---- public ops -------------------------------------------------------------------------------------


@custom_op("float8::norm_fwd")
def norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (x.shape, x.dtype), mean (M,) fp32 or (0,) for RMSNorm, rstd (M,) fp32).

    rms=True: y = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps), no bias. rms=False: y = (x - mean) *
    rstd * weight + bias (bias optional), rstd = 1/sqrt(var + eps).
    """
    _check_fwd("norm_fwd", x, weight, bias, eps, rms)
    if use_triton(x, writes_fp8=False):
        return norm_fwd_triton(x, weight, bias, eps, rms)
    return norm_fwd_ref(x, weight, bias, eps, rms)


@norm_fwd.register_fake
def _(x, weight, bias, eps, rms):
    _check_fwd("norm_fwd", x, weight, bias, eps, rms)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), *_fake_stats(x, rms))


@custom_op("float8::norm_fp8")
def norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_fwd straight to FP8, per-tensor scaling: y is never written in high precision.

    scale None: current scaling (scale from max|y|, margin, power_of_2); else a one-element fp32 scale on
    x's device (delayed or static scaling; margin and power_of_2 ignored). Returns (data (x.shape) fp8,
    data_t (N, M) fp8 or (0,) without with_transpose, scale_inv () fp32, amax () fp32 = max|y| (for a
    delayed-scaling history), mean (M,) fp32 or (0,) for RMSNorm, rstd (M,) fp32).
    """
    _check_fp8("norm_fp8", x, weight, bias, eps, rms, fp8_dtype, scale, margin, power_of_2, with_transpose)
    if use_triton(x):
        return norm_fp8_triton(x, weight, bias, eps, rms, fp8_dtype, scale, margin, power_of_2, with_transpose)
    return norm_fp8_ref(x, weight, bias, eps, rms, fp8_dtype, scale, margin, power_of_2, with_transpose)


@norm_fp8.register_fake
def _(x, weight, bias, eps, rms, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False):
    _check_fp8("norm_fp8", x, weight, bias, eps, rms, fp8_dtype, scale, margin, power_of_2, with_transpose)
    t_shape = (x.shape[-1], _rows(x)) if with_transpose else None
    return (*fake_fp8_outputs(x, x.shape, t_shape, fp8_dtype), *_fake_stats(x, rms))


@custom_op("float8::norm_bwd")
def norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: Optional[torch.Tensor], rstd: torch.Tensor,
    dres: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx (x.shape, x.dtype), dweight (N,), dbias (N,) in weight.dtype) from the forward's stats.

    mean None: RMSNorm, and dbias is an empty (0,) tensor of weight.dtype. dres (x's shape and dtype): a
    gradient added to dx, as `dx + dres` would (the residual branch's, for a norm right after a Residual).
    """
    _check_bwd("norm_bwd", dy, x, weight, mean, rstd, dres)
    if use_triton(x, writes_fp8=False):
        return norm_bwd_triton(dy, x, weight, mean, rstd, dres=dres)
    return norm_bwd_ref(dy, x, weight, mean, rstd, dres)


@norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, dres=None):
    _check_bwd("norm_bwd", dy, x, weight, mean, rstd, dres)
    dbias = weight.new_empty((0,) if mean is None else weight.shape)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight), dbias


# ---- references: the same float32 formulas in plain PyTorch ----------------------------------------


def _div_n(s: torch.Tensor, N: int) -> torch.Tensor:
    # A tensor divisor, not a Python scalar: CUDA divides by a scalar as a multiply by its reciprocal.
    return s / torch.full_like(s, N)


def norm_stats_ref(x: torch.Tensor, eps: float, is_rms: bool):
    """(mean (M,) fp32 or None for RMSNorm, rstd (M,) fp32) of x viewed as (M, N)."""
    N = x.shape[-1]
    xf = x.reshape(-1, N).float()
    if is_rms:
        mean = None
        var = _div_n((xf * xf).sum(-1), N)
    else:
        mean = _div_n(xf.sum(-1), N)
        d = xf - mean[:, None]
        var = _div_n((d * d).sum(-1), N)
    rstd = torch.reciprocal(sqrt_rn(var + eps))
    return mean, rstd


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (the kernels' sqrt_rn, CUDA's sqrtf).

    torch.sqrt on CPU is a vectorised approximation, 1 ulp off for ~20% of float32 inputs (and its float64
    sqrt for ~1%), so: a float64 sqrt rounded to float32 (within an ulp), then fixed by comparing v with the
    squares of the midpoints to its neighbours, which float64 holds exactly (25-bit midpoints).
    """
    v = v.float()
    s = torch.sqrt(v.double()).float()
    up = torch.nextafter(s, torch.full_like(s, float("inf")))
    down = torch.nextafter(s, torch.zeros_like(s))
    hi = (s.double() + up.double()) / 2
    lo = (s.double() + down.double()) / 2
    vd = v.double()
    s = torch.where(hi * hi < vd, up, s)
    return torch.where(lo * lo > vd, down, s)


def norm_apply_ref(x, weight, bias, mean, rstd) -> torch.Tensor:
    """y in float32, shape (M, N), from given stats (mean None: RMSNorm), rounded step by step like the kernels."""
    N = x.shape[-1]
    xf = x.reshape(-1, N).float()
    if mean is None:
        y = (xf * rstd[:, None]) * weight.float()[None, :]
    else:
        y = ((xf - mean[:, None]) * rstd[:, None]) * weight.float()[None, :]
    if bias is not None:
        y = y + bias.float()[None, :]
    return y


def quantize_y_ref(y_hp, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False):
    """reference.quantize_tensorwise_ref of y's rows: (data (y's shape), data_t (N, M) or (0,), scale_inv,
    amax = max|y|), at `scale` or (scale None) at the current scale."""
    N = y_hp.shape[-1]
    data, *rest = quantize_tensorwise_ref(y_hp.reshape(-1, N), fp8_dtype, scale, margin, power_of_2, with_transpose)
    return data.reshape(y_hp.shape), *rest


def norm_fwd_ref(x, weight, bias, eps, rms):
    mean, rstd = norm_stats_ref(x, eps, rms)
    y = norm_apply_ref(x, weight, bias, mean, rstd).to(x.dtype).reshape(x.shape)
    return y, _no_mean(x) if mean is None else mean, rstd


def norm_fp8_ref(x, weight, bias, eps, rms, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False):
    y, mean, rstd = norm_fwd_ref(x, weight, bias, eps, rms)
    return (*quantize_y_ref(y, fp8_dtype, scale, margin, power_of_2, with_transpose), mean, rstd)


def norm_bwd_ref(dy, x, weight, mean, rstd, dres=None):
    """(dx (x.shape, x.dtype), dweight, dbias (weight.dtype)) from given stats; mean None: RMSNorm, dbias (0,).
    dres: added to dx once dx is rounded to x.dtype."""
    N = x.shape[-1]
    xf = x.reshape(-1, N).float()
    dyf = dy.reshape(-1, N).float()
    r = rstd[:, None]
    g = dyf * weight.float()[None, :]
    if mean is None:
        xhat = xf * r
        c1 = _div_n((g * xhat).sum(-1), N)
        dx = (g - xhat * c1[:, None]) * r
        db = weight.new_empty((0,))
    else:
        xhat = (xf - mean[:, None]) * r
        c1 = _div_n((g * xhat).sum(-1), N)
        c2 = _div_n(g.sum(-1), N)
        dx = ((g - c2[:, None]) - xhat * c1[:, None]) * r
        db = dyf.sum(0).to(weight.dtype)
    dw = (dyf * xhat).sum(0).to(weight.dtype)
    dx = dx.to(x.dtype).reshape(x.shape)
    return (dx if dres is None else dx + dres), dw, db
