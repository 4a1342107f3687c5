"""cast_triton(x, scale, fp8_dtype) -> (data, scale_inv, amax): the per-tensor FP8 cast with a given scale.

data = satfinite RTNE cast of x.float() * scale (x's shape), scale_inv = 1 / scale (() float32, written
by program 0 of the same launch), amax = max|x| (() float32, from the same single read of x: delayed
scaling records it for the next step's scale). 3 bytes/element for bf16 input. It is the path of
float8::quantize_tensorwise (kernels/quantize.py) for a given scale without a transpose.

The same kernel, with CURRENT=True, is the second pass of current scaling (kernels/quantize.py): it
reads the amax of the first pass and computes the scale itself, on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import abs_bits, atomic_amax, cdiv, clamp_keep_nan, fp8_constants, margin_div, scale_from_amax
from .launch import FastLauncher
from .reference import quantize_tensorwise_ref

BLOCK = 4096  # elements per program; 8 warps -> 16 per thread: 2x16 B loads (bf16), one 16 B store
NUM_WARPS = 8


@triton.jit
def _cast_kernel(
    x_ptr,  # (N,) hp, contiguous
    scale_ptr,  # (1,) fp32: the scale (CURRENT=False) ...
    amax_ptr,  # () fp32: ... or the amax to take it from (CURRENT=True); else max|x| is folded in here
    data_ptr,  # (N,) fp8, contiguous
    scale_inv_ptr,  # () fp32
    n,
    margin_div,  # 2.0**margin (CURRENT only)
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,  # reference.min_scale(fp8_dtype), for scale_from_amax
    CURRENT: tl.constexpr,
    POWER_OF_2: tl.constexpr,
    WITH_AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if CURRENT:
        scale = scale_from_amax(tl.load(amax_ptr), FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    else:
        scale = tl.load(scale_ptr)
    y = clamp_keep_nan(x * scale, FP8_MAX)
    tl.store(data_ptr + offs, y.to(data_ptr.dtype.element_ty), mask=mask)
    if WITH_AMAX:
        atomic_amax(amax_ptr, tl.max(abs_bits(x), axis=0))
    tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=pid == 0)


_launch_cast = FastLauncher(_cast_kernel)


def launch_cast(
    x: torch.Tensor,
    scale_or_amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    current: bool,
    margin: int = 0,
    power_of_2: bool = False,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate data/scale_inv and launch. x: contiguous. current: scale_or_amax is an amax buffer."""
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    n = x.numel()
    amax_arg = scale_or_amax if current else amax_out
    c = fp8_constants(fp8_dtype)
    _launch_cast(
        (max(1, cdiv(n, BLOCK)),),  # >= 1 program: program 0 writes scale_inv
        x,
        scale_or_amax,
        amax_arg if amax_arg is not None else scale_inv,  # unused when neither
        data,
        scale_inv,
        n,
        margin_div(margin),
        c["FP8_MAX"],
        c["MIN_SCALE"],
        current,
        power_of_2,
        (not current) and amax_out is not None,
        BLOCK,
        num_warps=NUM_WARPS,
    )
    return data, scale_inv


def cast_triton(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data (x.shape) fp8, scale_inv () fp32 = 1/scale, amax () fp32 = max|x|) for a one-element fp32 scale."""
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    data, scale_inv = launch_cast(x.contiguous(), scale, fp8_dtype, current=False, amax_out=amax)
    return data, scale_inv, amax


def cast_ref(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scale_inv, amax): x cast with the given scale, as quantize_tensorwise_ref casts."""
    data, _, scale_inv, amax = quantize_tensorwise_ref(x, fp8_dtype, scale)
    return data, scale_inv, amax
