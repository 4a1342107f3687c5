"""Launchers of the activation kernels: tile choice, one launch a pass, and the ops' Triton paths.

launch_fwd(x, kind, bias, y, y_t, scale, amax, scale_inv, *, mode, transpose, ...)     one _act_fwd_kernel pass
launch_bwd(dy, x, kind, bias, dx, dx_t, dbias_parts, scale, amax, scale_inv, *, mode, transpose, ...)
dbias_partials(dy, n_in) -> the (programs, n_in) float32 buffer of launch_bwd's "amax" pass
act_fwd_triton, act_fp8_triton, act_bwd_triton, dact_fp8_triton: the ops of kernels/activation.py on the GPU
Numerics: current scaling is two passes (amax, then the cast at the scale derived on the device), no host sync.
Design notes and the tile measurements: docs/design.md §10.
"""

from __future__ import annotations

import math

import torch

from .activation_bwd_kernel import _act_bwd_kernel
from .activation_fwd_kernel import _act_fwd_kernel
from .activation_math import SAVED_X_DTYPE
from .activation_ref import _grad_dtype, _n_out, _out_shape
from .common import cdiv, fp8_constants, next_pow2, transposed_shape
from .launch import FastLauncher

_launch_act_fwd = FastLauncher(_act_fwd_kernel)
_launch_act_bwd = FastLauncher(_act_bwd_kernel)

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
# docs/performance.md, "What the measurements say").
TRANSPOSE_CONFIG = dict(BLOCK_S=32, BLOCK_N=128, num_warps=4, T_MODE=1)
NO_FP8 = dict(FP8_MAX=1.0, MIN_SCALE=1.0)  # the FP8 constexprs of the modes that cast nothing ("hp", "amax")


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


def launch_fwd(
    x: torch.Tensor,
    kind: str,
    bias: torch.Tensor | None,
    y: torch.Tensor | None,
    y_t: torch.Tensor | None,
    scale: torch.Tensor | None,
    amax: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    mode: str,
    transpose: bool,
    fp8_dtype: torch.dtype | None = None,
    margin: int = 0,
    power_of_2: bool = False,
    config: dict | None = None,
    saved_x: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One pass of _act_fwd_kernel over x (contiguous) in `mode`; None for what the mode does not use.
    saved_x: (xq, x_amax, x_scale_inv) to quantize x itself as well (x_amax zeroed before the "amax" pass)."""
    xq, x_amax, x_scale_inv = saved_x if saved_x is not None else (x, amax, amax)
    n = _n_out(x.shape[-1], kind)
    B, S = _geometry(x, transpose)
    meta, tiles_s, tiles_n, grid = _tiles(B, S, n, transpose, iterate=(mode == "amax"), config=config)
    _launch_act_fwd(
        grid,
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
    dy: torch.Tensor,
    x: torch.Tensor,
    kind: str,
    bias: torch.Tensor | None,
    dx: torch.Tensor | None,
    dx_t: torch.Tensor | None,
    dbias_parts: torch.Tensor | None,
    scale: torch.Tensor | None,
    amax: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    mode: str,
    transpose: bool,
    fp8_dtype: torch.dtype | None = None,
    margin: int = 0,
    power_of_2: bool = False,
    config: dict | None = None,
    x_scale_inv: torch.Tensor | None = None,
) -> None:
    """One pass of _act_bwd_kernel over dy, x (contiguous) in `mode`; None for what the mode does not use.
    dbias_parts (mode "amax"): a dbias_partials buffer. x_scale_inv: x is FP8 with this scale-inverse, () or
    (..., 1) one per row (contiguous)."""
    n = dy.shape[-1]
    B, S = _geometry(dy, transpose)
    meta, tiles_s, tiles_n, grid = _tiles(B, S, n, transpose, iterate=mode in ("amax", "hp_amax"), config=config)
    _launch_act_bwd(
        grid,
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
        X_ROW_SCALES=x_scale_inv is not None and x_scale_inv.dim() > 0,
        **(fp8_constants(fp8_dtype) if fp8_dtype is not None else NO_FP8),
        POWER_OF_2=power_of_2,
        **meta,
    )


def dbias_partials(dy: torch.Tensor, n_in: int) -> torch.Tensor:
    """(programs, N_IN) float32: one row of column sums per program of launch_bwd's "amax" pass over dy."""
    _, tiles_s, _, _ = _tiles(*_geometry(dy, False), dy.shape[-1], False, iterate=True)
    return torch.empty((tiles_s, n_in), dtype=torch.float32, device=dy.device)


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


def act_fwd_triton(
    x: torch.Tensor, kind: str, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """act(x + bias) in out_dtype (default x.dtype; float32 gives the kernel's registers unrounded)."""
    x, bias = x.contiguous(), _contig(bias)
    y = torch.empty(_out_shape(x, kind), dtype=out_dtype or x.dtype, device=x.device)
    unused = torch.empty((), dtype=torch.float32, device=x.device)
    launch_fwd(x, kind, bias, y, None, None, unused, unused, mode="hp", transpose=False)
    return y


def act_fp8_triton(
    x: torch.Tensor,
    kind: str,
    bias: torch.Tensor | None,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
    config: dict | None = None,
    save_input: bool = False,
) -> tuple[torch.Tensor, ...]:
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
        x,
        kind,
        bias,
        data,
        data_t if with_transpose else None,
        scale,
        amax,
        scale_inv,
        mode=mode,
        transpose=with_transpose,
        fp8_dtype=fp8_dtype,
        margin=margin,
        power_of_2=power_of_2,
        config=config,
        saved_x=saved_x,
    )
    if save_input:
        return data, data_t, scale_inv, amax, x_data, x_scale_inv
    return data, data_t, scale_inv, amax


def act_bwd_triton(
    dy: torch.Tensor,
    x: torch.Tensor,
    kind: str,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    x_scale_inv: torch.Tensor | None = None,
    with_amax: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """dy * act'(x + bias) in out_dtype (default: x.dtype, dy.dtype for an FP8 x); with_amax: (dx, max|dx|), the
    maximum of the values stored, a () float32 tensor, folded in by the same pass."""
    dy, x, bias = dy.contiguous(), x.contiguous(), _contig(bias)
    dx = torch.empty(x.shape, dtype=out_dtype or _grad_dtype(dy, x), device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device) if with_amax else None
    unused = torch.empty((), dtype=torch.float32, device=x.device)
    launch_bwd(
        dy,
        x,
        kind,
        bias,
        dx,
        None,
        None,
        None,
        unused if amax is None else amax,
        unused,
        mode="hp_amax" if with_amax else "hp",
        transpose=False,
        x_scale_inv=x_scale_inv,
    )
    return (dx, amax) if with_amax else dx


def dact_fp8_triton(
    dy: torch.Tensor,
    x: torch.Tensor,
    kind: str,
    bias: torch.Tensor | None,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = True,
    with_dbias: bool = True,
    config: dict | None = None,
    x_scale_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dact_fp8 in two passes: amax (and dbias partials, summed by torch), then the cast at the current or
    the given scale, in both layouts (transposing tiles) or in data alone (row tiles)."""
    dy, x, bias = dy.contiguous(), x.contiguous(), _contig(bias)
    data, data_t, amax, scale_inv = _fp8_outputs(x.shape, fp8_dtype, with_transpose, x.device)
    parts = dbias_partials(dy, x.shape[-1]) if with_dbias else None
    launch_bwd(
        dy,
        x,
        kind,
        bias,
        None,
        None,
        parts,
        None,
        amax,
        scale_inv,
        mode="amax",
        transpose=False,
        x_scale_inv=x_scale_inv,
    )
    mode, scale, margin, power_of_2 = _fp8_mode(scale, margin, power_of_2)
    launch_bwd(
        dy,
        x,
        kind,
        bias,
        data,
        data_t if with_transpose else None,
        None,
        scale,
        amax,
        scale_inv,
        mode=mode,
        transpose=with_transpose,
        fp8_dtype=fp8_dtype,
        margin=margin,
        power_of_2=power_of_2,
        config=config,
        x_scale_inv=x_scale_inv,
    )
    dbias = parts.sum(0).to(dy.dtype) if with_dbias else dy.new_empty((0,))
    return data, data_t, scale_inv, amax, dbias
