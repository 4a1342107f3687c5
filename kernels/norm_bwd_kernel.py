"""The RMSNorm / LayerNorm backward kernel (Triton): dx, and per-program partial sums for dweight and dbias.

_norm_bwd_kernel: G persistent programs, program g over row blocks g, g + G, ...; each writes dx for its rows
    (plus dres, when given) and its own row of a (G, N) float32 buffer of column sums, which torch sums.
Numerics: float32 from the forward's stored (mean, rstd); no atomics, so the result is deterministic.
Launcher and op: kernels/norm.py; design notes: docs/design.md §10.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .norm_fwd_kernel import _load_stats, _load_tile, _store_rows


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
            xhat, g, dy = _bwd_tile(x_ptr, dy_ptr, w_ptr, rows, cols0, M, N, stride_xm, stride_dym, mean, rstd, IS_RMS)
            c1 = tl.math.div_rn(tl.sum(g * xhat, axis=1), n_f)
            c2 = tl.math.div_rn(tl.sum(g, axis=1), n_f)
            dx = _plus_dres(
                _bwd_dx(xhat, g, c1, c2, rstd, IS_RMS), dres_ptr, dx_ptr, rows, cols0, M, N, stride_rm, HAS_DRES
            )
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
                dx = _plus_dres(
                    _bwd_dx(xhat, g, c1, c2, rstd, IS_RMS), dres_ptr, dx_ptr, rows, cols, M, N, stride_rm, HAS_DRES
                )
                _store_rows(dx_ptr, dx, rows, cols, M, N)
                # This program's own row of the partial sums: no other program touches it.
                dw = tl.load(dw_ptr + part + cols, mask=cols < N, other=0.0) + tl.sum(dy * xhat, axis=0)
                tl.store(dw_ptr + part + cols, dw, mask=cols < N)
                if not IS_RMS:
                    db = tl.load(db_ptr + part + cols, mask=cols < N, other=0.0) + tl.sum(dy, axis=0)
                    tl.store(db_ptr + part + cols, db, mask=cols < N)
