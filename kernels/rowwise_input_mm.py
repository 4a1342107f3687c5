"""float8::fp8_rowwise_input_mm: x quantized per row to E4M3, then an FP8 x FP8 GEMM with an E4M3 weight.

fp8_rowwise_input_mm(x, w_data, w_scale_inv, bias=None) -> y
    x (M, K) bfloat16/float16 with contiguous rows; w_data (N, K) E4M3, rows contiguous; w_scale_inv () or
    contiguous (N, 1) float32; bias (N,) in x's dtype or None. y (M, N) in x's dtype.

    x --quantize_rowwise (kernels/rowwise.py, one launch)--> x8 (M, K) E4M3, sx (M, 1) its scale_inv
    y = (x8 @ w_data.t()) * sx * w_scale_inv (+ bias), in kernels/weight_only_kernel.py with X_FP8

Why: ops.Linear's inference forward with an FP8-only weight at 33-128 tokens, where the recipe asks for it
(`Recipe.inference_fp8_input_from`, off by default: eagerly its second launch costs more host time than it
saves; under CUDA graphs it is the faster kernel). There the weight-only kernel is no longer bound by reading the weight:
it widens every weight tile for a bf16 MMA, and its time grows with the tokens. FP8 MMAs do half the work
on the same weight bytes. GPU time summed over the Llama-style and HF Llama layers on the H100 (2026-11-26,
weights read from memory, docs/inference.md): at 128 tokens 217 us here plus 16 us of row quantization,
against 362 us for the weight-only kernel and 337 us for bf16 F.linear; at 64 tokens 182 + 18 against 289
and 321. cuBLASLt's row-wise FP8 GEMM (torch._scaled_mm) is as fast on the GPU, but its call costs about
20 us of host against about 5 for a prepared launch of this kernel (`prepare`), and eager forwards at these
sizes wait for the host (docs/performance.md).

Numerics: one scale per row of x (current scaling, no margin: each row uses E4M3's whole range), the
products exact in float32, each K step's FP8 MMA result added to a float32 accumulator (Hopper's FP8 MMA
accumulates in fewer bits than float32: with the sum left inside the MMA over a 14336-long K, a sweep found
outputs off by more than 1%), the row and weight scales applied once, the bias, one rounding to x's dtype.
`fp8_rowwise_input_mm_ref` states it; only the order of the float32 sums differs. The result is an FP8
Linear's (x's rounding joins the weight's), where the weight-only kernel keeps x as it is.

Non-finite input: a row of x holding inf or NaN gets a NaN scale (common.scale_from_amax), so that row of y
is NaN; the other rows are unaffected. A poisoned weight (scale_inv NaN) makes its columns NaN.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import weight_only
from .common import triton_op, use_triton
from .launch import run_compiled
from .rowwise import _launch as _launch_rowwise
from .rowwise import launch_rowwise, quantize_rowwise_ref, rowwise_args

E4M3 = torch.float8_e4m3fn


def supports(x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor) -> bool:
    """Whether fp8_rowwise_input_mm takes these operands: a 2-D bf16/fp16 x with contiguous rows, an (N, K)
    E4M3 weight with contiguous rows, and its scale: one float32, or a contiguous (N, 1) one per row."""
    if not (
        x.dtype in (torch.bfloat16, torch.float16)
        and x.dim() == 2
        and x.stride(1) == 1
        and w_data.dim() == 2
        and w_data.dtype == E4M3
        and w_data.stride(1) == 1
        and w_scale_inv.dtype == torch.float32
    ):
        return False
    if w_scale_inv.numel() == 1:
        return True
    return tuple(w_scale_inv.shape) == (w_data.shape[0], 1) and w_scale_inv.stride(0) == 1


def fp8_rowwise_input_mm_ref(
    x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The semantics: x quantized per row (quantize_rowwise_ref, E4M3, no margin), the float32 product of the
    two FP8 operands' values, times x's row scales, times the weight's scales, plus the bias, rounded once
    to x's dtype."""
    x8, sx = quantize_rowwise_ref(x, E4M3)
    acc = (x8.float() @ w_data.float().t()) * sx
    acc = acc * (w_scale_inv.reshape(1, -1) if w_scale_inv.numel() > 1 else w_scale_inv.reshape(()))
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def fp8_rowwise_input_mm_triton(
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[weight_only.Config] = None,
    split_k: Optional[int] = None,
) -> torch.Tensor:
    """The two kernels, no checks (fp8_rowwise_input_mm checks). config and split_k as in
    weight_only.fp8_weight_mm_triton (default: weight_only.FP8_X_CONFIGS and split_k_for)."""
    x8, sx = launch_rowwise(x, E4M3)
    call = weight_only._launch_plan(x8, w_data, w_scale_inv, bias, config, split_k, sx=sx, out_dtype=x.dtype)
    weight_only._launch(call.grid, *call.args, **call.options)
    if call.sum_args is not None:
        weight_only._launch_sum(call.sum_grid, *call.sum_args, **weight_only._SUM_OPTIONS)
    return call.y


class PreparedRowwiseMM(weight_only.PreparedMM):
    """fp8_rowwise_input_mm for repeated eager calls (weight_only.PreparedMM's contract): the row
    quantization's compiled kernel and arguments kept too, so that a call is two prepared launches. x8 and
    its scales are made afresh per call (a buffer kept across calls could be overwritten by another
    thread's call on the same stream between this call's two launches)."""

    __slots__ = ("quantize", "quantize_grid", "quantize_tail", "x8_shape")

    def operands(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """x quantized per row into fresh x8 and sx, by the kept kernel."""
        x8 = torch.empty(self.x8_shape, dtype=E4M3, device=self.device)
        sx = torch.empty(self.x8_shape[0], dtype=torch.float32, device=self.device)
        if x8.data_ptr() % 16 or sx.data_ptr() % 16:
            return None  # not from torch's caching allocator (a pluggable one): the checked path
        run_compiled(self.quantize, self.quantize_grid, self.device_index, (x, x8, sx, *self.quantize_tail))
        return x8, sx


def prepare(
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_shape: Optional[tuple[int, ...]] = None,
) -> tuple[torch.Tensor, Optional[PreparedRowwiseMM]]:
    """(y, PreparedRowwiseMM or None): one call of checked operands (`supports`, K, one CUDA device, the
    bias's dtype and contiguity, x contiguous), and what repeats it with less host time; None where
    weight_only.prepare gives None (the interpreter, a CUDA graph capture, another current device)."""
    m, k = x.shape
    x8 = torch.empty((m, k), dtype=E4M3, device=x.device)
    sx = torch.empty((m,), dtype=torch.float32, device=x.device)
    grid, args, warps = rowwise_args(x, x8, sx, E4M3)
    quantize = _launch_rowwise.launch_and_keep(grid, *args, num_warps=warps)
    p = PreparedRowwiseMM()
    p.dtype = x.dtype
    y, p = weight_only.prepare(x8, w_data, w_scale_inv, bias, out_shape, sx=sx, into=p)
    if p is None or quantize is None or any(t.data_ptr() % 16 for t in (x, x8, sx)):
        return y, None
    p.quantize, p.quantize_grid, p.quantize_tail, p.x8_shape = quantize, grid, args[3:], (m, k)
    return y, p


def fp8_rowwise_input_mm_prechecked(
    x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """fp8_rowwise_input_mm for a caller that has checked its operands (ops.Linear's inference forward): a
    plain eager call goes straight to the kernels; a traced one (torch.compile, a dispatch mode) through the
    registered op."""
    triton_fn, ref_fn = fp8_rowwise_input_mm_triton, fp8_rowwise_input_mm_ref
    return weight_only.call_prechecked(fp8_rowwise_input_mm, triton_fn, ref_fn, x, w_data, w_scale_inv, bias)


def _check(x, w_data, w_scale_inv, bias):
    op = "fp8_rowwise_input_mm"
    if not supports(x, w_data, w_scale_inv):
        raise ValueError(
            f"{op}: needs x (M, K) bfloat16/float16 and w_data (N, K) float8_e4m3fn, both with contiguous rows, "
            f"and w_scale_inv one float32 or a contiguous (N, 1); got x {tuple(x.shape)} {x.dtype} strides "
            f"{x.stride()}, w_data {tuple(w_data.shape)} {w_data.dtype} strides {w_data.stride()}, w_scale_inv "
            f"{tuple(w_scale_inv.shape)} {w_scale_inv.dtype}"
        )
    weight_only.check_k_bias_devices(op, x, w_data, w_scale_inv, bias)


@triton_op("float8::fp8_rowwise_input_mm")
def fp8_rowwise_input_mm(
    x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """y (M, N) in x's dtype = rowwise-quantized x @ (w_data * w_scale_inv).t() (+ bias); see the module
    docstring."""
    _check(x, w_data, w_scale_inv, bias)
    if use_triton(x):
        return fp8_rowwise_input_mm_triton(x, w_data, w_scale_inv, bias)
    return fp8_rowwise_input_mm_ref(x, w_data, w_scale_inv, bias)
