"""The Linear's engine: `linear_fwd` / `linear_bwd`, the two halves of y = x @ W.t() (+ bias) as FP8 GEMMs,
the record the forward saves (`LinearSaved`), the weight's quantization, and the autograd Function of the
stateless `functional.linear`. The `Linear` op (ops/linear.py) is a weight cache and three long-lived
quantizers around the same two calls; ops/functional.py keeps the one-call forms.

Numerics: per-tensor recipes reuse one set of FP8 bits (and its transpose) for every GEMM; per-row recipes
quantize each operand along the dim its GEMM reduces; block recipes and any other granularity
(ScaleLayout.OTHER) multiply the dequantized operands (docs/design.md section 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from float8 import Float8Tensor, Recipe
from float8.gemm import column_major_only, operand
from float8.gemm import fp8_mm_or_dequantized as _mm
from float8.ops.base import plain, second_backward_error, take
from float8.ops.bias import bias_backward
from float8.ops.saved import SavedRecord
from float8.quantizer import (
    LinearQuantizers,
    Quantizer,
    QuantRequest,
    ScaleLayout,
    TensorwiseQuantizer,
    dequantized_gemms,
    quantize_in_torch_ops,
)


@dataclass
class LinearSaved(SavedRecord):
    """What a Linear's forward keeps for its backward: a typed record, one per call.

    layout: the input quantizer's `ScaleLayout` when the GEMMs ran in FP8; None when they ran in high
        precision (the small-layer policy). It picks the backward's GEMMs.
    x: the input in the layout the weight-gradient GEMM reads (FP8 column-major for per-tensor scaling,
        the transposed quantization for per-row, the Float8Tensor for blocks, plain in high precision).
    w: the weight operand of the input-gradient GEMM, or None where the backward re-quantizes the weight
        (`rebuild`).
    rebuild: (weight, its version counter at the forward) where `rebuilds_weight` holds: the backward
        quantizes the weight again (the same bits: per-tensor current scaling of an unchanged tensor) and
        refuses if the weight was written in place since the forward.
    """

    layout: Optional[ScaleLayout]
    x: Optional[object]
    w: Optional[object]
    x_dtype: torch.dtype
    need_wgrad: bool
    need_dgrad: bool
    rebuild: Optional[tuple] = None


def check_fp8_weight_grad(weight: torch.Tensor) -> None:
    """An FP8-only weight has no high-precision master to apply a gradient to: refuse to train it."""
    if isinstance(weight, Float8Tensor) and weight.requires_grad and not weight._gathered_master:
        raise ValueError(
            "the weight is an FP8-only Float8Tensor that requires grad, but there is no high-precision master "
            "weight for an optimizer to update (its gradient would be lost). Freeze it "
            "(weight.requires_grad_(False)), or keep a high-precision weight and let the op quantize it."
        )


def quantize_weight(
    weight: torch.Tensor, quantizer: Quantizer, for_backward: bool, in_torch_ops: bool = False
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(forward operand, input-gradient operand or None): FP8 copies of a weight (an FP8-only weight as it is).

    The quantizer makes them (`Quantizer.operands`): per tensor one kernel writes both layouts, per row the
    transposed operand is quantized along its own rows, blocks and other granularities serve both with the
    forward copy (their GEMMs dequantize). in_torch_ops: `quantize_fusable` (a Linear among torch code)."""
    if isinstance(weight, Float8Tensor):
        return weight, (weight if for_backward else None)
    with torch.no_grad():
        if in_torch_ops and torch.compiler.is_compiling() and stateless_per_tensor(quantizer):
            w8 = quantize_in_torch_ops(quantizer, weight.detach(), for_backward)
            return w8, (w8 if for_backward else None)
        return quantizer.operands(weight.detach(), rows=True, columns=for_backward)


def stateless_per_tensor(q: Quantizer) -> bool:
    """Whether q is the library's per-tensor current scaling without an amax group: no history to advance,
    no collective to join, so quantizing the same tensor again gives the same bits."""
    return type(q) is TensorwiseQuantizer and q.amax_group is None


def rebuilds_weight(weight: torch.Tensor, quantizers: LinearQuantizers) -> bool:
    """Whether the backward can quantize `weight` again instead of keeping its FP8 transpose from the
    forward (every recipe, for a trained weight): a high-precision weight under stateless per-tensor current scaling
    (no amax history to advance, no collective to repeat), so the second quantization gives the same bits,
    in a Linear whose GEMMs run per tensor (the input's layout picks the backward's GEMMs).

    Writes into the weight between the forward and the backward that move its version counter are refused
    there; writes through `weight.data` move none and are not seen (the backward then reads the new
    weight), as with the weight cache (ops/linear.py)."""
    return (
        not isinstance(weight, Float8Tensor)
        and quantizers.input.layout is ScaleLayout.TENSOR
        and stateless_per_tensor(quantizers.weight)
    )


def requantizes_input(quantizers: LinearQuantizers) -> bool:
    """Whether a Linear under torch.compile may keep its high-precision input for the backward and quantize
    it there again instead of keeping its FP8 copy: a per-tensor input under stateless current scaling, so
    the second quantization gives the same bits.

    Both quantizations then run as torch operations (`quantize_in_torch_ops`), which the compiler fuses with
    the code that makes the input, and its partitioner keeps the input only if it finds nothing cheaper: in
    a converted transformer block each Linear's input is a norm's output, an activation's product or
    attention's output, which it recomputes in the backward from tensors it keeps anyway (as for torchao's
    Linears; docs/memory.md). A Linear whose input arrives in FP8 (after a norm or activation of a
    hand-written ops.Sequential) keeps that copy, and eager Linears keep the FP8 copy: nothing recomputes
    there."""
    return stateless_per_tensor(quantizers.input)


def quantize_fusable(q: Quantizer, x: torch.Tensor, with_transpose: bool) -> Float8Tensor:
    """q._quantize(x, with_transpose), in torch operations where q is stateless per-tensor current scaling
    and torch.compile traces: inductor then fuses the amax and the cast into the code that makes x (an
    output gradient's amax into the activation backward before it, as for torchao's Linears) and its
    partitioner may recompute them in a backward; through our kernels it could do neither (on the H100 a
    compiled converted Llama step ran 81 cast-transpose and 129 amax launches of its own, 18.2 ms:
    docs/performance.md). Else the kernel. The same bits for the same x (tests/ops/test_lean_activations.py);
    fused by inductor with x's producer, whose bf16 rounding it does not emulate, within the FP8 bound
    (README "Same results"). Taken by a Linear whose input arrives in high precision, so among torch code
    that inductor generates anyway (a converted model's); one whose input arrives in FP8 sits among our
    kernels in an ops.Sequential, which compiled gives eager's bits (tests/ops/test_gpu_compile.py), and
    keeps them."""
    if torch.compiler.is_compiling() and stateless_per_tensor(q):
        return quantize_in_torch_ops(q, x, with_transpose)
    return q._quantize(x, with_transpose)


def _rebuilt_weight(saved: LinearSaved, quantizer: Quantizer, in_torch_ops: bool):
    weight, version = take(saved, "rebuild")
    if version is not None and weight._version != version:
        raise RuntimeError(
            "Linear backward: the weight was modified in place after the forward (its version counter moved "
            f"from {version} to {weight._version}). Under per-tensor current scaling the backward quantizes the "
            "weight again instead of keeping its FP8 copy, so it needs the forward's weight, as nn.Linear's "
            "backward does: update weights after backward (as optimizers do)."
        )
    return column_major_only(quantize_weight(weight, quantizer, True, in_torch_ops)[1])


def linear_fwd(
    x2: torch.Tensor,
    w8: torch.Tensor,
    wd: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    quantizers: LinearQuantizers,
    *,
    need_wgrad: bool,
    need_dgrad: bool,
    fast_accum: bool,
    rows_only: bool = False,
    rebuild_weight: Optional[torch.Tensor] = None,
    requantize_input: bool = False,
) -> Tuple[torch.Tensor, LinearSaved]:
    """y = x2 @ w.t() (+ bias) with an FP8 GEMM, and the record its backward needs.

    x2: (M, K) high precision or a Float8Tensor; w8, wd: from `quantize_weight`; bias: (N,) in x2's dtype
    or None (added in the GEMM epilogue). The input is quantized by `quantizers.input`, and saved only in
    the layout the weight-gradient GEMM reads. rows_only (Recipe.lean_activations): a per-tensor input is
    quantized without its transpose and saved in rows, the layout the forward GEMM read; the backward's
    GEMM copies it into the other (float8/gemm.py), so two layouts are never alive at once.
    rebuild_weight: the weight itself (wd None; `rebuilds_weight` holds): the backward quantizes it again
    rather than keeping 1 byte per parameter from the forward to the backward.
    requantize_input (`requantizes_input` holds): a per-tensor high-precision input is saved as it is and
    quantized again by the backward (column-major, for the weight gradient), not kept in FP8.
    """
    out_dtype = x2.dtype
    qi = quantizers.input
    layout = qi.layout
    if dequantized_gemms(layout):
        x8 = x2 if isinstance(x2, Float8Tensor) else qi._quantize(x2, False)
        y = F.linear(x8.dequantize(), w8.dequantize(out_dtype), bias)
        saved_x = x8 if need_wgrad else None
    elif layout is ScaleLayout.TENSOR:
        source = requantize_input and need_wgrad and not isinstance(x2, Float8Tensor)
        if isinstance(x2, Float8Tensor):
            x8 = x2
        elif source:
            x8 = quantize_fusable(qi, x2, False)
        else:
            x8 = qi._quantize(x2, need_wgrad and not rows_only)
        y = _mm(x8, operand(w8, transposed=True), bias=bias, out_dtype=out_dtype, pad=True, fast_accum=fast_accum)
        # Saved for the weight gradient: the column-major layout only (half the bytes of both), or the
        # high-precision input itself, which the backward quantizes again (`source`).
        saved_x = (x2 if source else column_major_only(x8)) if need_wgrad else None
    else:
        x8, saved_x = qi.operands(plain(x2), rows=True, columns=need_wgrad)
        y = _mm(x8, operand(w8, transposed=True), bias=bias, out_dtype=out_dtype, pad=True, fast_accum=fast_accum)
    saved_w = rebuild = None
    if need_dgrad and rebuild_weight is not None:
        if layout is not ScaleLayout.TENSOR:
            raise ValueError(f"linear_fwd: rebuild_weight needs per-tensor GEMMs, got an input layout {layout}")
        # Under torch.compile no version counter is read: the compiled graph decides what it keeps. Under
        # inductor it keeps the weight, and autograd's check on its saved tensors refuses a weight written
        # in between; aot_eager's partitioner moves the quantization into the forward and keeps its result
        # (the forward's weight, no memory saved).
        rebuild = (rebuild_weight, None if torch.compiler.is_compiling() else rebuild_weight._version)
    elif need_dgrad:
        # Per-tensor: the input-gradient GEMM reads the weight column-major (its transpose): keep only that.
        saved_w = column_major_only(wd) if layout is ScaleLayout.TENSOR and isinstance(wd, Float8Tensor) else wd
    return y, LinearSaved(layout, saved_x, saved_w, out_dtype, need_wgrad, need_dgrad, rebuild)


def linear_fwd_high_precision(
    x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *, need_wgrad: bool, need_dgrad: bool
) -> Tuple[torch.Tensor, LinearSaved]:
    """The same in x2's dtype (the small-layer policy: GEMMs too small for FP8 to win)."""
    # The weight itself where no cast is needed: saved as the autograd Function's input, not as an alias
    # of it (which torch.compile refuses to carry to the backward).
    if isinstance(weight, Float8Tensor):
        weight = weight.dequantize(x2.dtype)  # an FP8-only weight under ops.high_precision
    w = weight if weight.dtype == x2.dtype else weight.to(x2.dtype)
    saved = LinearSaved(None, x2 if need_wgrad else None, w if need_dgrad else None, x2.dtype, need_wgrad, need_dgrad)
    return F.linear(x2, w, bias), saved


def grad_request(
    saved: Optional[LinearSaved], quantizers: LinearQuantizers, weight_requires_grad: bool, rows_only: bool = False
) -> Optional[QuantRequest]:
    """What the backward wants its output gradient as (FP8 from the op before, fused with dact/dbias), or
    None: only when the forward ran per-tensor FP8 and the grad quantizer is per-tensor too.

    rows_only (Recipe.lean_activations): no transpose, even for the weight gradient; `linear_bwd` makes it
    after the input-gradient GEMM (float8/gemm.py copies the layout a GEMM lacks)."""
    if quantizers.grad.layout is not ScaleLayout.TENSOR:
        return None
    if saved is not None and saved.layout is not ScaleLayout.TENSOR:
        return None
    need_wgrad = saved.need_wgrad if saved is not None else weight_requires_grad
    return QuantRequest(quantizers.grad, need_wgrad and not rows_only)


def linear_bwd(
    dy2: torch.Tensor, saved: LinearSaved, quantizers: LinearQuantizers, weight_dtype: torch.dtype
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(dx or None, dw or None) of `linear_fwd` for dy2 (M, N) (high precision or FP8 from the op after).

    The weight gradient comes first, and the saved input is let go before the input gradient is written:
    at the largest Linears of a block (an FFN's second) dx is the largest tensor of the backward, and the
    input (and its transpose, when the forward kept rows only) need not be alive beside it."""
    qg = quantizers.grad
    dx = dw = None
    x = take(saved, "x")
    if saved.layout is None:
        dyh = plain(dy2)
        if saved.need_wgrad:
            dw = (dyh.t() @ x).to(weight_dtype)
        del x
        if saved.need_dgrad:
            dx = dyh @ saved.w
    elif dequantized_gemms(saved.layout):
        dyh = qg._quantize(plain(dy2), False).dequantize()
        if saved.need_wgrad:
            dw = (dyh.t().float() @ x.dequantize(torch.float32)).to(weight_dtype)
        del x
        if saved.need_dgrad:
            dx = dyh @ saved.w.dequantize(dyh.dtype)
    elif saved.layout is ScaleLayout.TENSOR:
        # An input saved as it was (`requantize_input`: compiled, arrived in high precision): this Linear sits
        # among torch code, so its output gradient and weight are quantized in torch operations too.
        among_torch = type(x) is torch.Tensor
        if isinstance(dy2, Float8Tensor):
            dy8 = dy2
        else:
            dy8 = quantize_fusable(qg, dy2, saved.need_wgrad) if among_torch else qg._quantize(dy2, saved.need_wgrad)
        if saved.need_wgrad:
            if among_torch:  # quantized again, the same bits
                x = column_major_only(quantize_fusable(quantizers.input, x, True))
            dw = _mm(operand(dy8, transposed=True), x, out_dtype=weight_dtype, pad=True)
        del x
        if saved.need_dgrad:
            w = saved.w if saved.rebuild is None else _rebuilt_weight(saved, quantizers.weight, among_torch)
            dx = _mm(dy8, w, out_dtype=saved.x_dtype, pad=True)
    else:
        dy_rows, dy_columns = qg.operands(plain(dy2), rows=saved.need_dgrad, columns=saved.need_wgrad)
        if saved.need_wgrad:
            dw = _mm(operand(dy_columns, transposed=True), x, out_dtype=weight_dtype, pad=True)  # no view built
        del x
        if saved.need_dgrad:
            dx = _mm(dy_rows, saved.w, out_dtype=saved.x_dtype, pad=True)
    return dx, dw


def fp8_pays_off(recipe: Recipe, tokens: int, in_features: int, out_features: int, device: torch.device) -> bool:
    """The small-layer policy: FP8 unless, on CUDA, the GEMMs do fewer than recipe.min_fp8_gemm_flops FLOPs
    (2*M*K*N). The CPU path always runs FP8 (it exists to be exact)."""
    return device.type != "cuda" or 2 * tokens * in_features * out_features >= recipe.min_fp8_gemm_flops


def check_linear_args(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], name: str = "linear"
) -> None:
    """ValueError/TypeError naming the problem for inputs of the wrong rank, shape or kind."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} takes tensors, got x: {type(x).__name__}, weight: {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{name}: x must be (..., {weight.shape[1]}) for weight {tuple(weight.shape)}, got {tuple(x.shape)}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(
            f"{name}: bias must be ({weight.shape[0]},) for weight {tuple(weight.shape)}, got {tuple(bias.shape)}"
        )


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quantizers, fast_accum):
        need_dgrad, need_wgrad, need_dbias = ctx.needs_input_grad[:3]
        x2 = x.reshape(-1, x.shape[-1])
        w8, wd = quantize_weight(weight, quantizers.weight, need_dgrad)
        b = None if bias is None else bias.to(x.dtype)
        y, saved = linear_fwd(
            x2, w8, wd, b, quantizers, need_wgrad=need_wgrad, need_dgrad=need_dgrad, fast_accum=fast_accum
        )
        ctx.saved, ctx.quantizers, ctx.need_dbias = saved, quantizers, need_dbias
        ctx.x_shape, ctx.w_dtype, ctx.b_dtype = x.shape, weight.dtype, None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        saved, q = take(ctx, "saved"), ctx.quantizers
        if saved is None:
            raise second_backward_error("float8.ops.functional.linear")
        dy2 = plain(dy).reshape(-1, dy.shape[-1])
        dbias = None
        if ctx.need_dbias:
            dy2, dbias = bias_backward(dy2, grad_request(saved, q, saved.need_wgrad))
            dbias = dbias.to(ctx.b_dtype)
        dx, dw = linear_bwd(dy2, saved, q, ctx.w_dtype)
        if isinstance(dx, Float8Tensor):
            dx = dx.dequantize()
        return (None if dx is None else dx.reshape(ctx.x_shape)), dw, dbias, None, None
