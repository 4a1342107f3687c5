"""fp8_rowwise_input_mm: x quantized one row at a time, then an FP8 x FP8 GEMM with an FP8 weight.

For inference with an FP8-only weight at 33-128 tokens (ops.Linear's inference forward). At these sizes the
weight-only kernel (kernels/weight_only.py) is no longer bound by reading the weight: it widens every FP8
weight element in registers for a bf16 MMA, and its GPU time grows with the tokens. Quantizing x instead
and running the tensor cores in FP8 reads the same weight bytes and does half the MMA work:

    x (M, K) bf16 --quantize_rowwise (one launch)--> x8 (M, K) E4M3, sx (M, 1)
    y = (x8 @ w8.t()) * sx * sw (+ bias), in cuBLASLt/CUTLASS's row-wise scaled FP8 GEMM (torch._scaled_mm)

One scale per row of x (current scaling, no margin) needs one launch and no amax pass, and loses less
than one scale for the whole tensor: each row uses E4M3's full range. sw is the weight's scale, one per
tensor (broadcast to (1, N)) or one per output row. The row-wise GEMM wants E4M3 operands, a bf16 output
and contiguous float32 scales (1, N); K and N multiples of 16.

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

from .common import forward_ad_or_functorch_active, use_triton
from .launch import run_compiled, runtime_settings
from .rowwise import _launch as _launch_rowwise
from .rowwise import quantize_rowwise, quantize_rowwise_ref, rowwise_args

E4M3 = torch.float8_e4m3fn

# The token counts ops.Linear's inference forward sends here; fewer go to the weight-only kernel, more to
# the general path. Where the line lies: the module docstring's measurements (from 17 tokens on, this path
# is already faster on the GPU, but costs a second launch and a GEMM call of host time, which eager
# forwards of up to 32 tokens wait for).
MIN_TOKENS = 33


def weight_scale_row(w_data: torch.Tensor, w_scale_inv: torch.Tensor) -> torch.Tensor:
    """The weight's scale as the (1, N) contiguous float32 row the row-wise GEMM reads: one per-tensor scale
    repeated (a copy: the GEMM refuses a broadcast view), or the (N, 1) per-row scales viewed."""
    n = w_data.shape[0]
    if w_scale_inv.numel() == 1:
        return w_scale_inv.reshape(1, 1).expand(1, n).contiguous()
    return w_scale_inv.reshape(1, n)


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
    two FP8 operands' values, times x's row scales and the weight's scales, plus the bias, rounded once to
    x's dtype."""
    x8, sx = quantize_rowwise_ref(x, E4M3)
    acc = (x8.float() @ w_data.float().t()) * sx * weight_scale_row(w_data, w_scale_inv)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def _gemm(x8, sx, w_data, sb, bias):
    return torch._scaled_mm(x8, w_data.t(), scale_a=sx, scale_b=sb, bias=bias, out_dtype=torch.bfloat16)


def fp8_rowwise_input_mm(x, w_data, w_scale_inv, bias=None):
    """y (M, N) bf16 = the row-quantized x times (w_data * w_scale_inv).t() (+ bias, bf16 (N,)), for operands
    `supports` takes; on a CPU tensor the reference. Compiles: quantize_rowwise is a triton_op and the GEMM
    an aten op, which inductor calls as eager does (the same bits)."""
    if not supports(x, w_data, w_scale_inv):
        raise ValueError(
            "fp8_rowwise_input_mm: needs x (M, K) bfloat16 with contiguous rows, w_data (N, K) float8_e4m3fn with "
            "contiguous rows, K and N multiples of 16, and w_scale_inv one float32 or contiguous (N, 1); got "
            f"x {tuple(x.shape)} {x.dtype}, w_data {tuple(w_data.shape)} {w_data.dtype}, w_scale_inv "
            f"{tuple(w_scale_inv.shape)} {w_scale_inv.dtype}"
        )
    if bias is not None and (bias.shape != (w_data.shape[0],) or bias.dtype != torch.bfloat16):
        raise ValueError(f"fp8_rowwise_input_mm: bias must be ({w_data.shape[0]},) bfloat16, got {tuple(bias.shape)}")
    if not use_triton(x):
        return fp8_rowwise_input_mm_ref(x, w_data, w_scale_inv, bias)
    x8, sx = quantize_rowwise(x, E4M3)
    return _gemm(x8, sx, w_data, weight_scale_row(w_data, w_scale_inv), bias)


class PreparedRowwiseMM:
    """fp8_rowwise_input_mm for repeated eager calls with one weight, one bias and one activation shape:
    the quantize kernel's compiled launch and arguments, and the weight's (1, N) scale row, worked out once
    (`prepare`), as kernels/weight_only.py PreparedMM does for its kernel. ops.Linear keeps both kinds in
    one table and calls them alike.

    The scale row of a per-tensor weight scale is a copy: `matches` also holds the scale tensor's version,
    so that an in-place update of the scale (load_state_dict copies into it) re-prepares instead of
    multiplying by the old value. A call gives None where the fixed arguments would not fit (x not 16-byte
    aligned, another current device, Triton's runtime settings changed): the caller then takes the checked
    path. The caller guarantees the rest, as for PreparedMM."""

    __slots__ = ("w_data", "w_scale_inv", "version", "bias", "device", "device_index", "settings")
    __slots__ += ("quantize", "grid", "tail", "x8_shape", "sx_shape", "w_t", "sb")

    def matches(self, w_data, w_scale_inv, bias) -> bool:
        """Whether these are the tensors, and the scale's values, this call was prepared for."""
        return (
            w_data is self.w_data
            and w_scale_inv is self.w_scale_inv
            and bias is self.bias
            and w_scale_inv._version == self.version
        )

    def __call__(self, x: torch.Tensor, w_data, w_scale_inv, bias) -> Optional[torch.Tensor]:
        device = self.device_index
        if x.data_ptr() % 16 or torch._C._cuda_getDevice() != device or runtime_settings() != self.settings:
            return None
        x8 = torch.empty(self.x8_shape, dtype=E4M3, device=self.device)
        sx = torch.empty(self.sx_shape, dtype=torch.float32, device=self.device)
        if x8.data_ptr() % 16 or sx.data_ptr() % 16:
            return None  # not from torch's caching allocator (a pluggable one): the checked path
        run_compiled(self.quantize, self.grid, device, (x, x8, sx, *self.tail))
        return torch._scaled_mm(x8, self.w_t, scale_a=sx, scale_b=self.sb, bias=bias, out_dtype=torch.bfloat16)


def prepare(x, w_data, w_scale_inv, bias=None):
    """(y, PreparedRowwiseMM or None): one fp8_rowwise_input_mm call of operands `supports` takes (x contiguous
    on the current CUDA device, the bias bf16 and contiguous), and what repeats it with less host time. None
    where a later call could not skip Triton's own launch path (the interpreter, another current device)."""
    if not use_triton(x) or torch.compiler.is_compiling() or forward_ad_or_functorch_active():
        return fp8_rowwise_input_mm(x, w_data, w_scale_inv, bias), None
    settings = runtime_settings()
    m, k = x.shape
    x8 = torch.empty((m, k), dtype=E4M3, device=x.device)
    sx = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    grid, args, warps = rowwise_args(x, x8, sx, E4M3)
    compiled = _launch_rowwise.launch_and_keep(grid, *args, num_warps=warps)
    sb = weight_scale_row(w_data, w_scale_inv)
    y = _gemm(x8, sx, w_data, sb, bias)
    if compiled is None or any(t.data_ptr() % 16 for t in (x, x8, sx)):
        return y, None
    p = PreparedRowwiseMM()
    p.w_data, p.w_scale_inv, p.version, p.bias = w_data, w_scale_inv, w_scale_inv._version, bias
    p.device, p.device_index, p.settings = x.device, x.device.index, settings
    p.quantize, p.grid, p.tail = compiled, grid, args[3:]
    p.x8_shape, p.sx_shape, p.w_t, p.sb = (m, k), (m, 1), w_data.t(), sb
    return y, p
