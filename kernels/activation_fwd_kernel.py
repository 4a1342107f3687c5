"""The activation forward kernel (Triton): act(x + bias) in high precision, its amax, or its FP8 cast.

_act_fwd_kernel, one MODE a launch: "hp" stores act; "amax" folds max|act| (and max|x| with SAVE_X) into an
amax; "current" / "delayed" cast at the scale from that amax / the given scale, in rows and (WITH_T) in the
transposed layout, and with SAVE_X also store x itself in E4M3 (lean activation memory).
Numerics: float32 registers, never rounded to x.dtype before the FP8 cast (kernels/activation_math.py).
Launcher: kernels/activation_launch.py; design notes: docs/design.md §10.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activation_math import SAVED_X_MAX, SAVED_X_MIN_SCALE, _act, _fp8, _fp8_t, _silu, _tile_start
from .common import abs_bits, atomic_amax, scale_from_amax


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
