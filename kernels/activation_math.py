"""Device code shared by the activation kernels: the formulas, the FP8 casts, the tile start; and the
constants the kernels and the references share.

_act(v, KIND) -> act(v)     _dact(dy, v, KIND) -> dy * act'(v)     (KIND not "swiglu": it has two inputs)
_silu(v), _silu_dsilu(v) -> (silu, silu'), _logistic(u) -> (s, 1 - s), _phi(v) -> (normal cdf, exp(-v^2/2))
_fp8(v, scale, FP8_MAX, dtype), _fp8_t(q, v, scale, FP8_MAX, T_MODE): a tile cast, and its transpose
Numerics: float32; logistic terms from t = exp(-|u|) <= 1 (no overflow), the erf GELU's tail from erfc.
Kernels: kernels/activation_fwd_kernel.py, kernels/activation_bwd_kernel.py; design notes: docs/design.md §10.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import clamp_keep_nan

KINDS = ("identity", "relu", "gelu", "gelu_tanh", "silu", "swiglu")

# Constants of the formulas, written once for the kernels and the references (float32 when used).
SQRT1_2 = 0.7071067811865476  # 1/sqrt(2): gelu's erf argument
INV_SQRT_2PI = 0.3989422804014327  # 1/sqrt(2 pi): gelu's pdf
# erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), z >= 0: P's coefficients, t^0 first (Chebyshev fit of
# Numerical Recipes' erfcc; relative error < 1.2e-7 for all z >= 0, measured 1.05e-7 in float64).
ERFC_P = (
    -1.26551223,
    1.00002368,
    0.37409196,
    0.09678418,
    -0.18628806,
    0.27886807,
    -1.13520398,
    1.48851587,
    -0.82215223,
    0.17087277,
)
TANH_BETA = 0.7978845608028654  # sqrt(2/pi): gelu_tanh
TANH_KAPPA = 0.044715
TANH_KAPPA3 = 0.134145  # 3 * TANH_KAPPA
# The saved copy of x (lean activation memory, act_fp8_save_input): E4M3, per-tensor current scaling, margin 0.
SAVED_X_DTYPE = torch.float8_e4m3fn
SAVED_X_MAX = tl.constexpr(448.0)  # reference.fp8_max(SAVED_X_DTYPE)
SAVED_X_MIN_SCALE = tl.constexpr(2.0**-119)  # reference.min_scale(SAVED_X_DTYPE)


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
