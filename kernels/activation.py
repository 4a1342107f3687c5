"""Activations, forward and backward, optionally writing FP8 directly (per-tensor scaling).

    act_fwd(x, kind, bias=None) -> y                                        y = act(x + bias), x.dtype
    act_fp8(x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False)
        -> (data, data_t, scale_inv, amax)          act(x + bias) in FP8
    act_bwd(dy, x, kind, bias=None) -> dx                                   dx = dy * act'(x + bias), x.dtype
    dact_fp8(dy, x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=True,
             with_dbias=True, x_scale_inv=None)
        -> (data, data_t, scale_inv, amax, dbias)   dx in FP8, and dbias; kind "identity" with x = dy is a
                                                    bias's backward
    act_fp8_save_input(x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False)
        -> (data, data_t, scale_inv, amax, x_data, x_scale_inv)    act_fp8, and x itself in E4M3

Lean activation memory: act_fp8_save_input also writes x (before the bias) in E4M3 with its own per-tensor
current scale, in the same two passes (pass 1 folds max|x| too; pass 2 writes x_data beside the FP8 act);
act_bwd and dact_fp8 given x_scale_inv read that copy (x_data * x_scale_inv in float32) in place of x. An
activation saved this way keeps 1 byte per element for its backward instead of 2 (bf16).

scale None is current scaling (the scale derived on the device from the amax, with margin and power_of_2);
a one-element float32 tensor is a given scale (delayed or static scaling; margin and power_of_2 ignored),
and amax is still computed (for a delayed-scaling history). Each op runs its launcher *_triton (the op's
arguments, plus config: the transposing pass's tile) on a CUDA tensor and its reference *_ref elsewhere.

Kinds: "identity", "relu", "gelu" (erf form, torch.nn.functional.gelu's default), "gelu_tanh"
(approximate="tanh"), "silu", "swiglu". SwiGLU takes x (..., 2H) and gives (..., H):
    swiglu(x) = silu(x[..., :H]) * x[..., H:]        (first half: gate, through silu; second half: linear)
and its gradient has 2H columns: d a = dy * b * silu'(a), d b = dy * silu(a). A bias always has the size
of x's last dim (2H for swiglu) and is added before the activation.

Shapes: x is (..., N_IN); leading dims are rows. `data` has act's shape (..., N) (N = N_IN, or H), and
`data_t` is `data` with its last two dims swapped, contiguous (..., N, M): the layout an FP8 GEMM
needs in backward, the transpose cache of a Float8Tensor. A custom op cannot return an Optional
tensor, so without with_transpose `data_t` is an empty (0,) tensor of the FP8 dtype.
scale_inv and amax are () float32; amax is max|act(x + bias)| (or max|dx|) over float32 values, NaN
if one is NaN. dbias (N_IN,) = dx summed over rows in float32, returned in dy.dtype.

Numerics: every value is computed in float32 registers and never rounded to x.dtype before it is
quantized: the FP8 outputs are the satfinite RTNE cast of the float32 activation (or gradient) times
a scale computed on the device from its amax, exactly as reference.scale_from_amax (common.py).
For bf16/fp16 x that is one rounding fewer than act_fwd followed by a quantize, so the two can differ
by one FP8 step where the bf16 rounding crosses an FP8 midpoint. Logistic terms use t = exp(-|u|) <= 1,
so silu, gelu_tanh (x * sigmoid(2u), the same function as 0.5x(1 + tanh u)) and their derivatives have
no overflow and no cancellation. The erf GELU is x * Phi(x) with the normal cdf Phi computed without
cancellation (`_phi`): 0.5 (1 + erf(x / sqrt 2)) for x >= 0, and for x < 0, where 1 + erf cancels (to
nothing left by x ~ -6; torch's float32 F.gelu is wrong there), 0.5 erfc(|x| / sqrt 2) from an exp-based
erfc with relative error < 1.2e-7 (Triton has no erfc but libdevice's). The tiny negative values and
gradients of x << 0 are thus right to 1e-6 + x^2 2^-24 relative (exp(-x^2/2) inherits the roundings of
its argument: ~7e-6 at x = -12, where gelu is -1e-32) instead of noise.
Divisions are IEEE (div_rn), as in torch; Triton's exp and erf may differ from torch's by an ulp or two
(on the GPU exp is ex2.approx, and Triton contracts a * b + c to fma), so the *_ref twins agree with the
kernels to a few float32 ulps, and bit for bit for identity and relu.

Each current-scaling op is two launches of one kernel, no host sync: pass 1 computes act in registers
and folds max|act| into an amax buffer (the backward also writes per-program column sums for dbias,
unless with_dbias=False); pass 2 (MODE "current") recomputes act, reads the amax, computes the scale, and
writes FP8 (both layouts with with_transpose, through TRANSPOSE_CONFIG tiles transposed through shared
memory, so both stores are coalesced; data alone through row tiles); its program 0 writes scale_inv =
1 / scale. Recomputing costs a second read of x (and dy) but never writes act in high precision. With a
given scale (MODE "delayed") the forward is one launch that casts and folds the amax as it goes; the
backward keeps pass 1 (amax, dbias) and casts in pass 2 at the scale it loads. The backward's pair
(silu, silu') comes from one IEEE reciprocal per element (_logistic): with three divisions it was bound
by arithmetic, not by memory.
"""

from __future__ import annotations

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
    next_pow2,
    scale_from_amax,
    transposed_shape,
    use_triton,
)
from .reference import FP8_DTYPES, quantize_tensorwise_ref

KINDS = ("identity", "relu", "gelu", "gelu_tanh", "silu", "swiglu")

# Constants of the formulas, written once for the kernels and the references (float32 when used).
SQRT1_2 = 0.7071067811865476  # 1/sqrt(2): gelu's erf argument
INV_SQRT_2PI = 0.3989422804014327  # 1/sqrt(2 pi): gelu's pdf
# erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), z >= 0: P's coefficients, t^0 first (Chebyshev fit of
# Numerical Recipes' erfcc; relative error < 1.2e-7 for all z >= 0, measured 1.05e-7 in float64).
ERFC_P = (
    -1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
    0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277,
)  # fmt: skip
TANH_BETA = 0.7978845608028654  # sqrt(2/pi): gelu_tanh
TANH_KAPPA = 0.044715
TANH_KAPPA3 = 0.134145  # 3 * TANH_KAPPA

# Tiles. Row-wise passes (high-precision output, amax, FP8 without transpose): (BLOCK_S, BLOCK_N) with
# BLOCK_S * BLOCK_N <= 4096, looping over up to MAX_ITERS tiles down the rows (fewer atomics and dbias
# partials), NUM_WARPS warps. Transposing pass: TRANSPOSE_CONFIG (`python -m benchmarks.act_sweep` times
# the alternatives at the MLP block's SwiGLU shapes).
ROW_BLOCK_N = 128
ROW_ELEMS = 4096
MAX_ITERS = 16
NUM_WARPS = 4
# (32, 128), 4 warps, 16-bit transpose: 0.52 / 1.02 ms for the MLP block's SwiGLU forward / backward pass 2
# (90% / 76% of copy bandwidth), against 0.58 / 1.04 for (64, 64) through FP8 bytes (H100, 2026-11-22;
# examples/results/profile_nvidia-h100-80gb-hbm3_2026-11-22.md, section 4).
TRANSPOSE_CONFIG = dict(BLOCK_S=32, BLOCK_N=128, num_warps=4, T_MODE=1)
NO_FP8 = dict(FP8_MAX=1.0, MIN_SCALE=1.0)
# The saved copy of x (lean activation memory, act_fp8_save_input): E4M3, per-tensor current scaling, margin 0.
SAVED_X_DTYPE = torch.float8_e4m3fn
SAVED_X_MAX = tl.constexpr(448.0)  # reference.fp8_max(SAVED_X_DTYPE)
SAVED_X_MIN_SCALE = tl.constexpr(2.0**-119)  # reference.min_scale(SAVED_X_DTYPE)  # the FP8 constexprs of the modes that cast nothing ("hp", "amax")


# ---- device math: kernel formulas (the *_ref functions below repeat them op for op) -----------------


@triton.jit
def _logistic(u):
    """(s, 1 - s) for s = 1 / (1 + exp(-u)), from one IEEE reciprocal r = 1 / (1 + t), t = exp(-|u|) <= 1:
    the larger of the two is r, the smaller t * r (no cancellation). One division, not two: the SwiGLU
    backward is bound by its arithmetic (35% of the copy bandwidth with three divisions per element, H100)."""
    t = tl.exp(-tl.abs(u))
    r = tl.math.div_rn(1.0, 1.0 + t)
    tr = t * r
    pos = u >= 0.0
    return tl.where(pos, r, tr), tl.where(pos, tr, r)


@triton.jit
def _silu(v):
    # v * sigmoid(v) with a single rounding of the division: (v or v * t) / (1 + t)
    t = tl.exp(-tl.abs(v))
    return tl.math.div_rn(tl.where(v >= 0.0, v, v * t), 1.0 + t)


@triton.jit
def _silu_dsilu(v):
    """(silu(v), silu'(v)) = (v * s, s * (1 + v * (1 - s))) from one _logistic: the backward's pair."""
    s, c = _logistic(v)
    return v * s, s * (1.0 + v * c)


@triton.jit
def _phi(v):
    """(Phi(v), exp(-v^2 / 2)): the standard normal cdf with no cancellation, and the pdf's exponential.

    v >= 0: 0.5 (1 + erf(v / sqrt 2)). v < 0: 0.5 erfc(z), z = |v| / sqrt 2, as 0.5 t exp(-v^2/2) exp(P(t))
    (ERFC_P; the two exps keep exp(P)'s argument small and share exp(-v^2/2) with the pdf)."""
    e = tl.exp(-0.5 * v * v)
    t = tl.math.div_rn(1.0, 1.0 + 0.5 * (tl.abs(v) * 0.7071067811865476))
    p = 0.17087277 * t + -0.82215223  # ERFC_P, Horner from t^9
    p = p * t + 1.48851587
    p = p * t + -1.13520398
    p = p * t + 0.27886807
    p = p * t + -0.18628806
    p = p * t + 0.09678418
    p = p * t + 0.37409196
    p = p * t + 1.00002368
    p = p * t + -1.26551223
    lower = 0.5 * ((t * e) * tl.exp(p))
    upper = 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476))
    return tl.where(v < 0.0, lower, upper), e


@triton.jit
def _act(v, KIND: tl.constexpr):
    """act(v), elementwise, float32; KIND is not "swiglu" (that one takes two inputs)."""
    if KIND == "relu":
        y = tl.where(v < 0.0, 0.0, v)  # like torch.relu: -0.0 stays -0.0, NaN stays NaN
    elif KIND == "gelu":
        cdf, _ = _phi(v)
        y = v * cdf  # gelu(-inf) = NaN, as torch's
    elif KIND == "gelu_tanh":
        # 0.5 v (1 + tanh(u)) = v * sigmoid(2u), u = sqrt(2/pi) (v + 0.044715 v^3)
        w = 2.0 * (0.7978845608028654 * (v + 0.044715 * v * v * v))
        t = tl.exp(-tl.abs(w))
        y = tl.math.div_rn(tl.where(w >= 0.0, v, v * t), 1.0 + t)
    elif KIND == "silu":
        y = _silu(v)
    else:  # identity
        y = v
    return y


@triton.jit
def _dact(dy, v, KIND: tl.constexpr):
    """dy * act'(v), elementwise, float32; KIND is not "swiglu"."""
    if KIND == "relu":
        dx = tl.where(v <= 0.0, 0.0, dy)  # torch's threshold_backward: NaN inputs pass dy
    elif KIND == "gelu":
        cdf, e = _phi(v)
        dx = dy * (cdf + v * (e * 0.3989422804014327))
    elif KIND == "gelu_tanh":
        w = 2.0 * (0.7978845608028654 * (v + 0.044715 * v * v * v))
        s, c = _logistic(w)
        dw = 2.0 * (0.7978845608028654 * (1.0 + 0.134145 * v * v))
        dx = dy * (s + v * (s * c * dw))
    elif KIND == "silu":
        _, ds = _silu_dsilu(v)
        dx = dy * ds
    else:  # identity
        dx = dy
    return dx


@triton.jit
def _fp8(v, scale, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
    return clamp_keep_nan(v * scale, FP8_MAX).to(dtype)


@triton.jit
def _fp8_t(q, v, scale, FP8_MAX: tl.constexpr, T_MODE: tl.constexpr):
    """The transpose of the FP8 tile q = _fp8(v, scale): the same bits, by one of three routes through
    shared memory (T_MODE 0: the FP8 bytes; 1: the bytes widened to 16 bits; 2: v in float32, cast again)."""
    if T_MODE == 0:
        return tl.trans(q)
    elif T_MODE == 1:
        wide = q.to(tl.uint8, bitcast=True).to(tl.uint16)
        return tl.trans(wide).to(tl.uint8).to(q.dtype, bitcast=True)
    else:
        return _fp8(tl.trans(v), scale, FP8_MAX, q.dtype)


@triton.jit
def _tile_start(N, tiles_s, tiles_n, BLOCK_N: tl.constexpr, KIND: tl.constexpr):
    """Flat grid: program -> (batch b, row-chunk index, column offsets, their mask, input row length)."""
    pid = tl.program_id(0)
    b = (pid // (tiles_s * tiles_n)).to(tl.int64)
    t = pid % (tiles_s * tiles_n)
    cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    if KIND == "swiglu":
        n_in = 2 * N
    else:
        n_in = N
    return pid, b, t // tiles_n, cols, cols < N, n_in


# ---- kernels ----------------------------------------------------------------------------------------


@triton.jit
def _act_fwd_kernel(
    x_ptr,  # (B, S, N_IN) hp, contiguous; N_IN = 2N for swiglu (a = x[..., :N], b = x[..., N:]), else N
    bias_ptr,  # (N_IN,) hp (HAS_BIAS), else unused
    y_ptr,  # (B, S, N): hp (MODE "hp") or fp8 (MODE "current", "delayed"); unused in MODE "amax"
    y_t_ptr,  # (B, N, S) fp8 (WITH_T), else unused
    scale_ptr,  # (1,) fp32: the given scale (MODE "delayed"), else unused
    amax_ptr,  # () fp32, zeroed: receives max|act| ("amax", "delayed"); holds it ("current")
    scale_inv_ptr,  # () fp32: 1 / scale ("current", "delayed")
    xq_ptr,  # (B, S, N_IN) E4M3: x itself quantized (SAVE_X, modes "current", "delayed"), else unused
    x_amax_ptr,  # () fp32, zeroed: receives max|x| ("amax"), holds it (other modes) (SAVE_X)
    x_scale_inv_ptr,  # () fp32: 1 / x's scale (SAVE_X, modes "current", "delayed")
    S,
    N,
    tiles_s,
    tiles_n,
    margin_div,  # 2.0**margin ("current")
    KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MODE: tl.constexpr,  # "hp": store act; "amax": only fold max|act|; "current" / "delayed": store FP8
    WITH_T: tl.constexpr,
    SAVE_X: tl.constexpr,  # also quantize x (before the bias) per tensor to E4M3, current scaling
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,  # reference.min_scale(fp8_dtype), for scale_from_amax
    POWER_OF_2: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ITERS: tl.constexpr,  # row tiles per program
    T_MODE: tl.constexpr,  # how the FP8 tile is transposed (_fp8_t)
):
    pid, b, pid_s, cols, col_ok, n_in = _tile_start(N, tiles_s, tiles_n, BLOCK_N, KIND)
    if SAVE_X and (MODE == "current" or MODE == "delayed"):
        x_scale = scale_from_amax(tl.load(x_amax_ptr), SAVED_X_MAX, SAVED_X_MIN_SCALE, 1.0, False)
    x_amax_acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.int32)
    if HAS_BIAS:
        bias_a = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if KIND == "swiglu":
            bias_b = tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)
    if MODE == "current":
        scale = scale_from_amax(tl.load(amax_ptr), FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    elif MODE == "delayed":
        scale = tl.load(scale_ptr)
    amax_acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.int32)

    for i in range(ITERS):
        rows = (pid_s * ITERS + i) * BLOCK_S + tl.arange(0, BLOCK_S)
        mask = (rows[:, None] < S) & col_ok[None, :]
        row_start = (b * S + rows.to(tl.int64)) * n_in  # (BLOCK_S,) offsets of the rows in x
        x_off = row_start[:, None] + cols[None, :]
        x_tile = x_ptr + x_off
        xa = tl.load(x_tile, mask=mask, other=0.0).to(tl.float32)
        v = xa + bias_a[None, :] if HAS_BIAS else xa
        if KIND == "swiglu":
            xb = tl.load(x_tile + N, mask=mask, other=0.0).to(tl.float32)
            g = xb + bias_b[None, :] if HAS_BIAS else xb
            y = _silu(v) * g
        else:
            y = _act(v, KIND)
        if SAVE_X and MODE == "amax":
            x_amax_acc = tl.maximum(x_amax_acc, abs_bits(xa))  # masked lanes loaded 0
            if KIND == "swiglu":
                x_amax_acc = tl.maximum(x_amax_acc, abs_bits(xb))
        if SAVE_X and (MODE == "current" or MODE == "delayed"):
            xq = xq_ptr + x_off
            tl.store(xq, _fp8(xa, x_scale, SAVED_X_MAX, xq_ptr.dtype.element_ty), mask=mask)
            if KIND == "swiglu":
                tl.store(xq + N, _fp8(xb, x_scale, SAVED_X_MAX, xq_ptr.dtype.element_ty), mask=mask)

        out = (b * S + rows.to(tl.int64))[:, None] * N + cols[None, :]
        if MODE == "hp":
            tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=mask)
        if MODE == "current" or MODE == "delayed":
            q = _fp8(y, scale, FP8_MAX, y_ptr.dtype.element_ty)
            tl.store(y_ptr + out, q, mask=mask)
            if WITH_T:
                # (BLOCK_N, BLOCK_S): column c of the tile is row c of data_t, contiguous along S.
                out_t = (b * N + cols.to(tl.int64))[:, None] * S + rows[None, :]
                mask_t = col_ok[:, None] & (rows[None, :] < S)
                tl.store(y_t_ptr + out_t, _fp8_t(q, y, scale, FP8_MAX, T_MODE), mask=mask_t)
        if MODE == "amax" or MODE == "delayed":
            # masked lanes hold act(bias), not 0: drop them before the max
            amax_acc = tl.maximum(amax_acc, abs_bits(tl.where(mask, y, 0.0)))

    if MODE == "amax" or MODE == "delayed":
        atomic_amax(amax_ptr, tl.max(tl.max(amax_acc, axis=1), axis=0))
    if SAVE_X and MODE == "amax":
        atomic_amax(x_amax_ptr, tl.max(tl.max(x_amax_acc, axis=1), axis=0))
    if MODE == "current" or MODE == "delayed":
        tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=pid == 0)
    if SAVE_X and (MODE == "current" or MODE == "delayed"):
        tl.store(x_scale_inv_ptr, tl.math.div_rn(tl.full(x_scale.shape, 1.0, tl.float32), x_scale), mask=pid == 0)


@triton.jit
def _act_bwd_kernel(
    dy_ptr,  # (B, S, N) hp, contiguous
    x_ptr,  # (B, S, N_IN) hp, contiguous (unused for identity); N_IN = 2N for swiglu, else N
    bias_ptr,  # (N_IN,) hp (HAS_BIAS), else unused
    dx_ptr,  # (B, S, N_IN): x.dtype (MODE "hp") or fp8 (MODE "current", "delayed"); unused in MODE "amax"
    dx_t_ptr,  # (B, N_IN, S) fp8 (WITH_T), else unused
    dbias_ptr,  # (B * tiles_s, N_IN) fp32: per-program column sums of dx (DBIAS), else unused
    scale_ptr,  # (1,) fp32: the given scale (MODE "delayed"), else unused
    amax_ptr,  # () fp32, zeroed: receives max|dx| ("amax"); holds it ("current")
    scale_inv_ptr,  # () fp32: 1 / scale ("current", "delayed")
    x_scale_inv_ptr,  # () fp32: x's scale-inverse (X_FP8), else unused
    S,
    N,
    tiles_s,
    tiles_n,
    margin_div,  # 2.0**margin ("current")
    KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MODE: tl.constexpr,  # "hp": store dx; "amax": fold max|dx| (and dbias partials); "current" / "delayed": store FP8
    WITH_T: tl.constexpr,
    DBIAS: tl.constexpr,
    X_FP8: tl.constexpr,  # x is FP8 (the forward's saved E4M3 copy): its values are x * x_scale_inv
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,  # reference.min_scale(fp8_dtype), for scale_from_amax
    POWER_OF_2: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ITERS: tl.constexpr,
    T_MODE: tl.constexpr,
):
    pid, b, pid_s, cols, col_ok, n_in = _tile_start(N, tiles_s, tiles_n, BLOCK_N, KIND)
    if HAS_BIAS:
        bias_a = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if KIND == "swiglu":
            bias_b = tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)
    if MODE == "current":
        scale = scale_from_amax(tl.load(amax_ptr), FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    elif MODE == "delayed":
        scale = tl.load(scale_ptr)
    if X_FP8:
        x_scale_inv = tl.load(x_scale_inv_ptr)
    amax_acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.int32)
    # dbias: elementwise sums over the row tiles, reduced across rows once at the end (not per tile)
    dbias_a = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    dbias_b = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)

    for i in range(ITERS):
        rows = (pid_s * ITERS + i) * BLOCK_S + tl.arange(0, BLOCK_S)
        mask = (rows[:, None] < S) & col_ok[None, :]
        row = b * S + rows.to(tl.int64)
        g = tl.load(dy_ptr + row[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x_tile = x_ptr + (row * n_in)[:, None] + cols[None, :]
        if KIND == "identity":
            v = g  # x is not read
        else:
            v = tl.load(x_tile, mask=mask, other=0.0).to(tl.float32)
            if X_FP8:
                v = v * x_scale_inv
            if HAS_BIAS:
                v = v + bias_a[None, :]
        if KIND == "swiglu":
            u = tl.load(x_tile + N, mask=mask, other=0.0).to(tl.float32)
            if X_FP8:
                u = u * x_scale_inv
            if HAS_BIAS:
                u = u + bias_b[None, :]
            silu_v, dsilu_v = _silu_dsilu(v)
            da = (g * u) * dsilu_v  # d a = dy * b * silu'(a)
            db = g * silu_v  # d b = dy * silu(a)
        else:
            da = _dact(g, v, KIND)

        out = row[:, None] * n_in + cols[None, :]
        if MODE == "hp":
            tl.store(dx_ptr + out, da.to(dx_ptr.dtype.element_ty), mask=mask)
            if KIND == "swiglu":
                tl.store(dx_ptr + out + N, db.to(dx_ptr.dtype.element_ty), mask=mask)
        if MODE == "amax":
            da = tl.where(mask, da, 0.0)
            amax_acc = tl.maximum(amax_acc, abs_bits(da))
            if DBIAS:
                dbias_a += da
            if KIND == "swiglu":
                db = tl.where(mask, db, 0.0)
                amax_acc = tl.maximum(amax_acc, abs_bits(db))
                if DBIAS:
                    dbias_b += db
        if MODE == "current" or MODE == "delayed":
            qa = _fp8(da, scale, FP8_MAX, dx_ptr.dtype.element_ty)
            tl.store(dx_ptr + out, qa, mask=mask)
            if KIND == "swiglu":
                qb = _fp8(db, scale, FP8_MAX, dx_ptr.dtype.element_ty)
                tl.store(dx_ptr + out + N, qb, mask=mask)
            if WITH_T:
                # rows cols (and, for swiglu, N + cols) of dx_t, contiguous along S
                t_row = b * n_in + cols.to(tl.int64)
                mask_t = col_ok[:, None] & (rows[None, :] < S)
                tl.store(dx_t_ptr + t_row[:, None] * S + rows[None, :], _fp8_t(qa, da, scale, FP8_MAX, T_MODE), mask=mask_t)
                if KIND == "swiglu":
                    tl.store(dx_t_ptr + (t_row + N)[:, None] * S + rows[None, :], _fp8_t(qb, db, scale, FP8_MAX, T_MODE), mask=mask_t)

    if MODE == "amax":
        atomic_amax(amax_ptr, tl.max(tl.max(amax_acc, axis=1), axis=0))
        if DBIAS:
            part = dbias_ptr + (b * tiles_s + pid_s) * n_in + cols
            tl.store(part, tl.sum(dbias_a, axis=0), mask=col_ok)
            if KIND == "swiglu":
                tl.store(part + N, tl.sum(dbias_b, axis=0), mask=col_ok)
    if MODE == "current" or MODE == "delayed":
        tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=pid == 0)


# ---- launchers --------------------------------------------------------------------------------------


def _geometry(x: torch.Tensor, transpose: bool):
    """(B, S): with a transpose the leading dims but the last two are a batch; else all rows are one."""
    if transpose:
        return math.prod(x.shape[:-2]), x.shape[-2]
    return 1, math.prod(x.shape[:-1])


def _tiles(B: int, S: int, N: int, transpose: bool, iterate: bool, config=None):
    """Launch meta-parameters and the flat grid. iterate: a reduction pass, which loops over row tiles.
    config: the transposing pass's tile (TRANSPOSE_CONFIG unless given, as the sweep does)."""
    if transpose:
        cfg = config or TRANSPOSE_CONFIG
        block_s, block_n, warps, t_mode = cfg["BLOCK_S"], cfg["BLOCK_N"], cfg["num_warps"], cfg["T_MODE"]
    else:
        block_n = min(ROW_BLOCK_N, max(16, next_pow2(N)))
        block_s = min(max(1, ROW_ELEMS // block_n), max(16, next_pow2(S)))
        warps, t_mode = NUM_WARPS, 0
    iters = min(MAX_ITERS, next_pow2(cdiv(S, block_s))) if iterate else 1
    tiles_s = max(1, cdiv(S, block_s * iters))
    tiles_n = max(1, cdiv(N, block_n))
    grid = (max(1, B * tiles_s * tiles_n),)  # >= 1 program: program 0 writes scale_inv
    meta = dict(BLOCK_S=block_s, BLOCK_N=block_n, ITERS=iters, T_MODE=t_mode, num_warps=warps)
    return meta, tiles_s, tiles_n, grid


def _n_out(n_in: int, kind: str) -> int:
    return n_in // 2 if kind == "swiglu" else n_in


def launch_fwd(
    x, kind, bias, y, y_t, scale, amax, scale_inv, *,
    mode, transpose, fp8_dtype=None, margin=0, power_of_2=False, config=None, saved_x=None,
):  # fmt: skip
    """One pass of _act_fwd_kernel over x (contiguous) in `mode`; None for what the mode does not use.
    saved_x: (xq, x_amax, x_scale_inv) to quantize x itself as well (x_amax zeroed before the "amax" pass)."""
    xq, x_amax, x_scale_inv = saved_x if saved_x is not None else (x, amax, amax)
    n = _n_out(x.shape[-1], kind)
    B, S = _geometry(x, transpose)
    meta, tiles_s, tiles_n, grid = _tiles(B, S, n, transpose, iterate=(mode == "amax"), config=config)
    _act_fwd_kernel[grid](
        x,
        bias if bias is not None else x,
        y if y is not None else x,
        y_t if y_t is not None else (y if y is not None else x),
        scale if scale is not None else amax,
        amax,
        scale_inv,
        xq,
        x_amax,
        x_scale_inv,
        S if x.numel() else 0,
        n,
        tiles_s,
        tiles_n,
        float(2.0**margin),
        KIND=kind,
        HAS_BIAS=bias is not None,
        MODE=mode,
        WITH_T=y_t is not None,
        SAVE_X=saved_x is not None,
        **(fp8_constants(fp8_dtype) if fp8_dtype is not None else NO_FP8),
        POWER_OF_2=power_of_2,
        **meta,
    )


def launch_bwd(
    dy, x, kind, bias, dx, dx_t, dbias_parts, scale, amax, scale_inv, *,
    mode, transpose, fp8_dtype=None, margin=0, power_of_2=False, config=None, x_scale_inv=None,
):  # fmt: skip
    """One pass of _act_bwd_kernel over dy, x (contiguous) in `mode`; None for what the mode does not use.
    dbias_parts (mode "amax"): a dbias_partials buffer. x_scale_inv: x is FP8 with this scale-inverse."""
    n = dy.shape[-1]
    B, S = _geometry(dy, transpose)
    meta, tiles_s, tiles_n, grid = _tiles(B, S, n, transpose, iterate=(mode == "amax"), config=config)
    _act_bwd_kernel[grid](
        dy,
        x,
        bias if bias is not None else dy,
        dx if dx is not None else dy,
        dx_t if dx_t is not None else dy,
        dbias_parts if dbias_parts is not None else amax,
        scale if scale is not None else amax,
        amax,
        scale_inv,
        x_scale_inv if x_scale_inv is not None else amax,
        S if dy.numel() else 0,
        n,
        tiles_s,
        tiles_n,
        float(2.0**margin),
        KIND=kind,
        HAS_BIAS=bias is not None,
        MODE=mode,
        WITH_T=dx_t is not None,
        DBIAS=dbias_parts is not None,
        X_FP8=x_scale_inv is not None,
        **(fp8_constants(fp8_dtype) if fp8_dtype is not None else NO_FP8),
        POWER_OF_2=power_of_2,
        **meta,
    )


def dbias_partials(dy: torch.Tensor, n_in: int) -> torch.Tensor:
    """(programs, N_IN) float32: one row of column sums per program of launch_bwd's "amax" pass over dy."""
    _, tiles_s, _, _ = _tiles(*_geometry(dy, False), dy.shape[-1], False, iterate=True)
    return torch.empty((tiles_s, n_in), dtype=torch.float32, device=dy.device)


def _out_shape(x: torch.Tensor, kind: str):
    return (*x.shape[:-1], _n_out(x.shape[-1], kind))


def _grad_dtype(dy, x):
    """The dtype of a high-precision dx: x's, or dy's where x is the forward's saved FP8 copy."""
    return dy.dtype if x.dtype in FP8_DTYPES else x.dtype


def _contig(t):
    return None if t is None else t.contiguous()


def _fp8_outputs(shape, fp8_dtype, with_transpose, device):
    """(data shape, data_t (..., N, M) or (0,)) FP8, amax () zeroed and scale_inv () float32."""
    return (
        torch.empty(shape, dtype=fp8_dtype, device=device),
        torch.empty(transposed_shape(shape) if with_transpose else (0,), dtype=fp8_dtype, device=device),
        torch.zeros((), dtype=torch.float32, device=device),
        torch.empty((), dtype=torch.float32, device=device),
    )


def _fp8_mode(scale, margin, power_of_2):
    """(mode, scale (1,) or None, margin, power_of_2) of an FP8 pass: "current" (scale None) or "delayed"
    (margin and power_of_2 unused: the constexprs of the existing specialization)."""
    if scale is None:
        return "current", None, margin, power_of_2
    return "delayed", scale.reshape(1).float(), 0, False


def act_fwd_triton(x, kind, bias=None, out_dtype=None):
    """act(x + bias) in out_dtype (default x.dtype; float32 gives the kernel's registers unrounded)."""
    x, bias = x.contiguous(), _contig(bias)
    y = torch.empty(_out_shape(x, kind), dtype=out_dtype or x.dtype, device=x.device)
    unused = torch.empty((), dtype=torch.float32, device=x.device)
    launch_fwd(x, kind, bias, y, None, None, unused, unused, mode="hp", transpose=False)
    return y


def act_fp8_triton(
    x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False, config=None,
    save_input=False,
):  # fmt: skip
    """act_fp8: current scaling in two passes (amax; cast), a given scale in one (cast, amax folded in).
    save_input (act_fp8_save_input): x's own amax joins pass 1 (always run then) and pass 2 writes x in
    E4M3 too; returns (data, data_t, scale_inv, amax, x_data, x_scale_inv)."""
    x, bias = x.contiguous(), _contig(bias)
    data, data_t, amax, scale_inv = _fp8_outputs(_out_shape(x, kind), fp8_dtype, with_transpose, x.device)
    saved_x = None
    if save_input:
        x_data, _, x_amax, x_scale_inv = _fp8_outputs(x.shape, SAVED_X_DTYPE, False, x.device)
        saved_x = (x_data, x_amax, x_scale_inv)
    mode, scale, margin, power_of_2 = _fp8_mode(scale, margin, power_of_2)
    if mode == "current" or save_input:
        launch_fwd(x, kind, bias, None, None, None, amax, scale_inv, mode="amax", transpose=False, saved_x=saved_x)
    launch_fwd(
        x, kind, bias, data, data_t if with_transpose else None, scale, amax, scale_inv,
        mode=mode, transpose=with_transpose, fp8_dtype=fp8_dtype, margin=margin, power_of_2=power_of_2,
        config=config, saved_x=saved_x,
    )  # fmt: skip
    if save_input:
        return data, data_t, scale_inv, amax, x_data, x_scale_inv
    return data, data_t, scale_inv, amax


def act_bwd_triton(dy, x, kind, bias=None, out_dtype=None, x_scale_inv=None):
    """dy * act'(x + bias) in out_dtype (default: x.dtype, dy.dtype for an FP8 x)."""
    dy, x, bias = dy.contiguous(), x.contiguous(), _contig(bias)
    dx = torch.empty(x.shape, dtype=out_dtype or _grad_dtype(dy, x), device=x.device)
    unused = torch.empty((), dtype=torch.float32, device=x.device)
    launch_bwd(dy, x, kind, bias, dx, None, None, None, unused, unused, mode="hp", transpose=False, x_scale_inv=x_scale_inv)
    return dx


def dact_fp8_triton(
    dy, x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=True, with_dbias=True,
    config=None, x_scale_inv=None,
):  # fmt: skip
    """dact_fp8 in two passes: amax (and dbias partials, summed by torch), then the cast at the current or
    the given scale, in both layouts (transposing tiles) or in data alone (row tiles)."""
    dy, x, bias = dy.contiguous(), x.contiguous(), _contig(bias)
    data, data_t, amax, scale_inv = _fp8_outputs(x.shape, fp8_dtype, with_transpose, x.device)
    parts = dbias_partials(dy, x.shape[-1]) if with_dbias else None
    launch_bwd(
        dy, x, kind, bias, None, None, parts, None, amax, scale_inv, mode="amax", transpose=False,
        x_scale_inv=x_scale_inv,
    )  # fmt: skip
    mode, scale, margin, power_of_2 = _fp8_mode(scale, margin, power_of_2)
    launch_bwd(
        dy, x, kind, bias, data, data_t if with_transpose else None, None, scale, amax, scale_inv,
        mode=mode, transpose=with_transpose, fp8_dtype=fp8_dtype, margin=margin, power_of_2=power_of_2,
        config=config, x_scale_inv=x_scale_inv,
    )  # fmt: skip
    dbias = parts.sum(0).to(dy.dtype) if with_dbias else dy.new_empty((0,))
    return data, data_t, scale_inv, amax, dbias


# ---- input checks -----------------------------------------------------------------------------------


def _check(op, x, kind, bias, *, dy=None, transpose=False, x_scale_inv=None):
    if x_scale_inv is None:
        check_hp_input(x, op)
    else:
        _check_saved_x(op, x, x_scale_inv)
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"{op}: unknown activation kind {kind!r}; the kinds are {', '.join(KINDS)}")
    if x.dim() < (2 if transpose else 1):
        need = "at least 2 dims (..., M, N) to transpose" if transpose else "at least 1 dim"
        raise ValueError(f"{op}: x must have {need}, got shape {tuple(x.shape)}")
    n_in = x.shape[-1]
    if kind == "swiglu" and n_in % 2:
        raise ValueError(
            f"{op}: swiglu takes x (..., 2H) = [gate | linear] and needs an even last dim, got shape {tuple(x.shape)}"
        )
    if bias is not None:
        check_hp_input(bias, op, "bias")
        if tuple(bias.shape) != (n_in,):
            raise ValueError(
                f"{op}: bias has shape {tuple(bias.shape)} but x has shape {tuple(x.shape)}; bias must be ({n_in},)"
            )
        if bias.device != x.device:
            raise ValueError(f"{op}: bias is on {bias.device} but x is on {x.device}")
    if dy is not None:
        check_hp_input(dy, op, "dy")
        want = _out_shape(x, kind)
        if tuple(dy.shape) != tuple(want):
            raise ValueError(
                f"{op}: dy has shape {tuple(dy.shape)} but x has shape {tuple(x.shape)}; "
                f"for {kind} dy must be {tuple(want)}"
            )
        if dy.device != x.device:
            raise ValueError(f"{op}: dy is on {dy.device} but x is on {x.device}")


def _check_saved_x(op, x, x_scale_inv) -> None:
    """x given with x_scale_inv: the forward's FP8 copy of the activation's input (act_fp8_save_input)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FP8_DTYPES:
        raise TypeError(
            f"{op}: x_scale_inv is given, so x must be the FP8 copy of the input (act_fp8_save_input), "
            f"got {getattr(x, 'dtype', type(x).__name__)}"
        )
    if not isinstance(x_scale_inv, torch.Tensor) or x_scale_inv.dtype != torch.float32 or x_scale_inv.dim() != 0:
        raise ValueError(
            f"{op}: x_scale_inv must be a () float32 tensor, got "
            f"{getattr(x_scale_inv, 'dtype', type(x_scale_inv).__name__)} {tuple(getattr(x_scale_inv, 'shape', ()))}"
        )
    if x_scale_inv.device != x.device:
        raise ValueError(f"{op}: x_scale_inv is on {x_scale_inv.device} but x is on {x.device}")


# ---- custom ops -------------------------------------------------------------------------------------


@custom_op("float8::act_fwd")
def act_fwd(x: torch.Tensor, kind: str, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(x + bias) in x.dtype; (..., N) -> (..., N), or (..., 2H) -> (..., H) for swiglu."""
    _check("act_fwd", x, kind, bias)
    if use_triton(x, writes_fp8=False):
        return act_fwd_triton(x, kind, bias)
    return act_fwd_ref(x, kind, bias)


@act_fwd.register_fake
def _(x, kind, bias=None):
    _check("act_fwd", x, kind, bias)
    return x.new_empty(_out_shape(x, kind))


def _check_fp8(op, x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, dy=None, x_scale_inv=None):
    _check(op, x, kind, bias, dy=dy, transpose=with_transpose, x_scale_inv=x_scale_inv)
    check_tensorwise_args(dy if x_scale_inv is not None else x, fp8_dtype, scale, margin, power_of_2, op)
    check_flag(with_transpose, "with_transpose", op)


def _fake_fp8(shape, fp8_dtype, with_transpose, like):
    return fake_fp8_outputs(like, shape, transposed_shape(shape) if with_transpose else None, fp8_dtype)


@custom_op("float8::act_fp8")
def act_fp8(
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """act(x + bias) quantized per tensor: (data, data_t, scale_inv, amax).

    scale None: current scaling (margin, power_of_2), two launches; else a one-element fp32 scale on x's
    device (delayed or static scaling; margin and power_of_2 ignored), one launch. data (..., N) fp8;
    data_t (..., N, M) fp8 if with_transpose, else an empty (0,) fp8 tensor; scale_inv () fp32;
    amax () fp32 = max|act(x + bias)|.
    """
    _check_fp8("act_fp8", x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)
    if use_triton(x):
        return act_fp8_triton(x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)
    return act_fp8_ref(x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)


@act_fp8.register_fake
def _(x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False):
    _check_fp8("act_fp8", x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)
    return _fake_fp8(_out_shape(x, kind), fp8_dtype, with_transpose, x)


@custom_op("float8::act_fp8_save_input")
def act_fp8_save_input(
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """act_fp8, and x itself quantized for the backward: (data, data_t, scale_inv, amax, x_data, x_scale_inv).

    x_data: x (before the bias) in E4M3, per-tensor current scaling with margin 0, x's shape; x_scale_inv
    () fp32. The backward (dact_fp8 / act_bwd with x_scale_inv) reads it in place of x: half the bytes of
    a bf16 x. Same kernel passes as act_fp8 (pass 1 always runs: it also takes max|x|); the other outputs
    are bit for bit act_fp8's.
    """
    _check_fp8("act_fp8_save_input", x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)
    if use_triton(x):
        return act_fp8_triton(x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, save_input=True)
    return act_fp8_save_input_ref(x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)


@act_fp8_save_input.register_fake
def _(x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False):
    _check_fp8("act_fp8_save_input", x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)
    saved = fake_fp8_outputs(x, x.shape, None, SAVED_X_DTYPE)
    return (*_fake_fp8(_out_shape(x, kind), fp8_dtype, with_transpose, x), saved[0], saved[2])


@custom_op("float8::act_bwd")
def act_bwd(
    dy: torch.Tensor, x: torch.Tensor, kind: str, bias: Optional[torch.Tensor] = None,
    x_scale_inv: Optional[torch.Tensor] = None,
) -> torch.Tensor:  # fmt: skip
    """dx = dy * act'(x + bias), x's shape (2H columns for swiglu), in x.dtype (dy.dtype for an FP8 x).

    x_scale_inv: x is the forward's FP8 copy (act_fp8_save_input) and its values are x * x_scale_inv."""
    _check("act_bwd", x, kind, bias, dy=dy, x_scale_inv=x_scale_inv)
    if use_triton(x, writes_fp8=False):
        return act_bwd_triton(dy, x, kind, bias, x_scale_inv=x_scale_inv)
    return act_bwd_ref(dy, x, kind, bias, x_scale_inv)


@act_bwd.register_fake
def _(dy, x, kind, bias=None, x_scale_inv=None):
    _check("act_bwd", x, kind, bias, dy=dy, x_scale_inv=x_scale_inv)
    return x.new_empty(x.shape, dtype=_grad_dtype(dy, x))


@custom_op("float8::dact_fp8")
def dact_fp8(
    dy: torch.Tensor,
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = True,
    with_dbias: bool = True,
    x_scale_inv: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused activation backward: dx = dy * act'(x + bias), quantized per tensor, and dbias.

    Returns (data (..., M, N_IN) fp8, data_t (..., N_IN, M) fp8 or (0,) without with_transpose,
    scale_inv () fp32, amax () fp32 = max|dx|, dbias (N_IN,) in dy.dtype = float32 row sums of dx).
    scale None: current scaling (margin, power_of_2); else a one-element fp32 scale (delayed scaling;
    margin and power_of_2 ignored). with_dbias=False skips the sums (no bias to train) and returns an
    empty (0,) dbias. kind "identity" with x = dy is a bias's backward (dbias and dy's FP8 cast).
    x_scale_inv: x is the forward's FP8 copy (act_fp8_save_input) and its values are x * x_scale_inv.
    """
    _check_fp8("dact_fp8", x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, dy, x_scale_inv)
    check_flag(with_dbias, "with_dbias", "dact_fp8")
    if use_triton(x):
        return dact_fp8_triton(
            dy, x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, with_dbias, x_scale_inv=x_scale_inv
        )
    return dact_fp8_ref(dy, x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, with_dbias, x_scale_inv)


@dact_fp8.register_fake
def _(
    dy, x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=True, with_dbias=True,
    x_scale_inv=None,
):  # fmt: skip
    _check_fp8("dact_fp8", x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, dy, x_scale_inv)
    check_flag(with_dbias, "with_dbias", "dact_fp8")
    dbias = dy.new_empty((x.shape[-1] if with_dbias else 0,))
    return (*_fake_fp8(x.shape, fp8_dtype, with_transpose, x), dbias)


# ---- references: pure torch, float32, the kernels' formulas op for op -------------------------------


def _v_ref(x, bias, x_scale_inv=None):
    v = x.float()
    if x_scale_inv is not None:
        v = v * x_scale_inv
    return v + bias.float() if bias is not None else v


def _logistic_ref(u):
    t = torch.exp(-u.abs())
    r = 1.0 / (1.0 + t)
    tr = t * r
    pos = u >= 0.0
    return torch.where(pos, r, tr), torch.where(pos, tr, r)


def _silu_ref(v):
    t = torch.exp(-v.abs())
    return torch.where(v >= 0.0, v, v * t) / (1.0 + t)


def _silu_dsilu_ref(v):
    s, c = _logistic_ref(v)
    return v * s, s * (1.0 + v * c)


def _phi_ref(v):
    e = torch.exp(-0.5 * v * v)
    t = 1.0 / (1.0 + 0.5 * (v.abs() * SQRT1_2))
    p = ERFC_P[-1] * t + ERFC_P[-2]
    for c in reversed(ERFC_P[:-2]):
        p = p * t + c
    lower = 0.5 * ((t * e) * torch.exp(p))
    upper = 0.5 * (1.0 + torch.erf(v * SQRT1_2))
    return torch.where(v < 0.0, lower, upper), e


def act_ref_fp32(x: torch.Tensor, kind: str, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(x + bias) in float32, unrounded: what the FP8 kernels quantize."""
    v = _v_ref(x, bias)
    if kind == "relu":
        return torch.where(v < 0.0, 0.0, v)
    if kind == "gelu":
        return v * _phi_ref(v)[0]
    if kind == "gelu_tanh":
        w = 2.0 * (TANH_BETA * (v + TANH_KAPPA * v * v * v))
        t = torch.exp(-w.abs())
        return torch.where(w >= 0.0, v, v * t) / (1.0 + t)
    if kind == "silu":
        return _silu_ref(v)
    if kind == "swiglu":
        h = v.shape[-1] // 2
        return _silu_ref(v[..., :h]) * v[..., h:]
    return v.clone()  # identity: never an alias of x


def dact_ref_fp32(dy: torch.Tensor, x: torch.Tensor, kind: str, bias: Optional[torch.Tensor] = None, x_scale_inv=None) -> torch.Tensor:
    """dy * act'(x + bias) in float32, unrounded: what the fused backward quantizes (x * x_scale_inv for an
    FP8 x)."""
    g = dy.float()
    if kind == "identity":
        return g.clone()  # never an alias of dy
    v = _v_ref(x, bias, x_scale_inv)
    if kind == "relu":
        return torch.where(v <= 0.0, 0.0, g)
    if kind == "gelu":
        cdf, e = _phi_ref(v)
        return g * (cdf + v * (e * INV_SQRT_2PI))
    if kind == "gelu_tanh":
        w = 2.0 * (TANH_BETA * (v + TANH_KAPPA * v * v * v))
        s, c = _logistic_ref(w)
        dw = 2.0 * (TANH_BETA * (1.0 + TANH_KAPPA3 * v * v))
        return g * (s + v * (s * c * dw))
    if kind == "silu":
        return g * _silu_dsilu_ref(v)[1]
    h = v.shape[-1] // 2  # swiglu
    a, b = v[..., :h], v[..., h:]
    silu_a, dsilu_a = _silu_dsilu_ref(a)
    return torch.cat([(g * b) * dsilu_a, g * silu_a], dim=-1)


def act_fwd_ref(x: torch.Tensor, kind: str, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return act_ref_fp32(x, kind, bias).to(x.dtype)


def act_fp8_ref(x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False):
    return quantize_tensorwise_ref(act_ref_fp32(x, kind, bias), fp8_dtype, scale, margin, power_of_2, with_transpose)


def act_fp8_save_input_ref(x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False):
    saved = quantize_tensorwise_ref(x, SAVED_X_DTYPE)
    return (*act_fp8_ref(x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose), saved[0], saved[2])


def act_bwd_ref(dy, x, kind, bias=None, x_scale_inv=None):
    return dact_ref_fp32(dy, x, kind, bias, x_scale_inv).to(_grad_dtype(dy, x))


def dact_fp8_ref(
    dy, x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=True, with_dbias=True,
    x_scale_inv=None,
):  # fmt: skip
    dx = dact_ref_fp32(dy, x, kind, bias, x_scale_inv)
    data, data_t, scale_inv, amax = quantize_tensorwise_ref(dx, fp8_dtype, scale, margin, power_of_2, with_transpose)
    dbias = dx.reshape(-1, dx.shape[-1]).sum(0).to(dy.dtype) if with_dbias else dy.new_empty((0,))
    return data, data_t, scale_inv, amax, dbias
