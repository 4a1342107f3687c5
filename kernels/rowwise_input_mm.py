"""fp8_rowwise_input_mm: x quantized one row at a time, then an FP8 x FP8 GEMM with an FP8 weight.

For inference with an FP8-only weight at 33-128 tokens (ops.Linear's inference forward). At these sizes the
weight-only kernel (kernels/weight_only.py) is no longer bound by reading the weight: it widens every FP8
weight element in registers for a bf16 MMA, and its GPU time grows with the tokens. Quantizing x instead
and running the tensor cores in FP8 reads the same weight bytes and does half the MMA work:

    x (M, K) bf16 --quantize_rowwise (one launch)--> x8 (M, K) E4M3, sx (M, 1)
    y = (x8 @ w8.t()) * sx * sw (+ bias), in cuBLASLt/CUTLASS's row-wise scaled FP8 GEMM (torch._scaled_mm)

One scale per row of x (current scaling, no margin) needs one launch and no amax pass, and loses less
than one scale for the whole tensor: each row uses E4M3's full range. The weight's scale is one per output
row (the GEMM's (1, N) column scales, viewed) or one per tensor: then it is folded into x's row scales as
the quantize kernel writes them (sx * sw, rounded once) and the GEMM's column scales are ones, so that no
call keeps a copy of a scale that could go stale. The row-wise GEMM wants E4M3 operands, a bf16 output and
contiguous float32 scales; K and N multiples of 16.

Measured on an H200 (.scratch probe, 2026-11-26; GPU time of the Llama-style layers summed, weights read
from memory): at 128 tokens 0.199 ms against 0.391 for the weight-only kernel and 0.260 for bf16; at 64
0.207 / 0.304 / 0.238; at 32 0.217 / 0.249 / 0.229; at 16 0.220 / 0.191 / 0.224, where the weight-only
kernel stays. The output is about 3 dB further from the exact product than the weight-only kernel's
(the activation's rounding joins the weight's; the tolerance table's FP8 Linear bound is 18 dB).

Non-finite input: a row holding inf or NaN gets a NaN scale (common.scale_from_amax), so that row of y
is NaN; the other rows are unaffected.
"""

from __future__ import annotations

from typing import Optional

import torch

from .common import triton_op, use_triton
from .launch import run_compiled, runtime_settings
from .rowwise import _launch as _launch_rowwise
from .rowwise import quantize_rowwise_ref, rowwise_args

E4M3 = torch.float8_e4m3fn

# The token counts ops.Linear's inference forward sends here; fewer go to the weight-only kernel, more to
# the general path. Where the line lies: the module docstring's measurements (from 17 tokens on, this path
# is already faster on the GPU, but costs a second launch and a GEMM call of host time, which eager
# forwards of up to 32 tokens wait for).
MIN_TOKENS = 33


def _per_tensor(w_scale_inv: torch.Tensor) -> bool:
    return w_scale_inv.numel() == 1


def supports(x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor) -> bool:
    """Whether fp8_rowwise_input_mm takes these operands: x a 2-D bf16 with contiguous rows, w_data an (N, K)
    E4M3 weight with contiguous rows, K and N multiples of 16, and the weight's scale one float32 per tensor
    or a contiguous (N, 1) per row."""
    if not (
        x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.stride(1) == 1
        and w_data.dim() == 2
        and w_data.dtype == E4M3
        and w_data.stride(1) == 1
        and w_scale_inv.dtype == torch.float32
        and x.shape[1] == w_data.shape[1]
    ):
        return False
    n, k = w_data.shape
    if n % 16 or k % 16:
        return False
    if w_scale_inv.numel() == 1:
        return True
    return tuple(w_scale_inv.shape) == (n, 1) and w_scale_inv.is_contiguous()


def fp8_rowwise_input_mm_ref(x, w_data, w_scale_inv, bias=None):
    """The semantics: x quantized per row (quantize_rowwise_ref, E4M3, no margin), the float32 product of the
    two FP8 operands' values, times the row scales (a per-tensor weight scale folded into them: sx * sw in
    float32) and the weight's per-row scales, plus the bias, rounded once to x's dtype."""
    x8, sx = quantize_rowwise_ref(x, E4M3)
    acc = x8.float() @ w_data.float().t()
    if _per_tensor(w_scale_inv):
        acc = acc * (sx * w_scale_inv.reshape(()).float())
    else:
        acc = acc * sx * w_scale_inv.reshape(1, -1)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def _check(x, w_data, w_scale_inv, bias):
    if not supports(x, w_data, w_scale_inv):
        raise ValueError(
            "fp8_rowwise_input_mm: needs x (M, K) bfloat16 with contiguous rows, w_data (N, K) float8_e4m3fn with "
            "contiguous rows, K and N multiples of 16, and w_scale_inv one float32 or contiguous (N, 1); got "
            f"x {tuple(x.shape)} {x.dtype}, w_data {tuple(w_data.shape)} {w_data.dtype}, w_scale_inv "
            f"{tuple(w_scale_inv.shape)} {w_scale_inv.dtype}"
        )
    if bias is not None and (bias.shape != (w_data.shape[0],) or bias.dtype != torch.bfloat16):
        raise ValueError(f"fp8_rowwise_input_mm: bias must be ({w_data.shape[0]},) bfloat16, got {tuple(bias.shape)}")
    devices = {t.device for t in (x, w_data, w_scale_inv, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"fp8_rowwise_input_mm: operands on several devices: {sorted(map(str, devices))}")


def _column_scales(w_data, w_scale_inv):
    """The GEMM's (1, N) scales: the weight's per-row scales viewed, or ones (a per-tensor scale is folded
    into x's row scales)."""
    n = w_data.shape[0]
    if _per_tensor(w_scale_inv):
        return torch.ones((1, n), dtype=torch.float32, device=w_data.device)
    return w_scale_inv.reshape(1, n)


def _gemm(x8, sx, w_t, sb, bias):
    return torch._scaled_mm(x8, w_t, scale_a=sx, scale_b=sb, bias=bias, out_dtype=torch.bfloat16)


@triton_op("float8::fp8_rowwise_input_mm")
def fp8_rowwise_input_mm(
    x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """y (M, N) bf16 = the row-quantized x times (w_data * w_scale_inv).t() (+ bias, bf16 (N,)), for operands
    `supports` takes; on a CPU tensor the reference. A triton_op: under torch.compile its body is traced,
    the quantize launch becomes a Triton kernel of the graph and the GEMM the aten op eager calls."""
    _check(x, w_data, w_scale_inv, bias)
    if not use_triton(x):
        return fp8_rowwise_input_mm_ref(x, w_data, w_scale_inv, bias)
    times = w_scale_inv.reshape(()) if _per_tensor(w_scale_inv) else None
    m, k = x.shape
    x8 = torch.empty((m, k), dtype=E4M3, device=x.device)
    sx = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    grid, args, warps = rowwise_args(x, x8, sx, E4M3, times=times)
    _launch_rowwise(grid, *args, num_warps=warps)
    return _gemm(x8, sx, w_data.t(), _column_scales(w_data, w_scale_inv), bias)


class PreparedRowwiseMM:
    """fp8_rowwise_input_mm for repeated eager calls with one weight, one bias and one activation shape:
    the quantize kernel's compiled launch and arguments and the GEMM's column scales worked out once
    (`prepare`), as kernels/weight_only.py PreparedMM does for its kernel. ops.Linear keeps both kinds in
    one table and calls them alike. It holds no copy of a value that can change: the weight's scale is read
    by the quantize kernel at every call (or viewed, per row), and ones are ones.

    A call gives None where the fixed arguments would not fit (x not 16-byte aligned, another current
    device, Triton's runtime settings changed): the caller then takes the checked path. The caller
    guarantees the rest, as for PreparedMM."""

    __slots__ = ("w_data", "w_scale_inv", "bias", "device", "device_index", "settings")
    __slots__ += ("quantize", "grid", "tail", "times", "x8_shape", "sx_shape", "w_t", "sb")

    def matches(self, w_data, w_scale_inv, bias) -> bool:
        """Whether these are the tensors this call was prepared for (identity: their values may change)."""
        return w_data is self.w_data and w_scale_inv is self.w_scale_inv and bias is self.bias

    def __call__(self, x: torch.Tensor, w_data, w_scale_inv, bias) -> Optional[torch.Tensor]:
        device = self.device_index
        if x.data_ptr() % 16 or torch._C._cuda_getDevice() != device or runtime_settings() != self.settings:
            return None
        x8 = torch.empty(self.x8_shape, dtype=E4M3, device=self.device)
        sx = torch.empty(self.sx_shape, dtype=torch.float32, device=self.device)
        if x8.data_ptr() % 16 or sx.data_ptr() % 16:
            return None  # not from torch's caching allocator (a pluggable one): the checked path
        run_compiled(self.quantize, self.grid, device, (x, x8, sx, self.times, *self.tail))
        return _gemm(x8, sx, self.w_t, self.sb, bias)


def prepare(x, w_data, w_scale_inv, bias=None):
    """(y, PreparedRowwiseMM or None): one fp8_rowwise_input_mm call of operands `supports` takes (x contiguous
    on the current CUDA device, the bias bf16 and contiguous), and what repeats it with less host time. None
    where a later call could not skip Triton's own launch path (the interpreter, tracing, another current
    device)."""
    if not use_triton(x) or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return fp8_rowwise_input_mm(x, w_data, w_scale_inv, bias), None
    settings = runtime_settings()
    m, k = x.shape
    x8 = torch.empty((m, k), dtype=E4M3, device=x.device)
    sx = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    times = w_scale_inv.reshape(()) if _per_tensor(w_scale_inv) else None
    grid, args, warps = rowwise_args(x, x8, sx, E4M3, times=times)
    compiled = _launch_rowwise.launch_and_keep(grid, *args, num_warps=warps)
    w_t, sb = w_data.t(), _column_scales(w_data, w_scale_inv)
    y = _gemm(x8, sx, w_t, sb, bias)
    if compiled is None or any(t.data_ptr() % 16 for t in (x, x8, sx, args[3])):
        return y, None
    p = PreparedRowwiseMM()
    p.w_data, p.w_scale_inv, p.bias = w_data, w_scale_inv, bias
    p.device, p.device_index, p.settings = x.device, x.device.index, settings
    p.quantize, p.grid, p.times, p.tail = compiled, grid, args[3], args[4:]
    p.x8_shape, p.sx_shape, p.w_t, p.sb = (m, k), (m, 1), w_t, sb
    return y, p
