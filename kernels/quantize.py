"""float8::quantize_tensorwise: per-tensor FP8 quantization, one op over four paths.

quantize_tensorwise(x, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False)
    -> (data, data_t, scale_inv, amax)

data has x's shape; data_t is data with its last two dims swapped, contiguous (..., K, M) (the layout an
FP8 GEMM needs in backward), or an empty (0,) tensor without with_transpose (a custom op cannot return
None); scale_inv and amax are () float32, amax = max|x| on every path (delayed scaling records it).
scale None is current scaling (scale from max|x|, margin and power_of_2, on the device: no host sync); a
one-element float32 scale is delayed or static scaling (margin and power_of_2 ignored). The paths, each
a launcher with its reference (reference.quantize_tensorwise_ref states them all):

    scale given, no transpose   cast_triton (kernels/cast.py): one launch, 3 bytes/element for bf16
    scale None, no transpose    here: the amax pass of kernels/amax.py, then the cast kernel of
                                kernels/cast.py with CURRENT=True, whose programs each read the amax and
                                compute the scale as reference.scale_from_amax does (common.scale_from_amax);
                                program 0 writes scale_inv. 5 bytes/element.
    scale given, transpose      cast_transpose_triton (kernels/cast_transpose.py): 4 bytes/element
    scale None, transpose       quantize_transpose_tensorwise_triton (kernels/cast_transpose.py): 6

Small tensors (numel <= common.SMALL_NUMEL) under current scaling take one launch instead:
_quantize_small_kernel, one program holding all of x in registers, reduces the amax, computes the scale,
casts and writes every output (no torch.zeros, no atomics); cast_transpose.py has the transposing twin.
Same helpers, same bits; it exists to cut host time (see common.SMALL_NUMEL).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .amax import launch_amax
from .cast import cast_triton, launch_cast
from .cast_transpose import cast_transpose_triton, launch_cast_transpose, quantize_transpose_tensorwise_triton
from .common import (
    SMALL_NUMEL,
    _plain_eager,
    abs_bits,
    check_flag,
    check_hp_input,
    check_tensorwise_args,
    clamp_keep_nan,
    fp8_constants,
    margin_div,
    next_pow2,
    refuse_redefinition,
    scale_from_amax,
    small_num_warps,
    triton_op,
    use_triton,
)
from .launch import FastLauncher
from .reference import quantize_tensorwise_ref
from .reference import scale_from_amax as scale_from_amax_ref

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::quantize_tensorwise", __name__)

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
    scale = scale_from_amax(amax, FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    y = clamp_keep_nan(x * scale, FP8_MAX)
    tl.store(data_ptr + offs, y.to(data_ptr.dtype.element_ty), mask=mask)
    tl.store(amax_ptr, amax)
    tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


launch_small = FastLauncher(_quantize_small_kernel)


def small_launch(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int, power_of_2: bool) -> tuple:
    """(outputs (data, scale_inv, amax), args, named) of the one-launch path for x.numel() <= SMALL_NUMEL,
    x contiguous: what `launch_small((1,), *args, **named)` takes."""
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    amax = torch.empty((), dtype=torch.float32, device=x.device)
    block = max(SMALL_MIN_BLOCK, next_pow2(x.numel()))
    c = fp8_constants(fp8_dtype)
    args = (x, data, scale_inv, amax, x.numel(), margin_div(margin), c["FP8_MAX"], c["MIN_SCALE"], power_of_2, block)
    return (data, scale_inv, amax), args, {"num_warps": small_num_warps(block)}


def _quantize_small(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int, power_of_2: bool):
    """One launch for x.numel() <= SMALL_NUMEL. x: contiguous."""
    outputs, args, named = small_launch(x, fp8_dtype, margin, power_of_2)
    launch_small((1,), *args, **named)
    return outputs


def quantize_tensorwise_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
    config: Optional[dict] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_tensorwise on the GPU, by its four paths. config: the transposing kernels' tile
    (cast_transpose.CONFIGS unless given)."""
    if with_transpose:
        if scale is None:
            return quantize_transpose_tensorwise_triton(x, fp8_dtype, margin, power_of_2, config)
        return cast_transpose_triton(x, scale, fp8_dtype, config)
    no_t = torch.empty((0,), dtype=fp8_dtype, device=x.device)
    if scale is not None:
        data, scale_inv, amax = cast_triton(x, scale, fp8_dtype)
        return data, no_t, scale_inv, amax
    x = x.contiguous()
    # Small x: one launch, no torch.zeros; host time, not the GPU, is what small layers wait for (see
    # common.SMALL_NUMEL for the threshold and why).
    if x.numel() <= SMALL_NUMEL:
        data, scale_inv, amax = _quantize_small(x, fp8_dtype, margin, power_of_2)
        return data, no_t, scale_inv, amax
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    launch_amax(x, amax)
    data, scale_inv = launch_cast(x, amax, fp8_dtype, current=True, margin=margin, power_of_2=power_of_2)
    return data, no_t, scale_inv, amax


def _check(x, fp8_dtype, scale, margin, power_of_2, with_transpose):
    op = "quantize_tensorwise"
    check_hp_input(x, op)
    check_tensorwise_args(x, fp8_dtype, scale, margin, power_of_2, op)
    check_flag(with_transpose, "with_transpose", op)
    if with_transpose and x.dim() < 2:
        raise ValueError(f"{op}: x must have at least 2 dims (..., M, K) to transpose, got shape {tuple(x.shape)}")


@triton_op("float8::quantize_tensorwise")
def quantize_tensorwise(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data (x.shape) fp8, data_t (..., K, M) fp8 or (0,), scale_inv () fp32, amax () fp32 = max|x|).

    scale None: current scaling, scale = scale_from_amax(max|x|, margin, power_of_2); else a one-element
    fp32 scale on x's device (margin and power_of_2 ignored).
    """
    _check(x, fp8_dtype, scale, margin, power_of_2, with_transpose)
    if use_triton(x):
        return quantize_tensorwise_triton(x, fp8_dtype, scale, margin, power_of_2, with_transpose)
    return quantize_tensorwise_ref(x, fp8_dtype, scale, margin, power_of_2, with_transpose)


def cast_with_scale(x: torch.Tensor, fp8_dtype: torch.dtype, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (x.shape) fp8, scale_inv () fp32): quantize_tensorwise(x, fp8_dtype, scale)'s first and third
    outputs, the same bits, for a caller that drops max|x|: one launch, without the zeroed amax buffer and
    its fill kernel (float8/fsdp.py: each FP8-gathered weight's shard before every all-gather, 64 a step in
    the 8-block benchmark model). Traced (torch.compile, a dispatch mode, forward AD) or off the GPU,
    quantize_tensorwise itself: the registered op, which runs the kernel with the mode set aside."""
    _check(x, fp8_dtype, scale, 0, False, False)
    if not _plain_eager((x, scale), {}) or not use_triton(x):
        data, _, scale_inv, _ = quantize_tensorwise(x, fp8_dtype, scale)
        return data, scale_inv
    return launch_cast(x.contiguous(), scale, fp8_dtype, current=False)


def quantize_tensorwise_from_amax(
    x: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_tensorwise(x, fp8_dtype, None, margin, power_of_2, with_transpose) for a caller that holds
    max|x| already, as a () float32 tensor on x's device (the kernel that wrote x folded it in:
    kernels/product_amax.py, kernels/swiglu_pair.py): the cast pass alone, the scale computed from `amax` on
    the device as current scaling computes it. The same four outputs (`amax` itself last), and the same bits
    wherever amax is max|x|, which is the caller's to guarantee (ops/known_amax.py). Eager calls only (the
    lone Linear's path, ops/linear_train.py); off the GPU the reference with that scale."""
    _check(x, fp8_dtype, None, margin, power_of_2, with_transpose)
    if amax.shape != () or amax.dtype != torch.float32 or amax.device != x.device:
        raise ValueError(
            f"quantize_tensorwise_from_amax: amax must be a () float32 tensor on {x.device}, got "
            f"{tuple(amax.shape)} {amax.dtype} on {amax.device}"
        )
    if not use_triton(x):
        scale = scale_from_amax_ref(amax, fp8_dtype, margin, power_of_2)
        data, data_t, scale_inv, _ = quantize_tensorwise_ref(x, fp8_dtype, scale, with_transpose=with_transpose)
        return data, data_t, scale_inv, amax
    return quantize_tensorwise_from_amax_triton(x, amax, fp8_dtype, margin, power_of_2, with_transpose)


def quantize_tensorwise_from_amax_triton(
    x: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_tensorwise_from_amax's launches (on CPU tensors under TRITON_INTERPRET=1), no checks: the cast
    kernels of kernels/cast.py and kernels/cast_transpose.py with CURRENT=True, reading `amax`."""
    if with_transpose:
        data, data_t, scale_inv = launch_cast_transpose(
            x, amax, fp8_dtype, current=True, margin=margin, power_of_2=power_of_2
        )
        return data, data_t, scale_inv, amax
    data, scale_inv = launch_cast(x.contiguous(), amax, fp8_dtype, current=True, margin=margin, power_of_2=power_of_2)
    return data, torch.empty((0,), dtype=fp8_dtype, device=x.device), scale_inv, amax
