"""The per-tensor FP8 cast writing both layouts in one pass over x: the transposing paths of
float8::quantize_tensorwise (kernels/quantize.py).

cast_transpose_triton(x, scale, fp8_dtype) -> (data, data_t, scale_inv, amax)             a given scale
quantize_transpose_tensorwise_triton(x, fp8_dtype, margin, power_of_2) -> (data, data_t, scale_inv, amax)
                                                                                          current scaling

x is (..., M, K): leading dims are a batch. data is (..., M, K) and data_t (..., K, M), both contiguous:
the two layouts an FP8 GEMM needs in forward and backward. Each program casts one (BLOCK_M, BLOCK_K)
tile and stores it twice, the second time through tl.trans, so both stores are row-wise coalesced.
x may have any strides (a transposed weight is read in place). 4 bytes/element for bf16 input; the
current-scaling version adds the amax pass of kernels/amax.py (6 bytes/element).

A small x (one (M, K) matrix, M and K <= common.SMALL_DIM, M * K <= common.SMALL_NUMEL) takes one launch
for current scaling: _quantize_transpose_small_kernel holds the whole matrix as one tile, reduces the amax,
computes the scale, and writes data, data_t, scale_inv and amax (no torch.zeros, no atomics).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .amax import launch_amax
from .common import (
    SMALL_DIM,
    SMALL_NUMEL,
    abs_bits,
    atomic_amax,
    cdiv,
    clamp_keep_nan,
    fp8_constants,
    margin_div,
    next_pow2,
    scale_from_amax,
    small_num_warps,
    transposed_shape,
)
from .launch import FastLauncher
from .reference import quantize_tensorwise_ref

# Per input element size. (64, 128) tiles: 256 B row segments read (bf16), 128 B / 64 B written. For
# 16-bit inputs TRANS_INPUT transposes the input tile (ldmatrix.trans) rather than the FP8 one (byte-wise
# shared-memory stores). Not measured yet: `python -m benchmarks.kernels --sweep` compares variants.
CONFIGS = {
    2: dict(BLOCK_M=64, BLOCK_K=128, num_warps=8, TRANS_INPUT=True),
    4: dict(BLOCK_M=64, BLOCK_K=128, num_warps=8, TRANS_INPUT=False),
}


@triton.jit
def _cast_transpose_kernel(
    x_ptr,  # (B, M, K) hp, any strides
    scale_ptr,  # (1,) fp32: the scale (CURRENT=False) ...
    amax_ptr,  # () fp32: ... or the amax to take it from (CURRENT=True); else max|x| is folded in here
    data_ptr,  # (B, M, K) fp8, contiguous
    data_t_ptr,  # (B, K, M) fp8, contiguous
    scale_inv_ptr,  # () fp32
    M,
    K,
    stride_xb,
    stride_xm,
    stride_xk,
    tiles_m,
    tiles_k,
    margin_div,  # 2.0**margin (CURRENT only)
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,  # reference.min_scale(fp8_dtype), for scale_from_amax
    CURRENT: tl.constexpr,
    POWER_OF_2: tl.constexpr,
    WITH_AMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TRANS_INPUT: tl.constexpr,
):
    # One flat grid (no 65535 limit on the batch): pid -> (batch, tile row, tile column).
    pid = tl.program_id(0)
    b = pid // (tiles_m * tiles_k)
    t = pid % (tiles_m * tiles_k)
    rows = (t // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (t % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    b64 = b.to(tl.int64)

    x_tile = x_ptr + b64 * stride_xb + rows[:, None].to(tl.int64) * stride_xm + cols[None, :].to(tl.int64) * stride_xk
    x_in = tl.load(x_tile, mask=mask, other=0.0)
    x = x_in.to(tl.float32)
    if CURRENT:
        scale = scale_from_amax(tl.load(amax_ptr), FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    else:
        scale = tl.load(scale_ptr)
    y = clamp_keep_nan(x * scale, FP8_MAX).to(data_ptr.dtype.element_ty)
    if TRANS_INPUT:
        # Transpose the input tile and cast it again: 16-bit shared-memory traffic instead of 8-bit.
        y_t = clamp_keep_nan(tl.trans(x_in).to(tl.float32) * scale, FP8_MAX).to(data_ptr.dtype.element_ty)
    else:
        y_t = tl.trans(y)

    mk = b64 * M * K
    tl.store(data_ptr + mk + rows[:, None].to(tl.int64) * K + cols[None, :], y, mask=mask)
    # (BLOCK_K, BLOCK_M): row c of the tile lands in row c of data_t, contiguous along M.
    mask_t = (cols[:, None] < K) & (rows[None, :] < M)
    tl.store(data_t_ptr + mk + cols[:, None].to(tl.int64) * M + rows[None, :], y_t, mask=mask_t)
    if WITH_AMAX:
        atomic_amax(amax_ptr, tl.max(tl.max(abs_bits(x), axis=1), axis=0))
    tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=pid == 0)


SMALL_MIN_TILE = 16  # per side: fewer specializations for the tiniest matrices


@triton.jit
def _quantize_transpose_small_kernel(
    x_ptr,  # (M, K) hp, any strides, M <= BLOCK_M, K <= BLOCK_K
    data_ptr,  # (M, K) fp8, contiguous
    data_t_ptr,  # (K, M) fp8, contiguous
    scale_inv_ptr,  # () fp32
    amax_ptr,  # () fp32, written (not accumulated): max|x|
    M,
    K,
    stride_xm,
    stride_xk,
    margin_div,  # 2.0**margin
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,  # reference.min_scale(fp8_dtype), for scale_from_amax
    POWER_OF_2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program, one tile: the whole matrix, read once. The FP8 tile is what gets transposed (fewer
    # registers than TRANS_INPUT's second cast: 127 against 219 for a bf16 128 x 128 .t() view, ptxas sm_90a).
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :].to(tl.int64) * stride_xk  # any view
    x = tl.load(x_tile, mask=mask, other=0.0).to(tl.float32)
    # The integer max of common.abs_bits keeps NaN; its bits are the float amax (+0.0 for an empty x).
    amax = tl.max(tl.max(abs_bits(x), axis=1), axis=0).to(tl.float32, bitcast=True)
    scale = scale_from_amax(amax, FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    y = clamp_keep_nan(x * scale, FP8_MAX).to(data_ptr.dtype.element_ty)
    y_t = tl.trans(y)
    tl.store(data_ptr + rows[:, None] * K + cols[None, :], y, mask=mask)
    mask_t = (cols[:, None] < K) & (rows[None, :] < M)
    tl.store(data_t_ptr + cols[:, None] * M + rows[None, :], y_t, mask=mask_t)
    tl.store(amax_ptr, amax)
    tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


_launch_ct = FastLauncher(_cast_transpose_kernel)
launch_small_t = FastLauncher(_quantize_transpose_small_kernel)


def _is_small(x: torch.Tensor) -> bool:
    """One (M, K) matrix (leading dims all 1) that one program holds in registers (common.SMALL_NUMEL)."""
    *batch, M, K = x.shape
    return M <= SMALL_DIM and K <= SMALL_DIM and M * K <= SMALL_NUMEL and all(b == 1 for b in batch)


def small_transpose_launch(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int, power_of_2: bool) -> tuple:
    """(outputs (data, data_t, scale_inv, amax), args, named) of the one-launch path for a small x (see
    _is_small), read in place with its strides: what `launch_small_t((1,), *args, **named)` takes."""
    M, K = x.shape[-2:]
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    data_t = torch.empty(transposed_shape(x.shape), dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    amax = torch.empty((), dtype=torch.float32, device=x.device)
    block_m = max(SMALL_MIN_TILE, next_pow2(M))
    block_k = max(SMALL_MIN_TILE, next_pow2(K))
    args = (x, data, data_t, scale_inv, amax, M, K, x.stride(-2), x.stride(-1), margin_div(margin))
    named = dict(
        **fp8_constants(fp8_dtype),
        POWER_OF_2=power_of_2,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        num_warps=small_num_warps(block_m * block_k),
    )
    return (data, data_t, scale_inv, amax), args, named


def _quantize_transpose_small(x, fp8_dtype, margin, power_of_2):
    """One launch for a small x (see _is_small), read in place with its strides."""
    outputs, args, named = small_transpose_launch(x, fp8_dtype, margin, power_of_2)
    launch_small_t((1,), *args, **named)
    return outputs


def launch_cast_transpose(
    x: torch.Tensor,
    scale_or_amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    current: bool,
    margin: int = 0,
    power_of_2: bool = False,
    amax_out: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate (data, data_t, scale_inv) and launch the cast with the transpose. current: scale_or_amax is an
    amax buffer, whose scale each program computes (the second pass of current scaling)."""
    cfg = CONFIGS[x.element_size()] if config is None else config
    *batch, M, K = x.shape
    B = math.prod(batch)
    x3 = x.reshape(B, M, K)  # a view when the batch dims merge, else a contiguous copy
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    data_t = torch.empty((*batch, K, M), dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    tiles_m = max(1, cdiv(M, cfg["BLOCK_M"]))
    tiles_k = max(1, cdiv(K, cfg["BLOCK_K"]))
    amax_arg = scale_or_amax if current else amax_out
    _launch_ct(
        (max(1, B * tiles_m * tiles_k),),  # >= 1 program: program 0 writes scale_inv
        x3,
        scale_or_amax,
        amax_arg if amax_arg is not None else scale_inv,  # unused when neither
        data,
        data_t,
        scale_inv,
        M if x.numel() else 0,  # empty x: one program, everything masked
        K,
        x3.stride(0),
        x3.stride(1),
        x3.stride(2),
        tiles_m,
        tiles_k,
        margin_div(margin),
        **fp8_constants(fp8_dtype),
        CURRENT=current,
        POWER_OF_2=power_of_2,
        WITH_AMAX=(not current) and amax_out is not None,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_K=cfg["BLOCK_K"],
        TRANS_INPUT=cfg["TRANS_INPUT"],
        num_warps=cfg["num_warps"],
    )
    return data, data_t, scale_inv


def cast_transpose_triton(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, data_t, scale_inv, amax): x cast with the given scale and its transpose, in one kernel (no checks)."""
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    data, data_t, scale_inv = launch_cast_transpose(x, scale, fp8_dtype, current=False, amax_out=amax, config=config)
    return data, data_t, scale_inv, amax


def quantize_transpose_tensorwise_triton(
    x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, power_of_2: bool = False, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Small x: one launch, no torch.zeros; host time, not the GPU, is what small layers wait for (see
    # common.SMALL_NUMEL for the threshold and why). An explicit config asks for the tiled kernel.
    """(data, data_t, scale_inv, amax) at current scaling: the amax pass, then the cast with the transpose
    (one launch for a small x), no checks."""
    if config is None and _is_small(x):
        return _quantize_transpose_small(x, fp8_dtype, margin, power_of_2)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    # The amax pass reads a flat contiguous x, in any order: a transposed view (a weight's .t()) is read
    # through its contiguous transpose, other strided views are copied. The cast pass reads x as it is.
    if x.is_contiguous():
        flat = x
    elif x.transpose(-2, -1).is_contiguous():
        flat = x.transpose(-2, -1)
    else:
        flat = x.contiguous()
    launch_amax(flat, amax)
    data, data_t, scale_inv = launch_cast_transpose(
        x, amax, fp8_dtype, current=True, margin=margin, power_of_2=power_of_2, config=config
    )
    return data, data_t, scale_inv, amax


def cast_transpose_ref(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_tensorwise_ref with the given scale and the transpose: the semantics of cast_transpose."""
    return quantize_tensorwise_ref(x, fp8_dtype, scale, with_transpose=True)


def quantize_transpose_tensorwise_ref(
    x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_tensorwise_ref at current scaling, with the transpose."""
    return quantize_tensorwise_ref(x, fp8_dtype, None, margin, power_of_2, with_transpose=True)
