"""quantize_tensorwise(x, fp8_dtype, margin, power_of_2) -> (data, scale_inv, amax): current per-tensor scaling.

Two launches, no host sync: the amax pass of kernels/amax.py, then the cast kernel of kernels/cast.py
with CURRENT=True, whose programs each read the amax and compute the scale on the device exactly as
reference.scale_from_amax does (common.scale_from_amax); program 0 writes scale_inv.
5 bytes/element for bf16 input (x read twice, FP8 written once).

Small tensors (numel <= common.SMALL_NUMEL) take one launch instead: _quantize_small_kernel, one program
holding all of x in registers, reduces the amax, computes the scale, casts and writes every output (no
torch.zeros, no atomics). Same helpers, same bits; it exists to cut host time (see common.SMALL_NUMEL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .amax import launch_amax
from .cast import launch_cast
from .common import (
    SMALL_NUMEL,
    abs_bits,
    custom_op,
    check_hp_input,
    check_scaling_args,
    clamp_keep_nan,
    fp8_constants,
    margin_div,
    next_pow2,
    scale_from_amax as _device_scale_from_amax,
    small_num_warps,
    use_triton,
)
from .reference import amax_ref, cast_to_fp8_ref, scale_from_amax

SMALL_MIN_BLOCK = 128  # fewer specializations (one per power of two from here to SMALL_NUMEL)


@triton.jit
def _quantize_small_kernel(
    x_ptr,  # (N,) hp, contiguous, N <= BLOCK
    data_ptr,  # (N,) fp8, contiguous
    scale_inv_ptr,  # () fp32
    amax_ptr,  # () fp32, written (not accumulated): max|x|
    n,
    margin_div,  # 2.0**margin
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,  # reference.min_scale(fp8_dtype), for scale_from_amax
    POWER_OF_2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: the whole of x, read once.
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # The integer max of common.abs_bits keeps NaN; its bits are the float amax (+0.0 for an empty x).
    amax = tl.max(abs_bits(x), axis=0).to(tl.float32, bitcast=True)
    scale = _device_scale_from_amax(amax, FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    y = clamp_keep_nan(x * scale, FP8_MAX)
    tl.store(data_ptr + offs, y.to(data_ptr.dtype.element_ty), mask=mask)
    tl.store(amax_ptr, amax)
    tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


def _quantize_small(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int, power_of_2: bool):
    """One launch for x.numel() <= SMALL_NUMEL. x: contiguous."""
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    amax = torch.empty((), dtype=torch.float32, device=x.device)
    block = max(SMALL_MIN_BLOCK, next_pow2(x.numel()))
    _quantize_small_kernel[(1,)](
        x,
        data,
        scale_inv,
        amax,
        x.numel(),
        margin_div(margin),
        **fp8_constants(fp8_dtype),
        POWER_OF_2=power_of_2,
        BLOCK=block,
        num_warps=small_num_warps(block),
    )
    return data, scale_inv, amax


def _quantize_tensorwise_triton(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, power_of_2: bool = False):
    x = x.contiguous()
    # Small x: one launch, no torch.zeros; host time, not the GPU, is what small layers wait for (see
    # common.SMALL_NUMEL for the threshold and why).
    if x.numel() <= SMALL_NUMEL:
        return _quantize_small(x, fp8_dtype, margin, power_of_2)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    launch_amax(x, amax)
    data, scale_inv = launch_cast(x, amax, fp8_dtype, current=True, margin=margin, power_of_2=power_of_2)
    return data, scale_inv, amax


def _check(x, fp8_dtype, margin, power_of_2):
    check_hp_input(x, "quantize_tensorwise")
    check_scaling_args(fp8_dtype, margin, power_of_2, "quantize_tensorwise")


@custom_op("float8::quantize_tensorwise")
def quantize_tensorwise(
    x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data (x.shape) fp8, scale_inv () fp32, amax () fp32) with scale = scale_from_amax(max|x|)."""
    _check(x, fp8_dtype, margin, power_of_2)
    if use_triton(x):
        return _quantize_tensorwise_triton(x, fp8_dtype, margin, power_of_2)
    return quantize_tensorwise_ref(x, fp8_dtype, margin, power_of_2)


@quantize_tensorwise.register_fake
def _(x, fp8_dtype, margin=0, power_of_2=False):
    _check(x, fp8_dtype, margin, power_of_2)
    return (
        x.new_empty(x.shape, dtype=fp8_dtype),
        x.new_empty((), dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
    )


def quantize_tensorwise_ref(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, power_of_2: bool = False):
    amax = amax_ref(x)
    scale = scale_from_amax(amax, fp8_dtype, margin, power_of_2)
    return cast_to_fp8_ref(x.contiguous(), scale, fp8_dtype), scale.reciprocal(), amax
