"""Per-tensor current-scaling quantization of a small tensor, prepared for repeated eager calls.

A training step of a small Linear quantizes its input, its weight, its output gradient and its weight again
(for the input gradient), each through float8::quantize_tensorwise's checks, its dispatch to a path, the
path's argument set-up and FastLauncher's specialization key: about 55 us of host per quantization on the
H100 machine's host (benchmarks/results/profile_lone_linear.txt, 2026-11-27), of which the one-launch kernel's own
launch and its four allocations are about half. `prepare_quantize` does one quantization the usual way and
keeps what a later call of the same layout needs (kernels/launch.py `PreparedLaunch`): such a call
allocates the outputs and launches, nothing else. Same kernel, same arguments: the same bits.

Only the one-launch paths of small tensors (common.SMALL_NUMEL) are prepared; there host time is what the
call waits for. Everything else is quantize_tensorwise each time.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .cast_transpose import _is_small, launch_small_t, small_transpose_launch
from .common import SMALL_NUMEL, _plain_eager, use_triton
from .quantize import launch_small, quantize_tensorwise, small_launch


class PreparedQuantize:
    """quantize_tensorwise(x, fp8_dtype, None, margin, power_of_2, with_transpose) for an x of one shape,
    strides, dtype and device (those of the call that prepared it). A call returns (data, data_t or None,
    scale_inv, amax), or None where it did not launch (another layout, a misaligned x, another current
    device): the caller then quantizes the checked way."""

    __slots__ = ("launch", "shape", "strides", "dtype", "device", "fp8_dtype", "t_shape")

    def __call__(self, x: torch.Tensor) -> Optional[tuple]:
        if x.shape != self.shape or x.dtype != self.dtype or x.stride() != self.strides:
            return None
        if torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling():
            return None  # a dispatch mode or a trace sees the checked op, not a launch by address
        if x.get_device() != self.device:
            return None
        data = x.new_empty(self.shape, dtype=self.fp8_dtype)
        scale_inv = x.new_empty((), dtype=torch.float32)
        amax = x.new_empty((), dtype=torch.float32)
        if self.t_shape is None:
            launched = self.launch(x, data, scale_inv, amax)
            data_t = None
        else:
            data_t = x.new_empty(self.t_shape, dtype=self.fp8_dtype)
            launched = self.launch(x, data, data_t, scale_inv, amax)
        return (data, data_t, scale_inv, amax) if launched else None


def small_layout(x: torch.Tensor, with_transpose: bool) -> bool:
    """Whether x's layout takes a one-launch small path on the GPU (what `prepare_quantize` prepares)."""
    if not (x.numel() > 0 and x.is_cuda and use_triton(x)):
        return False
    if with_transpose:
        return x.dim() == 2 and _is_small(x)
    return x.is_contiguous() and x.numel() <= SMALL_NUMEL


def prepare_quantize(
    x: torch.Tensor, fp8_dtype: torch.dtype, margin: int, power_of_2: bool, with_transpose: bool
) -> Tuple[tuple, Optional[PreparedQuantize]]:
    """quantize_tensorwise(x, fp8_dtype, None, margin, power_of_2, with_transpose) now, as (data, data_t or
    None, scale_inv, amax), and a PreparedQuantize for later calls on x's layout, or None where x does not
    take a one-launch path on the GPU from plain eager code (call quantize_tensorwise then). fp8_dtype,
    margin and power_of_2 as a quantizer validated them."""
    small = _plain_eager((x,), {}) and small_layout(x, with_transpose)
    if small and with_transpose:
        outputs, args, named = small_transpose_launch(x, fp8_dtype, margin, power_of_2)
        launch = launch_small_t.prepare((1,), (0, 1, 2, 3, 4), *args, **named)
        t_shape = outputs[1].shape
    elif small:
        (data, scale_inv, amax), args, named = small_launch(x, fp8_dtype, margin, power_of_2)
        launch = launch_small.prepare((1,), (0, 1, 2, 3), *args, **named)
        outputs, t_shape = (data, None, scale_inv, amax), None
    else:
        data, data_t, scale_inv, amax = quantize_tensorwise(x, fp8_dtype, None, margin, power_of_2, with_transpose)
        return (data, data_t if with_transpose else None, scale_inv, amax), None
    if launch is None:
        return outputs, None
    p = PreparedQuantize()
    p.launch, p.shape, p.strides, p.dtype, p.device = launch, x.shape, x.stride(), x.dtype, x.get_device()
    p.fp8_dtype, p.t_shape = fp8_dtype, t_shape
    return outputs, p
