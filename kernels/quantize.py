"""quantize_tensorwise(x, fp8_dtype, margin, power_of_2) -> (data, scale_inv, amax): current per-tensor scaling.

Two launches, no host sync: the amax pass of kernels/amax.py, then the cast kernel of kernels/cast.py
with CURRENT=True, whose programs each read the amax and compute the scale on the device exactly as
reference.scale_from_amax does (common.scale_from_amax); program 0 writes scale_inv.
5 bytes/element for bf16 input (x read twice, FP8 written once).
"""

from __future__ import annotations

import torch

from .amax import launch_amax
from .cast import launch_cast
from .common import custom_op, check_hp_input, check_scaling_args, use_triton
from .reference import amax_ref, cast_to_fp8_ref, scale_from_amax


def _quantize_tensorwise_triton(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, power_of_2: bool = False):
    x = x.contiguous()
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
