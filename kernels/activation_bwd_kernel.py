"""The activation backward kernel (Triton): dx = dy * act'(x + bias), its amax and dbias partials, or its
FP8 cast.

_act_bwd_kernel, one MODE a launch: "hp" stores dx; "hp_amax" stores dx and folds max|dx| of the stored
(rounded) values, for the FP8 cast that reads dx next (ops/known_amax.py); "amax" folds max|dx| and (DBIAS)
writes one row of column sums per program; "current" / "delayed" cast dx at the scale from that amax / the
given scale, in rows and (WITH_T) transposed. X_FP8: x is the forward's saved E4M3 copy, read as x * x_scale_inv (one
scale, or with X_ROW_SCALES one per row of x).
Numerics: float32 registers; silu and silu' from one IEEE reciprocal (kernels/activation_math.py).
Launcher: kernels/activation_launch.py; design notes: docs/design.md §10.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activation_math import _dact, _fp8, _fp8_t, _silu_dsilu, _tile_start
from .common import abs_bits, atomic_amax, scale_from_amax


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
    x_scale_inv_ptr,  # () fp32, or (B * S,) with X_ROW_SCALES: x's scale-inverse (X_FP8), else unused
    S,
    N,
    tiles_s,
    tiles_n,
    margin_div,  # 2.0**margin ("current")
    KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MODE: tl.constexpr,  # "hp": store dx; "hp_amax": store dx, fold max|dx| as stored; "amax": fold max|dx| (and
    # dbias partials); "current" / "delayed": store FP8
    WITH_T: tl.constexpr,
    DBIAS: tl.constexpr,
    X_FP8: tl.constexpr,  # x is FP8 (the forward's saved E4M3 copy): its values are x * x_scale_inv
    X_ROW_SCALES: tl.constexpr,  # X_FP8 with one scale-inverse per row of x (a per-row copy), not one
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
    if X_FP8 and not X_ROW_SCALES:
        xs = tl.load(x_scale_inv_ptr)
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
        if X_FP8 and X_ROW_SCALES:
            xs = tl.load(x_scale_inv_ptr + row, mask=rows < S, other=1.0)[:, None]
        if KIND == "identity":
            v = g  # x is not read
        else:
            v = tl.load(x_tile, mask=mask, other=0.0).to(tl.float32)
            if X_FP8:
                v = v * xs
            if HAS_BIAS:
                v = v + bias_a[None, :]
        if KIND == "swiglu":
            u = tl.load(x_tile + N, mask=mask, other=0.0).to(tl.float32)
            if X_FP8:
                u = u * xs
            if HAS_BIAS:
                u = u + bias_b[None, :]
            silu_v, dsilu_v = _silu_dsilu(v)
            da = (g * u) * dsilu_v  # d a = dy * b * silu'(a)
            db = g * silu_v  # d b = dy * silu(a)
        else:
            da = _dact(g, v, KIND)

        out = row[:, None] * n_in + cols[None, :]
        if MODE == "hp" or MODE == "hp_amax":
            da_out = da.to(dx_ptr.dtype.element_ty)
            tl.store(dx_ptr + out, da_out, mask=mask)
            if MODE == "hp_amax":  # masked lanes: 0
                amax_acc = tl.maximum(amax_acc, abs_bits(tl.where(mask, da_out, 0.0)))
            if KIND == "swiglu":
                db_out = db.to(dx_ptr.dtype.element_ty)
                tl.store(dx_ptr + out + N, db_out, mask=mask)
                if MODE == "hp_amax":
                    amax_acc = tl.maximum(amax_acc, abs_bits(tl.where(mask, db_out, 0.0)))
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
                tl.store(
                    dx_t_ptr + t_row[:, None] * S + rows[None, :], _fp8_t(qa, da, scale, FP8_MAX, T_MODE), mask=mask_t
                )
                if KIND == "swiglu":
                    tl.store(
                        dx_t_ptr + (t_row + N)[:, None] * S + rows[None, :],
                        _fp8_t(qb, db, scale, FP8_MAX, T_MODE),
                        mask=mask_t,
                    )

    if MODE == "amax" or MODE == "hp_amax":
        atomic_amax(amax_ptr, tl.max(tl.max(amax_acc, axis=1), axis=0))
    if MODE == "amax":
        if DBIAS:
            part = dbias_ptr + (b * tiles_s + pid_s) * n_in + cols
            tl.store(part, tl.sum(dbias_a, axis=0), mask=col_ok)
            if KIND == "swiglu":
                tl.store(part + N, tl.sum(dbias_b, axis=0), mask=col_ok)
    if MODE == "current" or MODE == "delayed":
        tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=pid == 0)
