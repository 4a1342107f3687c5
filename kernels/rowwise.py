"""quantize_rowwise(x, fp8_dtype, margin, power_of_2) -> (data, scale_inv): one scale per row.

A row is a slice along the last dim; scale_inv has shape x.shape[:-1] + (1,). Each program takes ROWS
rows: it reduces their amaxes, computes their scales on the device (common.scale_from_amax), casts and
writes scale_inv. A row that fits in BLOCK_K stays in registers (one read of x); a longer one is read
twice (amax loop, then cast loop; the second read mostly hits L2).

launch_rowwise is also the (1, C) block kernel of kernels/blockwise.py, on the (-1, C) view of x.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (
    abs_bits,
    cdiv,
    check_hp_input,
    check_scaling_args,
    clamp_keep_nan,
    fp8_constants,
    margin_div,
    next_pow2,
    refuse_redefinition,
    scale_from_amax,
    triton_op,
    use_triton,
)
from .launch import FastLauncher
from .reference import cast_to_fp8_ref
from .reference import scale_from_amax as scale_from_amax_ref

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::quantize_rowwise", __name__)

MAX_SINGLE_K = 8192  # rows up to this long are cast from registers
LOOP_BLOCK_K = 4096  # column block of the two-pass loop for longer rows
TILE = 4096  # elements per program (ROWS * BLOCK_K) for short rows


@triton.jit
def _quantize_rows(
    x_ptr,  # (R, K) hp, unit column stride, row stride stride_xr
    data_ptr,  # (R, K) fp8, contiguous
    scale_inv_ptr,  # (R,) fp32
    pid,  # which ROWS rows
    R,
    K,
    stride_xr,
    margin_div,  # 2.0**margin, float32
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    POWER_OF_2: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """Rows pid * ROWS .. + ROWS of x quantized, each with its own scale: the body of _rowwise_kernel, of the
    quantizing programs of kernels/rowwise_input_mm.py's one-launch GEMM and of its two-launch path's first
    kernel (kernels/weight_only_kernel.py): the same bits each way."""
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < R
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xr
    d_rows = data_ptr + rows[:, None] * K
    if SINGLE:
        mask = row_mask[:, None] & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(abs_bits(x), axis=1).to(tl.float32, bitcast=True)  # (ROWS,)
        scale = scale_from_amax(amax, FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
        y = clamp_keep_nan(x * scale[:, None], FP8_MAX)
        tl.store(d_rows + cols[None, :], y.to(data_ptr.dtype.element_ty), mask=mask)
    else:
        bits = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
        for k in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (cols[None, :] + k < K)
            x = tl.load(x_rows + k + cols[None, :], mask=mask, other=0.0)
            bits = tl.maximum(bits, abs_bits(x))
        amax = tl.max(bits, axis=1).to(tl.float32, bitcast=True)
        scale = scale_from_amax(amax, FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
        for k in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (cols[None, :] + k < K)
            x = tl.load(x_rows + k + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = clamp_keep_nan(x * scale[:, None], FP8_MAX)
            tl.store(d_rows + k + cols[None, :], y.to(data_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_inv_ptr + rows, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=row_mask)


@triton.jit
def _rowwise_kernel(
    x_ptr,  # (R, K) hp, unit column stride, row stride stride_xr
    data_ptr,  # (R, K) fp8, contiguous
    scale_inv_ptr,  # (R,) fp32
    R,
    K,
    stride_xr,
    margin_div,  # 2.0**margin
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,  # reference.min_scale(fp8_dtype), for scale_from_amax
    POWER_OF_2: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE: tl.constexpr,  # K <= BLOCK_K: the whole row in registers
):
    # A float argument is float32 in Triton's own launcher but float64 in inductor's (quantize_rowwise is a
    # triton_op): scale_from_amax's div_rn refused the float64 (GPU tier, 2026-11-26).
    margin_div = tl.cast(margin_div, tl.float32)
    _quantize_rows(
        x_ptr, data_ptr, scale_inv_ptr, tl.program_id(0), R, K, stride_xr, margin_div,
        FP8_MAX, MIN_SCALE, POWER_OF_2, ROWS, BLOCK_K, SINGLE,
    )  # fmt: skip


_launch = FastLauncher(_rowwise_kernel)


def rowwise_args(
    x2: torch.Tensor,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
    max_single_k: int = MAX_SINGLE_K,
) -> tuple[tuple[int], tuple, int]:
    """(grid, the kernel's arguments in its order, num_warps) of one launch writing x2's (R, K) rows, with
    unit column stride, into data (R, K) and scale_inv (R,): for launch_rowwise."""
    R, K = x2.shape
    rows, block_k, single = row_blocks(K, max_single_k)
    c = fp8_constants(fp8_dtype)
    args = (x2, data, scale_inv, R, K, x2.stride(0), margin_div(margin), c["FP8_MAX"], c["MIN_SCALE"])
    args += (power_of_2, rows, block_k, single)
    return (cdiv(R, rows),), args, warps_for(rows, block_k)


def warps_for(rows: int, block_k: int) -> int:
    """Warps of a `_quantize_rows` launch of ROWS x BLOCK_K tiles: 8 from 4096 elements, else 4."""
    return 8 if rows * block_k >= 4096 else 4


def row_blocks(k: int, max_single_k: int = MAX_SINGLE_K) -> tuple[int, int, bool]:
    """(ROWS, BLOCK_K, SINGLE) of `_quantize_rows` for rows of k elements: rows up to max_single_k long are
    cast from registers, TILE elements a program; longer ones one row a program, read twice in LOOP_BLOCK_K
    blocks (no wider than max_single_k)."""
    single = k <= max_single_k
    block_k = next_pow2(k) if single else min(LOOP_BLOCK_K, next_pow2(max_single_k))
    return (max(1, TILE // block_k) if single else 1), block_k, single


def launch_rowwise(
    x2: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
    max_single_k: int = MAX_SINGLE_K,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x2: (R, K). Returns data (R, K) fp8 and scale_inv (R,) fp32."""
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R, K = x2.shape
    data = torch.empty((R, K), dtype=fp8_dtype, device=x2.device)
    scale_inv = torch.empty((R,), dtype=torch.float32, device=x2.device)
    if R == 0:
        return data, scale_inv
    grid, args, warps = rowwise_args(x2, data, scale_inv, fp8_dtype, margin, power_of_2, max_single_k)
    _launch(grid, *args, num_warps=warps)
    return data, scale_inv


def quantize_rowwise_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
    max_single_k: int = MAX_SINGLE_K,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale_inv of shape x.shape[:-1] + (1,)): one scale per row, by the Triton kernel (no checks)."""
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # (-1, K) fails for an empty x
    data, scale_inv = launch_rowwise(x2, fp8_dtype, margin, power_of_2, max_single_k)
    return data.view(x.shape), scale_inv.view(*x.shape[:-1], 1)


def _check(x, fp8_dtype, margin, power_of_2):
    check_hp_input(x, "quantize_rowwise")
    check_scaling_args(fp8_dtype, margin, power_of_2, "quantize_rowwise")
    if x.dim() < 1:
        raise ValueError("quantize_rowwise: x must have at least 1 dim (rows run along the last), got a 0-d tensor")


@triton_op("float8::quantize_rowwise")
def quantize_rowwise(
    x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (x.shape) fp8, scale_inv x.shape[:-1] + (1,) fp32): one scale per row of the last dim."""
    _check(x, fp8_dtype, margin, power_of_2)
    if use_triton(x):
        return quantize_rowwise_triton(x, fp8_dtype, margin, power_of_2)
    return quantize_rowwise_ref(x, fp8_dtype, margin, power_of_2)


def rowwise_amax_ref(x: torch.Tensor) -> torch.Tensor:
    """max|x| along the last dim, keepdim, float32; NaN-propagating; 0 for empty rows."""
    if x.shape[-1] == 0:
        return torch.zeros((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    return x.float().abs().amax(dim=-1, keepdim=True)


def quantize_rowwise_ref(
    x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale_inv of shape x.shape[:-1] + (1,)): each row scaled from its own amax."""
    scale = scale_from_amax_ref(rowwise_amax_ref(x), fp8_dtype, margin, power_of_2)
    return cast_to_fp8_ref(x.contiguous(), scale, fp8_dtype), scale.reciprocal()
