"""quantize_blockwise(x, block_rows, block_cols, fp8_dtype, margin, power_of_2) -> (data, scale_inv).

One scale per block (DeepSeek-V3 style). Supported blocks:
- (1, C), any C >= 1 dividing the last dim, for x with ndim >= 1: scale_inv is x.shape[:-1] + (K // C,).
  This is kernels/rowwise.py on the (-1, C) view of x: every C-long slice is a row. (1, 128) is the
  activation/gradient layout.
- (R, C) with R > 1, for 2-D x: R and C powers of two, R * C <= 16384, dividing (M, K): scale_inv is
  (M // R, K // C); one program per block, the block held in registers (one read of x). (128, 128) is
  the weight layout.
Anything else raises ValueError naming the shape and the block.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from .common import (
    abs_bits,
    check_hp_input,
    check_scaling_args,
    clamp_keep_nan,
    custom_op,
    fp8_constants,
    margin_div,
    refuse_redefinition,
    scale_from_amax,
    use_triton,
)
from .launch import on_device_of
from .reference import cast_to_fp8_ref, expand_blocks
from .reference import scale_from_amax as scale_from_amax_ref
from .rowwise import launch_rowwise

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::quantize_blockwise", __name__)

MAX_BLOCK_ELEMS = 128 * 128  # registers of one program (8 warps: 64 values per thread)


@triton.jit
def _block2d_kernel(
    x_ptr,  # (M, K) hp, any strides
    data_ptr,  # (M, K) fp8, contiguous
    scale_inv_ptr,  # (M // BLOCK_R, K // BLOCK_C) fp32, contiguous
    K,
    stride_xm,
    stride_xk,
    blocks_k,  # K // BLOCK_C
    margin_div,  # 2.0**margin
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,  # reference.min_scale(fp8_dtype), for scale_from_amax
    POWER_OF_2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid // blocks_k).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % blocks_k) * BLOCK_C + tl.arange(0, BLOCK_C)
    # No masks: the launcher checked that the blocks tile x exactly.
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :].to(tl.int64) * stride_xk).to(tl.float32)
    amax = tl.max(tl.max(abs_bits(x), axis=1), axis=0).to(tl.float32, bitcast=True)
    scale = scale_from_amax(amax, FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    y = clamp_keep_nan(x * scale, FP8_MAX)
    tl.store(data_ptr + rows[:, None] * K + cols[None, :], y.to(data_ptr.dtype.element_ty))
    tl.store(scale_inv_ptr + pid, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


def quantize_blockwise_triton(
    x: torch.Tensor,
    block_rows: int,
    block_cols: int,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale_inv), one scale per block_rows x block_cols block, by the Triton kernels (no checks)."""
    K = x.shape[-1]
    if block_rows == 1:
        x2 = x.reshape(math.prod(x.shape[:-1]) * (K // block_cols), block_cols)
        data, scale_inv = launch_rowwise(x2, fp8_dtype, margin, power_of_2)
        return data.view(x.shape), scale_inv.view(*x.shape[:-1], K // block_cols)
    M = x.shape[0]
    data = torch.empty((M, K), dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((M // block_rows, K // block_cols), dtype=torch.float32, device=x.device)
    n_blocks = scale_inv.numel()
    if n_blocks:
        with on_device_of(x):
            _block2d_kernel[(n_blocks,)](
                x,
                data,
                scale_inv,
                K,
                x.stride(0),
                x.stride(1),
                K // block_cols,
                margin_div(margin),
                **fp8_constants(fp8_dtype),
                POWER_OF_2=power_of_2,
                BLOCK_R=block_rows,
                BLOCK_C=block_cols,
                num_warps=8 if block_rows * block_cols >= 4096 else 4,
            )
    return data, scale_inv


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_block(shape: Sequence[int], block_rows: object, block_cols: object, op: str = "quantize_blockwise") -> None:
    """ValueError unless (block_rows, block_cols) is a supported block that tiles `shape` exactly."""
    block = (block_rows, block_cols)
    shape = tuple(shape)
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block):
        raise ValueError(f"{op}: block must be two positive ints, got {block!r}")
    if len(shape) == 0:
        raise ValueError(f"{op}: a 0-d tensor has no blocks; got shape () and block {block}")
    if shape[-1] % block_cols:
        raise ValueError(f"{op}: block {block} does not tile shape {shape}: {shape[-1]} columns % {block_cols} != 0")
    if block_rows == 1:
        return
    if len(shape) != 2:
        raise ValueError(f"{op}: block {block} with more than one row needs a 2-D tensor, got shape {shape}")
    if shape[0] % block_rows:
        raise ValueError(f"{op}: block {block} does not tile shape {shape}: {shape[0]} rows % {block_rows} != 0")
    if not (_is_pow2(block_rows) and _is_pow2(block_cols)) or block_rows * block_cols > MAX_BLOCK_ELEMS:
        raise ValueError(
            f"{op}: unsupported block {block} for shape {shape}: blocks of more than one row must be powers of "
            f"two with at most {MAX_BLOCK_ELEMS} elements (e.g. (128, 128)); (1, C) blocks take any C"
        )


def _check(x, block_rows, block_cols, fp8_dtype, margin, power_of_2):
    check_hp_input(x, "quantize_blockwise")
    check_scaling_args(fp8_dtype, margin, power_of_2, "quantize_blockwise")
    check_block(x.shape, block_rows, block_cols)


def _scale_inv_shape(x, block_rows, block_cols):
    if block_rows == 1:
        return (*x.shape[:-1], x.shape[-1] // block_cols)
    return (x.shape[0] // block_rows, x.shape[1] // block_cols)


@custom_op("float8::quantize_blockwise")
def quantize_blockwise(
    x: torch.Tensor,
    block_rows: int,
    block_cols: int,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (x.shape) fp8, scale_inv fp32 with one value per block: x.shape[:-1] + (K // C,) or (M // R, K // C))."""
    _check(x, block_rows, block_cols, fp8_dtype, margin, power_of_2)
    if use_triton(x):
        return quantize_blockwise_triton(x, block_rows, block_cols, fp8_dtype, margin, power_of_2)
    return quantize_blockwise_ref(x, block_rows, block_cols, fp8_dtype, margin, power_of_2)


@quantize_blockwise.register_fake
def _(x, block_rows, block_cols, fp8_dtype, margin=0, power_of_2=False):
    _check(x, block_rows, block_cols, fp8_dtype, margin, power_of_2)
    return (
        x.new_empty(x.shape, dtype=fp8_dtype),
        x.new_empty(_scale_inv_shape(x, block_rows, block_cols), dtype=torch.float32),
    )


def blockwise_amax_ref(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """max|x| per block, float32, NaN-propagating, in the scale_inv layout."""
    a = x.float().abs()
    K = x.shape[-1]
    if block_rows == 1:
        return a.reshape(*x.shape[:-1], K // block_cols, block_cols).amax(dim=-1)
    M = x.shape[0]
    return a.reshape(M // block_rows, block_rows, K // block_cols, block_cols).amax(dim=(1, 3))


def quantize_blockwise_ref(
    x: torch.Tensor,
    block_rows: int,
    block_cols: int,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale_inv), one scale per block_rows x block_cols block from that block's amax: the semantics
    of quantize_blockwise."""
    check_block(x.shape, block_rows, block_cols)
    scale = scale_from_amax_ref(blockwise_amax_ref(x, block_rows, block_cols), fp8_dtype, margin, power_of_2)
    data = cast_to_fp8_ref(x.contiguous(), expand_blocks(scale, x.shape), fp8_dtype)
    return data, scale.reciprocal()
